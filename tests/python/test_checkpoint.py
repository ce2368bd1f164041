"""torch.distributed.checkpoint (DCP) with ShardTensors: every rank writes only its shard (uneven and zero
extents, replicated copies once); a checkpoint reloads into another layout, other extents, a 2-D mesh and other
rank counts (1-4); plain-parameter models and their optimizer state checkpoint with ordinary DCP after a
domain-parallel step; Partial values are refused on every rank."""
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import harness
import shardtensor as st
from cases_util import close, mesh, randn, tiny_extents, uneven_extents

FIELD = (7, 5)
VOLUME = (6, 4, 3)


def saved_values():
    return {"field": randn(*FIELD, seed=11), "volume": randn(*VOLUME, seed=12), "scale": randn(3, seed=13),
            "bias": randn(4, seed=14)}


def case_save(path, two_d):
    """Save sharded (uneven, a zero extent on 3+ ranks), replicated and plain values."""
    v = saved_values()
    w = dist.get_world_size()
    if two_d:
        m = mesh((2, 2), ("a", "b"))
        field = st.distribute_tensor(v["field"], m, [st.Shard(0), st.Shard(1)], {0: [5, 2], 1: [0, 5]})
        volume = st.distribute_tensor(v["volume"], m, [st.Replicate(), st.Shard(2)], {1: [1, 2]})
        scale = st.distribute_tensor(v["scale"], m, [st.Replicate(), st.Replicate()])
    else:
        m = mesh()
        field = st.distribute_tensor(v["field"], m, [st.Shard(0)], {0: tiny_extents(FIELD[0], w)})
        volume = st.distribute_tensor(v["volume"], m, [st.Shard(1)], {0: uneven_extents(VOLUME[1], w, 2)})
        scale = st.distribute_tensor(v["scale"], m, [st.Replicate()])
    with st.CommCounter() as c:
        dcp.save({"field": field, "nested": {"volume": volume, "scale": scale}, "bias": v["bias"]},
                 checkpoint_id=path)
    # DCP's own planning and barrier only: no all-gather of any shard.
    assert "all_gather" not in c.calls, c.calls
    return True


def case_load(path, layout):
    """Reload into ShardTensors of another layout (and into plain tensors); values equal the saved ones."""
    v = saved_values()
    w = dist.get_world_size()
    if layout == "2d":
        m = mesh((2, 2), ("a", "b"))
        field = st.distribute_tensor(torch.zeros(FIELD), m, [st.Shard(1), st.Shard(0)], {0: [1, 4], 1: [6, 1]})
        volume = st.distribute_tensor(torch.zeros(VOLUME), m, [st.Shard(0), st.Replicate()])
        scale = st.distribute_tensor(torch.zeros(3), m, [st.Shard(0), st.Replicate()], {0: [0, 3]})
    else:
        m = mesh()
        field = st.distribute_tensor(torch.zeros(FIELD), m, [st.Shard(1)], {0: uneven_extents(FIELD[1], w, 7)})
        volume = st.distribute_tensor(torch.zeros(VOLUME), m, [st.Shard(0)], {0: tiny_extents(VOLUME[0], w)})
        scale = st.distribute_tensor(torch.zeros(3), m, [st.Shard(0)])
    field_before = field
    bias = torch.zeros(4)
    state = {"field": field, "nested": {"volume": volume, "scale": scale}, "bias": bias}
    dcp.load(state, checkpoint_id=path)
    assert state["field"] is field_before, "loaded in place"
    close(field.full_tensor(), v["field"], what="field")
    close(volume.full_tensor(), v["volume"], what="volume")
    close(scale.full_tensor(), v["scale"], what="scale")
    close(bias, v["bias"], what="plain")
    # The plain tensor loads wholly into a plain target as well.
    plain = {"field": torch.zeros(FIELD)}
    dcp.load(plain, checkpoint_id=path)
    close(plain["field"], v["field"], what="field into a plain tensor")
    return True


@pytest.fixture(scope="module")
def saved_1d(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "one_d")
    harness.run(2, case_save, path, False)
    return path


@pytest.mark.parametrize("world", [1, 2, 3])
def test_save_2_ranks_load_other_layouts(saved_1d, world):
    harness.run(world, case_load, saved_1d, "1d")


def test_save_1d_load_2d(saved_1d):
    harness.run(4, case_load, saved_1d, "2d")


def test_save_2d_mesh_load_1d(tmp_path):
    path = str(tmp_path / "two_d")
    harness.run(4, case_save, path, True)
    harness.run(3, case_load, path, "1d")


# ---- models ----

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.norm = torch.nn.GroupNorm(2, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)).movedim(1, -1))


def make_net():
    torch.manual_seed(0)
    return Net()


def case_model_save(path):
    """One domain-parallel Adam step on a height-sharded image, then DCP save of model and optimizer."""
    m = mesh()
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    x = st.distribute_tensor(randn(1, 2, 9, 6, seed=3), m, [st.Shard(2)], {0: uneven_extents(9, m.size(), 4)})
    net(x).square().mean().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return {k: t.detach().clone() for k, t in net.state_dict().items()}


def case_model_load(path, expected):
    """A fresh model and optimizer on another rank count get the saved weights and Adam state; the next step
    matches the single-device step from the same state."""
    net, ref = make_net(), make_net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    for model, optim in ((net, opt), (ref, ref_opt)):
        model(torch.zeros(1, 2, 4, 4)).sum().backward()   # materialise the Adam state to load into
        optim.step()
        optim.zero_grad()
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for k, t in net.state_dict().items():
        close(t, expected[k], what=f"loaded {k}")
    m = mesh()
    full = randn(1, 2, 9, 6, seed=8)
    net(st.distribute_tensor(full, m, [st.Shard(3)])).square().mean().backward()
    ref(full).square().mean().backward()
    opt.step()
    ref_opt.step()
    for (k, a), b in zip(net.named_parameters(), ref.parameters()):
        close(a, b, what=f"step after load {k}")
    return True


def test_plain_parameter_model_and_optimizer(tmp_path):
    path = str(tmp_path / "model")
    expected = harness.run(2, case_model_save, path)[0]
    harness.run(3, case_model_load, path, expected)


def case_sharded_parameter(path):
    """A module whose parameter is a ShardTensor (a sharded field it learns): model.state_dict() through DCP."""
    m = mesh()
    mod = torch.nn.Module()
    mod.field = torch.nn.Parameter(st.distribute_tensor(randn(5, 4, seed=9), m, [st.Shard(0)],
                                                        {0: tiny_extents(5, m.size())}))
    dcp.save(mod.state_dict(), checkpoint_id=path)
    other = torch.nn.Module()
    other.field = torch.nn.Parameter(st.distribute_tensor(torch.zeros(5, 4), m, [st.Shard(1)]))
    dcp.load(other.state_dict(), checkpoint_id=path)
    close(other.field.full_tensor(), randn(5, 4, seed=9), what="sharded parameter")
    assert st.placements(other.field) == (st.Shard(1),)
    return True


def test_sharded_parameter(tmp_path):
    harness.run(3, case_sharded_parameter, str(tmp_path / "param"))


def case_partial_refused(path):
    m = mesh()
    total = st.distribute_tensor(randn(4, 3), m, [st.Shard(0)]).sum(0)   # Partial(sum)
    dcp.save({"total": total}, checkpoint_id=path)


def test_partial_refused_on_every_rank(tmp_path):
    harness.expect_error(2, case_partial_refused, str(tmp_path / "partial"), match="Partial",
                         kinds=("CheckpointException",))


# ---- st.checkpoint.save / load: fresh directories and a pointer (issue 30 item 3) ----

def case_checkpoint_helper(root):
    """Two saves, a third that fails on one rank mid-save: the pointer names the second, loading the root gives its
    values, loading the failed directory raises on every rank; a save into an existing directory is refused."""
    import os
    m = mesh()
    w = dist.get_world_size()
    values = [randn(*FIELD, seed=40 + i) for i in range(3)]

    def state(i):
        return {"field": st.distribute_tensor(values[i], m, [st.Shard(0)], {0: uneven_extents(FIELD[0], w, 4)})}

    first = st.checkpoint.save(state(0), root)
    second = st.checkpoint.save(state(1), root)
    assert os.path.basename(first) == "step-1" and os.path.basename(second) == "step-2", (first, second)
    assert st.checkpoint.latest(root) == second
    # A rank fails while writing its files: DCP raises on every rank; nothing is marked or pointed at.
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    original = FileSystemWriter.write_data

    def failing(self, plan, planner):
        if dist.get_rank() == w - 1:
            raise OSError("disk full (simulated)")
        return original(self, plan, planner)

    FileSystemWriter.write_data = failing
    try:
        st.checkpoint.save(state(2), root)
    except BaseException as e:   # noqa: BLE001  (DCP's CheckpointException is a BaseException)
        failed = type(e).__name__
    else:
        failed = None
    finally:
        FileSystemWriter.write_data = original
    assert failed, "the failing save returned"
    assert st.checkpoint.latest(root) == second
    into = {"field": st.distribute_tensor(torch.zeros(FIELD), m, [st.Shard(1)])}
    assert st.checkpoint.load(into, root) == second
    close(into["field"].full_tensor(), values[1], what="latest complete checkpoint")
    assert st.checkpoint.load(into, first) == first
    close(into["field"].full_tensor(), values[0], what="an older complete checkpoint")
    errors = []
    for bad in (os.path.join(root, "step-3"), os.path.join(root, "nowhere")):
        try:
            st.checkpoint.load(into, bad)
        except ValueError as e:
            errors.append(str(e))
    try:
        st.checkpoint.save(state(0), root, "step-2")
    except ValueError as e:
        errors.append(str(e))
    assert len(errors) == 3 and "not a complete checkpoint" in errors[0] and "no checkpoint" in errors[1] \
        and "exists" in errors[2], errors
    return failed, errors


def test_checkpoint_save_is_all_or_nothing(tmp_path):
    for world in (2, 3):
        results = harness.run(world, case_checkpoint_helper, str(tmp_path / f"w{world}"))
        assert all(r == results[0] for r in results), results   # the same errors on every rank
