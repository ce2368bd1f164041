#include "dispatch/write_back.h"

#include "comm/functional.h"
#include "comm/redistribute.h"

#include <shardtensor/shard_tensor.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace shardtensor::dispatch {

namespace {

// A replicated copy of base[..., index, ...] (index along `dim`, global). Both are held by their buffers, weakly
// (the entry keeps neither alive) and with their local geometry: the base tensor itself is often a temporary
// view (x[1:, i]) whose buffer is x's, and a write must reach that buffer as it would on one device.
struct Local {
  explicit Local(const at::Tensor& t)
      : storage(t.storage().getWeakStorageImpl()), offset(t.storage_offset()), sizes(t.sizes().vec()),
        strides(t.strides().vec()), dtype(t.scalar_type()), device(t.device()) {}
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t offset;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  at::Device device;
  // The tensor again, or undefined when its buffer is gone.
  at::Tensor get() const {
    auto s = storage.lock();
    if (!s) return {};
    return at::empty({0}, at::TensorOptions().dtype(dtype).device(device))
        .set_(c10::Storage(std::move(s)), offset, sizes, strides);
  }
};

// One select along a sharded dim: `base`[..., index, ...] along `dim`, which mesh dim `mesh_dim` shards in `spec`.
struct Step {
  Local base;
  SpecPtr spec;
  int64_t dim, index, mesh_dim;
};

// steps[0] selected the copy from its base; steps[k > 0] are the selects that made steps[k-1]'s base, when that
// base was itself a copy (x[i][j] with i and j sharded on two mesh dims; the middle copy is often a temporary).
// `owned`/`scattered` (set for a scattered copy, whose steps hold one select): the slice's layout on its owner and
// the copy's layout with the selected dim kept (size 1).
struct Entry {
  Local copy;
  std::vector<Step> steps;
  SpecPtr owned, scattered;
  // A scattered copy of the same base to refresh after this copy's write reached the base (register_refresh).
  std::shared_ptr<const Entry> refresh;
  // How the copy was made from steps[0]'s base, for computing it again after the base is written: the selected
  // slice's layout on its owner and the layout it was moved to (the copy's, the selected dim kept, size 1).
  SpecPtr slice_owned, slice_moved;
  const c10::StorageImpl* base_key = nullptr;
  uint64_t seq = 0; // registration order (alike on every rank), shared with the view copies'
};

// A view computed as a copy (register_relaid_view_copy): the copy, its base, and the layouts between them.
// `base_key` identifies the base's buffer (the weak reference keeps the address from being reused); `seq` orders
// the copies of one base alike on every rank (registration order: the same program registers them alike).
struct RelaidEntry {
  Local copy, base;
  SpecPtr copy_spec, viewed, aligned, base_spec;
  const c10::StorageImpl* base_key = nullptr;
  uint64_t seq = 0;
  // When the base was itself such a copy (einops' split-permute-merge with two re-layouts): its entry, to tell
  // whether a write into this copy, once the base is freed, still had an input to reach.
  std::shared_ptr<const RelaidEntry> parent;
};

// A re-laid-out view's buffer: writes into it are refused.
struct Refusal {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  std::string what;
};

struct Registry {
  std::mutex mu;
  std::unordered_map<const c10::StorageImpl*, Entry> entries;
  std::unordered_map<const c10::StorageImpl*, Refusal> refusals;
  std::unordered_map<const c10::StorageImpl*, RelaidEntry> relaid;
  uint64_t seq = 0;
  size_t sweep_at = 64;
};

Registry& registry() {
  static auto* r = new Registry(); // never destroyed: ops may run during interpreter shutdown
  return *r;
}

std::atomic<size_t> g_entries{0};

void sweep(Registry& r) {
  for (auto it = r.entries.begin(); it != r.entries.end();) {
    if (it->second.copy.storage.expired()) {
      it = r.entries.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = r.refusals.begin(); it != r.refusals.end();) {
    if (it->second.storage.expired()) {
      it = r.refusals.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = r.relaid.begin(); it != r.relaid.end();) {
    if (it->second.copy.storage.expired()) {
      it = r.relaid.erase(it);
    } else {
      ++it;
    }
  }
  r.sweep_at = 2 * (r.entries.size() + r.refusals.size() + r.relaid.size()) + 64;
  g_entries = r.entries.size() + r.refusals.size() + r.relaid.size();
}

size_t registered(const Registry& r) {
  return r.entries.size() + r.refusals.size() + r.relaid.size();
}

const c10::StorageImpl* storage_key(const at::Tensor& local) {
  return local.has_storage() ? local.storage().unsafeGetStorageImpl() : nullptr;
}

// The step's selected row in this rank's shard of its base, or none when another rank owns it.
std::optional<int64_t> own_row(const Step& st) {
  const auto coord = st.spec->mesh->coordinate(st.mesh_dim);
  const auto off = st.spec->offset_of(st.mesh_dim, coord);
  if (st.index < off || st.index >= off + st.spec->extents[st.mesh_dim][coord]) return std::nullopt;
  return st.index - off;
}

// A live select copy made equal to its base's slice again: the owner's row moved again as the select moved it
// (scattered or broadcast). Returns the copy, or undefined when it or its base is gone (alike on every rank: the same
// program frees them).
at::Tensor refresh_select(const Entry& e) {
  auto copy = e.copy.get();
  const auto& st = e.steps.front();
  auto base = st.base.get();
  if (!copy.defined() || !base.defined()) return {};
  const auto row = own_row(st);
  auto slice = base.narrow(st.dim, row.value_or(0), row ? 1 : 0);
  copy.copy_(redistribute_local(slice, *e.slice_owned, *e.slice_moved).select(st.dim, 0));
  return copy;
}

// The write of one registered copy into its base(s), as far as this rank holds a part of it.
void write_entry(const Entry& entry, const c10::StorageImpl* key) {
  auto copy = entry.copy.get();
  // Gone (or the address reused by another buffer): nothing can read the copy any more.
  if (!copy.defined() || storage_key(copy) != key) return;
  const auto& steps = entry.steps;
  if (entry.scattered) {
    // Every rank of the mesh dim holds a part of the copy and takes part in moving it back to the owner.
    const auto& st = steps.front();
    auto slice = redistribute_local(copy.unsqueeze(st.dim), *entry.scattered, *entry.owned);
    const auto row = own_row(st);
    if (!row) return;
    auto region = st.base.get();
    if (region.defined()) region.select(st.dim, *row).copy_(slice.select(st.dim, 0));
    return;
  }
  std::vector<int64_t> local_index(steps.size());
  for (size_t k = 0; k < steps.size(); ++k) {
    const auto& st = steps[k];
    const auto row = own_row(st);
    // This rank holds no part of the copy in this base, nor in any base further up (same mesh dim, same shard).
    if (!row) return;
    local_index[k] = *row;
    auto region = st.base.get();
    if (!region.defined()) continue; // a temporary base that is gone: write the bases further up
    for (size_t j = k + 1; j-- > 0;) region = region.select(steps[j].dim, local_index[j]);
    region.copy_(copy);
  }
}

// The local shape `spec` gives this rank.
std::vector<int64_t> own_local_shape(const ShardSpec& spec) {
  auto shape = spec.global_shape;
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    const auto& p = spec.placements[m];
    if (p.is_shard()) shape[p.dim] = spec.extents[m][spec.mesh->coordinate(static_cast<int64_t>(m))];
  }
  return shape;
}

void write_back_storage(const c10::StorageImpl* key, const c10::StorageImpl* except = nullptr);

// A view's copy carried back into its base (register_relaid_view_copy). Every rank runs the same collectives: the
// entry, the layouts and whether the buffers are gone are alike on every rank (the same program made and freed them).
void write_relaid(const RelaidEntry& e, const c10::StorageImpl* key) {
  auto copy = e.copy.get();
  if (!copy.defined() || storage_key(copy) != key) return;
  auto local = copy;
  if (!e.copy_spec->same_layout(*e.viewed)) local = redistribute_local(local, *e.copy_spec, *e.viewed);
  local = local.reshape(own_local_shape(*e.aligned));
  if (!e.aligned->same_layout(*e.base_spec)) local = redistribute_local(local, *e.aligned, *e.base_spec);
  auto base = e.base.get();
  if (!base.defined()) {
    // The base was a temporary copy made by an earlier view (freed alike on every rank). If an input further up is
    // still alive, one device's write would reach it and this one cannot: refused on every rank alike.
    for (auto p = e.parent; p; p = p->parent)
      TORCH_CHECK_NOT_IMPLEMENTED(p->base.storage.expired(),
                                  "ShardTensor: an in-place write into a view computed from an earlier view's copy "
                                  "that is gone (two views of a sharded tensor that each re-laid it out, e.g. a "
                                  "split then a merge of the sharded dim), while their input is alive: the write "
                                  "cannot reach it. Keep the intermediate view in a variable, or write into the "
                                  "input instead");
    return;
  }
  base.copy_(local);
  // The base may itself be a copy (a view of a view, a select copy): carry the write on up; and its other views
  // computed as copies see the write, as a view would on one device.
  write_back_storage(e.base_key, key);
}

// A copy of the buffer `key` to compute again after `key` was written: a view's copy, or a select's (one step).
struct Derived {
  uint64_t seq;
  std::optional<RelaidEntry> view;
  std::optional<Entry> select;
};

// The live copies made from the buffer `key` (but `except`), in registration order (the same on every rank).
std::vector<Derived> copies_of(const c10::StorageImpl* key, const c10::StorageImpl* except) {
  std::vector<Derived> found;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& [copy_key, e] : r.relaid)
    if (e.base_key == key && copy_key != except && !e.copy.storage.expired()) found.push_back({e.seq, e, {}});
  for (const auto& [copy_key, e] : r.entries)
    if (e.base_key == key && copy_key != except && e.slice_owned && !e.copy.storage.expired())
      found.push_back({e.seq, {}, e});
  std::sort(found.begin(), found.end(), [](const Derived& a, const Derived& b) { return a.seq < b.seq; });
  return found;
}

// After the buffer `key` was written, the copies made from it by views and selects (and theirs) are computed
// again, as a view would show the write on one device: the forward's collectives repeated (a select's row moved
// from its owner again; a view's re-layout).
void refresh_copies_of(const c10::StorageImpl* key, const c10::StorageImpl* except) {
  for (const auto& d : copies_of(key, except)) {
    at::Tensor copy;
    if (d.view) {
      const auto& e = *d.view;
      auto base = e.base.get();
      copy = e.copy.get();
      if (!base.defined() || !copy.defined()) continue; // alike on every rank
      auto local = base;
      if (!e.aligned->same_layout(*e.base_spec)) local = redistribute_local(local, *e.base_spec, *e.aligned);
      local = local.reshape(own_local_shape(*e.viewed));
      if (!e.copy_spec->same_layout(*e.viewed)) local = redistribute_local(local, *e.viewed, *e.copy_spec);
      if (local.is_alias_of(copy)) local = local.clone();
      copy.copy_(local);
    } else {
      copy = refresh_select(*d.select);
      if (!copy.defined()) continue;
    }
    refresh_copies_of(storage_key(copy), nullptr);
  }
}

// `key` was written: carry the write to where it must be seen (the base of a copy, the other copies of a buffer).
// `except`: the copy whose write-back wrote `key` (it holds the values already).
void write_back_storage(const c10::StorageImpl* key, const c10::StorageImpl* except) {
  if (!key) return;
  std::optional<Entry> found;
  std::optional<RelaidEntry> relaid;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    if (auto ref = r.refusals.find(key); ref != r.refusals.end()) {
      auto alive = ref->second.storage.lock();
      if (alive && alive.get() == key)
        TORCH_CHECK_NOT_IMPLEMENTED(false, "ShardTensor: an in-place write into the result of ", ref->second.what,
                                    ", which had to re-lay out its input first, so it is a copy, not a view: the "
                                    "write cannot reach the input. Write into the input before the view, or use "
                                    "the out-of-place op and keep its result");
    }
    // A buffer is registered in one map at a time (each registration clears the other), but an entry of a freed
    // buffer stays until the next sweep: only a live one counts (its address may now be another buffer's).
    if (auto rel = r.relaid.find(key); rel != r.relaid.end() && !rel->second.copy.storage.expired())
      relaid = rel->second;
    auto it = r.entries.find(key);
    if (it != r.entries.end()) found = it->second;
  }
  if (relaid) {
    write_relaid(*relaid, key);
  } else if (found) {
    write_entry(*found, key);
    // Every rank, whether or not it held a part of the write: the refresh is a collective.
    if (found->refresh) refresh_select(*found->refresh);
    // The base's other copies see the write (a re-laid view of it, another select's overlapping copy).
    if (found->base_key) refresh_copies_of(found->base_key, key);
  }
  refresh_copies_of(key, except);
}

} // namespace

void register_select_copy(const at::Tensor& base, const at::Tensor& copy, int64_t dim, int64_t index,
                          int64_t mesh_dim, SpecPtr owned, SpecPtr scattered, SpecPtr slice_owned,
                          SpecPtr slice_moved) {
  auto* bimpl = shard_impl(base);
  auto* cimpl = shard_impl(copy);
  TORCH_INTERNAL_ASSERT(bimpl && cimpl);
  // While torch.compile traces, python/shardtensor/_traced.py carries writes home in the graph; a tracer's tensors
  // have no buffer to key on (registering one made a traced write replay the write-back on fake storage).
  if (comm::tracing(cimpl->local())) return;
  const auto* key = storage_key(cimpl->local());
  const auto* base_key = storage_key(bimpl->local());
  // A copy that aliases the base (e.g. a size-1 mesh dim) is a real view already: writes reach the base.
  if (!key || !base_key || key == base_key) return;
  Entry e{Local(cimpl->local()), {Step{Local(bimpl->local()), bimpl->spec(), dim, index, mesh_dim}},
          std::move(owned), std::move(scattered)};
  e.slice_owned = std::move(slice_owned);
  e.slice_moved = std::move(slice_moved);
  e.base_key = base_key;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  e.seq = r.seq++;
  if (auto it = r.entries.find(base_key); it != r.entries.end() && !it->second.copy.storage.expired()) {
    if (e.scattered || it->second.scattered) {
      // A chain through a scattered copy would have to move each link back in turn: refused (rare: selects along
      // two sharded dims, one result of 3 or more dims).
      r.refusals.insert_or_assign(key, Refusal{cimpl->local().storage().getWeakStorageImpl(),
                                               "a select along a sharded dim of a tensor that was itself selected "
                                               "along a sharded dim (a copy of a copy)"});
      g_entries = registered(r);
      return;
    }
    e.steps.insert(e.steps.end(), it->second.steps.begin(), it->second.steps.end());
  }
  r.relaid.erase(key);
  r.entries.insert_or_assign(key, std::move(e));
  if (registered(r) >= r.sweep_at) sweep(r);
  g_entries = registered(r);
}

std::optional<SelectOrigin> scattered_select_origin(const at::Tensor& copy) {
  auto* impl = shard_impl(copy);
  if (!impl) return std::nullopt;
  const auto& local = impl->local();
  const auto* key = storage_key(local);
  if (!key) return std::nullopt;
  std::optional<Entry> found;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.entries.find(key);
    if (it == r.entries.end() || !it->second.scattered) return std::nullopt;
    found = it->second;
  }
  const auto& c = found->copy;
  if (c.offset != local.storage_offset() || c.sizes != local.sizes().vec() || c.strides != local.strides().vec())
    return std::nullopt; // a view of the copy, not the copy: its dims are not the copy's
  const auto& st = found->steps.front();
  auto base = st.base.get();
  if (!base.defined()) return std::nullopt;
  const auto landing_in_base = found->scattered->placements[st.mesh_dim].dim;
  return SelectOrigin{make_shard_tensor(base, st.spec), st.dim, st.index,
                      landing_in_base > st.dim ? landing_in_base - 1 : landing_in_base};
}

void register_refresh(const at::Tensor& copy, const at::Tensor& source) {
  auto* cimpl = shard_impl(copy);
  auto* simpl = shard_impl(source);
  TORCH_INTERNAL_ASSERT(cimpl && simpl);
  const auto* key = storage_key(cimpl->local());
  const auto* source_key = storage_key(simpl->local());
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(key);
  auto src = r.entries.find(source_key);
  // Registered alike on every rank (the copy and its source are decided from the specs).
  if (it == r.entries.end() || src == r.entries.end() || !src->second.scattered) return;
  it->second.refresh = std::make_shared<const Entry>(src->second);
}

void register_relaid_view(const at::Tensor& copy, std::string what) {
  auto* cimpl = shard_impl(copy);
  TORCH_INTERNAL_ASSERT(cimpl);
  const auto& local = cimpl->local();
  const auto* key = storage_key(local);
  if (!key) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.refusals.insert_or_assign(key, Refusal{local.storage().getWeakStorageImpl(), std::move(what)});
  if (registered(r) >= r.sweep_at) sweep(r);
  g_entries = registered(r);
}

void register_relaid_view_copy(const at::Tensor& base, const at::Tensor& copy, SpecPtr aligned, SpecPtr viewed) {
  auto* bimpl = shard_impl(base);
  auto* cimpl = shard_impl(copy);
  TORCH_INTERNAL_ASSERT(bimpl && cimpl);
  const auto& local = cimpl->local();
  const auto* key = storage_key(local);
  const auto* base_key = storage_key(bimpl->local());
  // While torch.compile traces there is no buffer to carry a write into: refused, as before this write-back existed.
  if (comm::tracing(local)) {
    register_relaid_view(copy, "a view that re-laid out its input, while torch.compile traces");
    return;
  }
  // A result that aliases its base (a mesh dim of one rank moves nothing) is a real view: writes reach the base.
  if (!key || !base_key || key == base_key) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.entries.erase(key);
  std::shared_ptr<const RelaidEntry> parent;
  if (auto it = r.relaid.find(base_key); it != r.relaid.end() && !it->second.copy.storage.expired())
    parent = std::make_shared<const RelaidEntry>(it->second);
  r.relaid.insert_or_assign(key, RelaidEntry{Local(local), Local(bimpl->local()), cimpl->spec(), std::move(viewed),
                                             std::move(aligned), bimpl->spec(), base_key, r.seq++,
                                             std::move(parent)});
  if (registered(r) >= r.sweep_at) sweep(r);
  g_entries = registered(r);
}

bool any_select_copies() {
  return g_entries.load(std::memory_order_relaxed) != 0;
}

void after_write(const at::Tensor& written) {
  auto* impl = shard_impl(written);
  if (!impl) return;
  write_back_storage(storage_key(impl->local()));
}

} // namespace shardtensor::dispatch
