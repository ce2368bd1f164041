"""Simulation mode (``st.simulate``): one process as rank r of P over torch's fake process group.

The contract checked here: a simulated rank r issues exactly the collectives of the real rank r (calls and bytes
per kind), allocates exactly its peak memory (CPU allocator tracker) and counts the same local FLOPs, for a halo
convolution stack, the ViT (ring attention, sharded pos-embed gradient) and Transolver (pending sums), at P = 2 and 3
with uneven extents; the meta simulation (fake tensors) reports the same FLOPs and bytes and a memory estimate close
to the measured peak; and what cannot work without other ranks' values refuses with the remedy.
"""
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import harness  # noqa: E402
import shardtensor as st  # noqa: E402
from benchmarks.models import build  # noqa: E402

# ---- the workloads, identical in real ranks and simulated ones ---------------------------------------------------

WORKLOADS = {
    # name: (global input shape, sharded dim)
    "conv": ((1, 4, 23, 16), 2),      # 23 rows: uneven at P = 2 and 3
    "vit": ((1, 3, 48, 32), 2),       # patch 8 -> 6 x 4 tokens, rows split 3/3, 2/2/2
    "transolver": ((1, 37, 8), 1),    # 37 points: uneven
    "natten": ((1, 13, 6, 8), 1),     # 2-D neighbourhood attention (the library's kernel), 13 rows: uneven
}


class _NA(nn.Module):
    """q, k, v from one linear layer, 2 heads of 4, 3x3 neighbourhood attention (halo of one row)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        b, h, w, _ = x.shape
        q, k, v = self.qkv(x).view(b, h, w, 3, 2, 4).unbind(3)
        return st.ops.neighborhood_attention2d(q, k, v, 3)


def _model(name):
    torch.manual_seed(0)
    if name == "conv":
        return nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 4, 5, padding=2))
    if name == "natten":
        return _NA()
    if name == "vit":
        return build("vit", "tiny", img_size=(48, 32), embed_dim=32, depth=1, num_heads=2)
    return build("transolver", "tiny", n_layers=1)


def _local_input(name, mesh, world, coord):
    shape, dim = WORKLOADS[name]
    g = torch.Generator().manual_seed(1)
    full = torch.randn(shape, generator=g)
    local = torch.tensor_split(full, world, dim=dim)[coord].contiguous()
    x = st.from_local(local, mesh, [st.Shard(dim)], sharding_shapes="even", global_shape=shape)
    return x


def _forward(name, model, x):
    if name == "transolver":
        return model(x[..., :6], x[..., 6:])
    return model(x)


def measure(name, mesh, world, coord):
    """FLOPs, collectives and peak memory of inference and of a training step of this rank (the same code for a
    real rank and a simulated one)."""
    model = _model(name)
    st.sync_module(model, mesh)
    x = _local_input(name, mesh, world, coord)
    out = {}
    with st.RankStats() as s:
        with torch.no_grad():
            _forward(name, model, x)
    out["fwd"] = (s.flops, s.comm_calls, s.comm_bytes, s.peak_bytes)
    leaf = x.detach().requires_grad_(True)

    def step():
        model.zero_grad(set_to_none=True)
        _forward(name, model, leaf).square().mean().backward()

    step()  # steady state: the second step is measured
    model.zero_grad(set_to_none=True)
    with st.RankStats() as s:
        step()
    out["step"] = (s.flops, s.comm_calls, s.comm_bytes, s.peak_bytes)
    return out


def case_measure(name):
    from cases_util import mesh
    import torch.distributed as dist
    torch.set_num_threads(1)
    m = mesh()
    return measure(name, m, dist.get_world_size(), m.get_coordinate()[0])


def simulated(name, world, rank, device="cpu"):
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", st.SimulationWarning)
        with st.simulate(rank, world, device=device) as sim:
            return measure(name, sim.mesh, world, sim.coordinate[0])


# ---- agreement with real Gloo ranks ------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_simulated_rank_equals_real_rank(name, world):
    real = harness.run(world, case_measure, name)
    for r in range(world):
        sim = simulated(name, world, r)
        for kind in ("fwd", "step"):
            rf, rc, rb, rp = real[r][kind]
            sf, sc, sb, sp = sim[kind]
            assert sc == rc and sb == rb, f"{name} P={world} rank {r} {kind}: collectives {sc} {sb} != real {rc} {rb}"
            assert sf == rf, f"{name} P={world} rank {r} {kind}: FLOPs {sf} != real {rf}"
            # Gloo's worker thread drops its reference to a finished collective's buffers asynchronously, so on a
            # busy machine the real peak can hold one collective's buffers longer (seen: +2 KiB once in ~10 runs).
            slack = 2 * max([b // max(rc[k], 1) for k, b in rb.items()] or [0])
            assert sp == rp or 0 <= rp - sp <= slack, \
                f"{name} P={world} rank {r} {kind}: peak memory {sp} != real {rp} (slack {slack})"


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_meta_simulation_counts_like_cpu_and_estimates_memory(name):
    world, rank = 3, 1
    cpu = simulated(name, world, rank, "cpu")
    meta = simulated(name, world, rank, "meta")
    for kind in ("fwd", "step"):
        cf, cc, cb, cp = cpu[kind]
        mf, mc, mb, mp = meta[kind]
        assert (mf, mc, mb) == (cf, cc, cb), f"{name} {kind}: meta {mf} {mc} {mb} != cpu {cf} {cc} {cb}"
        # The tally counts what ops return; the allocator also sees kernels' internal workspaces (the CPU
        # convolution's im2col columns, CPU flash and neighbourhood attention's blocks), which are large at these tiny sizes and
        # shrink in proportion as sizes grow (ViT 128x128, 4 ranks: within 0.3 %; benchmarks/vit/bench.py --quick
        # --sizes 128 --simulate 4, --sim-device cpu against meta).
        # The convolution runs its im2col over all of a rank's rows at once, as on one device: at 8 x 16 rows that
        # workspace is most of the peak (the same layers on a plain tensor of the rank's rows peak at 25 KiB, the
        # tally 10 KiB).
        lower = 0.3 if name == "conv" else 0.4
        if name == "transolver":  # no kernel with a workspace
            assert mp == cp, f"{name} {kind}: meta estimate {mp} B != measured {cp} B"
        else:
            assert lower * cp <= mp <= cp, f"{name} {kind}: meta estimate {mp} B vs measured {cp} B"


def test_flops_are_local_and_sum_to_single_device():
    """Through ShardTensors the counter sees the local kernels: a linear layer's FLOPs split over the ranks in
    proportion to their rows and add up to the single-device count."""
    lin = nn.Linear(16, 32)
    with st.RankStats() as single:
        lin(torch.randn(1, 30, 16))
    total = 0
    for r in range(3):
        with st.simulate(r, 3, warn=False) as sim:
            x = sim.shard((1, 30, 16), [st.Shard(1)])
            with st.RankStats() as s:
                lin(x)
            assert s.flops == single.flops // 3
            total += s.flops
    assert total == single.flops == 2 * 30 * 16 * 32


# ---- the mode itself --------------------------------------------------------------------------------------------

def test_flag_warning_and_teardown():
    assert not st.simulating()
    with pytest.warns(st.SimulationWarning, match="garbage"):
        with st.simulate(2, 4) as sim:
            assert st.simulating() and st._C.simulating()
            assert sim.coordinate == (2,) and sim.mesh.size() == 4
            x = sim.shard((10, 3), [st.Shard(0)])
            assert st.to_local(x).shape == (2, 3) and x.shape == (10, 3)
    assert not st.simulating() and not st._C.simulating()
    import torch.distributed as dist
    assert not dist.is_initialized()


def test_tensor_from_an_ended_simulation_refuses():
    """Issue 30 item 5: a ShardTensor made inside st.simulate and used after the block computed garbage silently over
    the ended simulation's fake group; now every op, collective or new wrap on it raises ValueError, also inside a
    later simulation, while that simulation's own tensors work."""
    for device in ("cpu", "meta"):
        with st.simulate(1, 2, device=device, warn=False) as sim:
            x = sim.shard((6, 4), [st.Shard(0)])
            mesh = sim.mesh
            (x * 2).sum()                              # fine inside
        for use in (lambda: x * 2, lambda: x.sum(), lambda: x.full_tensor(), lambda: x.redistribute([st.Replicate()]),
                    lambda: st.from_local(torch.zeros(3, 4), mesh, [st.Shard(0)], "even", global_shape=(6, 4))):
            with pytest.raises(ValueError, match="simulate.*has ended"):
                use()
        with st.simulate(0, 2, device=device, warn=False) as sim2:
            with pytest.raises(ValueError, match="has ended"):
                x + 1
            y = sim2.shard((6, 4), [st.Shard(0)])
            assert st.to_local(y * 2).shape == (3, 4)
        with pytest.raises(ValueError, match="has ended"):
            y.sum()


def _local_ops_of_a_step(world):
    """The tensor ops a halo-exchanging training step runs on a simulated rank's local (fake) tensors."""
    class Count:
        n = 0

        def on_op(self, name, flops, traffic, seconds):
            Count.n += 1

    with st.simulate(world // 2, world, device="meta", warn=False) as sim:
        x = sim.shard((1, 3, 4 * world, 16), [st.Shard(2)], requires_grad=True)
        w = torch.randn(4, 3, 3, 3, requires_grad=True)
        sim.local_mode.listeners.append(Count())
        F.conv2d(x, w, padding=1).square().sum().backward()
    return Count.n


def test_simulated_step_host_work_does_not_grow_with_world():
    """Issue 30 item 5: a simulated rank's host work per op grew with P (a tensor op per peer in every halo exchange,
    a tensor per rank to plan a shard), 43 s per step at P = 8192; now the neighbours' pieces only."""
    assert _local_ops_of_a_step(512) == _local_ops_of_a_step(16)


def test_two_dim_mesh_and_meta_allocates_nothing():
    with st.simulate(5, 8, mesh_shape=(2, 4), mesh_dim_names=("data", "domain"), device="meta", warn=False) as sim:
        assert sim.coordinate == (1, 1)
        x = sim.shard((2, 4, 1000, 1000), [st.Shard(0), st.Shard(2)])
        local = st.to_local(x)
        assert local.shape == (1, 4, 250, 1000) and local.device.type == "cpu"
        before = sim.live_bytes()
        with st.RankStats() as s:
            y = F.conv2d(x, torch.randn(8, 4, 3, 3), padding=1)
        assert st.to_local(y).shape == (1, 8, 250, 1000)
        assert s.peak_bytes >= 8 * 250 * 1000 * 4 and s.comm_calls  # the output and a halo exchange
        assert sim.live_bytes() >= before


def test_scatter_tensor_under_simulation():
    shape = (1, 2, 11, 5)
    real = torch.randn(shape)
    for rank in range(3):
        with st.simulate(rank, 3, warn=False) as sim:
            src_tensor = real if rank == 0 else torch.empty(shape, device="meta")  # a shape/dtype stand-in
            with st.CommCounter() as c:
                x = st.scatter_tensor(src_tensor, 0, sim.mesh, [st.Shard(2)])
            assert x.shape == shape and st.to_local(x).shape == (1, 2, (4, 4, 3)[rank], 5)
            assert ("scatter" in c.calls) and c.calls.get("broadcast") == 1
            # No tensor: on src the usual error; elsewhere the shape cannot arrive, so it refuses with the remedy.
            with pytest.raises(NotImplementedError, match="stand-in") if rank else \
                    pytest.raises(ValueError, match="passed no tensor"):
                st.scatter_tensor(None, 0, sim.mesh, [st.Shard(2)])


def test_refusals():
    with st.simulate(1, 2, warn=False) as sim:
        with pytest.raises(NotImplementedError, match="'even'"):
            st.from_local(torch.randn(3, 4), sim.mesh, [st.Shard(0)])  # "infer"
        a = sim.shard((6, 2), [st.Shard(0)])
        with pytest.raises(NotImplementedError, match="torch.equal"):
            torch.equal(a, a)
        with pytest.raises(NotImplementedError, match="torch.allclose"):
            torch.allclose(a, a)
        # Values are garbage, but there: a flip along the sharded dim takes the partner's shape from the layout.
        b = sim.shard((7, 2), [st.Shard(0)])
        assert st.to_local(torch.flip(b, [0])).shape == (4, 2)  # rank 1 of [4, 3] receives rank 0's 4 rows
        float(a.sum())  # .item() on "cpu": a garbage number, allowed
    with st.simulate(0, 2, device="meta", warn=False) as sim:
        a = sim.shard((6, 2), [st.Shard(0)])
        with pytest.raises(st.SimulationError, match="reads tensor values"):
            a.sum().item()
    with pytest.raises(ValueError, match="mesh_shape"):
        st.simulate(0, 4, mesh_shape=(3,))
    with pytest.raises(ValueError, match="rank"):
        st.simulate(4, 4)


def test_flip_matches_single_device_on_real_ranks():
    harness.run(3, case_flip)


def case_flip():
    from cases_util import mesh
    import torch.distributed as dist
    full = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)
    x = st.distribute_tensor(full, mesh(), [st.Shard(0)], sharding_shapes={0: [1, 4, 2]})
    y = torch.flip(x, [0, 1])
    assert st.sharding_shapes(y) == {0: [2, 4, 1]}
    assert torch.equal(y.full_tensor(), torch.flip(full, [0, 1]))
    return dist.get_rank()


def test_kernel_cpu_time_is_the_local_kernels_share():
    """RankStats.kernel_cpu_s: this thread's CPU time inside the local aten ops, per op and in total — part of the
    block's CPU time, dominated by the convolutions here; None in a meta simulation (nothing is computed)."""
    torch.set_num_threads(1)
    with st.simulate(0, 2, warn=False) as sim:
        x = sim.shard((1, 16, 96, 96), [st.Shard(2)])
        w = torch.randn(16, 16, 5, 5)
        with st.RankStats(memory=False) as s:
            for _ in range(3):
                x = F.conv2d(x, w, padding=2).relu()
    assert s.kernel_cpu_s == pytest.approx(sum(s.kernel_cpu_by_op.values()))
    assert 0 < s.kernel_cpu_s <= s.cpu_s + 1e-3
    conv = sum(t for op, t in s.kernel_cpu_by_op.items() if "conv" in op)
    assert conv > 0.5 * s.kernel_cpu_s, s.kernel_cpu_by_op
    with st.simulate(0, 2, device="meta", warn=False) as sim:
        x = sim.shard((1, 16, 96, 96), [st.Shard(2)])
        with st.RankStats(memory=False) as s:
            F.conv2d(x, torch.randn(16, 16, 5, 5), padding=2)
    assert s.kernel_cpu_s is None and s.flops > 0
