// Sliding windows along one sharded dim run without building the window.
//
// A rank's window along the sharded dim is its own rows with a few rows of its neighbours (and padding) on either
// side. Building it copies every own row into a new tensor, and splitting the work into an interior and border parts
// concatenates the output again. Instead: the local kernel runs once on the rank's own rows with a symmetric
// padding P on the dim — the single-device op's own call on this rank's rows, into the output it returns — which
// gives every output of this rank, those near an edge computed with the neighbours' rows read as padding. Those
// border outputs then get what the halo rows add: a linear op (convolution, ops/conv.cpp) adds the halo rows'
// terms; any op can compute them again from border windows (the halo rows and the few own rows they read) and
// write them over their rows of the output (border_forward; pooling). The halo travels while the main call runs.
// Memory traffic beyond the single-device op: the halo rows and the border rows.
//
// The backward of a linear op (convolution) needs no window either (BorderTerms): the main call's backward on the
// rank's own rows gives every term that reads them, of all its outputs; the terms through a neighbour's rows are
// computed by that neighbour, to which the gradient rows of the border outputs travel (as many rows as the halo) —
// one exchange instead of the input's halo and then its gradient.
//
// One executor runs the pattern for every family (border_forward / border_backward, multi_border_forward over
// several sharded dims): the op supplies the split and a
// kernel that computes a call (the main call, or a border's outputs from its window); the executor posts the halo
// (several inputs in one message per peer), overlaps it with the main call, assembles the outputs in the main call's
// buffers and, backward, sends the border windows' halo gradients home while the main call runs. Convolution and
// pooling use border_split (symmetric padding); neighbourhood attention (the main call's geometry takes the rank's
// rows as the whole extent) and interpolation (taps relative to the own rows) plan their own splits.
//
// The split is a pure function of the layout and the window (cached with the op's plan). It applies when the main
// call's outputs are exactly this rank's outputs (P = the distance from the window start to the rank's first row,
// and the output count matches: stride-1 windows always, strided ones at stride-aligned offsets; ceil mode counted
// as PyTorch's pooling counts it) and there is an interior; otherwise the op builds the window (HaloPlan::gather). Either way a rank exchanges the same rows with
// the same peers, so ranks on different paths still match.
#pragma once

#include "comm/halo_plan.h"

#include <functional>

namespace shardtensor::comm {

struct BorderSplit {
  // Outputs (local indices) recomputed from window positions [win_begin, win_begin + win_len).
  struct Border {
    int64_t out_begin = 0, out_len = 0;
    int64_t win_begin = 0, win_len = 0;
  };
  bool direct = false;           // the border execution applies (else: the caller builds the window)
  bool main = true;              // a main call on the own rows gives the outputs (else one border covers them all)
  int64_t padding = 0;           // the main call's symmetric padding on the dim
  std::vector<Border> borders;   // at most two, in order, disjoint
};

// The split of coordinate `coord` along a dim of size L with `in_extents`, whose outputs (`out_extents`) follow
// sliding_window_partition with zero padding (positions outside [0, L) read as the padding value). `max_padding`:
// the most padding the local kernel accepts (-1: any; pooling accepts at most half its window).
BorderSplit border_split(const std::vector<int64_t>& in_extents, const std::vector<int64_t>& out_extents, int64_t coord,
                         int64_t L, const SlidingWindow& w, int64_t max_padding = -1);

// The backward's exchange of a linear sliding-window op along one sharded dim (its layout as for border_split, for
// every rank whatever its forward path): coordinate `coord` sends each peer the gradient rows of its outputs that
// read the peer's rows, and adds the terms of the peers' outputs that read its own rows. Ranges are contiguous
// (with dilation a range may hold outputs that skip the rows: their terms there are zero).
struct BorderTerms {
  struct Received {
    int64_t outputs = 0;                // the peer's output rows that arrive
    int64_t row_begin = 0, rows = 0;    // the global input rows they read
  };
  std::vector<std::pair<int64_t, int64_t>> send;  // [peer]: (first local output, count)
  std::vector<Received> recv;                     // [peer]
  int64_t own_begin = 0, own_rows = 0;            // this rank's input rows (global)
};
BorderTerms border_terms(const std::vector<int64_t>& in_extents, const std::vector<int64_t>& out_extents,
                         int64_t coord, int64_t L, const SlidingWindow& w);

// `kernel(input, padding, first)`: the local op on `input` with `padding` on the split dim (the op's own arguments
// elsewhere); the rows of each of its outputs along the dim are the window's outputs. `first`: the window position
// of the input's first row (for outputs that name input rows, such as max pooling's indices).
using WindowKernel =
    std::function<std::vector<at::Tensor>(const at::Tensor& input, int64_t padding, int64_t first)>;

// The forward of a direct split along the plan's only dim: posts the halo rows, runs the main call (while they
// travel when `overlap`), then each border's call, written into the main call's outputs, which are returned.
std::vector<at::Tensor> border_forward(const HaloPlan& plan, const BorderSplit& split, const at::Tensor& local,
                                       const Mesh& mesh, const WindowKernel& kernel, bool overlap = true);

// Several exchanged dims (the plan's steps, `splits[k]` and `windows[k]` for step k's dim, each split direct with a
// main call; every step's maps runs): the main call on the own block with each dim's split padding gives every
// output of this rank, those near an edge computed with the halo read as padding, while the first dim's halo
// travels; then each further dim's exchange sends the earlier dims' windows of its halo rows (the corners travel as a
// second hop: one message per neighbour and step, as the window path's gather sends, in the same order, so ranks on
// either path match) and travels while dim k's border slabs are computed: its border outputs over every output of
// the earlier dims and the interior ones of the later dims, each from its region window (halo-sized along k, the
// windows of its outputs along the others), written over the main call's rows. The slabs cover every output that
// reads the halo once. Memory traffic beyond the single-device op: the halo and the slabs' region windows.
// `kernel(input, padding, first)`: `padding[k]` and `first[k]` per step as WindowKernel's (the main call: the splits'
// paddings, its first row at window position padding[k]; a slab: no padding, its region's first window positions).
using MultiWindowKernel = std::function<std::vector<at::Tensor>(
    const at::Tensor& input, const std::vector<int64_t>& padding, const std::vector<int64_t>& first)>;
std::vector<at::Tensor> multi_border_forward(const HaloPlan& plan, const std::vector<BorderSplit>& splits,
                                             const std::vector<SlidingWindow>& windows, const at::Tensor& local,
                                             const Mesh& mesh, const MultiWindowKernel& kernel, bool overlap = true);
// Whether multi_border_forward applies to this rank: two or more steps, each running and its split direct with a
// main call.
bool multi_border_applies(const HaloPlan& plan, const std::vector<BorderSplit>& splits);
// A border slab of multi_border_forward, whose geometry its adjoint (a linear op's backward over the same slabs,
// ops/conv.cpp) shares: step k's `border` outputs along k, every output along the earlier steps' dims and the
// interior ones (no border of their split holds them) along the later ones -- they read own rows and padding there,
// so the slab needs the halo of steps <= k only; the slabs of all steps cover every output that reads the halo once.
// `outputs[d]` and `window[d]` (first, count) along step d's dim: the outputs and the window positions they read
// (from the first one's first tap to the last one's last). `empty`: some dim has no outputs. `out_len[d]`: the
// outputs along step d's dim.
struct BorderSlab {
  std::vector<std::pair<int64_t, int64_t>> outputs, window;
  bool empty = false;
};
BorderSlab border_slab(const std::vector<BorderSplit>& splits, const std::vector<SlidingWindow>& windows, size_t k,
                       const BorderSplit::Border& border, const std::vector<int64_t>& out_len);

// The general form, for kernels whose main call is not a padding of the border calls (neighbourhood attention's
// windows shift inward at the edges, so its main call runs the rank's rows as a whole tensor of their own) and for
// several windowed inputs travelling together (key and value: one message per peer). A call names what it
// computes: `main` (the own rows of every input, every output; out_len -1) or a border (windows
// starting at window position `first`, computing outputs [out_begin, out_begin + out_len)). With split.main false
// the only border covers every output and its call's outputs are returned as they are (ranks whose rows are too
// few for a main call: their window is a few rows anyway).
struct BorderCall {
  bool main = false;
  int64_t padding = 0, first = 0;
  int64_t out_begin = 0, out_len = 0;
};
using BorderKernel = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs,
                                                           const BorderCall& call)>;
struct BorderForward {
  std::vector<at::Tensor> outputs;
  std::vector<std::vector<at::Tensor>> received;  // [input][peer]: the halo rows, for the backward's border windows
};
BorderForward border_forward(const HaloPlan& plan, const BorderSplit& split, const std::vector<at::Tensor>& locals,
                             const Mesh& mesh, const BorderKernel& kernel, bool overlap = true);

// The backward of a split run by border_forward, for kernels that take a window and give gradients over it
// (the adjoint of border_forward; a linear op needs no window: BorderTerms). The kernel's call returns
// {row outputs..., window gradients...}: `row_outputs` tensors over the call's outputs (the gradients of inputs
// that are not windowed, such as the queries; border calls' rows are written over the main call's) and then one
// gradient per windowed input over the call's input rows (the own rows for the main call, which must leave out the
// border outputs' terms; the border window otherwise). The border windows' own rows are summed into the main
// call's gradients and their halo rows go home (one message per peer, posted before the main call so they travel
// while it runs). `received`: the forward's halo rows (border_forward's), so no row travels twice. Returns
// {row outputs..., input gradients over the own rows...}.
std::vector<at::Tensor> border_backward(const HaloPlan& plan, const BorderSplit& split,
                                        const std::vector<at::Tensor>& locals,
                                        const std::vector<std::vector<at::Tensor>>& received, size_t row_outputs,
                                        const Mesh& mesh, const BorderKernel& kernel);
// The same for a linear op, whose gradient needs no input rows (interpolation): the kernel's calls get no inputs;
// `shape` is the local input's (its gradient's) and `options` the gradient's dtype and device.
std::vector<at::Tensor> border_backward(const HaloPlan& plan, const BorderSplit& split, at::IntArrayRef shape,
                                        const at::TensorOptions& options, size_t row_outputs, const Mesh& mesh,
                                        const BorderKernel& kernel);

} // namespace shardtensor::comm
