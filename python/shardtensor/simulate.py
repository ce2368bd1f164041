"""Simulation mode: this one process is rank ``r`` of a ``P``-rank world.

``st.simulate(rank, world)`` initialises torch's fake process group (backend ``"fake"``: collectives complete at
once and move no data) and a DeviceMesh on it, so the library runs unchanged as rank ``r``: its local tensors have
exactly the shapes rank ``r`` would hold, it issues exactly the collectives rank ``r`` would issue (counted by
``st.CommCounter``), and it allocates what rank ``r`` would allocate. Every *value* it computes is garbage by
design (nothing arrives from other ranks); the mode warns once and ``st.simulating()`` says so.

Two kinds of local tensors:

- ``device="cpu"``: real CPU tensors of the shard's size. Per-rank peak memory (``st.peak_memory``) and the local
  compute time are measured; this needs the shard to fit in memory.
- ``device="meta"``: meta-backed fake tensors (``torch._subclasses.FakeTensor``, reporting the CPU device so the
  library dispatches exactly as in a CPU run). Nothing is allocated and nothing is computed: shapes, FLOPs, bytes
  sent and an allocation-tracked memory estimate (the bytes the fake storages would hold, live, and their peak) at
  any size. Every factory inside the simulation creates fake tensors, so a model built inside it holds no memory.

What cannot work without other ranks' values raises ``NotImplementedError`` (``SimulationError`` from Python) with
the remedy: ``from_local(..., sharding_shapes="infer")`` (give ``"even"`` with ``global_shape`` or explicit
extents), ``scatter_tensor`` on a non-source rank that passes no tensor (pass the tensor or a stand-in of its
shape and dtype, e.g. ``torch.empty(shape, device="meta")``), ``torch.equal`` / ``torch.allclose`` of ShardTensors,
and, with ``device="meta"``, anything that reads tensor values (``.item()``, ``bool()``, ``nonzero``, masks).
``.item()`` under ``device="cpu"`` returns a garbage number: never branch on it. See docs/simulation.md.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import _C
from .local_ops import LocalOpMode, SimulationError

__all__ = ["simulate", "simulating", "Simulation", "SimulationWarning", "SimulationError", "current_simulation"]


class SimulationWarning(UserWarning):
    """Issued when a simulation starts: its values are garbage by design."""


_current: Optional["Simulation"] = None


def simulating() -> bool:
    """True inside ``st.simulate(...)``: this process is one simulated rank and every value is garbage."""
    return _current is not None


def current_simulation() -> Optional["Simulation"]:
    """The active ``Simulation`` (None outside one)."""
    return _current


class Simulation:
    """The context ``st.simulate`` returns. Attributes: ``rank``, ``world``, ``device`` ("cpu" or "meta"),
    ``mesh`` (the DeviceMesh over the fake process group), ``fake_mode`` (the FakeTensorMode of a meta simulation,
    else None) and ``local_mode`` (the mode that makes factories fake and tallies their bytes; None on "cpu")."""

    def __init__(self, rank: int, world: int, mesh_shape: Optional[Sequence[int]] = None,
                 mesh_dim_names: Optional[Sequence[str]] = None, device: str = "cpu", warn: bool = True):
        if device not in ("cpu", "meta"):
            raise ValueError(f"simulate: device must be 'cpu' (real local tensors of the shard's size) or 'meta' "
                             f"(fake tensors, nothing allocated), got {device!r}")
        world, rank = int(world), int(rank)
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"simulate: rank must be in [0, world) with world >= 1, got rank {rank} of {world}")
        mesh_shape = (world,) if mesh_shape is None else tuple(int(s) for s in mesh_shape)
        prod = 1
        for s in mesh_shape:
            prod *= s
        if prod != world:
            raise ValueError(f"simulate: mesh_shape {mesh_shape} holds {prod} ranks, not world={world}")
        if mesh_dim_names is None:
            mesh_dim_names = ("domain",) if len(mesh_shape) == 1 else tuple(f"dim{i}" for i in range(len(mesh_shape)))
        self.rank, self.world, self.device = rank, world, device
        self.mesh_shape, self.mesh_dim_names = mesh_shape, tuple(mesh_dim_names)
        self.warn = warn
        self.mesh = None
        self.fake_mode = None
        self.local_mode = None
        self._previous_flag = None

    # ---- lifetime ---------------------------------------------------------------------------------------------
    def __enter__(self) -> "Simulation":
        global _current
        if _current is not None:
            raise RuntimeError("simulate: a simulation is already active (one simulated rank per process at a time)")
        if dist.is_initialized():
            raise RuntimeError("simulate: a process group is already initialised; a simulation needs its own fake "
                               "world (run it in a process without init_process_group, or destroy that group first)")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=self.rank, world_size=self.world, store=FakeStore())
        try:
            self.mesh = init_device_mesh("cpu", self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
        except Exception:
            dist.destroy_process_group()
            raise
        self._previous_flag = _C.set_simulating(True)
        _current = self
        if self.device == "meta":
            from torch._subclasses.fake_tensor import FakeTensorMode
            # Real tensors meeting fake ones (a model built before the simulation, host metadata) are treated as
            # fake of the same shape: nothing is copied.
            self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            self.local_mode = LocalOpMode(fake=self.fake_mode)
            self.local_mode.__enter__()
        if self.warn:
            warnings.warn(f"shardtensor.simulate: this process is rank {self.rank} of {self.world} over a fake process "
                          "group that moves no data; every value computed is garbage by design (shapes, FLOPs, bytes "
                          f"sent and memory are rank {self.rank}'s)" +
                          ("; local tensors are fake (nothing allocated or computed)" if self.device == "meta" else ""),
                          SimulationWarning, stacklevel=3)
        return self

    def __exit__(self, *exc):
        global _current
        try:
            if self.local_mode is not None:
                self.local_mode.__exit__(*exc)
        finally:
            self.local_mode = None
            self.fake_mode = None
            _current = None
            _C.set_simulating(bool(self._previous_flag))
            if dist.is_initialized():
                dist.destroy_process_group()
        return False

    # ---- helpers ----------------------------------------------------------------------------------------------
    @property
    def coordinate(self) -> tuple:
        """This rank's coordinate on the mesh."""
        return tuple(self.mesh.get_coordinate())

    def local_shape(self, global_shape: Sequence[int], placements, sharding_shapes=None) -> tuple:
        """The local shape this rank holds of a tensor of ``global_shape`` laid out by ``placements`` (default split,
        or explicit ``sharding_shapes``)."""
        from . import _shapes
        from .placement import normalize_placements
        pl = normalize_placements(placements, len(self.mesh_shape))
        extents = _shapes(sharding_shapes, pl) if sharding_shapes is not None else {}
        shape = list(int(s) for s in global_shape)
        coord = self.coordinate
        for m, p in enumerate(pl):
            if not p.is_shard():
                continue
            d = p.dim % len(shape)
            ext = extents.get(m)
            if ext:
                shape[d] = ext[coord[m]]
            else:
                # torch.tensor_split's sizes (the first n % k parts one longer), computed for this coordinate only:
                # no tensor per rank (each would be a fake-tensor op under a meta simulation).
                base, extra = divmod(shape[d], self.mesh_shape[m])
                shape[d] = base + (1 if coord[m] < extra else 0)
        return tuple(shape)

    def shard(self, global_shape: Sequence[int], placements, dtype=torch.float32, sharding_shapes=None,
              requires_grad: bool = False) -> torch.Tensor:
        """A ShardTensor of ``global_shape`` laid out by ``placements`` whose local tensor is this rank's part:
        random on ``device="cpu"``, fake on ``"meta"`` (only this rank's shard is ever created)."""
        from . import from_local
        from .placement import normalize_placements
        pl = normalize_placements(placements, len(self.mesh_shape))
        local_shape = self.local_shape(global_shape, pl, sharding_shapes)
        local = torch.randn(local_shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(local_shape, dtype=dtype)
        out = from_local(local, self.mesh, pl, sharding_shapes=sharding_shapes if sharding_shapes is not None
                         else "even", global_shape=tuple(global_shape))
        return out.requires_grad_(requires_grad) if requires_grad else out

    @contextlib.contextmanager
    def real(self):
        """Inside a meta simulation, create real tensors again (e.g. small host data the code must read)."""
        mode = self.local_mode
        if mode is None:
            yield
            return
        from torch.utils._python_dispatch import _pop_mode_temporarily
        with _pop_mode_temporarily():
            yield

    def live_bytes(self) -> Optional[int]:
        """Meta simulation: bytes the live fake storages would hold now (None on "cpu")."""
        return None if self.local_mode is None else self.local_mode.live_bytes


def simulate(rank: int, world: int, mesh_shape: Optional[Sequence[int]] = None,
             mesh_dim_names: Optional[Sequence[str]] = None, device: str = "cpu", warn: bool = True) -> Simulation:
    """Run this process as rank ``rank`` of ``world`` over torch's fake process group (see the module docstring)::

        with st.simulate(rank=3, world=16) as sim:          # or device="meta" for sizes that do not fit
            x = sim.shard((1, 3, 4096, 4096), [st.Shard(2)])  # this rank's rows only
            model = MyViT()                                  # inside a meta simulation: fake parameters
            with st.RankStats() as s:
                model(x).square().mean().backward()
            print(s.flops, s.comm_bytes, s.peak_bytes)

    ``mesh_shape`` (default ``(world,)``) and ``mesh_dim_names`` (default ``("domain",)`` for 1-D) shape
    ``sim.mesh``. Needs a process without a process group; one simulation at a time."""
    return Simulation(rank, world, mesh_shape, mesh_dim_names, device, warn)
