"""torch.compile: tracing a ShardTensor fails with an error that names the remedy (on every rank); the
remedy, st.local_map over a compiled function or module, gives the single-device forward, input gradients and
parameter gradients (plain parameters summed over the sharded mesh dims), uneven shards, 1-3 ranks, 2-D mesh.
Compiled with the aot_eager backend (dynamo + AOTAutograd, no code generation) to keep the suite fast."""
import math

import pytest
import torch

import harness
import shardtensor as st
from cases_util import close, mesh, randn, uneven_extents

BACKEND = "aot_eager"


def case_compile_refused():
    x = st.distribute_tensor(torch.randn(6, 4), mesh(), [st.Shard(0)])
    torch._dynamo.reset()
    torch.compile(lambda a: a.sin() + 1, backend="eager")(x)


def test_compile_of_shardtensor_names_the_remedy():
    harness.expect_error(2, case_compile_refused, match="local_map",
                         kinds=("InternalTorchDynamoError", "NotImplementedError"))


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
