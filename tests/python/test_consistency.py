"""Ranks that disagree raise on every rank (never a wrong number, a hang or an abort): from_local's and
scatter_tensor's and distribute_tensor's agreement checks, scatter_tensor's src problems sent with the metadata, and the opt-in per-op check
(SHARDTENSOR_CHECK_CONSISTENCY)."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import close, mesh, randn, rank


# ---- from_local ----

def bad_explicit_extents():
    m = mesh()
    w = m.size()
    ext = [2] * w if rank() == 0 else [1] * (w - 1) + [2 + w - 1]   # both sum to 2w; rank 0's view differs
    local = torch.zeros(ext[rank()], 3)
    st.from_local(local, m, [st.Shard(0)], sharding_shapes={0: ext})


def bad_even_global_shape():
    m = mesh()
    n = 8 if rank() == 0 else 9
    st.from_local(torch.tensor_split(torch.zeros(n, 2), m.size())[rank()].clone(), m, [st.Shard(0)], "even",
                  global_shape=(n, 2))


def bad_placements():
    m = mesh()
    pl = [st.Shard(0)] if rank() == 0 else [st.Replicate()]
    st.from_local(torch.zeros(4, 4), m, pl, "even", global_shape=(4 * m.size(), 4) if rank() == 0 else (4, 4))


def bad_dtype_infer():
    m = mesh()
    st.from_local(torch.zeros(2, 3, dtype=torch.float64 if rank() == 0 else torch.float32), m, [st.Shard(0)])


def bad_ndim_infer():
    m = mesh()
    st.from_local(torch.zeros(2, 3) if rank() == 0 else torch.zeros(2, 3, 1), m, [st.Shard(0)])


def bad_local_fit_even():
    m = mesh()
    # Every rank declares the same layout, but one rank's local tensor does not fit it.
    rows = torch.tensor_split(torch.zeros(7, 2), m.size())[rank()].shape[0] + (1 if rank() == m.size() - 1 else 0)
    st.from_local(torch.zeros(rows, 2), m, [st.Shard(0)], "even", global_shape=(7, 2))


def bad_infer_2d_lines():
    m = mesh((2, 2), ("a", "b"))
    a, b = m.get_coordinate()
    # Along mesh dim 1 (Replicate) the two lines infer different extents: [1, 2] on b == 0, [2, 1] on b == 1.
    rows = [[1, 2], [2, 1]][b][a]
    st.from_local(torch.zeros(rows, 2), m, [st.Shard(0), st.Replicate()])


@pytest.mark.parametrize("case,match", [
    (bad_explicit_extents, "sharding_shapes"),
    (bad_even_global_shape, "global_shape"),
    (bad_placements, "placements"),
    (bad_dtype_infer, "dtype"),
    (bad_ndim_infer, "ndim"),
    (bad_local_fit_even, "fits the layout"),
])
def test_from_local_disagreement_raises(case, match):
    errors = harness.expect_error(2, case, match=match, kinds=("ValueError",))
    assert all("ranks disagree" in msg for _, msg, _ in errors.values())


def placements_differ_then_use(how, mode, mesh_shape):
    """Issue 18 item 9: Shard(0) on one rank, Replicate() (or Shard(1)) on the others, default arguments
    (sharding_shapes="infer", check=True) or "infer" spelled out, then full_tensor() or .sum().item(): from_local
    itself must raise on every rank (it once aborted one rank inside the agreement check)."""
    m = mesh(mesh_shape)
    if len(m.mesh.shape) == 2:
        pl = [st.Shard(0), st.Replicate()] if rank() == 0 else [st.Replicate(), st.Replicate()]
    else:
        pl = [st.Shard(0)] if rank() == 0 else [st.Shard(1) if how == "shard1" else st.Replicate()]
    local = torch.randn(4, 4)
    x = st.from_local(local, m, pl) if mode == "default" else st.from_local(local, m, pl, sharding_shapes="infer")
    if how == "full_tensor":
        x.full_tensor()
    else:
        x.sum().item()


@pytest.mark.parametrize("how", ["full_tensor", "item", "shard1"])
@pytest.mark.parametrize("mode", ["default", "infer"])
def test_from_local_placements_differ_per_rank(how, mode):
    for world in (2, 3):
        errors = harness.expect_error(world, placements_differ_then_use, how, mode, None, match="placements",
                                      kinds=("ValueError",))
        assert all("ranks disagree" in msg for _, msg, _ in errors.values())
    if how == "item" and mode == "default":   # and on a 2-D mesh
        harness.expect_error(4, placements_differ_then_use, how, mode, (2, 2), match="placements",
                             kinds=("ValueError",))


def modes_differ(modes, mesh_shape):
    """Issue 30 item 1: a different sharding_shapes mode per rank (explicit extents, "even", "infer"): the agreement
    message has one size whatever the mode, so every rank raises instead of a Gloo size mismatch aborting one."""
    m = mesh(mesh_shape)
    w = m.size()
    n = 2 * w
    local = torch.zeros(2, 3)
    mode = modes[rank() % len(modes)]
    if mode == "explicit":
        st.from_local(local, m, [st.Shard(0)] * len(m.mesh.shape) if len(m.mesh.shape) == 1
                      else [st.Shard(0), st.Replicate()], sharding_shapes={0: [2] * m.mesh.shape[0]})
    else:
        pl = [st.Shard(0)] if len(m.mesh.shape) == 1 else [st.Shard(0), st.Replicate()]
        gs = (2 * m.mesh.shape[0], 3)
        st.from_local(local, m, pl, sharding_shapes=mode, global_shape=gs if mode == "even" else None)


@pytest.mark.parametrize("modes", [("explicit", "even"), ("even", "explicit"), ("infer", "explicit"),
                                   ("explicit", "infer"), ("infer", "even"), ("even", "infer"),
                                   ("infer", "even", "explicit")])
def test_from_local_modes_differ_per_rank(modes):
    for world in (2, 3):
        errors = harness.expect_error(world, modes_differ, modes, None, match="sharding_shapes mode",
                                      kinds=("ValueError",))
        assert all("ranks disagree" in msg for _, msg, _ in errors.values())
    harness.expect_error(4, modes_differ, modes, (2, 2), match="sharding_shapes mode", kinds=("ValueError",))


def case_infer_wrong_global_shape():
    """Issue 30 item 5: "infer" with a global_shape the gathered extents contradict raises (it was ignored)."""
    m = mesh()
    st.from_local(torch.zeros(2, 3), m, [st.Shard(0)], "infer", global_shape=(2 * m.size() + 1, 3))


def test_from_local_infer_checks_global_shape():
    for world in (1, 2):
        harness.expect_error(world, case_infer_wrong_global_shape, match="global_shape", kinds=("ValueError",))


def test_from_local_disagreement_raises_3_ranks():
    harness.expect_error(3, bad_explicit_extents, match="sharding_shapes", kinds=("ValueError",))
    harness.expect_error(3, bad_local_fit_even, match="fits the layout", kinds=("ValueError",))


def bad_distribute_shard_dim():
    """A square tensor with Shard(0) on rank 0 and Shard(1) elsewhere: every rank could slice a shard, so without
    the check the result was silently inconsistent."""
    m = mesh()
    st.distribute_tensor(torch.zeros(4, 4), m, [st.Shard(0)] if rank() == 0 else [st.Shard(1)])


def bad_distribute_extents():
    m = mesh()
    ext = [3, 1] if rank() == 0 else [1, 3]
    st.distribute_tensor(torch.zeros(4, 2), m, [st.Shard(0)], sharding_shapes={0: ext})


def bad_distribute_shape():
    m = mesh()
    st.distribute_tensor(torch.zeros(4 if rank() == 0 else 5, 2), m, [st.Shard(0)])


@pytest.mark.parametrize("case,match", [
    (bad_distribute_shard_dim, "placements"),
    (bad_distribute_extents, "sharding_shapes"),
    (bad_distribute_shape, "global shape"),
])
def test_distribute_tensor_disagreement_raises(case, match):
    errors = harness.expect_error(2, case, match=match, kinds=("ValueError",))
    assert all("ranks disagree" in msg for _, msg, _ in errors.values())


def test_from_local_2d_inconsistent_inference_raises():
    harness.expect_error(4, bad_infer_2d_lines, match="layout", kinds=("ValueError",))


def case_from_local_check_cost():
    """The check is one small all-reduce per mesh dim (explicit/even); check=False communicates nothing."""
    m = mesh()
    w = m.size()
    x = randn(2 * w, 3, seed=1)
    local = torch.tensor_split(x, w)[rank()].clone()
    with st.CommCounter() as c:
        y = st.from_local(local, m, [st.Shard(0)], "even", global_shape=x.shape)
    assert c.calls == ({"all_reduce": 1} if w > 1 else {}), c.calls
    with st.CommCounter() as c:
        z = st.from_local(local, m, [st.Shard(0)], "even", global_shape=x.shape, check=False)
    assert c.calls == {}, c.calls
    close(y.full_tensor(), x, what="checked")
    close(z.full_tensor(), x, what="unchecked")
    return True


def test_from_local_check_cost():
    for world in (1, 2):
        harness.run(world, case_from_local_check_cost)


def case_permuted_mesh(grid):
    """Issue 30 item 4: DeviceMesh("cpu", [2, 1, 0]) at 3 ranks runs on the default group, whose rank order differs:
    two ranks raised and the third waited for them. Now every rank raises when the mesh is first used."""
    from torch.distributed.device_mesh import DeviceMesh
    m = DeviceMesh("cpu", grid)
    st.distribute_tensor(torch.arange(12.0).view(4, 3), m, [st.Shard(0)] * len(m.mesh.shape))


def case_mesh_in_order_works():
    from torch.distributed.device_mesh import DeviceMesh
    import torch.distributed as dist
    m = DeviceMesh("cpu", list(range(dist.get_world_size())))
    x = torch.arange(12.0).view(4, 3)
    close(st.distribute_tensor(x, m, [st.Shard(0)]).full_tensor(), x, what="mesh in rank order")
    return True


def test_permuted_mesh_raises_everywhere():
    errors = harness.expect_error(3, case_permuted_mesh, [2, 1, 0], match="does not hold that dim's ranks",
                                  kinds=("ValueError",))
    assert len({msg for _, msg, _ in errors.values()}) == 1
    harness.expect_error(4, case_permuted_mesh, [[0, 1], [3, 2]], match="does not hold that dim's ranks",
                         kinds=("ValueError",))
    harness.run(3, case_mesh_in_order_works)


# ---- scatter_tensor ----

def scatter_none_on_src():
    st.scatter_tensor(None, 0, mesh(), [st.Shard(0)])


def scatter_not_a_tensor_on_src():
    st.scatter_tensor([[1.0, 2.0]] if rank() == 1 else None, 1, mesh(), [st.Shard(0)])


def scatter_shard_tensor_on_src():
    m = mesh()
    x = st.distribute_tensor(torch.zeros(4, 2), m, [st.Shard(0)])
    st.scatter_tensor(x, 0, m, [st.Shard(0)])


def scatter_src_differs():
    st.scatter_tensor(torch.zeros(4, 2), rank() % 2, mesh(), [st.Shard(0)])


def scatter_placements_differ():
    st.scatter_tensor(torch.zeros(4, 2) if rank() == 0 else None, 0, mesh(),
                      [st.Shard(0)] if rank() == 0 else [st.Shard(1)])


def case_scatter_then_works():
    """After failed scatters the pool still communicates: a good scatter right after."""
    m = mesh()
    x = randn(5, 2, seed=2)
    s = st.scatter_tensor(x if rank() == 0 else None, 0, m, [st.Shard(0)])
    close(s.full_tensor(), x, what="scatter after errors")
    return True


@pytest.mark.parametrize("case,match", [
    (scatter_none_on_src, "passed no tensor"),
    (scatter_not_a_tensor_on_src, "passed no tensor"),
    (scatter_shard_tensor_on_src, "passed a ShardTensor"),
    (scatter_src_differs, "src"),
    (scatter_placements_differ, "placements"),
])
def test_scatter_errors_raise_everywhere(case, match):
    for world in (2, 3):
        harness.expect_error(world, case, match=match, kinds=("ValueError",))
    harness.run(3, case_scatter_then_works)


# ---- the opt-in per-op check ----

def _disagreeing_layout():
    # from_local(check=False) compares nothing, so ranks can build different layouts of one tensor.
    m = mesh()
    w = m.size()
    ext = [4] + [0] * (w - 1) if rank() == 0 else [0] * (w - 1) + [4]
    full = torch.arange(8.0).view(4, 2)
    local = full[sum(ext[:rank()]):sum(ext[:rank() + 1])].clone()
    return st.from_local(local, m, [st.Shard(0)], {0: ext}, global_shape=(4, 2), check=False)


def per_op_check_catches_layouts():
    previous = st._C.set_consistency_check(True)
    try:
        x = _disagreeing_layout()
        (x * 2).sum()     # elementwise: no communication of its own, a silently wrong sum without the check
    finally:
        st._C.set_consistency_check(previous)


def per_op_check_catches_ops():
    previous = st._C.set_consistency_check(True)
    try:
        x = st.distribute_tensor(torch.arange(8.0).view(4, 2), mesh(), [st.Shard(0)])
        x.exp() if rank() == 0 else x.neg()
    finally:
        st._C.set_consistency_check(previous)


def case_per_op_check_agreeing_ranks():
    previous = st._C.set_consistency_check(True)
    try:
        m = mesh()
        x = randn(6, 3, seed=4)
        xs = st.distribute_tensor(x, m, [st.Shard(0)])
        with st.CommCounter() as c:
            y = (xs * 2 + 1).exp()
        assert c.calls.get("all_reduce", 0) >= 3 or m.size() == 1, c.calls   # one check per op
        close(y.full_tensor(), (x * 2 + 1).exp(), what="checked ops")
    finally:
        st._C.set_consistency_check(previous)
    # Off by default: the same ops communicate nothing.
    with st.CommCounter() as c:
        (xs * 2 + 1).exp()
    assert c.calls == {}, c.calls
    return True


def test_per_op_check():
    for world in (2, 3):
        harness.expect_error(world, per_op_check_catches_layouts, match="argument layouts", kinds=("ValueError",))
        harness.expect_error(world, per_op_check_catches_ops, match="op", kinds=("ValueError",))
        harness.run(world, case_per_op_check_agreeing_ranks)


def case_global_strides_agree():
    """Global strides derive from each rank's local tensor; a rank holding extent 1 of a dim has tied local strides,
    which must not change the global strides it reports (code branching on strides would diverge between ranks)."""
    import torch.distributed as dist
    m = mesh()
    w = m.size()
    ext = [1] + [1] * (w - 2) + [3] if w > 1 else [4]
    cases = {
        "(3, 4) Shard(1)": st.distribute_tensor(randn(3, sum(ext), seed=1), m, [st.Shard(1)], {0: ext}),
        "channels-last H": st.distribute_tensor(randn(2, 3, sum(ext), 5, seed=2), m, [st.Shard(2)], {0: ext})
        .contiguous(memory_format=torch.channels_last),
        # permuted: the sharded dim moves inward; a rank holding one row or none cannot tell where from its strides
        "permuted, one-row rank": st.distribute_tensor(randn(3, sum(ext), 4, seed=3), m, [st.Shard(1)], {0: ext})
        .permute(1, 2, 0),
        "permuted, empty rank": st.distribute_tensor(randn(2, 1, w - 1, seed=4), m, [st.Shard(2)],
                                                     {0: [0] + [1] * (w - 1)}).permute(2, 0, 1),
        "transposed tokens, one-row rank": st.distribute_tensor(randn(2, sum(ext), 6, seed=5), m, [st.Shard(1)],
                                                                {0: ext}).transpose(1, 2),
    }
    for name, t in cases.items():
        mine = (tuple(t.stride()), t.is_contiguous(), t.is_contiguous(memory_format=torch.channels_last))
        every = [None] * w
        dist.all_gather_object(every, mine)
        assert all(e == every[0] for e in every), f"{name}: ranks report different strides: {every}"
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_global_strides_agree(world):
    harness.run(world, case_global_strides_agree)


def case_stride_branching_composites():
    """Composites that branch on strides with a rank holding one row or none of a split dim: tensordot (its
    reshape-or-copy, then dot or mul-and-sum) and multi_head_attention_forward with every tensor split along a dim
    of size 2; they hung (the ranks took different paths and different collectives)."""
    import torch.nn.functional as F
    from cases_util import check_op
    m = mesh()
    x, y = randn(2, 2, 1, seed=6), randn(2, 1, 2, seed=7)
    for ext in ([0, 1, 1], [1, 1, 0]):
        check_op(lambda a, b: torch.tensordot(a, b, dims=([0, 1], [2, 0])), [x, y], [None, ([st.Shard(2)], {0: ext})],
                 m, what=f"tensordot {ext}")
    shapes = dict(q=(3, 2), k=(3, 2), v=(3, 2), w_in=(6, 2), b_in=(6,), bias_k=(2,), bias_v=(2,), w_out=(2, 2),
                  b_out=(2,))
    ts = [randn(*s, seed=10 + i) for i, s in enumerate(shapes.values())]
    lays = [([st.Shard(t.dim() - 1)], {0: [1, 1, 0] if t.shape[-1] == 2 else [2, 2, 2]}) for t in ts]

    def mha(q, k, v, w_in, b_in, bias_k, bias_v, w_out, b_out):
        return F.multi_head_attention_forward(q, k, v, 2, 1, w_in, b_in, bias_k, bias_v, False, 0.0, w_out, b_out,
                                              training=False)[0]
    check_op(mha, ts, lays, m, what="multi_head_attention_forward, every tensor split")
    return True


def test_stride_branching_composites():
    harness.run(3, case_stride_branching_composites)
