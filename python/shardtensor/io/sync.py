"""Agreement and barriers over a whole mesh with torch.distributed, for file I/O that can fail on one rank.

A file that one rank cannot open (a path that is not shared, a full disk) must not leave the other ranks waiting
in the next collective: every step that can fail is followed by ``agree``, one small all-reduce per mesh dim that
tells every rank which ranks failed, and then every rank raises. The same call is the barrier between a rank
creating a file and the others writing into it. The mesh's own per-dim process groups are used (a group over the
whole mesh would need ``new_group``, a collective over the world); reducing along each mesh dim in turn reduces
over the whole mesh, and a rank returns only after every rank of the mesh has entered.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def mesh_groups(mesh, what: str) -> list:
    """The process group of every mesh dim (a DeviceMesh is needed: a mesh built in C++ has no Python groups)."""
    if not hasattr(mesh, "get_group"):
        raise TypeError(f"{what}: needs the torch DeviceMesh of the ShardTensor (a mesh built in C++ has no "
                        "Python process groups to synchronise the writers with)")
    return [mesh.get_group(d) for d in range(mesh.ndim)]


def _flag_device(group, mesh) -> torch.device:
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend or mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def _flat_index(mesh) -> int:
    coordinate, index = mesh.get_coordinate(), 0
    for c, s in zip(coordinate, mesh.mesh.shape):
        index = index * int(s) + int(c)
    return index


class Progress:
    """Which ranks of the mesh finished which step of one collective I/O call, recorded in the job's c10d store (the
    rendezvous store, reached by every rank) so that a rank whose peer died mid-call can name the peer instead of
    repeating the transport's error. Best effort: without a reachable store (or once rank 0, which hosts a TCP store,
    is gone) the peers stay unnamed."""

    _calls = 0

    def __init__(self, mesh, what: str):
        Progress._calls += 1        # every rank makes the same collective I/O calls in the same order
        self.prefix = f"shardtensor/io/{Progress._calls}/"
        self.ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001
            self.store = None

    def done(self, step: int) -> None:
        if self.store is not None:
            try:
                self.store.set(f"{self.prefix}{step}/{dist.get_rank()}", "1")
            except Exception:  # noqa: BLE001
                self.store = None

    def missing(self, step: int):
        """The global ranks that did not finish ``step``, or None when the store cannot tell."""
        if self.store is None:
            return None
        try:
            return [r for r in self.ranks if not self.store.check([f"{self.prefix}{step}/{r}"])]
        except Exception:  # noqa: BLE001
            return None

    def forget(self, steps: int) -> None:
        if self.store is None:
            return
        for step in range(steps):
            try:
                self.store.delete_key(f"{self.prefix}{step}/{dist.get_rank()}")
            except Exception:  # noqa: BLE001
                return


def identity_digest(identity) -> int:
    """A digest in [0, 2^62) of a tuple of ints and strings, the same in every process (unlike ``hash``)."""
    import hashlib
    h = hashlib.blake2b(repr(tuple(identity)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 62) - 1)


def _reduce(tensor, groups, op, what, progress: Optional[Progress], step: int):
    """``all_reduce`` over every mesh dim; a failed collective (a peer died or left: the transport's error) raises
    a RuntimeError naming the call and, when the store can tell, the ranks that stopped."""
    try:
        for g in groups:
            dist.all_reduce(tensor, op=op, group=g)
    except RuntimeError as e:
        gone = progress.missing(step) if progress is not None else None
        who = f"rank(s) {gone} of the mesh (global ranks)" if gone else "a peer rank of the mesh"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"{what}: {who} stopped before finishing (it died or left the job), so this rank cannot "
                           f"complete the call; nothing was published. (The collective with it failed: {first})") \
            from e


def agree(mesh, failure: Optional[BaseException], what: str, progress: Optional[Progress] = None, step: int = 0,
          identity=None) -> None:
    """Collective over every rank of ``mesh``: returns when no rank failed; otherwise raises on every rank, the
    failing ranks their own exception, the others a ``RuntimeError`` naming the failed ranks and the first error.
    Also a barrier: no rank returns before every rank of the mesh has called it. ``progress``/``step``: marks this
    rank done with ``step`` first, so peers can name a rank that died. ``identity``: a tuple describing what this
    rank read (e.g. a file's inode, size and modification time); ranks whose identities differ raise ``ValueError``
    on every rank."""
    groups = mesh_groups(mesh, what)
    device = _flag_device(groups[0], mesh)
    if progress is not None:
        progress.done(step)
    failed = torch.zeros(mesh.mesh.numel(), dtype=torch.int32, device=device)
    if failure is not None:
        failed[_flat_index(mesh)] = 1
    _reduce(failed, groups, dist.ReduceOp.SUM, what, progress, step)
    ranks = [int(r) for r, f in zip(mesh.mesh.flatten().tolist(), failed.tolist()) if f]
    if not ranks:
        if identity is not None:
            d = identity_digest(identity)
            both = torch.tensor([d, -d], dtype=torch.int64, device=device)
            _reduce(both, groups, dist.ReduceOp.MIN, what, progress, step)
            if int(both[0]) != -int(both[1]):
                raise ValueError(f"{what}: the ranks read different versions of the file (its inode, size, "
                                 "modification time or header differ between ranks: it was replaced or modified "
                                 "while they read it), so their slabs would mix two versions; read it again when "
                                 "no one is writing it")
        return
    # Every rank knows the same list, so every rank takes this path: the failed ranks' messages travel too.
    mine = [] if failure is None else [(dist.get_rank(), f"{type(failure).__name__}: {failure}")]
    for g in groups:
        gathered = [None] * dist.get_world_size(g)
        dist.all_gather_object(gathered, mine, group=g)
        mine = [m for part in gathered for m in part]
    if failure is not None:
        raise failure
    rank, first = min(mine)
    raise RuntimeError(f"{what} failed on rank(s) {ranks} of the mesh (global ranks); rank {rank}: {first}")
