// The halo planner without ranks: window partitions (convolution, pooling, transposed convolution, padding,
// adaptive pooling) swept over uneven / zero / narrow extents and window parameters, checked against brute-force
// computations and torch's single-device ops; HaloPlan's gather and scatter_add run for every coordinate of 1-D
// and 2-D meshes with the all-to-alls routed in-process; the plan cache.
#include "comm/halo_plan.h"

#include <shardtensor/shard_tensor.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <limits>
#include <sstream>
#include <stdexcept>

using namespace shardtensor;
using namespace shardtensor::comm;

namespace {

std::vector<int64_t> offsets_of(const std::vector<int64_t>& ext) {
  std::vector<int64_t> off(ext.size() + 1, 0);
  for (size_t i = 0; i < ext.size(); ++i) off[i + 1] = off[i] + ext[i];
  return off;
}

int64_t sum_of(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (auto x : v) s += x;
  return s;
}

std::string str(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

// Every coordinate of a mesh, row-major.
std::vector<std::vector<int64_t>> all_coordinates(const std::vector<int64_t>& shape) {
  std::vector<std::vector<int64_t>> out{{}};
  for (auto n : shape) {
    std::vector<std::vector<int64_t>> next;
    for (const auto& c : out)
      for (int64_t i = 0; i < n; ++i) {
        auto d = c;
        d.push_back(i);
        next.push_back(d);
      }
    out = next;
  }
  return out;
}

// The rows `want` of `t` along `dim` (-1: `fill`): what one coordinate's window must hold.
at::Tensor take_rows(const at::Tensor& t, int64_t dim, const std::vector<int64_t>& want, double fill) {
  auto idx = at::tensor(want, at::kLong);
  auto rows = t.index_select(dim, idx.clamp_min(0));
  std::vector<int64_t> shape(t.dim(), 1);
  shape[dim] = static_cast<int64_t>(want.size());
  return at::where(idx.lt(0).view(shape), at::scalar_tensor(fill, t.options()), rows);
}

// The adjoint of take_rows: window rows summed into a tensor of `size` rows along `dim`.
at::Tensor add_rows_back(const at::Tensor& window, int64_t dim, const std::vector<int64_t>& want, int64_t size) {
  auto shape = window.sizes().vec();
  shape[dim] = size;
  auto out = at::zeros(shape, window.options());
  std::vector<int64_t> pos, rows;
  for (size_t p = 0; p < want.size(); ++p)
    if (want[p] >= 0) {
      pos.push_back(static_cast<int64_t>(p));
      rows.push_back(want[p]);
    }
  if (!pos.empty()) out.index_add_(dim, at::tensor(rows, at::kLong), window.index_select(dim, at::tensor(pos, at::kLong)));
  return out;
}

// The local tensor of coordinate `coord`: the global tensor sliced along every sharded dim of `dims`.
at::Tensor local_of(const at::Tensor& global, const std::vector<HaloDim>& dims, const std::vector<int64_t>& coord) {
  auto t = global;
  for (const auto& d : dims) {
    if (d.mesh_dim < 0) continue;
    const auto off = offsets_of(d.extents);
    const auto c = coord[d.mesh_dim];
    t = t.narrow(d.dim, off[c], d.extents[c]);
  }
  return t;
}

using PerCoord = std::map<std::vector<int64_t>, at::Tensor>;

// A mesh whose process groups carry only rank and size (no backend: the tests here never communicate).
MeshPtr grid(std::vector<int64_t> shape, std::vector<int64_t> coord);

// HaloPlan::gather (or, `adjoint`, scatter_add) on every coordinate of a mesh, the all-to-all of each dim routed
// between the coordinates that differ only along its mesh dim.
PerCoord simulate(const std::vector<HaloDim>& dims, const std::vector<int64_t>& mesh_shape, PerCoord cur, double fill,
                  bool adjoint) {
  const auto coords = all_coordinates(mesh_shape);
  std::map<std::vector<int64_t>, HaloPlan> plans;
  for (const auto& c : coords) plans.emplace(c, HaloPlan(dims, c, at::kCPU, fill));
  for (size_t k = 0; k < dims.size(); ++k) {
    const auto i = adjoint ? dims.size() - 1 - k : k;
    const auto m = dims[i].mesh_dim;
    PerCoord next;
    std::map<std::vector<int64_t>, std::vector<at::Tensor>> sent;
    for (const auto& c : coords) {
      const auto& plan = plans.at(c);
      next[c] = adjoint ? plan.own_sum(i, cur[c]) : plan.own_window(i, cur[c]);
      if (plan.exchanges(i)) sent[c] = adjoint ? plan.returns(i, cur[c]) : plan.sends(i, cur[c]);
    }
    for (const auto& c : coords) {
      const auto& plan = plans.at(c);
      if (!plan.exchanges(i)) continue;
      std::vector<at::Tensor> pieces;
      for (int64_t r = 0; r < mesh_shape[m]; ++r) {
        auto peer = c;
        peer[m] = r;
        pieces.push_back(sent.at(peer)[c[m]]);
      }
      if (adjoint) plan.add_returns(i, next[c], pieces);
      else plan.receive(i, next[c], pieces);
    }
    cur = next;
  }
  return cur;
}

// Gather and scatter_add of `dims` over a mesh against the brute-force windows and their adjoint, on a random global
// tensor of `shape` (dims must name distinct tensor dims).
void check_exchange(const std::vector<HaloDim>& dims, const std::vector<int64_t>& mesh_shape,
                    const std::vector<int64_t>& shape, double fill, const std::string& what) {
  auto global = at::randn(shape, at::kDouble);
  const auto coords = all_coordinates(mesh_shape);
  PerCoord locals;
  for (const auto& c : coords) locals[c] = local_of(global, dims, c);
  auto windows = simulate(dims, mesh_shape, locals, fill, false);
  PerCoord grads;  // a random window gradient per coordinate
  at::Tensor adjoint = at::zeros(shape, at::kDouble);
  for (const auto& c : coords) {
    auto expect = global;
    for (const auto& d : dims) expect = take_rows(expect, d.dim, d.want[d.mesh_dim < 0 ? 0 : c[d.mesh_dim]], fill);
    ASSERT_TRUE(at::equal(windows.at(c), expect)) << what << ": gather at coordinate " << str(c);
    auto g = at::randn(expect.sizes(), at::kDouble);
    grads[c] = g;
    for (auto it = dims.rbegin(); it != dims.rend(); ++it)
      g = add_rows_back(g, it->dim, it->want[it->mesh_dim < 0 ? 0 : c[it->mesh_dim]], shape[it->dim]);
    adjoint += g;
  }
  auto sums = simulate(dims, mesh_shape, grads, 0.0, true);
  for (const auto& c : coords)
    ASSERT_TRUE(at::allclose(sums.at(c), local_of(adjoint, dims, c), 1e-12, 1e-12))
        << what << ": scatter_add at coordinate " << str(c);
}

// ---- sliding windows -------------------------------------------------------------------------------------------

struct ExtentsCase {
  std::string name;
  std::vector<int64_t> extents;
};

std::ostream& operator<<(std::ostream& os, const ExtentsCase& c) {
  return os << c.name << str(c.extents);
}

const std::vector<ExtentsCase>& extents_cases() {
  static const std::vector<ExtentsCase> cases = {
      {"one_rank", {9}},
      {"even", {4, 4, 4}},
      {"uneven", {5, 2, 6}},
      {"zero_extent", {4, 0, 5, 0}},
      {"narrower_than_halo", {1, 1, 7, 1}},
      {"all_but_one_empty", {0, 0, 6}},
      {"tiny", {1, 0, 1}},
  };
  return cases;
}

class WindowSweep : public ::testing::TestWithParam<ExtentsCase> {};

// Convolution and pooling windows: the owned outputs tile the output exactly once, each coordinate owns the
// outputs centred in its rows, its window holds exactly the rows of its outputs' windows (brute force), and the
// exchange delivers them.
TEST_P(WindowSweep, SlidingWindowPartition) {
  const auto& ext = GetParam().extents;
  const auto n = static_cast<int64_t>(ext.size());
  const auto L = sum_of(ext);
  const auto off = offsets_of(ext);
  int64_t checked = 0;
  for (int64_t k : {1, 2, 3, 4, 5})
    for (int64_t s : {1, 2, 3})
      for (int64_t dil : {1, 2})
        for (int64_t p : {0, 1, 2, 3})
          for (bool pool : {false, true})
            for (bool ceil : {false, true}) {
              if (ceil && !pool) continue;
              SlidingWindow w{k, s, p, dil, ceil};
              if (pool && p > w.span() / 2) continue;  // PyTorch's pooling limit
              const auto out = pool ? pool_output_size(L, w) : conv_output_size(L, w);
              if (out <= 0) continue;
              std::ostringstream what;
              what << (pool ? "pool" : "conv") << " k=" << k << " s=" << s << " d=" << dil << " p=" << p
                   << " ceil=" << ceil << " extents " << str(ext);
              const auto mode = pool ? PadMode::NegInf : PadMode::Zeros;
              auto part = sliding_window_partition(ext, L, out, w, mode);
              ASSERT_EQ(static_cast<int64_t>(part.out_extents.size()), n) << what.str();
              ASSERT_EQ(static_cast<int64_t>(part.want.size()), n) << what.str();
              int64_t total = 0;
              for (int64_t c = 0; c < n; ++c) {
                ASSERT_GE(part.out_extents[c], 0) << what.str();
                ASSERT_EQ(part.out_begin(c), total) << what.str();
                total += part.out_extents[c];
                std::vector<int64_t> expect;
                std::set<int64_t> read;
                for (auto o = part.out_begin(c); o < part.out_begin(c) + part.out_extents[c]; ++o) {
                  // Centre ownership (the first / last coordinate also take what lies before / after).
                  const auto centre = o * s - p + (w.span() - 1) / 2;
                  if (c > 0) EXPECT_GE(centre, off[c]) << what.str() << " output " << o;
                  if (c < n - 1) EXPECT_LT(centre, off[c + 1]) << what.str() << " output " << o;
                  for (int64_t j = 0; j < k; ++j) read.insert(o * s - p + j * dil);
                }
                if (part.out_extents[c] > 0) {
                  // The window: the positions from the first output's window start to the last one's end.
                  const auto start = part.out_begin(c) * s - p;
                  const auto end = (part.out_begin(c) + part.out_extents[c] - 1) * s - p + w.span();
                  for (auto pos = start; pos < end; ++pos) expect.push_back(pos >= 0 && pos < L ? pos : -1);
                  EXPECT_EQ(*read.begin(), start) << what.str();
                  EXPECT_EQ(*read.rbegin(), end - 1) << what.str();
                }
                EXPECT_EQ(part.want[c], expect) << what.str() << " coordinate " << c;
              }
              ASSERT_EQ(total, out) << what.str();
              check_exchange({HaloDim{1, 0, ext, part.want}}, {n}, {2, L, 3}, fill_value(mode), what.str());
              ++checked;
            }
  EXPECT_GT(checked, 100);
}

// 'same'-padded stride-1 windows keep the input extents: no shard drift through a stack of layers.
TEST_P(WindowSweep, SamePaddingKeepsExtents) {
  const auto& ext = GetParam().extents;
  const auto L = sum_of(ext);
  for (int64_t k : {1, 3, 5, 7}) {
    SlidingWindow w{k, 1, k / 2, 1};
    auto part = sliding_window_partition(ext, L, conv_output_size(L, w), w, PadMode::Zeros);
    EXPECT_EQ(part.out_extents, ext) << "k=" << k;
  }
}

// Transposed convolution: the sum of every coordinate's local transposed convolution of its own inputs, sent to
// the owners of the output rows, is the single-device transposed convolution.
TEST_P(WindowSweep, TransposedPartitionMatchesTorch) {
  const auto& ext = GetParam().extents;
  const auto n = static_cast<int64_t>(ext.size());
  const auto L = sum_of(ext);
  const auto off = offsets_of(ext);
  for (int64_t k : {1, 2, 3, 4})
    for (int64_t s : {1, 2, 3})
      for (int64_t dil : {1, 2})
        for (int64_t p : {0, 1, 2})
          for (int64_t op : {0, 1}) {
            if (op >= s && op >= dil) continue;  // PyTorch: output_padding < stride or dilation
            SlidingWindow w{k, s, p, dil};
            const auto lout = (L - 1) * s - 2 * p + w.span() + op;
            if (lout <= 0) continue;
            std::ostringstream what;
            what << "conv_transpose k=" << k << " s=" << s << " d=" << dil << " p=" << p << " op=" << op
                 << " extents " << str(ext);
            auto x = at::randn({1, 2, L}, at::kDouble);
            auto wt = at::randn({2, 3, k}, at::kDouble);
            auto expect = at::conv_transpose1d(x, wt, {}, s, p, op, 1, dil);
            auto part = transposed_window_partition(ext, L, w, op);
            ASSERT_EQ(sum_of(part.out_extents), lout) << what.str();
            PerCoord windows;
            for (int64_t c = 0; c < n; ++c) {
              auto xc = x.narrow(2, off[c], ext[c]);
              windows[{c}] = ext[c] > 0 ? at::conv_transpose1d(xc, wt, {}, s, 0, 0, 1, dil)
                                        : at::zeros({1, 3, 0}, at::kDouble);
              ASSERT_EQ(windows[{c}].size(2), static_cast<int64_t>(part.want[c].size())) << what.str();
            }
            auto outs = simulate({HaloDim{2, 0, part.out_extents, part.want}}, {n}, windows, 0.0, true);
            std::vector<at::Tensor> pieces;
            for (int64_t c = 0; c < n; ++c) pieces.push_back(outs.at({c}));
            EXPECT_TRUE(at::allclose(at::cat(pieces, 2), expect, 1e-10, 1e-10)) << what.str();
          }
}

// Adaptive pooling cells: a cell belongs to the coordinate holding its first row; the owned cells tile the output
// and every cell's rows lie in its owner's window.
TEST_P(WindowSweep, AdaptivePartition) {
  const auto& ext = GetParam().extents;
  const auto n = static_cast<int64_t>(ext.size());
  const auto L = sum_of(ext);
  const auto off = offsets_of(ext);
  for (int64_t lout : {1, 2, 3, 5, 8, 13}) {
    std::vector<int64_t> first(lout), last(lout);
    for (int64_t i = 0; i < lout; ++i) {
      first[i] = i * L / lout;
      last[i] = ((i + 1) * L + lout - 1) / lout - 1;
    }
    auto part = primary_row_partition(ext, first, first, last);
    ASSERT_EQ(sum_of(part.out_extents), lout);
    for (int64_t c = 0; c < n; ++c)
      for (auto i = part.out_begin(c); i < part.out_begin(c) + part.out_extents[c]; ++i) {
        EXPECT_TRUE(first[i] >= off[c] && first[i] < off[c + 1]) << "lout " << lout << " cell " << i;
        const auto& win = part.want[c];
        ASSERT_FALSE(win.empty());
        EXPECT_LE(win.front(), first[i]);
        EXPECT_GE(win.back(), last[i]);
        EXPECT_EQ(static_cast<int64_t>(win.size()), win.back() - win.front() + 1);
      }
    check_exchange({HaloDim{0, 0, ext, part.want}}, {n}, {L, 2}, 0.0, "adaptive lout " + std::to_string(lout));
  }
}

// Padding: the outputs tile the padded dim in order, each coordinate's rows are torch's single-device padding of
// its outputs, and the exchange delivers them.
TEST_P(WindowSweep, PaddingPartitionMatchesTorch) {
  const auto& ext = GetParam().extents;
  const auto n = static_cast<int64_t>(ext.size());
  const auto L = sum_of(ext);
  auto x = at::arange(L, at::kDouble).view({1, 1, L}) + 1;
  for (auto mode : {PadMode::Constant, PadMode::Reflect, PadMode::Replicate, PadMode::Circular})
    for (int64_t left : {-2, 0, 1, 2, 4})
      for (int64_t right : {-1, 0, 1, 3}) {
        // Circular crops are not a mapping of the uncropped rows (torch wraps the cropped tensor): the pad rule
        // crops first and plans only non-negative circular pads.
        if ((left < 0 || right < 0) && mode == PadMode::Circular) continue;
        if (mode == PadMode::Reflect && (left >= L || right >= L)) continue;   // torch: pad < size
        if (mode == PadMode::Circular && (left > L || right > L)) continue;    // torch: pad <= size
        if (L + left + right < (mode == PadMode::Constant ? 0 : 1)) continue;  // torch: an output row (reflect, ...)
        std::ostringstream what;
        what << "pad mode " << static_cast<int>(mode) << " (" << left << ", " << right << ") extents " << str(ext);
        at::Tensor expect;
        switch (mode) {
          case PadMode::Constant: expect = at::constant_pad_nd(x, {left, right}, -7.0); break;
          case PadMode::Reflect: expect = at::reflection_pad1d(x, {left, right}); break;
          case PadMode::Replicate: expect = at::replication_pad1d(x, {left, right}); break;
          default: expect = at::_pad_circular(x, {left, right}); break;
        }
        auto part = padding_partition(ext, L, left, right, mode);
        ASSERT_EQ(sum_of(part.out_extents), L + left + right) << what.str();
        std::vector<int64_t> all;
        for (int64_t c = 0; c < n; ++c) {
          ASSERT_EQ(static_cast<int64_t>(part.want[c].size()), part.out_extents[c]) << what.str();
          all.insert(all.end(), part.want[c].begin(), part.want[c].end());
        }
        // The index mapping against torch: row r holds the value r + 1, -1 rows the constant.
        std::vector<double> got;
        for (auto r : all) got.push_back(r < 0 ? -7.0 : static_cast<double>(r + 1));
        EXPECT_TRUE(at::equal(at::tensor(got, at::kDouble), expect.flatten())) << what.str();
        check_exchange({HaloDim{0, 0, ext, part.want}}, {n}, {L, 2}, -7.0, what.str());
      }
}

INSTANTIATE_TEST_SUITE_P(Extents, WindowSweep, ::testing::ValuesIn(extents_cases()),
                         [](const ::testing::TestParamInfo<ExtentsCase>& info) { return info.param.name; });

// padded_index against torch for positions far outside (several periods).
TEST(PaddedIndex, MatchesTorchFarOutside) {
  for (int64_t L : {1, 2, 3, 5}) {
    auto x = at::arange(L, at::kDouble).view({1, 1, L});
    const int64_t pad = 3 * L + 1;
    auto circ = at::_pad_circular(at::_pad_circular(at::_pad_circular(x, {L, L}), {L, L}), {L, L});
    auto repl = at::replication_pad1d(x, {pad, pad});
    for (int64_t pos = -pad; pos < L + pad; ++pos) {
      EXPECT_EQ(padded_index(pos, L, PadMode::Replicate), repl[0][0][pos + pad].item<double>()) << L << " " << pos;
      if (pos >= -3 * L && pos < 4 * L)
        EXPECT_EQ(padded_index(pos, L, PadMode::Circular), circ[0][0][pos + 3 * L].item<double>()) << L << " " << pos;
      EXPECT_EQ(padded_index(pos, L, PadMode::Zeros), pos >= 0 && pos < L ? pos : -1);
    }
    if (L > 1) {
      // Reflect beyond one period: reflecting the reflection (torch limits one pad to L - 1).
      auto r = x;
      for (int i = 0; i < 3; ++i) r = at::reflection_pad1d(r, {r.size(2) - 1, r.size(2) - 1});
      const auto half = (r.size(2) - L) / 2;
      for (int64_t pos = -half; pos < L + half; ++pos)
        EXPECT_EQ(padded_index(pos, L, PadMode::Reflect), r[0][0][pos + half].item<double>()) << L << " " << pos;
    }
  }
  EXPECT_EQ(fill_value(PadMode::NegInf), -std::numeric_limits<double>::infinity());
  EXPECT_EQ(fill_value(PadMode::Constant, 2.5), 2.5);
  EXPECT_EQ(fill_value(PadMode::Zeros, 2.5), 0.0);
}

// Two sharded dims on a 2 x 3 mesh: the second exchange carries the first one's halo, so corners come along; an
// unsharded padded dim is gathered locally.
TEST(HaloPlan, TwoDimMeshWithCornersAndLocalDim) {
  const std::vector<int64_t> eh{3, 4}, ew{2, 0, 5};
  SlidingWindow w3{3, 1, 1, 1}, w5{5, 2, 2, 1};
  auto ph = sliding_window_partition(eh, 7, conv_output_size(7, w3), w3, PadMode::Zeros);
  auto pw = sliding_window_partition(ew, 7, conv_output_size(7, w5), w5, PadMode::Zeros);
  std::vector<int64_t> local_rows;
  for (int64_t o = 0; o < 4 + 2 + 1; ++o) local_rows.push_back(padded_index(o - 2, 4, PadMode::Reflect));
  std::vector<HaloDim> dims{{2, 0, eh, ph.want}, {3, 1, ew, pw.want}, {1, -1, {4}, {local_rows}}};
  check_exchange(dims, {2, 3}, {2, 4, 7, 7}, 0.0, "2x3 mesh");
}

// A window gradient held as pieces (the multi-dim border backward of ops/conv.cpp): add_region splits a whole
// window's gradient into the own rows and the pieces of every step, and the steps in reverse (add_piece_returns,
// the pieces routed as scatter_pieces' exchanges route them) give scatter_add's result on every coordinate:
// narrow and empty shards, halos from two ranks away, corners through the second dim.
TEST(HaloPlan, GradientPiecesMatchScatterAdd) {
  for (const auto& [eh, ew] : std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>{
           {{3, 4}, {2, 0, 5}}, {{1, 6}, {1, 1, 5}}, {{0, 7}, {4, 2, 1}}}) {
    SlidingWindow w3{3, 1, 1, 1}, w5{5, 1, 2, 1};
    auto ph = sliding_window_partition(eh, 7, conv_output_size(7, w3), w3, PadMode::Zeros);
    auto pw = sliding_window_partition(ew, 7, conv_output_size(7, w5), w5, PadMode::Zeros);
    std::vector<HaloDim> dims{{2, 0, eh, ph.want}, {3, 1, ew, pw.want}};
    const std::vector<int64_t> mesh_shape{2, 3}, shape{2, 3, 7, 7};
    const auto coords = all_coordinates(mesh_shape);
    std::map<std::vector<int64_t>, HaloPlan> plans;
    PerCoord windows, own;
    std::map<std::vector<int64_t>, std::vector<std::vector<at::Tensor>>> halo;
    auto global = at::zeros(shape, at::kDouble);
    for (const auto& c : coords) {
      const auto& plan = plans.emplace(c, HaloPlan(dims, c, at::kCPU)).first->second;
      auto local = local_of(global, dims, c);
      auto g = at::randn({2, 3, plan.window_rows(0), plan.window_rows(1)}, at::kDouble);
      windows[c] = g;
      own[c] = at::zeros(local.sizes(), at::kDouble);
      halo[c] = plan.all_runs() ? plan.zero_pieces(local) : std::vector<std::vector<at::Tensor>>{};
      ASSERT_TRUE(plan.all_runs());
      plan.add_region(own[c], halo[c], 2, {{0, plan.window_rows(0)}, {0, plan.window_rows(1)}}, g, false);
    }
    auto expect = simulate(dims, mesh_shape, windows, 0.0, true);
    for (size_t k = dims.size(); k-- > 0;) {
      const auto m = dims[k].mesh_dim;
      for (const auto& c : coords) {
        if (!plans.at(c).exchanges(k)) continue;
        std::vector<at::Tensor> back;
        for (int64_t r = 0; r < mesh_shape[m]; ++r) {
          auto peer = c;
          peer[m] = r;
          back.push_back(halo.at(peer)[k][c[m]]);
        }
        plans.at(c).add_piece_returns(k, own[c], halo[c], back);
      }
    }
    for (const auto& c : coords)
      ASSERT_TRUE(at::allclose(own.at(c), expect.at(c), 1e-12, 1e-12))
          << "H " << str(eh) << " W " << str(ew) << ": pieces at coordinate " << str(c);
  }
}

// HaloPlan::region (the multi-dim border slabs of ops/conv.cpp and ops/neighborhood_attention.cpp): any block of
// the window, built from the own rows and the pieces each step received (exchange_all's: step k's pieces are the
// rows peers send of their windows over the earlier dims), equals that block of the gathered window -- window
// positions along the first `stop` steps, local rows along the others, corners through the second dim; with
// `zero_own` the own rows read as zeros. Narrow and empty shards on a 2 x 3 mesh.
TEST(HaloPlan, RegionMatchesWindowBlocks) {
  for (const auto& [eh, ew] : std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>{
           {{3, 4}, {2, 0, 5}}, {{1, 6}, {1, 1, 5}}}) {
    SlidingWindow w3{3, 1, 1, 1}, w5{5, 1, 2, 1};
    auto ph = sliding_window_partition(eh, 7, conv_output_size(7, w3), w3, PadMode::Zeros);
    auto pw = sliding_window_partition(ew, 7, conv_output_size(7, w5), w5, PadMode::Zeros);
    std::vector<HaloDim> dims{{2, 0, eh, ph.want}, {3, 1, ew, pw.want}};
    const std::vector<int64_t> mesh_shape{2, 3};
    const auto coords = all_coordinates(mesh_shape);
    auto global = at::randn({2, 3, 7, 7}, at::kDouble);
    std::map<std::vector<int64_t>, HaloPlan> plans;
    PerCoord cur, locals;
    std::map<std::vector<int64_t>, std::vector<std::vector<at::Tensor>>> received;
    std::vector<PerCoord> after;  // after[k]: every coordinate's tensor extended by the windows of the first k dims
    for (const auto& c : coords) {
      plans.emplace(c, HaloPlan(dims, c, at::kCPU));
      locals[c] = cur[c] = local_of(global, dims, c);
      received[c].resize(dims.size());
    }
    after.push_back(cur);
    for (size_t k = 0; k < dims.size(); ++k) {
      const auto m = dims[k].mesh_dim;
      PerCoord next;
      std::map<std::vector<int64_t>, std::vector<at::Tensor>> sent;
      for (const auto& c : coords) {
        next[c] = plans.at(c).own_window(k, cur[c]);
        if (plans.at(c).exchanges(k)) sent[c] = plans.at(c).sends(k, cur[c]);
      }
      for (const auto& c : coords) {
        if (!plans.at(c).exchanges(k)) continue;
        for (int64_t r = 0; r < mesh_shape[m]; ++r) {
          auto peer = c;
          peer[m] = r;
          received[c][k].push_back(sent.at(peer)[c[m]]);
        }
        plans.at(c).receive(k, next[c], received[c][k]);
      }
      cur = next;
      after.push_back(cur);
    }
    for (const auto& c : coords) {
      const auto& plan = plans.at(c);
      for (size_t stop = 0; stop <= dims.size(); ++stop) {
        const auto& block = after[stop].at(c);  // window positions along the first `stop` dims, local rows after
        // Every range of every dim: [b, b + l) with l >= 1 (a few per dim).
        std::vector<std::vector<std::pair<int64_t, int64_t>>> choices(dims.size());
        for (size_t d = 0; d < dims.size(); ++d) {
          const auto n = block.size(dims[d].dim);
          for (int64_t b = 0; b < n; ++b)
            for (int64_t l : {int64_t{1}, n - b})
              if (l >= 1) choices[d].emplace_back(b, l);
        }
        for (const auto& r0 : choices[0])
          for (const auto& r1 : choices[1]) {
            const std::vector<std::pair<int64_t, int64_t>> ranges{r0, r1};
            auto expect = block.narrow(2, r0.first, r0.second).narrow(3, r1.first, r1.second);
            auto got = plan.region(locals.at(c), received.at(c), ranges, stop);
            ASSERT_TRUE(at::equal(got, expect)) << "H " << str(eh) << " W " << str(ew) << " at " << str(c)
                                                << " stop " << stop << " [" << r0.first << "+" << r0.second << ", "
                                                << r1.first << "+" << r1.second << ")";
            // zero_own: the positions every one of whose coordinates is an own row read as zeros.
            auto zeroed = block.clone();
            auto own = zeroed;
            for (size_t d = 0; d < dims.size(); ++d) {
              if (d >= stop) continue;
              const auto [p, row, cnt] = plan.own_run(d);
              own = own.narrow(dims[d].dim, p, cnt);
            }
            own.zero_();
            auto zexpect = zeroed.narrow(2, r0.first, r0.second).narrow(3, r1.first, r1.second);
            ASSERT_TRUE(at::equal(plan.region(locals.at(c), received.at(c), ranges, stop, true), zexpect))
                << "zero_own at " << str(c) << " stop " << stop;
          }
      }
    }
  }
}

// start / finish give what gather gives, over every dim (here two locally padded dims: no collective).
TEST(HaloPlan, StartFinishMatchesGather) {
  std::vector<int64_t> r1, r2;
  for (int64_t o = 0; o < 5 + 3; ++o) r1.push_back(padded_index(o - 2, 5, PadMode::Circular));
  for (int64_t o = 0; o < 4 + 2; ++o) r2.push_back(padded_index(o - 1, 4, PadMode::Zeros));
  HaloPlan plan({HaloDim{1, -1, {5}, {r1}}, HaloDim{2, -1, {4}, {r2}}}, {0}, at::kCPU, 3.0);
  auto mesh = grid({1}, {0});
  auto x = at::randn({2, 5, 4}, at::kDouble);
  auto pending = plan.start(x, *mesh);
  auto window = plan.finish(pending, *mesh);
  EXPECT_TRUE(at::equal(window, plan.gather(x, *mesh)));
  EXPECT_TRUE(at::equal(window, take_rows(take_rows(x, 1, r1, 3.0), 2, r2, 3.0)));
}

// A rank whose window is only its own rows exchanges nothing along that dim when no rank needs another's rows.
TEST(HaloPlan, NoExchangeWhenSelfContained) {
  auto part = padding_partition({3, 0, 4}, 7, 2, 1, PadMode::Constant);
  for (int64_t c = 0; c < 3; ++c) {
    HaloPlan plan({HaloDim{0, 0, {3, 0, 4}, part.want}}, {c}, at::kCPU, 1.5);
    EXPECT_FALSE(plan.exchanges(0));
  }
  // Coordinate 0 holds one row: its left pad mirrors rows 1 and 2, which coordinate 2 holds.
  auto refl = padding_partition({1, 0, 6}, 7, 2, 1, PadMode::Reflect);
  HaloPlan plan({HaloDim{0, 0, {1, 0, 6}, refl.want}}, {1}, at::kCPU);
  EXPECT_TRUE(plan.exchanges(0));  // every rank posts the collective, even one with nothing to send
  EXPECT_TRUE(HaloPlan().empty());
}

// ---- the plan cache ---------------------------------------------------------------------------------------------

MeshPtr grid(std::vector<int64_t> shape, std::vector<int64_t> coord) {
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;
  for (size_t i = 0; i < shape.size(); ++i)
    groups.push_back(c10::make_intrusive<c10d::ProcessGroup>(static_cast<int>(coord[i]), static_cast<int>(shape[i])));
  return std::make_shared<const Mesh>(shape, groups, coord, std::vector<std::string>{}, c10::DeviceType::CPU);
}

struct PlanA {
  int64_t value;
};
struct PlanB {
  int64_t value;
};

TEST(PlanCache, KeysFollowLayoutContentsNotMeshObjects) {
  auto a = ShardSpec::make(grid({2}, {1}), {Placement::shard(2)}, {1, 2, 9}, {{0, {4, 5}}});
  auto same = ShardSpec::make(grid({2}, {1}), {Placement::shard(2)}, {1, 2, 9}, {{0, {4, 5}}});
  auto other_extents = ShardSpec::make(grid({2}, {1}), {Placement::shard(2)}, {1, 2, 9}, {{0, {5, 4}}});
  auto other_coord = ShardSpec::make(grid({2}, {0}), {Placement::shard(2)}, {1, 2, 9}, {{0, {4, 5}}});
  auto partial = ShardSpec::make(grid({2}, {1}), {Placement::partial()}, {1, 2, 9});
  auto replicate = ShardSpec::make(grid({2}, {1}), {Placement::replicate()}, {1, 2, 9});
  auto key = [](const SpecPtr& s) { return PlanKey().add_spec(*s).add_device(at::kCPU); };
  EXPECT_TRUE(key(a) == key(same));
  EXPECT_EQ(key(a).hash(), key(same).hash());
  EXPECT_FALSE(key(a) == key(other_extents));
  EXPECT_FALSE(key(a) == key(other_coord));
  EXPECT_FALSE(key(partial) == key(replicate));
  EXPECT_FALSE(PlanKey().add(1).add_ints({2, 3}) == PlanKey().add_ints({1, 2}).add(3));
  EXPECT_FALSE(PlanKey().add_double(0.5) == PlanKey().add_double(0.25));
}

TEST(PlanCache, BuildsOncePerKeyAndTypeBoundedLru) {
  set_plan_cache_capacity(2);
  reset_plan_cache_stats();
  int builds = 0;
  auto get_a = [&](int64_t k) {
    return cached_plan<PlanA>(PlanKey().add(k), [&] {
      ++builds;
      return PlanA{k};
    });
  };
  auto p1 = get_a(1);
  EXPECT_EQ(get_a(1).get(), p1.get());  // the same plan object: not rebuilt
  EXPECT_EQ(builds, 1);
  // Another plan type with the same key is a different entry.
  auto b1 = cached_plan<PlanB>(PlanKey().add(1), [] { return PlanB{-1}; });
  EXPECT_EQ(b1->value, -1);
  EXPECT_EQ(get_a(1)->value, 1);
  EXPECT_EQ(builds, 1);
  // Capacity 2: A(1) and B(1) are held; A(2) evicts the least recently used (B(1)).
  get_a(2);
  EXPECT_EQ(builds, 2);
  get_a(1);
  EXPECT_EQ(builds, 2);
  cached_plan<PlanB>(PlanKey().add(1), [] { return PlanB{-2}; });  // rebuilt: it was evicted
  auto stats = plan_cache_stats();
  EXPECT_EQ(stats.size, 2);
  EXPECT_EQ(stats.capacity, 2);
  EXPECT_EQ(stats.hits, 3);
  EXPECT_EQ(stats.misses, 4);
  // A build that throws caches nothing.
  EXPECT_THROW(cached_plan<PlanA>(PlanKey().add(9), []() -> PlanA { throw std::runtime_error("bad"); }),
               std::runtime_error);
  EXPECT_EQ(cached_plan<PlanA>(PlanKey().add(9), [] { return PlanA{9}; })->value, 9);
  set_plan_cache_capacity(1024);
}

// Index tensors are built with the plan, on its device; a plan never needs the host lists at exchange time.
TEST(HaloPlan, HoldsLayoutOnly) {
  auto part = padding_partition({2, 3}, 5, 1, 1, PadMode::Reflect);
  HaloPlan plan({HaloDim{0, 0, {2, 3}, part.want}}, {0}, at::kCPU);
  EXPECT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan.window_rows(0), part.out_extents[0]);
  EXPECT_EQ(plan.dim(0).extents, (std::vector<int64_t>{2, 3}));
}

} // namespace
