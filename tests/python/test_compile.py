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

import harness
import shardtensor as st
from cases_util import close, mesh, randn, uneven_extents

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
        for (name, p), pr in zip(net.named_parameters(), ref.parameters()):
            assert not st.is_shard_tensor(p.grad) and type(p.grad) is torch.Tensor, (name, type(p.grad))
            close(p.grad, pr.grad, rtol=1e-5, atol=1e-6, what=f"step {step} grad {name}")
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
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
    }


def case_compiled_family(name):
    m = mesh()
    fn, shape, dim = compiled_families()[name]
    full = randn(*shape, seed=11)
    torch._dynamo.reset()
    x = st.distribute_tensor(full, m, [st.Shard(dim)], {0: uneven_extents(shape[dim], m.size(), 1)})
    y = torch.compile(fn, backend=BACKEND)(x)
    close(y.full_tensor() if st.is_shard_tensor(y) else y, fn(full), rtol=1e-5, atol=1e-5, what=f"compiled {name}")
    return True


@pytest.mark.parametrize("name", list(compiled_families()))
def test_compiled_family(name):
    harness.run(2, case_compiled_family, name)


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
