// The halo planner: one place that decides, from specs alone, which outputs a rank owns along a sharded dim and
// which input rows its windows read (the window partition), and that moves those rows (HaloPlan). Convolutions,
// pooling, padding, interpolation and neighbourhood attention build their plans here.
//
// Plans are pure functions of the layout (spec contents, this rank's mesh coordinates) and the window
// parameters: the same on every rank's view, computed without communication, so every rank issues the same
// collectives. They are cached (PlanCache) and reused by the backward; their index tensors live on the tensors'
// device, built once per plan, so an exchange copies no indices from the host.
#pragma once

#include "comm/collectives.h"
#include "comm/halo.h"

#include <shardtensor/mesh.h>
#include <shardtensor/spec.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <tuple>
#include <typeindex>
#include <vector>

namespace shardtensor::comm {

// ---- padding ----------------------------------------------------------------------------------------------------

// What a window position outside [0, L) reads.
enum class PadMode : int8_t {
  None,       // windows never leave the tensor (adaptive pooling, interpolation, neighbourhood attention)
  Zeros,      // a zero row (convolution, average pooling, constant padding with 0)
  Constant,   // a row of a given value (constant padding)
  NegInf,     // a row of -inf (max pooling: never selected)
  Reflect,    // mirrored about the edge row, which is not repeated (torch's reflect)
  Replicate,  // the edge row repeated
  Circular,   // wrapped around
};

// Global row of window position `pos` along a dim of size `L`: `pos` itself inside, the mirrored / repeated /
// wrapped row for Reflect / Replicate / Circular, -1 (a filled row) for the fill modes.
int64_t padded_index(int64_t pos, int64_t L, PadMode mode);

// The value of filled (-1) rows: 0, `constant`, -inf.
double fill_value(PadMode mode, double constant = 0.0);

// ---- the window partition rule ------------------------------------------------------------------------------------

// Along one sharded dim: the outputs every coordinate owns (consecutive ranges tiling [0, out_size) in
// coordinate order) and the input rows its outputs read, in window order (-1: a filled row).
struct WindowPartition {
  std::vector<int64_t> out_extents;
  RowRequests want;

  int64_t out_begin(int64_t coord) const;
};

// A sliding window: output o reads input positions o*stride - padding + j*dilation, j < kernel.
struct SlidingWindow {
  int64_t kernel = 1, stride = 1, padding = 0, dilation = 1;
  bool ceil_mode = false;  // pooling only

  int64_t span() const { return dilation * (kernel - 1) + 1; }
};

// Output sizes: convolution (floor, at least 0) and PyTorch's pooling_output_shape (ceil_mode's last window must
// start inside the input or the left padding).
int64_t conv_output_size(int64_t L, const SlidingWindow& w);
int64_t pool_output_size(int64_t L, const SlidingWindow& w);

// Centre ownership: the first output whose window centre (o*s - p + (span-1)/2) lies at or after input row `a`.
// A coordinate owns the outputs centred in its rows, which keeps 'same'-padded stride-1 outputs on exactly the
// input extents (no shard drift through a stack of layers) and halves them for stride 2.
int64_t first_output_centred_at(int64_t a, const SlidingWindow& w);

// Convolution and pooling along a sharded dim of size L (out_size from the op's rule): centre ownership, each
// coordinate reading the rows of its outputs' windows (any distance: shards narrower than the halo ask further
// away) with positions outside the input mapped by `mode`.
WindowPartition sliding_window_partition(const std::vector<int64_t>& in_extents, int64_t L, int64_t out_size,
                                         const SlidingWindow& w, PadMode mode);

// Transposed convolution (the adjoint): each coordinate's local transposed kernel on its own inputs produces the
// output positions a*s - p ... (a its first input row); `out_extents` follow the inputs (each coordinate owns the
// rows its inputs produce, less a halo on each side that differs by at most one row between the sides) and
// `want[c]` names the output rows coordinate c produces (-1: cropped by the padding), which go to their owners.
WindowPartition transposed_window_partition(const std::vector<int64_t>& in_extents, int64_t L, const SlidingWindow& w,
                                            int64_t output_padding);

// Padding by (left, right) (negative: crop) along a sharded dim: output o reads row o - left mapped by `mode`
// and belongs to the coordinate owning that row (pads go to the edge coordinates that hold rows), so constant
// padding moves nothing and the other modes only the mirrored rows. Circular pads must be non-negative: torch
// wraps the cropped tensor, not the rows of the uncropped one, so a caller crops first.
WindowPartition padding_partition(const std::vector<int64_t>& in_extents, int64_t L, int64_t left, int64_t right,
                                  PadMode mode);

// Outputs that follow a primary input row (adaptive pooling, interpolation): output o belongs to the coordinate
// owning row primary[o] (non-decreasing in o) and reads rows [first[o], last[o]]; a coordinate's window is the
// contiguous range of rows its outputs read.
WindowPartition primary_row_partition(const std::vector<int64_t>& in_extents, const std::vector<int64_t>& primary,
                                      const std::vector<int64_t>& first, const std::vector<int64_t>& last);

// ---- the exchange -----------------------------------------------------------------------------------------------

// One dim of a halo plan: the rows of tensor dim `dim` every coordinate's window holds (`want`), the dim split
// along mesh dim `mesh_dim` with `extents`. mesh_dim -1: an unsharded dim (extents {L}), gathered locally (the
// padding of a dim no mesh dim shards).
struct HaloDim {
  int64_t dim = 0;
  int64_t mesh_dim = -1;
  std::vector<int64_t> extents;
  RowRequests want;
};

struct PendingHalo {
  at::Tensor window;
  PeerExchange exchange;
  bool posted = false;
};

// Gather (forward), start/finish (the same, with compute in between), scatter_add (backward) over one or more dims,
// in order: the second dim's exchange moves rows that already hold the first dim's halo, so the corners of 2-D
// meshes come along. When no coordinate needs another's rows along a dim (a decision every rank makes alike from
// the plan) that dim issues no collective.
class HaloPlan {
 public:
  HaloPlan() = default;
  // `coordinates`: this rank's mesh coordinates; index tensors are built on `device`; -1 rows read `fill`.
  HaloPlan(const std::vector<HaloDim>& dims, const std::vector<int64_t>& coordinates, c10::Device device,
           double fill = 0.0);

  bool empty() const { return steps_.empty(); }
  size_t size() const { return steps_.size(); }
  const HaloDim& dim(size_t i) const { return steps_.at(i).geometry; }
  // This rank's window length along dim i.
  int64_t window_rows(size_t i) const { return steps_.at(i).window_rows; }

  // This rank's window of `local` (a fresh tensor; `local` itself for an empty plan).
  at::Tensor gather(const at::Tensor& local, const Mesh& mesh) const;
  // Every dim's exchange in order, without a window: step k sends the rows its peers name of `local` extended by
  // the windows of dims < k (only those rows are built); [step][peer]: the pieces received. Needs runs.
  // `while_first`: work that runs while the first dim's rows travel (it must issue no collective).
  std::vector<std::vector<at::Tensor>> exchange_all(const at::Tensor& local, const Mesh& mesh,
                                                    const std::function<void()>& while_first = {}) const;
  // Whether every dim's maps are runs (what exchange_all and assemble need).
  bool all_runs() const {
    for (const auto& s : steps_)
      if (!s.runs) return false;
    return true;
  }
  // `local` extended by the windows of the first `steps` dims from `received` (exchange_all's), each element
  // written once; when `steps` < size(), only local rows [rows_first, rows_first + rows_count) of that step's dim.
  // `into`: the tensor to write (of the result's shape; a fresh one when undefined); `own_written`: its own rows are
  // there already (write_own_rows, while the exchange travelled).
  at::Tensor assemble(const at::Tensor& local, const std::vector<std::vector<at::Tensor>>& received, size_t steps,
                      int64_t rows_first, int64_t rows_count, const at::Tensor& into = {},
                      bool own_written = false) const;
  // The rows of `base` (the local tensor, cut as assemble cuts it) into their place in `out`, a window over the
  // first `steps` dims.
  void write_own_rows(const at::Tensor& out, const at::Tensor& base, size_t steps) const;
  // gather in two steps: start posts the first dim's exchange and places the own rows; finish completes it and
  // gathers the remaining dims. Every rank must call both (start's post is in the collective order).
  PendingHalo start(const at::Tensor& local, const Mesh& mesh) const;
  at::Tensor finish(PendingHalo& pending, const Mesh& mesh) const;
  // The adjoint of gather: window rows go home (dims in reverse order) and are summed into the local tensor.
  // `consume`: the caller hands over `window` (a temporary nobody else reads): when this rank's rows sit in it
  // as one run covering the whole local extent, the result is that part of the window, summed into in place,
  // instead of a fresh local tensor next to the window (one activation less at a backward's peak).
  at::Tensor scatter_add(const at::Tensor& window, const Mesh& mesh, bool consume = false) const;

  // A region of the window without the window (the border executions over several dims): `ranges`, one per step,
  // window positions along the first `stop` steps' dims and local rows along the others; built from `local`'s rows
  // and `received` (exchange_all's pieces, or a post_rows exchange's; a step whose rows the region does not read may
  // be empty). `zero_own`: the own rows read as zeros (the halo's terms alone). A fresh tensor of the region's size.
  at::Tensor region(const at::Tensor& local, const std::vector<std::vector<at::Tensor>>& received,
                    const std::vector<std::pair<int64_t, int64_t>>& ranges, size_t stop, bool zero_own = false) const;

  // A window's gradient held as pieces instead of a window (the backward of a border execution over several dims,
  // ops/conv.cpp): `own`, the local tensor's gradient, and `halo[k][r]`, the gradient of the piece exchange_all
  // received from peer r at step k (its shape: window positions along the dims of earlier steps, the peer's rows
  // along step k's dim, local rows along later ones). zero_pieces makes them (zeros; zero-row pieces for peers
  // without rows). add_region adds `grad`, the gradient of a region of the window — one range per step: window
  // positions for steps < `steps`, local rows for the others (dims outside the plan whole) — into them: each element
  // into the piece that holds it, padding positions dropped, the own rows dropped too when `skip_own`.
  // scatter_pieces is scatter_add on such pieces: the steps in reverse, step k's pieces go home (scatter_add's
  // messages, so ranks on either path match) and what returns is added into `own` and the earlier steps' pieces
  // (a corner's gradient travels back its two hops). Need all_runs.
  std::vector<std::vector<at::Tensor>> zero_pieces(const at::Tensor& local) const;
  // `skip_halo`: only the own rows' part (the halo pieces were posted already).
  void add_region(at::Tensor& own, std::vector<std::vector<at::Tensor>>& halo, size_t steps,
                  const std::vector<std::pair<int64_t, int64_t>>& ranges, const at::Tensor& grad, bool skip_own,
                  bool skip_halo = false) const;
  void scatter_pieces(at::Tensor& own, std::vector<std::vector<at::Tensor>>& halo, const Mesh& mesh) const;
  // One step of it, split around its exchange so the caller can compute meanwhile: post_pieces sends step k's
  // pieces home (nothing when the step exchanges nothing); `back[r]`, what peer r returned (its halo[k] piece of this
  // rank), is added into `own` and the earlier steps' pieces by add_piece_returns. Steps in reverse, each added
  // before the next is posted.
  PeerExchange post_pieces(size_t k, const at::Tensor& own, const std::vector<std::vector<at::Tensor>>& halo,
                           const Mesh& mesh) const;
  // The same before the own tensor exists: its shape, and a tensor of its dtype and device.
  PeerExchange post_pieces(size_t k, at::IntArrayRef own_shape, const at::Tensor& like,
                           const std::vector<std::vector<at::Tensor>>& halo, const Mesh& mesh) const;
  std::vector<std::vector<at::Tensor>> zero_pieces(at::IntArrayRef local_shape, const at::TensorOptions& options) const;
  void add_piece_returns(size_t k, at::Tensor& own, std::vector<std::vector<at::Tensor>>& halo,
                         const std::vector<at::Tensor>& back) const;

  // Dim i's halo rows alone, without a window (the border execution of comm/halo_borders.h): `post` sends this
  // rank's rows to the peers whose windows name them and receives the rows of its own window that peers hold
  // (wait() gives them by peer: the `received` of window_slice). The same messages as gather's exchange of dim i, so
  // a rank running this path and one building its window match.
  PeerExchange post(size_t i, const at::Tensor& local, const Mesh& mesh) const;
  // post for several tensors whose rows travel together (the same sizes except the last dim; key and value): one
  // message per peer with their rows concatenated on the last dim (a copy of the halo rows only); split_parts gives
  // the received pieces back by tensor, then by peer.
  PeerExchange post(size_t i, const std::vector<at::Tensor>& parts, const Mesh& mesh) const;
  // post of a tensor that is never built whole (a window along earlier dims, which a second-hop exchange sends):
  // `rows(first, count)` gives its rows [first, first + count) along dim i, `shape` is its shape. Only the sent
  // rows are built. Needs runs(i).
  PeerExchange post_rows(size_t i, const std::function<at::Tensor(int64_t first, int64_t count)>& rows,
                         at::IntArrayRef shape, const at::Tensor& like, const Mesh& mesh) const;
  static std::vector<std::vector<at::Tensor>> split_parts(const std::vector<at::Tensor>& pieces,
                                                          const std::vector<int64_t>& last_dims);
  // The adjoint of post, from gradient rows over a few window slices rather than a window: `slices` are (first
  // window position, gradient rows over the positions that follow; disjoint), the halo positions among them go
  // to their owners (positions no slice covers: zero). wait() gives, by peer, the gradient rows of this rank's
  // rows that the peer's window named: add_returns sums them into the local gradient. `shape`: the local tensor's
  // (any extent along dim i); `like`: its dtype and device.
  PeerExchange post_returns(size_t i, const std::vector<std::pair<int64_t, at::Tensor>>& slices,
                            at::IntArrayRef shape, const at::Tensor& like, const Mesh& mesh) const;
  // Where this rank's own rows sit in dim i's window when they form one run: (first window position, first local
  // row, count).
  std::tuple<int64_t, int64_t, int64_t> own_run(size_t i) const;
  // Whether every row map of dim i is one consecutive run and its padding rows are runs (the windows of sliding
  // windows over zero-padded dims): what window_slice needs.
  bool runs(size_t i) const { return steps_.at(i).runs; }
  // Window positions [begin, begin + len) of dim i, assembled from the padding value, `local`'s rows and the rows
  // received from peers (none: zeros in their place): a few rows, not the window.
  // `local_first`: the local row `local`'s first row is (a caller passes only the own rows the slice reads).
  at::Tensor window_slice(size_t i, const at::Tensor& local, const std::vector<at::Tensor>& received, int64_t begin,
                          int64_t len, int64_t local_first = 0) const;

  // One dim's local parts around its collective (gather/scatter_add put the all-to-all between them; the tests
  // route the pieces between coordinates themselves). Pieces are indexed by peer coordinate.
  bool exchanges(size_t i) const { return steps_.at(i).exchange; }
  at::Tensor own_window(size_t i, const at::Tensor& local) const;                  // own rows placed, -1 rows filled
  std::vector<at::Tensor> sends(size_t i, const at::Tensor& local) const;          // the rows each peer's window names
  void receive(size_t i, at::Tensor& window, const std::vector<at::Tensor>& pieces) const;
  at::Tensor own_sum(size_t i, const at::Tensor& window, bool reuse = false) const;  // adjoint of own_window
  std::vector<at::Tensor> returns(size_t i, const at::Tensor& window) const;       // window rows each peer owns
  void add_returns(size_t i, at::Tensor& out, const std::vector<at::Tensor>& pieces) const;

 private:
  // Window positions and the rows of a tensor they correspond to, with both as index tensors on the plan's device
  // (unless they are consecutive runs, which need none).
  struct RowMap {
    std::vector<int64_t> pos, rows;
    at::Tensor pos_t, rows_t;
    bool run = true;
    int64_t size() const { return static_cast<int64_t>(pos.size()); }
    // Packed pieces (sends, returned gradient rows) of a consecutive run are a narrow of `t`, except for CUDA
    // tensors with a device index table: those go through the csrc_cuda halo kernels.
    bool packs_by_narrow(const at::Tensor& t) const { return run && (!t.is_cuda() || !rows_t.defined()); }
  };
  struct Step {
    HaloDim geometry;
    int64_t me = 0;
    int64_t window_rows = 0, own_extent = 0;
    bool exchange = false;   // some coordinate needs rows of another one
    bool runs = true;        // every map below is a run and the -1 rows form fill_runs
    std::vector<std::pair<int64_t, int64_t>> fill_runs;  // (first position, count) of the -1 rows
    at::Tensor fill_t;       // their positions, when they form more than kMaxFillRuns runs
    RowMap own;              // my window positions <- my local rows
    std::vector<RowMap> to;  // [peer] rows: my local rows that peer's window names (its order)
    std::vector<RowMap> from;  // [peer] pos: my window positions that peer owns
  };
  static constexpr size_t kMaxFillRuns = 4;
  static RowMap row_map(std::vector<int64_t> pos, std::vector<int64_t> rows, c10::Device device);
  // Per map, the slices of `t` along `dim` at its rows (by_rows) or its window positions, packed for a collective.
  static std::vector<at::Tensor> pieces(const at::Tensor& t, int64_t dim, const std::vector<RowMap>& maps,
                                        bool by_rows);
  at::Tensor gather_step(size_t i, const at::Tensor& local, const Mesh& mesh) const;
  // The shapes of the pieces dim i's exchange receives from every peer (window rows), and of those its adjoint
  // receives (the rows of `local` each peer's window named).
  std::vector<std::vector<int64_t>> recv_shapes(size_t i, at::IntArrayRef window_shape) const;
  std::vector<std::vector<int64_t>> return_shapes(size_t i, at::IntArrayRef window_shape) const;

  std::vector<Step> steps_;
  double fill_ = 0.0;
};

// ---- plan caching -----------------------------------------------------------------------------------------------

// What a plan depends on, flattened to integers: the key of the plan cache.
class PlanKey {
 public:
  PlanKey& add(int64_t v) {
    v_.push_back(v);
    return *this;
  }
  PlanKey& add_ints(at::IntArrayRef v);
  PlanKey& add_double(double v);
  // Placements, global shape, extents, the mesh's shape and this rank's coordinates (a plan holds this rank's
  // part of the exchange; meshes of the same shape share plans, which never hold a mesh).
  PlanKey& add_spec(const ShardSpec& spec);
  PlanKey& add_device(c10::Device device);

  bool operator==(const PlanKey& other) const { return v_ == other.v_; }
  size_t hash() const;

 private:
  std::vector<int64_t> v_;
};

struct PlanCacheStats {
  int64_t hits = 0, misses = 0, size = 0, capacity = 0;
};

// A bounded, least-recently-used cache of immutable plans of any type, shared by the ops. `make` runs on a miss
// (outside the lock; a build that throws caches nothing). Plans must not hold tensors' data or meshes (a cached
// plan would keep a process group alive): layouts, index lists, and index tensors on the device.
template <typename Plan>
std::shared_ptr<const Plan> cached_plan(const PlanKey& key, const std::function<Plan()>& make);

PlanCacheStats plan_cache_stats();
void reset_plan_cache_stats();
// Drops every plan; sets the capacity (tests).
void set_plan_cache_capacity(size_t capacity);

namespace detail {
std::shared_ptr<const void> find_plan(const PlanKey& key, std::type_index type);
void store_plan(const PlanKey& key, std::type_index type, std::shared_ptr<const void> plan);
} // namespace detail

template <typename Plan>
std::shared_ptr<const Plan> cached_plan(const PlanKey& key, const std::function<Plan()>& make) {
  const std::type_index type(typeid(Plan));
  if (auto hit = detail::find_plan(key, type)) return std::static_pointer_cast<const Plan>(hit);
  auto plan = std::make_shared<const Plan>(make());
  detail::store_plan(key, type, plan);
  return plan;
}

} // namespace shardtensor::comm
