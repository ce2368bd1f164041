"""The functional collective backend (issue 21, item 1): every primitive issued as `_c10d_functional` ops.

- Selected for eager runs (`st.use_comm_backend("functional")`), cases of the op test modules give the same results
  and issue the same collectives with the same bytes as with the ProcessGroup backend: redistribution (all-gather,
  reduce-scatter, all-to-all, uneven and zero extents), scatter_tensor, broadcast (sync_module), halo convolution,
  ring attention, FFT pencils, softmax/norm statistics, 1-3 ranks and a 2-D mesh.
- While tracing (make_fx) the collectives are `_c10d_functional` ops (then `wait_tensor`) whatever the setting: a
  trace holds functional collective nodes only. A user's own dispatch mode runs eagerly and sees ProcessGroup
  collectives, or functional ones when selected.
- Reads of communicated values on the host (`from_local("infer")`, the agreement check) refuse while tracing.
"""
import importlib

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import harness
import shardtensor as st
from cases_util import close, mesh, randn, tiny_extents, uneven_extents


def case_primitives():
    """Every primitive under the functional backend: values and the counter's calls/bytes equal the ProcessGroup
    backend's."""
    w = dist.get_world_size()
    m = mesh()
    full = randn(7, 5, seed=1)
    ext = tiny_extents(7, w)
    results = {}
    for backend in ("process_group", "functional"):
        with st.use_comm_backend(backend), st.CommCounter() as c:
            x = st.distribute_tensor(full, m, [st.Shard(0)], {0: ext})
            gathered = x.full_tensor()                                        # all-gather, uneven
            moved = st.redistribute(x, [st.Shard(1)])                         # all-to-all, dim change
            reext = st.redistribute(x, [st.Shard(0)], {0: uneven_extents(7, w, 3)})  # all-to-all, new extents
            part = st.from_local(randn(7, 5, seed=10 + dist.get_rank()), m, [st.Partial()],
                                 sharding_shapes="even", global_shape=(7, 5))
            summed = part.full_tensor()                                       # all-reduce
            scattered = st.redistribute(part, [st.Shard(1)], {0: tiny_extents(5, w)})  # reduce-scatter
            sc = st.scatter_tensor(full if dist.get_rank() == 0 else None, 0, m, [st.Shard(0)], {0: ext})
            cplx = st.distribute_tensor(torch.complex(full, full.flip(0)), m, [st.Shard(0)], {0: ext}).full_tensor()
            amax = x.abs().amax().item()                                      # Partial(max) completed
            me = dist.get_rank()
            back = w > 2
            src = (me + 1) % w if back else (me - 1) % w
            ring = st.ring_pass([randn(me + 1, 3, seed=me), torch.complex(randn(2, seed=me), randn(2, seed=9))], m,
                                recv_shapes=[(src + 1, 3), (2,)], direction="backward" if back else "forward")
        results[backend] = (gathered, st.to_local(moved), st.to_local(reext), summed, st.to_local(scattered),
                            st.to_local(sc), cplx, torch.tensor(amax), dict(c.calls), dict(c.bytes), ring)
    pg, fn = results["process_group"], results["functional"]
    for a, b in zip(pg[10], fn[10]):
        close(b, a, what="ring pass")
    for a, b in zip(pg[:8], fn[:8]):
        close(b, a, what="functional vs process group values")
    assert pg[8] == fn[8] and pg[9] == fn[9], (pg[8], fn[8], pg[9], fn[9])
    close(pg[0], full, what="gathered")
    assert st.comm_backend() == "process_group"
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_primitives(world):
    harness.run(world, case_primitives)


def case_module_case(module_name, case_name, args):
    """A case of another test module run with the functional backend selected (it asserts against one device)."""
    fn = getattr(importlib.import_module(module_name), case_name)
    with st.use_comm_backend("functional"):
        return fn(*args)


MODULE_CASES = [
    ("test_conv", "case_conv_module_training", (0,), 3),
    ("test_conv", "case_conv_2d_mesh", (1,), 4),
    ("test_attention", "case_self", ("ring", "uneven"), 3),
    ("test_attention", "case_self", ("all_to_all", "tiny"), 2),
    ("test_attention", "case_self", ("ring_contiguous", "tiny"), 3),
    ("test_fft_sharded", "case_fno_block", ("pad",), 3),
    ("test_fft_sharded", "case_2d_mesh", (), 4),
    ("test_norm", "case_group_norm", (0,), 3),
    ("test_norm", "case_layer_norm", (0,), 2),
    ("test_linear", "case_softmax", (0,), 2),
    ("test_optim_sharded", "case_foreach_reductions", (True,), 4),
    ("test_ecosystem", "case_data_x_domain", ("ddp",), 4),
]


def _existing(cases):
    out = []
    for mod, name, args, world in cases:
        if name is None:
            continue
        fn = getattr(importlib.import_module(mod), name, None)
        out.append(pytest.param(mod, name, args, world, id=f"{mod}.{name}",
                                marks=() if fn else pytest.mark.skip(reason=f"{mod}.{name} does not exist")))
    return out


@pytest.mark.parametrize("module_name,case_name,args,world", _existing(MODULE_CASES))
def test_op_cases_functional(module_name, case_name, args, world):
    harness.run(world, case_module_case, module_name, case_name, args)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def case_backends_under_a_user_mode():
    """A user's dispatch mode (a recorder, a FLOP counter) runs eagerly: it sees no functional collective with the
    default backend and only functional ones (each waited) with the functional backend selected; same results."""
    w = dist.get_world_size()
    m = mesh()
    x = st.distribute_tensor(randn(6, 4, seed=2), m, [st.Shard(0)], {0: uneven_extents(6, w, 1)})
    seen = {}
    for backend in ("process_group", "functional"):
        with st.use_comm_backend(backend), _Recorder() as rec:
            y = st.redistribute(x.softmax(0), [st.Shard(1)]).full_tensor()
        close(y, randn(6, 4, seed=2).softmax(0), what=f"softmax under the mode ({backend})")
        seen[backend] = [n for n in rec.names if "c10d" in n]
    # The process-group backend issues no functional collective (over the shared-memory rings of one host it issues
    # no c10d op at all: comm/shm_transport.h).
    assert not any(n.startswith("_c10d_functional.") for n in seen["process_group"])
    assert seen["functional"] and all(n.startswith("_c10d_functional.") for n in seen["functional"])
    assert "_c10d_functional.wait_tensor.default" in seen["functional"]
    return True


def test_backends_under_a_user_mode():
    harness.run(2, case_backends_under_a_user_mode)


def case_make_fx_graph():
    """make_fx over a function building its ShardTensor with an explicit layout: the graph's collectives are
    `_c10d_functional` nodes (each waited), never c10d ProcessGroup calls, and the traced graph computes the same."""
    from torch.fx.experimental.proxy_tensor import make_fx
    w = dist.get_world_size()
    m = mesh()
    ext = uneven_extents(6, w, 2)

    def f(local):
        x = st.from_local(local, m, [st.Shard(0)], sharding_shapes={0: ext}, global_shape=(6, 4), check=False)
        return st.to_local(st.redistribute(torch.nn.functional.softmax(x, 0) * 2, [st.Shard(1)]))

    full = randn(6, 4, seed=3)
    lo = sum(ext[:dist.get_rank()])
    local = full[lo:lo + ext[dist.get_rank()]].clone()
    gm = make_fx(f)(local)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    coll = [t for t in targets if "c10d" in t]
    assert coll and all(t.startswith("_c10d_functional.") for t in coll), coll
    assert any("wait_tensor" in t for t in coll)
    close(gm(local), f(local), what="traced graph vs eager")
    return True


def test_make_fx_graph():
    harness.run(2, case_make_fx_graph)


def refuse_infer_while_tracing():
    from torch.fx.experimental.proxy_tensor import make_fx
    m = mesh()
    make_fx(lambda t: st.to_local(st.from_local(t, m, [st.Shard(0)]) * 2))(randn(3, 4, seed=1))  # "infer"


def test_host_reads_refused_while_tracing():
    harness.expect_error(2, refuse_infer_while_tracing, match="reads communicated values on the host",
                         kinds=("NotImplementedError",))


def test_bad_backend_name():
    with pytest.raises(ValueError, match="process_group"):
        st.set_comm_backend("nccl")
