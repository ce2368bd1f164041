#include "dispatch/write_back.h"

#include "comm/functional.h"
#include "comm/redistribute.h"

#include <shardtensor/shard_tensor.h>

#include <ATen/ATen.h>

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
  r.sweep_at = 2 * (r.entries.size() + r.refusals.size()) + 64;
  g_entries = r.entries.size() + r.refusals.size();
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

// A live scattered copy made equal to its base's slice again: the owner's row moved back along the mesh dim.
void refresh_scattered(const Entry& e) {
  auto copy = e.copy.get();
  const auto& st = e.steps.front();
  auto base = st.base.get();
  if (!copy.defined() || !base.defined()) return; // gone alike on every rank (the same program frees them)
  const auto row = own_row(st);
  auto slice = base.narrow(st.dim, row.value_or(0), row ? 1 : 0);
  auto moved = redistribute_local(slice, *e.owned, *e.scattered);
  copy.copy_(moved.select(st.dim, 0));
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

void write_back_storage(const c10::StorageImpl* key) {
  if (!key) return;
  std::optional<Entry> found;
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
    auto it = r.entries.find(key);
    if (it == r.entries.end()) return;
    found = it->second;
  }
  write_entry(*found, key);
  // Every rank, whether or not it held a part of the write: the refresh is a collective.
  if (found->refresh) refresh_scattered(*found->refresh);
}

} // namespace

void register_select_copy(const at::Tensor& base, const at::Tensor& copy, int64_t dim, int64_t index,
                          int64_t mesh_dim, SpecPtr owned, SpecPtr scattered) {
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
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (auto it = r.entries.find(base_key); it != r.entries.end() && !it->second.copy.storage.expired()) {
    if (e.scattered || it->second.scattered) {
      // A chain through a scattered copy would have to move each link back in turn: refused (rare: selects along
      // two sharded dims, one result of 3 or more dims).
      r.refusals.insert_or_assign(key, Refusal{cimpl->local().storage().getWeakStorageImpl(),
                                               "a select along a sharded dim of a tensor that was itself selected "
                                               "along a sharded dim (a copy of a copy)"});
      g_entries = r.entries.size() + r.refusals.size();
      return;
    }
    e.steps.insert(e.steps.end(), it->second.steps.begin(), it->second.steps.end());
  }
  r.entries.insert_or_assign(key, std::move(e));
  if (r.entries.size() + r.refusals.size() >= r.sweep_at) sweep(r);
  g_entries = r.entries.size() + r.refusals.size();
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
  if (r.entries.size() + r.refusals.size() >= r.sweep_at) sweep(r);
  g_entries = r.entries.size() + r.refusals.size();
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
