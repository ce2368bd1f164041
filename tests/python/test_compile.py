"""torch.compile with ShardTensor inputs: `torch.compile(fn)(x)` and `torch.compile(model)(x)` trace the library's
rules through the traced representation (shardtensor/_traced.py) and the functional collectives; forward, input
gradients, parameter gradients and optimizer steps equal eager and one device (uneven shards, 1-D and 2-D meshes), and
no graph holds a ProcessGroup call (`with_effects(c10d.*)`). Host reads of communicated values refuse on every rank.
st.local_map over a compiled function or module: single-device forward, input gradients and parameter gradients
(plain parameters summed over the sharded mesh dims), uneven shards, 1-3 ranks, 2-D mesh.
Compiled with the aot_eager backend (dynamo + AOTAutograd, no code generation) to keep the suite fast; one inductor
case."""
import math

import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import close, full, mesh, randn, uneven_extents

BACKEND = "aot_eager"


class GraphRecorder:
    """An aot_eager-like backend that keeps every forward and backward graph AOTAutograd produces."""

    def __init__(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        self.graphs = []

        def keep(gm, example_inputs):
            self.graphs.append(gm)
            return make_boxed_func(gm.forward)
        self.backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def targets(self):
        return [str(n.target) for g in self.graphs for n in g.graph.nodes if n.op == "call_function"]


def assert_functional_collectives_only(rec, expect_collectives=True):
    targets = rec.targets()
    assert rec.graphs, "nothing was compiled"
    assert not any("with_effects" in t for t in targets), [t for t in targets if "with_effects" in t]
    coll = [t for t in targets if "c10d" in t]
    assert all(t.startswith("_c10d_functional.") for t in coll), coll
    if expect_collectives:
        assert coll and any("wait_tensor" in t for t in coll), targets


def check_plain_grads_and_step(net, ref, opt, ropt, rtol, what):
    """Every parameter's gradient is a plain tensor equal to one device's; then one optimizer step on both."""
    for (name, p), pr in zip(net.named_parameters(), ref.parameters()):
        assert type(p.grad) is torch.Tensor, (name, type(p.grad))
        close(p.grad, pr.grad, rtol=rtol, atol=1e-6, what=f"{what} grad {name}")
    for o in (opt, ropt):
        o.step()
        o.zero_grad()


def conv_net():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.GELU(),
                               torch.nn.Conv2d(3, 2, 3, padding=1, padding_mode="zeros"), torch.nn.Tanh())


def case_compiled_function(backend):
    """torch.compile(fn)(x): pointwise, a softmax and a mean over the sharded dim; forward and input gradient equal
    eager and one device; the graphs hold functional collectives only."""
    m = mesh()
    full = randn(2, 9, 5, seed=1)
    ext = uneven_extents(9, m.size(), 4)

    def fn(t):
        return (t.sin() * 2).softmax(1) * t.mean(1, keepdim=True)

    torch._dynamo.reset()
    rec = GraphRecorder()
    compiled = torch.compile(fn, backend=rec.backend if backend == "record" else backend)
    x = st.distribute_tensor(full, m, [st.Shard(1)], {0: ext}).requires_grad_(True)
    xe = st.distribute_tensor(full, m, [st.Shard(1)], {0: ext}).requires_grad_(True)
    xr = full.clone().requires_grad_(True)
    y, ye, yr = compiled(x), fn(xe), fn(xr)
    assert st.is_shard_tensor(y) and st.placements(y) == st.placements(ye)
    close(y.full_tensor(), yr, what="compiled forward vs one device")
    close(y.full_tensor(), ye.full_tensor(), what="compiled vs eager")
    g = randn(2, 9, 5, seed=2)
    (y * st.distribute_tensor(g, m, [st.Shard(1)], {0: ext})).sum().backward()
    (yr * g).sum().backward()
    assert st.is_shard_tensor(x.grad) and st.sharding_shapes(x.grad) == st.sharding_shapes(x)
    close(x.grad.full_tensor(), xr.grad, what="compiled input gradient")
    if backend == "record":
        assert_functional_collectives_only(rec)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_compiled_function(world):
    harness.run(world, case_compiled_function, "record")


def case_compiled_training(backend, mesh_shape):
    """torch.compile(model)(x) for a halo-exchanging conv stack: two training steps (optimizer outside) equal
    eager one-device steps — outputs, input gradients, parameter gradients (plain, reduced once) and weights."""
    m = mesh(mesh_shape)
    full = randn(1, 2, 10, 8, seed=3)
    if len(mesh_shape) == 1:
        layout, ext = [st.Shard(2)], {0: uneven_extents(10, m.size(), 2)}
    else:
        layout, ext = [st.Shard(2), st.Shard(3)], {0: [6, 4], 1: [2, 6]}
    torch._dynamo.reset()
    rec = GraphRecorder()
    net, ref = conv_net(), conv_net()
    compiled = torch.compile(net, backend=rec.backend if backend == "record" else backend)
    opt, ropt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x = st.distribute_tensor(full, m, layout, ext).requires_grad_(True)
        xr = full.clone().requires_grad_(True)
        y, yr = compiled(x), ref(xr)
        close(y.full_tensor(), yr, rtol=1e-5, atol=1e-6, what=f"step {step} forward")
        y.square().mean().backward()
        yr.square().mean().backward()
        close(x.grad.full_tensor(), xr.grad, rtol=1e-5, atol=1e-6, what=f"step {step} input gradient")
        check_plain_grads_and_step(net, ref, opt, ropt, 1e-5, f"step {step}")
    for p, pr in zip(net.parameters(), ref.parameters()):
        close(p.detach(), pr.detach(), rtol=1e-5, atol=1e-6, what="weights after two steps")
    if backend == "record":
        assert_functional_collectives_only(rec)
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
def test_compiled_training(mesh_shape):
    harness.run(int(math.prod(mesh_shape)), case_compiled_training, "record", mesh_shape)


def test_compiled_training_inductor():
    """One inductor case (code generation is slow on 2 cores)."""
    harness.run(2, case_compiled_training, "inductor", (2,), timeout=600)


def compiled_families():
    """(name, fn, global input shape, sharded dim): rule families that compile (forward, vs one device)."""
    torch.manual_seed(7)
    lin, ln = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
    weight = torch.ones(2, 4, 3, 3)
    tw = torch.randn(4, 3, 3, 3)
    mm = torch.randn(8, 5)
    gn_w, gn_b, bn_w, bn_b = torch.randn(4), torch.randn(4), torch.randn(4), torch.randn(4)
    F = torch.nn.functional
    return {
        "pointwise": (lambda t: (t.sin() + 1).relu(), (1, 4, 10, 8), 2),
        "reductions": (lambda t: t.sum((2, 3)) + t.mean(), (1, 4, 10, 8), 2),
        "amax": (lambda t: t.amax(2), (1, 4, 10, 8), 2),
        "views": (lambda t: t.reshape(1, 4, 80).transpose(1, 2) * 2, (1, 4, 10, 8), 2),
        "softmax": (lambda t: t.softmax(2), (1, 4, 10, 8), 2),
        "linear": (lambda t: lin(t), (1, 11, 8), 1),
        "layer_norm": (lambda t: ln(t), (1, 11, 8), 1),
        "conv2d": (lambda t: F.conv2d(t, weight, padding=1), (1, 4, 10, 8), 2),
        "max_pool2d": (lambda t: F.max_pool2d(t, 2), (1, 4, 10, 8), 2),
        "interpolate": (lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), (1, 4, 10, 8), 2),
        "rfft2": (lambda t: torch.fft.rfft2(t).abs(), (1, 4, 10, 8), 2),
        "cat": (lambda t: torch.cat([t, t.cos()], 1), (1, 4, 10, 8), 2),
        # Rules that build plan tensors on the host (halo indices, divisors, averaging matrices, counts): they enter
        # the graph as constants.
        "group_norm": (lambda t: F.group_norm(t, 2, gn_w, gn_b), (2, 4, 10, 8), 2),
        "instance_norm": (lambda t: F.instance_norm(t), (2, 4, 10, 8), 2),
        "avg_pool2d": (lambda t: F.avg_pool2d(t, 3, 2, padding=1), (1, 4, 10, 8), 2),
        "avg_pool2d_ceil_nopad": (lambda t: F.avg_pool2d(t, 3, 2, ceil_mode=True, count_include_pad=False),
                                  (1, 4, 11, 8), 2),
        "avg_pool3d": (lambda t: F.avg_pool3d(t, 2), (1, 2, 8, 4, 4), 2),
        "adaptive_avg_pool2d": (lambda t: F.adaptive_avg_pool2d(t, (3, 5)), (1, 4, 10, 8), 2),
        "adaptive_max_pool2d": (lambda t: F.adaptive_max_pool2d(t, (3, 5)), (1, 4, 10, 8), 2),
        "reflect_pad": (lambda t: F.pad(t, (1, 2, 2, 1), mode="reflect"), (1, 4, 10, 8), 2),
        "replicate_pad": (lambda t: F.pad(t, (1, 1, 2, 2), mode="replicate"), (1, 4, 10, 8), 2),
        "circular_pad": (lambda t: F.pad(t, (1, 1, 2, 2), mode="circular"), (1, 4, 10, 8), 2),
        "amax_sum": (lambda t: t.amax(2).sum(), (1, 4, 10, 8), 2),
        "conv_transpose2d": (lambda t: F.conv_transpose2d(t, tw, stride=2, padding=1), (1, 4, 10, 8), 2),
        "conv2d_stride2": (lambda t: F.conv2d(t, weight, stride=2, padding=1), (1, 4, 10, 8), 2),
        "upsample_nearest": (lambda t: F.interpolate(t, scale_factor=2, mode="nearest"), (1, 4, 10, 8), 2),
        # Above-autograd rules (composite-implicit ops the tracers would decompose first): the autograd-key bridge.
        "sdpa_ring": (_sdpa, (1, 2, 11, 4), 2),
        "sdpa_all_to_all": (_sdpa, (1, 2, 11, 4), 2),
        "batch_norm": (lambda t: F.batch_norm(t, None, None, bn_w, bn_b, training=True), (2, 4, 10, 8), 2),
        "matmul": (lambda t: t @ mm, (1, 11, 8), 1),
        "upsample_bilinear_vec": (lambda t: F.interpolate(t, size=(20, 16), mode="bilinear", align_corners=True),
                                  (1, 4, 10, 8), 2),
        "max_pool1d": (lambda t: F.max_pool1d(t, 3, 2, padding=1), (1, 4, 11), 2),
        "neighborhood_attention2d": (lambda t: _na2d(t, t * 0.5, t.cos(), 3), (1, 10, 6, 2, 4), 1),
    }


def _na2d(q, k, v, kernel):
    from shardtensor.ops import neighborhood_attention2d
    return neighborhood_attention2d(q, k, v, kernel)


def _knn(points):
    from shardtensor.ops import knn
    return knn(points, points * 0.5, 3)[1]


def _radius(points):
    from shardtensor.ops import radius_search
    return radius_search(points, points * 0.5, 1.0, 4)[1]


def _sdpa(t):
    return torch.nn.functional.scaled_dot_product_attention(t, t * 0.5, t.cos())


# The sequence-parallel attention strategy of a family (set around the compiled call: it is read while tracing).
STRATEGY = {"sdpa_ring": "ring", "sdpa_all_to_all": "all_to_all"}


def case_compiled_family(name):
    m = mesh()
    fn, shape, dim = compiled_families()[name]
    full = randn(*shape, seed=11)
    torch._dynamo.reset()
    x = st.distribute_tensor(full, m, [st.Shard(dim)], {0: uneven_extents(shape[dim], m.size(), 1)})
    with st.use_attention_strategy(STRATEGY.get(name, "auto")):
        y = torch.compile(fn, backend=BACKEND)(x)
    close(y.full_tensor() if st.is_shard_tensor(y) else y, fn(full), rtol=1e-5, atol=1e-5, what=f"compiled {name}")
    return True


@pytest.mark.parametrize("name", list(compiled_families()))
def test_compiled_family(name):
    harness.run(2, case_compiled_family, name)


BACKWARD_FAMILIES = ["pointwise", "reductions", "softmax", "linear", "layer_norm", "conv2d", "max_pool2d",
                     "interpolate", "group_norm", "avg_pool2d", "adaptive_avg_pool2d", "reflect_pad", "amax_sum",
                     "conv_transpose2d", "conv2d_stride2", "sdpa_ring", "sdpa_all_to_all", "batch_norm", "matmul",
                     "max_pool1d", "neighborhood_attention2d"]


def case_compiled_family_backward(name, mesh_shape=(2,)):
    """Forward and input gradient of one compiled family against one device (the loss is taken outside the
    compiled region, so the compiled backward receives a sharded gradient); the graphs hold functional collectives
    only."""
    m = mesh(mesh_shape)
    fn, shape, dim = compiled_families()[name]
    full = randn(*shape, seed=13)
    torch._dynamo.reset()
    rec = GraphRecorder()
    if len(mesh_shape) == 1:
        layout, ext = [st.Shard(dim)], {0: uneven_extents(shape[dim], m.size(), 2)}
    else:       # batch and the sharded dim on a 2 x 2 mesh
        layout, ext = [st.Shard(0), st.Shard(dim)], {1: uneven_extents(shape[dim], mesh_shape[1], 2)}
    x = st.distribute_tensor(full, m, layout, ext).requires_grad_(True)
    xr = full.clone().requires_grad_(True)
    with st.use_attention_strategy(STRATEGY.get(name, "auto")):
        y = torch.compile(fn, backend=rec.backend)(x)
    yr = fn(xr)
    close(y.full_tensor() if st.is_shard_tensor(y) else y, yr, rtol=1e-5, atol=1e-5, what=f"compiled {name}")
    with st.use_attention_strategy(STRATEGY.get(name, "auto")):
        (y * y).sum().backward()
    (yr * yr).sum().backward()
    assert st.is_shard_tensor(x.grad) and st.sharding_shapes(x.grad) == st.sharding_shapes(x), name
    close(x.grad.full_tensor(), xr.grad, rtol=1e-4, atol=1e-5, what=f"compiled {name} input gradient")
    assert_functional_collectives_only(rec, expect_collectives=False)
    return True


@pytest.mark.parametrize("name", BACKWARD_FAMILIES)
def test_compiled_family_backward(name):
    harness.run(2, case_compiled_family_backward, name)


@pytest.mark.parametrize("name,mesh_shape", [("group_norm", (3,)), ("sdpa_ring", (3,)), ("conv2d", (2, 2)),
                                             ("batch_norm", (2, 2))])
def test_compiled_family_backward_more_ranks(name, mesh_shape):
    harness.run(math.prod(mesh_shape), case_compiled_family_backward, name, mesh_shape)


def case_layout_api_in_compiled_code():
    """The st.* layout functions inside a compiled region (not traceable yet: Dynamo breaks the graph there and the
    call runs eagerly on the traced representation) raise a clear error on every rank."""
    m = mesh()
    torch._dynamo.reset()
    x = st.distribute_tensor(torch.randn(6, 4), m, [st.Shard(0)])
    torch.compile(lambda a: st.to_local(a.sin()) * 2, backend="aot_eager")(x)


def test_layout_api_in_compiled_code_refused():
    harness.expect_error(2, case_layout_api_in_compiled_code, match="inside a torch.compile'd region is not supported yet",
                         kinds=("NotImplementedError", "InternalTorchDynamoError"))


def _write_columns(x):
    y = x * 1
    y[:, 2] = 5.0           # x[i] along the split dim 1 is a copy; its write is carried back to y
    return y


def _write_through_view(x):
    y = x * 1
    y[:, 4][1:, :2] = -1.0  # a view of the copy, written
    return y


def _accumulate_into_column(x):
    y = x.sin()
    y[:, -1] += 2.0         # select, add_ into the copy, setitem's copy_ into it again
    y[:, 0].mul_(3.0)
    return y * 2


def _write_nested(x):
    y = x * 1
    y[:, 2][:, 1] = 5.0      # on a 2x2 mesh a copy of a copy (dims 1 and 2 both split)
    return y


def _scale_column(x):
    y = x * 1
    y[:, 1] = y[:, 1] * 3.0  # differentiable: x's gradient is 3 in that column
    return y


def case_write_into_select_copy_in_compiled_code(world_dims):
    """An in-place write into x[i] along a split dim inside a compiled region: eagerly the library carries the copy's
    write back to x (dispatch/write_back.h); in the traced graph the write into the copy is followed by a write of
    the copy into x's one-row slice (only the row's owner writes). Was silently lost, then refused; now equal to one
    device, forward and gradient, for direct writes, writes through a view of the copy and in-place accumulation, on
    1-D and 2-D meshes."""
    m = mesh(world_dims) if world_dims else mesh()
    placements = [st.Shard(1)] if not world_dims else [st.Shard(1), st.Shard(2)]
    torch._dynamo.reset()
    full_x = randn(3, 6, 4, seed=3)
    for fn in (_write_columns, _write_through_view, _accumulate_into_column, _write_nested, _scale_column):
        x = st.distribute_tensor(full_x, m, placements,
                                 sharding_shapes={0: uneven_extents(6, m.size(0), seed=4)}).requires_grad_()
        ref_x = full_x.clone().requires_grad_()
        out = torch.compile(fn, backend="aot_eager")(x)
        ref = fn(ref_x)
        close(full(out), ref, what=fn.__name__)
        w = randn(3, 6, 4, seed=5)
        (out * w).sum().backward()
        (ref * w).sum().backward()
        close(full(x.grad), ref_x.grad, what=f"{fn.__name__} grad")
    return True


@pytest.mark.parametrize("world_dims", [None, (2, 2)])
def test_write_into_select_copy_in_compiled_code(world_dims):
    harness.run(4 if world_dims else 2, case_write_into_select_copy_in_compiled_code, world_dims)


def _write_unbound_rows(x):
    rows = x.unbind(1)
    rows[1].mul_(2)                  # an output of unbind along the split dim
    rows[4][0].add_(1)               # through a view of one
    x.unbind(1)[2].unbind(0)[1].fill_(3)   # an unbind along another dim of one
    return x * 1


def case_write_into_unbind_output_in_compiled_code(world_dims):
    """Without autograd (with it torch refuses such writes on one device too), `x.unbind(dim)[i]` along a split dim
    may be written in place: eagerly the library carries it home as for x[i]; in compiled code it was silently lost
    (the outputs were not tracked, and tracking them alone replayed the C++ write-back on the tracer's storage)."""
    m = mesh(world_dims) if world_dims else mesh()
    placements = [st.Shard(1)] if not world_dims else [st.Shard(1), st.Shard(2)]
    torch._dynamo.reset()
    full_x = randn(3, 6, 4, seed=3)
    x = st.distribute_tensor(full_x, m, placements, sharding_shapes={0: uneven_extents(6, m.size(0), seed=4)})
    ref_x = full_x.clone()
    out = torch.compile(_write_unbound_rows, backend="aot_eager")(x)
    ref = _write_unbound_rows(ref_x)
    close(full(out), ref, what="output")
    close(full(x), ref_x, what="x written")
    return True


@pytest.mark.parametrize("world_dims", [None, (2, 2)])
def test_write_into_unbind_output_in_compiled_code(world_dims):
    harness.run(4 if world_dims else 2, case_write_into_unbind_output_in_compiled_code, world_dims)


class _ChannelsFirstNorm(torch.nn.Module):
    """A LayerNorm over the channels of a (B, C, T) signal through transposes (PVT, FocalNet, ConvNeXt, HuBERT)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 32, 3, padding=1)
        self.ln = torch.nn.LayerNorm(32)

    def forward(self, x):
        return self.ln(self.conv(x).transpose(1, 2)).transpose(1, 2)


def case_compiled_channels_first_layer_norm():
    """The LayerNorm backward's input gradient is contiguous at runtime while the tracer gave it the permuted input's
    strides: the compiled backward viewed it with the traced strides and failed (four zoo models under compile).
    Training step against one device."""
    m = mesh()
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = _ChannelsFirstNorm().double()
    ref = _ChannelsFirstNorm().double()
    ref.load_state_dict(net.state_dict())
    x = randn(2, 4, 20, seed=1, dtype=torch.float64)
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: uneven_extents(20, m.size(), seed=1)})
    out = torch.compile(net, backend="aot_eager")(xs.requires_grad_())
    rx = x.clone().requires_grad_()
    r = ref(rx)
    close(full(out), r, rtol=1e-9, atol=1e-9, what="output")
    w = randn(*r.shape, seed=2, dtype=torch.float64)
    (out * w).sum().backward()
    (r * w).sum().backward()
    close(full(xs.grad), rx.grad, rtol=1e-9, atol=1e-9, what="input grad")
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        close(p.grad, q.grad, rtol=1e-9, atol=1e-9, what=n)
    return True


def test_compiled_channels_first_layer_norm():
    harness.run(2, case_compiled_channels_first_layer_norm)


class ChannelMlp(torch.nn.Module):
    """Per-position MLP over the last (channel) dim: local under any sharding of the other dims."""

    def __init__(self, c=5, hidden=7):
        super().__init__()
        self.up = torch.nn.Linear(c, hidden)
        self.down = torch.nn.Linear(hidden, c)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def make_mlp():
    torch.manual_seed(3)
    return ChannelMlp()


def case_local_map_module(mesh_shape):
    m = mesh(mesh_shape)
    full = randn(2, 9, 6, 5, seed=1)
    weight = randn(2, 9, 6, 5, seed=2)
    if len(mesh_shape) == 1:
        layout, ext = [st.Shard(1)], {0: uneven_extents(9, m.size(), 3)}
    else:
        layout, ext = [st.Shard(1), st.Shard(2)], {0: [7, 2], 1: [0, 6]}
    ref_mlp, mlp = make_mlp(), make_mlp()
    compiled = torch.compile(mlp, backend=BACKEND)
    f = st.local_map(compiled, sharding_shapes="input")
    xr = full.clone().requires_grad_(True)
    x = st.distribute_tensor(full, m, layout, ext).requires_grad_(True)
    for step in range(2):   # the second call reuses the compiled graph
        yr, y = ref_mlp(xr), f(x)
        assert st.placements(y) == tuple(layout) and st.sharding_shapes(y) == st.sharding_shapes(x)
        close(y.full_tensor(), yr, rtol=1e-5, atol=1e-5, what=f"local_map forward {step}")
        (yr * weight).sum().backward()
        (y * weight).sum().backward()
    close(x.grad.full_tensor(), xr.grad, rtol=1e-5, atol=1e-5, what="input grad")
    for (name, p), pr in zip(mlp.named_parameters(), ref_mlp.parameters()):
        assert not st.is_shard_tensor(p.grad)
        close(p.grad, pr.grad, rtol=1e-5, atol=1e-5, what=f"param grad {name}")
    return True


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (3,), (2, 2)])
def test_local_map_compiled_module(mesh_shape):
    harness.run(math.prod(mesh_shape), case_local_map_module, mesh_shape)


def scale_shift(x, gain, shift):
    return torch.tanh(x * gain) + shift


def case_local_map_function():
    """A compiled function with plain tensor arguments requiring grad (summed gradient), infer mode, explicit
    out_placements, and a module mixing ShardTensor ops (a halo convolution) with a compiled local block."""
    m = mesh()
    full = randn(1, 3, 8, 5, seed=4)
    gain_r, shift_r = randn(5, seed=5).requires_grad_(True), randn(5, seed=6).requires_grad_(True)
    gain, shift = gain_r.detach().clone().requires_grad_(True), shift_r.detach().clone().requires_grad_(True)
    f = st.local_map(torch.compile(scale_shift, backend=BACKEND), [st.Shard(2)])
    x = st.distribute_tensor(full, m, [st.Shard(2)], {0: uneven_extents(8, m.size(), 1)})
    y = f(x, gain, shift=shift)
    assert st.sharding_shapes(y) == st.sharding_shapes(x)   # inferred
    close(y.full_tensor(), scale_shift(full, gain_r, shift_r), what="function forward")
    (y * y).sum().backward()
    (scale_shift(full, gain_r, shift_r) ** 2).sum().backward()
    close(gain.grad, gain_r.grad, rtol=1e-5, atol=1e-5, what="gain grad")
    close(shift.grad, shift_r.grad, rtol=1e-5, atol=1e-5, what="shift grad")

    torch.manual_seed(0)
    conv_r = torch.nn.Conv2d(3, 5, 3, padding=1)
    conv = torch.nn.Conv2d(3, 5, 3, padding=1)
    conv.load_state_dict(conv_r.state_dict())
    mlp_r, mlp = make_mlp(), make_mlp()
    block = st.local_map(torch.compile(mlp, backend=BACKEND), sharding_shapes="input")
    out_r = mlp_r(conv_r(full).movedim(1, -1)).square().mean()
    out = block(conv(x).movedim(1, -1)).square().mean()
    close(out.full_tensor(), out_r, what="conv + compiled block")
    out_r.backward()
    out.backward()
    for (name, p), pr in zip(list(conv.named_parameters()) + list(mlp.named_parameters()),
                             list(conv_r.parameters()) + list(mlp_r.parameters())):
        close(p.grad, pr.grad, rtol=1e-5, atol=1e-5, what=f"mixed model grad {name}")
    # No ShardTensor argument: fn is simply called.
    close(f(full, gain_r, shift_r), scale_shift(full, gain_r, shift_r), what="plain call")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_local_map_compiled_function(world):
    harness.run(world, case_local_map_function)


def case_local_map_input_shapes_must_match():
    x = st.distribute_tensor(torch.randn(6, 4), mesh(), [st.Shard(0)])
    st.local_map(lambda a: a, [st.Shard(1)], sharding_shapes="input")(x)


def case_local_map_in_placements():
    x = st.distribute_tensor(torch.randn(6, 4), mesh(), [st.Shard(0)])
    st.local_map(lambda a: a, in_placements=[[st.Shard(1)]])(x)


@pytest.mark.parametrize("fn,match", [(case_local_map_input_shapes_must_match, "sharded like the input"),
                                      (case_local_map_in_placements, "redistribute_inputs=True")])
def test_local_map_errors_on_every_rank(fn, match):
    harness.expect_error(2, fn, match=match)


def case_local_map_redistributes_inputs():
    m = mesh()
    full = randn(6, 4, seed=7)
    x = st.distribute_tensor(full, m, [st.Shard(0)])
    y = st.local_map(lambda a: a * 2, in_placements=[[st.Shard(1)]], redistribute_inputs=True)(x)
    assert st.placements(y) == (st.Shard(1),)
    close(y.full_tensor(), full * 2, what="redistributed input")
    return True


def test_local_map_redistributes_inputs():
    harness.run(3, case_local_map_redistributes_inputs)


# ------------------------------------------------------------------------------------ bundled models end to end

def _tiny_vit():
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.models import build
    return build("vit", "tiny", img_size=(32, 24), embed_dim=32, depth=2, num_heads=2)


def _tiny_unet():
    from test_unet import TinyUNet
    return TinyUNet()


def case_compiled_model_training(name, mesh_shape, backend="record", strategy="auto"):
    """torch.compile(model) of a bundled model, two training steps with the loss inside the compiled step: loss,
    input gradient, parameter gradients and weights equal one device; every graph holds functional collectives
    only."""
    m = mesh(mesh_shape)
    torch.manual_seed(0)
    net = _tiny_vit() if name == "vit" else _tiny_unet()
    torch.manual_seed(0)
    ref = _tiny_vit() if name == "vit" else _tiny_unet()
    ref.load_state_dict(net.state_dict())
    opt, ropt = torch.optim.SGD(net.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    torch._dynamo.reset()
    rec = GraphRecorder()
    # fullgraph: the whole model is one graph (no graph break anywhere in the bundled models).
    compiled = torch.compile(net, backend=rec.backend if backend == "record" else backend, fullgraph=True)
    F = torch.nn.functional
    for step in range(2):
        # Uneven; at 3 ranks one rank holds nothing (rank 1, then rank 0): its graph must keep every collective.
        tokens = [[1, 3], [3, 1]][step] if m.size() == 2 else [[2, 0, 2], [0, 1, 3]][step]
        if name == "vit":
            x = randn(2, 3, 32, 24, seed=20 + step)
            target = torch.tensor([1, 7])
            rows = [8 * e for e in tokens]
            loss_of = lambda out, tgt: F.cross_entropy(out, tgt)  # noqa: E731
        else:
            x = randn(2, 2, 16, 12, seed=20 + step)
            target = randn(2, 1, 16, 12, seed=30 + step)
            rows = [4 * e for e in tokens]
            loss_of = lambda out, tgt: F.mse_loss(out, tgt)  # noqa: E731
        xs = st.distribute_tensor(x, m, [st.Shard(2)], {0: rows}).requires_grad_(True)
        xr = x.clone().requires_grad_(True)
        ts = target if name == "vit" else st.distribute_tensor(target, m, [st.Shard(2)], {0: rows})
        with st.use_attention_strategy(strategy):
            loss = loss_of(compiled(xs), ts)
        loss_ref = loss_of(ref(xr), target)
        close(loss.full_tensor() if st.is_shard_tensor(loss) else loss, loss_ref, rtol=1e-5, atol=1e-6,
              what=f"{name} step {step} loss")
        loss.backward()
        loss_ref.backward()
        close(xs.grad.full_tensor(), xr.grad, rtol=1e-4, atol=1e-6, what=f"{name} step {step} input gradient")
        check_plain_grads_and_step(net, ref, opt, ropt, 1e-4, f"{name} step {step}")
    for p, pr in zip(net.parameters(), ref.parameters()):
        close(p.detach(), pr.detach(), rtol=1e-4, atol=1e-6, what=f"{name} weights after two steps")
    if backend == "record":
        assert_functional_collectives_only(rec)
    return True


@pytest.mark.parametrize("name,world", [("vit", 2), ("vit", 3), ("unet", 2), ("unet", 3)])
def test_compiled_model_training(name, world):
    harness.run(world, case_compiled_model_training, name, (world,), timeout=600)


@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
def test_compiled_vit_attention_strategies(strategy):
    harness.run(3, case_compiled_model_training, "vit", (3,), "record", strategy, timeout=600)


def case_point_search_in_compiled_code(which):
    """knn / radius_search on ShardTensors cannot be traced (host kernels, exchanges sized by the candidates found):
    the rule refuses while tracing, Dynamo breaks the graph there and the search runs eagerly on the sharded tensor;
    the result equals one device."""
    m = mesh()
    torch._dynamo.reset()
    full = randn(11, 3, seed=3)
    fn = _knn if which == "knn" else _radius
    x = st.distribute_tensor(full, m, [st.Shard(0)], {0: uneven_extents(11, m.size(), 1)})
    y = torch.compile(lambda t: fn(t.sin()) * 2, backend=BACKEND)(x)   # missing neighbours: inf distances
    close(y.full_tensor(), fn(full.sin()) * 2, what=f"compiled {which} (graph break)")
    return True


@pytest.mark.parametrize("which", ["knn", "radius_search"])
def test_point_search_in_compiled_code(which):
    harness.run(2, case_point_search_in_compiled_code, which)


# Every pointwise op of torch's OpInfo database (unary and binary ufuncs, the activations of torch.nn.functional) that
# is differentiable in float32, compiled forward and backward with a sharded input. Ops whose composite kernel runs at
# the ShardTensor key below autograd (silu_backward) once failed to trace; the sweep keeps the whole class covered.
ACTIVATIONS = {"nn.functional.silu", "nn.functional.gelu", "nn.functional.mish", "nn.functional.elu",
               "nn.functional.celu", "nn.functional.selu", "nn.functional.hardswish", "nn.functional.hardsigmoid",
               "nn.functional.softplus", "nn.functional.leaky_relu", "nn.functional.relu6", "nn.functional.hardtanh",
               "nn.functional.logsigmoid", "nn.functional.tanhshrink", "nn.functional.softsign",
               "nn.functional.hardshrink", "nn.functional.softshrink", "nn.functional.relu", "nn.functional.threshold",
               "nn.functional.rrelu", "sigmoid", "nn.functional.glu"}


def _pointwise_cases():
    """(name, fn, args, kwargs) with the first float32 sample of every differentiable pointwise OpInfo whose input has
    at least 2 rows (the sharded dim)."""
    from torch.testing._internal.common_methods_invocations import binary_ufuncs, op_db, unary_ufuncs
    names = {o.name for o in unary_ufuncs} | {o.name for o in binary_ufuncs} | ACTIVATIONS
    cases = []
    for info in op_db:
        if info.name not in names or not info.supports_autograd or torch.float32 not in info.dtypes:
            continue
        if info.name == "nn.functional.rrelu":   # random in training mode: compared in eval mode below
            continue
        for sample in info.sample_inputs("cpu", torch.float32, requires_grad=False):
            x = sample.input
            if info.name == "nn.functional.glu":   # it halves its dim: sharded along another one
                dim = sample.kwargs.get("dim", sample.args[0] if sample.args else -1)
                if x.dim() < 2 or dim % x.dim() == 0:
                    continue
            if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.size(0) >= 2 and x.numel() > 0:
                cases.append((f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name,
                              info.op, x, list(sample.args), dict(sample.kwargs)))
                break
    return cases


def case_compiled_pointwise_sweep():
    """One compiled graph applies every op to its sharded sample (strict: no gather fallback); outputs and, after one
    backward over all of them, input gradients equal one device."""
    m = mesh()
    cases = _pointwise_cases()

    def like(t, a):  # a second tensor argument of the input's shape is sharded like it
        return isinstance(a, torch.Tensor) and a.shape == t.shape

    inputs, plain = [], []
    for name, fn, x, args, kwargs in cases:
        ext = {0: uneven_extents(x.size(0), m.size(), 3)}

        def shard(t):
            return st.distribute_tensor(t.detach(), m, [st.Shard(0)], ext).requires_grad_(t.is_floating_point()
                                                                                       or t.is_complex())
        inputs.append([shard(x)] + [shard(a) if like(x, a) else a for a in args])
        plain.append([x.detach().requires_grad_(True)] + [
            a.detach().requires_grad_(a.is_floating_point() or a.is_complex()) if like(x, a) else a for a in args])
    torch._dynamo.reset()

    def run_all(all_inputs):
        return [fn(*ins, **kwargs) for (_, fn, _, _, kwargs), ins in zip(cases, all_inputs)]
    with st.use_strict():
        outs = torch.compile(run_all, backend=BACKEND, fullgraph=True)(inputs)
    refs = run_all(plain)
    sharded, tangents, references, ref_tangents = [], [], [], []
    for (name, *_), out, ref in zip(cases, outs, refs):
        out, ref = (out[0], ref[0]) if isinstance(ref, tuple) else (out, ref)   # frexp, max.dim: the values
        close(out.full_tensor(), ref, rtol=1e-5, atol=1e-6, equal_nan=True, what=f"compiled {name}")
        if ref.requires_grad:
            grad = torch.linspace(0.5, 1.5, ref.numel()).reshape(ref.shape).to(ref.dtype)
            sharded.append(out)
            tangents.append(st.distribute_tensor(grad, m, list(st.placements(out)), st.sharding_shapes(out)))
            references.append(ref)
            ref_tangents.append(grad)
    # One backward over every output: a compiled graph's backward takes all its tangents at once.
    with st.use_strict():
        torch.autograd.backward(sharded, tangents)
    torch.autograd.backward(references, ref_tangents)
    for (name, *_), ins, pins in zip(cases, inputs, plain):
        for i, (a, b) in enumerate(zip(ins, pins)):
            if isinstance(b, torch.Tensor) and b.grad is not None:
                close(a.grad.full_tensor(), b.grad, rtol=1e-4, atol=1e-5, equal_nan=True,
                      what=f"compiled {name} gradient of input {i}")
    return len(cases)


def test_compiled_pointwise_sweep():
    counts = harness.run(2, case_compiled_pointwise_sweep, timeout=900)
    assert counts[0] > 100, counts


def case_new_rules_in_compiled_code():
    """Rules whose collectives depend on the data (grid_sample's windows, unique's sizes, max_unpool's routing) and a
    batch-local one (linalg) inside compiled code: right answers, graph breaks where the data decides."""
    m = mesh()
    torch._dynamo.reset()
    d64 = dict(dtype=torch.float64)
    x = randn(1, 2, 8, 6, seed=1, **d64)
    g = randn(1, 8, 6, 2, seed=2, **d64) * 0.5
    mats = randn(5, 6, 6, seed=3, **d64)
    eye = 3 * torch.eye(6, **d64)
    xs, gs = st.distribute_tensor(x, m, [st.Shard(2)]), st.distribute_tensor(g, m, [st.Shard(1)])
    ms = st.distribute_tensor(mats, m, [st.Shard(0)])
    idx = torch.tensor([7, 0, 3, 3, 5])
    gidx = torch.randint(0, 8, (1, 2, 5, 6), generator=torch.Generator().manual_seed(4))
    cases = (
        ("grid_sample", lambda a, b: F.grid_sample(a.sin(), b, align_corners=False) * 2, (xs, gs), (x, g)),
        ("linalg", lambda a: torch.linalg.inv(a.sin() + eye) * 2, (ms,), (mats,)),
        ("unique", lambda a: torch.unique(a.round()) * 2, (xs,), (x,)),
        ("max_unpool", lambda a: F.max_unpool2d(*F.max_pool2d(a.sin(), 2, return_indices=True), 2) * 2, (xs,), (x,)),
        # Reads by a whole index along the split dim: eager, a routed read sized from the index; traced, the
        # owners' picks and one all-reduce (a graph cannot size messages from values).
        ("index", lambda a: a.sin()[:, :, idx] * 2, (xs,), (x,)),
        ("gather", lambda a: torch.gather(a.sin(), 2, gidx) * 2, (xs,), (x,)),
    )
    for name, fn, args, refs in cases:
        y = torch.compile(fn, backend="aot_eager")(*args)
        close(y.full_tensor() if st.is_shard_tensor(y) else y, fn(*refs), what=f"compiled {name}")
    return True


def test_new_rules_in_compiled_code():
    harness.run(2, case_new_rules_in_compiled_code)
