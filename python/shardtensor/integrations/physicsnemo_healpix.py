"""PhysicsNeMo's HEALPix padding (``physicsnemo.nn.module.hpx.padding.HEALPixPadding``, DLWP-HEALPix's padded
convolutions) on a split sphere.

The padding surrounds each of the 12 faces (folded into the batch: ``(B * 12, C, H, W)``) with ``p`` rows and
columns of its eight neighbours, rotated and flipped where the faces meet at an angle, the two missing corners of
the equatorial faces averaged from two neighbours. Op by op on a ShardTensor (split along H, W or the folded faces)
that is some 300 small collectives per call: a split, slice, ``rot90`` and ``cat`` per face and strip, and corner
patches written row by row. Every output element is either one input element or the mean of two, the same for every
sample and channel, so ``HEALPixPadding.forward`` is routed here (``st.register_function``) and runs as one gather:

- the map (which input elements each output element reads) is taken from the module's own code, run once per face
  size on two encodings of the element indices (``i + 1`` and ``(i + 1)**2``: a copy reads back a square, a mean of
  two sources ``u``, ``v`` gives ``(u + v) / 2`` and ``(u**2 + v**2) / 2``, from which both are recovered exactly in
  float64) and checked against the module on random data, so a map that is not such a gather is never used (the
  module's own body runs then);
- each rank's output block is its input block copied into the face interiors (what the single-device ``cat`` does)
  plus the border strips, read from a table of the input elements they name: the rank's own, and the others' from
  their owners in one peer exchange (point-to-point messages only between the ranks that hold a strip's elements
  and the ranks that read them; every rank knows every message's size from the map and the layout, so nothing is
  negotiated). The backward is the same exchange the other way (autograd of the peer exchange).

The output is split like the input along the same dims; along H or W the first and last coordinates also hold the
padding rows at the faces' edges (a rank's interior rows stay where its input rows were, so the next "valid"
convolution's output has the input's extents). Any of the faces, H and W may be split, each by one mesh dim (a 2-D
decomposition of every face on a 2-D mesh: one peer exchange per split mesh dim, an element that crosses both
travelling through the rank that shares the owner's coordinate on the first and the reader's on the second); other
mesh dims may split the channels or replicate. A dim split by two mesh dims runs the module's own body on the
ShardTensor (correct, op by op).
"""
from __future__ import annotations

import itertools
import threading

import torch

from .. import _C
from ..mesh import as_cpp_mesh
from ..ring import completed
from .. import device_mesh, from_local, is_shard_tensor, placements, sharding_shapes, to_local

_FACES = 12
_lock = threading.Lock()
_maps: dict = {}    # (module type, p, nhwc, H, W) -> _FaceMap or None (not a gather)
_plans: dict = {}   # layout -> _Plan


def install(module) -> None:
    """Route ``HEALPixPadding.forward`` of the imported ``physicsnemo.nn.module.hpx.padding``."""
    from ..functions import register_function
    register_function(module.HEALPixPadding.forward, padding_forward_sharded)


class _FaceMap:
    """The border of one sample's padded faces ``(12, H + 2p, W + 2p)``: each border element's position and the
    flat indices into ``(12, H, W)`` of the one or two input elements it reads (-1: none) with their weights. The
    interior ``[p:p+H, p:p+W]`` of every padded face is its own face."""

    def __init__(self, pos, src1, src2, w1, w2):
        self.pos, self.src1, self.src2, self.w1, self.w2 = pos, src1, src2, w1, w2


def _face_map(pad, H: int, W: int):
    p = pad.p
    key = (type(pad), p, bool(getattr(pad, "enable_nhwc", False)), H, W)
    with _lock:
        if key in _maps:
            return _maps[key]
    found = _derive_face_map(pad, H, W)
    with _lock:
        _maps[key] = found
    return found


def _derive_face_map(pad, H: int, W: int):
    p, n = pad.p, _FACES * H * W
    if 2 * n * n >= 2 ** 53:  # the squares must be exact in float64
        return None
    body = type(pad).forward  # inside the handler: the module's own body
    with torch.no_grad():
        code = torch.arange(1, n + 1, dtype=torch.float64).reshape(_FACES, 1, H, W)
        try:
            e1 = body(pad, code).reshape(_FACES, H + 2 * p, W + 2 * p)
            e2 = body(pad, code * code).reshape(_FACES, H + 2 * p, W + 2 * p)
        except Exception:  # noqa: BLE001 - not a padding this routing understands: the body runs (and raises)
            return None
        border = torch.ones(H + 2 * p, W + 2 * p, dtype=torch.bool)
        border[p:p + H, p:p + W] = False
        border = border.expand(_FACES, -1, -1)
        interior = e1[:, p:p + H, p:p + W]
        if not torch.equal(interior, code.reshape(_FACES, H, W)) or not torch.equal(
                e2[:, p:p + H, p:p + W], interior * interior):
            return None
        pos = border.nonzero()                          # [K, 3]: face, row, column of the padded faces
        a, b = e1[border], e2[border]
        single = b == a * a                             # a copy (or nothing: a == 0)
        s, q = 2 * a, 2 * b                             # u + v and u**2 + v**2 of a mean of two
        disc = torch.where(single, torch.zeros_like(s), 2 * q - s * s)
        if bool((disc < 0).any()):
            return None
        d = disc.sqrt()
        u = torch.where(single, a, (s + d) / 2)
        v = torch.where(single, torch.zeros_like(a), (s - d) / 2)
        if not (torch.equal(u, u.round()) and torch.equal(v, v.round())):
            return None
        src1, src2 = u.long() - 1, v.long() - 1         # -1: no source (a zero, or half of one source)
        w1 = torch.where(single, 1.0, 0.5).to(torch.float64)
        w2 = torch.where(single, 0.0, 0.5).to(torch.float64)
        fmap = _FaceMap(pos, src1, src2, w1, w2)
        # The map must reproduce the module on data (two samples, two channels: per-sample, per-channel alike).
        g = torch.Generator().manual_seed(0)
        probe = torch.randn(2 * _FACES, 2, H, W, generator=g, dtype=torch.float64)
        try:
            want = body(pad, probe)
        except Exception:  # noqa: BLE001
            return None
        got = _assemble_whole(probe, fmap, p)
        if got.shape != want.shape or not torch.equal(got, want):
            return None
    return fmap


def _assemble_whole(x, fmap, p):
    """The padding of a plain ``(B * 12, C, H, W)`` tensor by the map (the probe's check)."""
    BF, C, H, W = x.shape
    out = x.new_zeros(BF, C, H + 2 * p, W + 2 * p)
    out[:, :, p:p + H, p:p + W] = x
    flat = torch.cat([x.reshape(BF // _FACES, _FACES, C, H * W).transpose(1, 2).reshape(BF // _FACES, C, -1),
                      x.new_zeros(BF // _FACES, C, 1)], dim=2)
    s1 = torch.where(fmap.src1 < 0, _FACES * H * W, fmap.src1)
    s2 = torch.where(fmap.src2 < 0, _FACES * H * W, fmap.src2)
    vals = flat[:, :, s1] * fmap.w1.to(x.dtype) + flat[:, :, s2] * fmap.w2.to(x.dtype)   # [B, C, K]
    f, r, c = fmap.pos.unbind(1)
    for b in range(BF // _FACES):
        out[b * _FACES + f, :, r, c] = vals[b].transpose(0, 1)
    return out


class _Stage:
    """One peer exchange along mesh dim ``m``: what this rank sends to each coordinate (rows of its current table:
    local coordinates into its block at the first stage, row indices after), how many elements it receives from
    each, and which rows of its current table it keeps (the elements its own coordinate owns)."""

    def __init__(self, m, me, send, recv, own):
        self.m, self.me, self.send, self.recv, self.own = m, me, send, recv, own

    def pieces(self):
        """The rows of the table after this stage, by coordinate (the own rows at this rank's)."""
        return [_count(self.own) if s == self.me else k for s, k in enumerate(self.recv)]


def _count(idx):
    return int(idx[0].numel() if isinstance(idx, tuple) else idx.numel())


class _Plan:
    """One rank's part of a sharded padding: its output block's shape and interior, the stages that bring every
    element its border reads to it, and each border element's rows in the last table (a zero row appended)."""


def _make_plan(fmap, p, BF, H, W, splits, me):
    """``splits``: per mesh dim that splits the field, in mesh-dim order, ``(mesh dim, axis, extents)`` with ``axis``
    0 (the folded faces), 1 (H) or 2 (W) of ``(BF, H, W)``; ``me``: this rank's coordinates on those mesh dims.

    An element travels from its owner to a reader one split mesh dim at a time, the last mesh dim first: after the
    stage of mesh dim k it sits on the rank with the owner's coordinates before k and the reader's from k on. Every
    rank derives every rank's needs from the map and the layout, so all message sizes are known without asking."""
    K, me = len(splits), tuple(me)
    Hp, Wp = H + 2 * p, W + 2 * p
    axes = [a for _, a, _ in splits]
    sizes_out = (BF, Hp, Wp)
    ext_out, starts_in, starts_out, ends_in = [], [], [], []
    for _, axis, ext in splits:
        n = len(ext)
        eo = list(ext) if axis == 0 else [e + p * (c == 0) + p * (c == n - 1) for c, e in enumerate(ext)]
        assert sum(eo) == sizes_out[axis]
        ext_out.append(eo)
        starts_in.append([sum(ext[:c]) for c in range(n)])
        starts_out.append([sum(eo[:c]) for c in range(n)])
        ends_in.append(torch.tensor([sum(ext[:c + 1]) for c in range(n)]))
    B = BF // _FACES
    K0 = fmap.pos.shape[0]
    # The border of every sample: positions (bf, row, col) in the global output, sources flat in (BF, H, W).
    sample = torch.arange(B).repeat_interleave(K0)
    pos = fmap.pos.repeat(B, 1)
    pos[:, 0] += sample * _FACES
    base = sample * (_FACES * H * W)
    src1, src2 = fmap.src1.repeat(B), fmap.src2.repeat(B)
    src1 = torch.where(src1 < 0, src1, src1 + base)
    src2 = torch.where(src2 < 0, src2, src2 + base)
    w1, w2 = fmap.w1.repeat(B), fmap.w2.repeat(B)

    def coords(flat):  # (bf, h, w) of flat sources
        return torch.stack([flat // (H * W), flat // W % H, flat % W], 1)

    def owners(flat):  # [M, K]: the owning coordinate on every split mesh dim
        c = coords(flat)
        return torch.stack([torch.bucketize(c[:, a].contiguous(), ends_in[k], right=True) for k, a in enumerate(axes)],
                           1) if flat.numel() else torch.zeros(0, K, dtype=torch.long)

    def reading(r):  # mask of reader r's border positions
        mask = torch.ones(pos.shape[0], dtype=torch.bool)
        for k, a in enumerate(axes):
            lo = starts_out[k][r[k]]
            mask &= (pos[:, a] >= lo) & (pos[:, a] < lo + ext_out[k][r[k]])
        return mask

    readers = list(itertools.product(*[range(len(ext)) for _, _, ext in splits]))
    need = {}
    for r in readers:
        mask = reading(r)
        a, b = src1[mask], src2[mask]
        need[r] = torch.cat([a[a >= 0], b[b >= 0]]).unique()

    def needed(k, rk):
        """Sources needed by the readers with coordinate ``rk`` on mesh dim k and this rank's after it, whose owners
        share this rank's coordinates before k and on k ... (filtered by the caller), with their owners."""
        sets = [need[r] for r in readers if r[k] == rk and r[k + 1:] == me[k + 1:]]
        e = torch.cat(sets).unique() if sets else torch.zeros(0, dtype=torch.long)
        o = owners(e)
        keep = (o[:, :k] == torch.tensor(me[:k], dtype=torch.long)).all(1)
        return e[keep], o[keep]

    offset = [0, 0, 0]
    for k, a in enumerate(axes):
        offset[a] = starts_in[k][me[k]]

    def lookup(table):
        """Where each of the sources ``e`` sits in ``table``: local coordinates of the block (no table yet: the
        first stage) or row indices, a source of -1 at the row after the table (the zero row the forward appends)."""
        if table is None:
            return lambda e: (coords(e) - torch.tensor(offset)).unbind(1)
        order, n_rows = table.argsort(), table.numel()
        keys = table[order]

        def rows(e):
            if n_rows == 0:  # nothing read from anywhere (every source is "none"): the zero row
                return torch.full_like(e, n_rows)
            at = torch.searchsorted(keys, e.clamp(min=0)).clamp(max=n_rows - 1)
            return torch.where(e < 0, n_rows, order[at])
        return rows

    table = None
    stages = []
    for k in reversed(range(K)):
        m, n = splits[k][0], len(splits[k][2])
        find = lookup(table)
        send = []
        for q in range(n):
            if q == me[k]:
                send.append(None)
                continue
            e, o = needed(k, q)
            send.append(find(e[o[:, k] == me[k]]))
        e, o = needed(k, me[k])
        pieces = [e[o[:, k] == s] for s in range(n)]
        recv = [int(t.numel()) if s != me[k] else 0 for s, t in enumerate(pieces)]
        stages.append(_Stage(m, me[k], send, recv, find(pieces[me[k]])))
        table = torch.cat(pieces)
    plan = _Plan()
    plan.stages = stages
    plan.ext_out = {splits[k][0]: ext_out[k] for k in range(K)}
    mask = reading(me)
    rows = lookup(table)

    plan.i1, plan.i2 = rows(src1[mask]), rows(src2[mask])
    plan.w1, plan.w2 = w1[mask], w2[mask]
    local_pos = pos[mask].clone()
    for k, a in enumerate(axes):
        local_pos[:, a] -= starts_out[k][me[k]]
    plan.pos = local_pos.unbind(1)
    # The interior: the rank's whole input block, at this offset of its output block.
    plan.interior = [0, p, p]
    plan.out_sizes = list(sizes_out)
    for k, a in enumerate(axes):
        if a > 0:
            plan.interior[a] = starts_in[k][me[k]] + p - starts_out[k][me[k]]
        plan.out_sizes[a] = ext_out[k][me[k]]
    return plan


def _to(idx, device):
    if idx is None:
        return None
    return tuple(t.to(device) for t in idx) if isinstance(idx, tuple) else idx.to(device)


def _plan(fmap, pad, BF, H, W, splits, me, device):
    key = (id(fmap), pad.p, BF, H, W, tuple((m, a, tuple(e)) for m, a, e in splits), tuple(me), str(device))
    with _lock:
        plan = _plans.get(key)
    if plan is None:
        plan = _make_plan(fmap, pad.p, BF, H, W, splits, me)
        for name in ("i1", "i2", "w1", "w2", "pos"):
            setattr(plan, name, _to(getattr(plan, name), device))
        for st_ in plan.stages:
            st_.send = [_to(s, device) for s in st_.send]
            st_.own = _to(st_.own, device)
        with _lock:
            _plans[key] = plan
    return plan


def _take(x, table, idx):
    """Rows of the current table: local coordinates of the block ``x`` (first stage), else rows of ``table``."""
    if isinstance(idx, tuple):
        return x[idx[0], :, idx[1], idx[2]]
    return table[idx]


def _give(gx, gtable, idx, rows):
    """Adds ``rows`` to the gradient of the rows ``_take`` read: ``gx`` (the block's) or ``gtable``."""
    if isinstance(idx, tuple):
        gx.permute(0, 2, 3, 1).index_put_(idx, rows, accumulate=True)
    else:
        gtable.index_add_(0, idx, rows)


class _Padding(torch.autograd.Function):
    """The padding of one rank's block by its plan, with a backward that touches the output gradient once (its
    interior is the block's gradient) plus the border strips (autograd of the forward's slice writes would clone the
    whole gradient twice)."""

    @staticmethod
    def forward(ctx, x, plan, cpp_mesh, fmt):
        ctx.plan, ctx.mesh = plan, cpp_mesh
        last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        ctx.block = (tuple(x.shape), torch.channels_last if last else torch.contiguous_format)
        C = x.shape[1]
        out = torch.empty([plan.out_sizes[0], C, plan.out_sizes[1], plan.out_sizes[2]], dtype=x.dtype,
                          device=x.device, memory_format=fmt)
        i0, i1, i2 = plan.interior
        out[i0:i0 + x.shape[0], :, i1:i1 + x.shape[2], i2:i2 + x.shape[3]] = x
        table = None
        for stage in plan.stages:
            send = [x.new_empty((0, C)) if s is None else _take(x, table, s) for s in stage.send]
            got = _C._peer_exchange(send, [[k, C] for k in stage.recv], x, cpp_mesh, stage.m)
            got[stage.me] = _take(x, table, stage.own)
            table = torch.cat(got)
        table = torch.cat([table, x.new_zeros((1, C))])
        vals = table[plan.i1] * plan.w1.to(x.dtype)[:, None] + table[plan.i2] * plan.w2.to(x.dtype)[:, None]
        out[plan.pos[0], :, plan.pos[1], plan.pos[2]] = vals
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        plan = ctx.plan
        shape, block_format = ctx.block
        C = shape[1]
        i0, i1, i2 = plan.interior
        gx = torch.empty(shape, dtype=g.dtype, device=g.device, memory_format=block_format)
        gx.copy_(g[i0:i0 + shape[0], :, i1:i1 + shape[2], i2:i2 + shape[3]])
        gv = g[plan.pos[0], :, plan.pos[1], plan.pos[2]]
        sizes = [sum(st_.pieces()) for st_ in plan.stages]
        gtable = g.new_zeros((sizes[-1] + 1, C))
        gtable.index_add_(0, plan.i1, gv * plan.w1.to(g.dtype)[:, None])
        gtable.index_add_(0, plan.i2, gv * plan.w2.to(g.dtype)[:, None])
        gtable = gtable[:-1]
        # The stages backwards: each piece's gradient goes back to the rank it came from.
        for k in reversed(range(len(plan.stages))):
            stage = plan.stages[k]
            gprev = g.new_zeros((sizes[k - 1], C)) if k > 0 else None
            pieces = list(gtable.split(stage.pieces()))
            _give(gx, gprev, stage.own, pieces[stage.me])
            pieces[stage.me] = g.new_empty((0, C))
            got = _C._peer_exchange(pieces, [[0 if s is None else _count(s), C] for s in stage.send], g, ctx.mesh,
                                    stage.m)
            for q, idx in enumerate(stage.send):
                if idx is not None and _count(idx):
                    _give(gx, gprev, idx, got[q])
            gtable = gprev
        return gx, None, None, None


def padding_forward_sharded(pad, data):
    """``HEALPixPadding.forward(data)`` with a ShardTensor ``data`` (see the module's docstring)."""
    body = type(pad).forward
    if not is_shard_tensor(data) or data.dim() != 4 or data.shape[0] % _FACES != 0:
        return body(pad, data)
    data = completed(data)
    pl = placements(data)
    split_dims = [(m, p.dim % 4) for m, p in enumerate(pl) if p.is_shard() and p.dim % 4 != 1]
    if len({d for _, d in split_dims}) != len(split_dims):
        return body(pad, data)  # one dim split by two mesh dims: op by op
    BF, _, H, W = data.shape
    fmap = _face_map(pad, H, W)
    if fmap is None:
        return body(pad, data)
    mesh = device_mesh(data)
    shapes = sharding_shapes(data)
    x = to_local(data)
    if not split_dims:
        # Only the channels are split (or nothing): every rank pads its own channels whole.
        return from_local(body(pad, x), mesh, list(pl), sharding_shapes=shapes, check=False)
    cpp_mesh = as_cpp_mesh(mesh)
    splits = [(m, {0: 0, 2: 1, 3: 2}[d], list(shapes[m])) for m, d in split_dims]
    me = [int(cpp_mesh.coordinate[m]) for m, _ in split_dims]
    plan = _plan(fmap, pad, BF, H, W, splits, me, x.device)
    fmt = torch.channels_last if getattr(pad, "enable_nhwc", False) else torch.contiguous_format
    out = _Padding.apply(x, plan, cpp_mesh, fmt)
    ext = dict(shapes)
    ext.update(plan.ext_out)
    return from_local(out, mesh, list(pl), sharding_shapes=ext, check=False)
