"""Position tables built for the tokens a rank holds (diffusers' LTX-Video rotary embedding, timm's Gemma 4 ViT).

A rotary (or learned) position table comes from the positions of the tokens: an ``arange`` / ``meshgrid`` over the
global grid, since the model reads the grid's size from its arguments or from the input's (global) shape. With the
tokens split across ranks the positions are plain, so every rank built the table for every token: LTX-Video's cos
and sin tables are each batch x tokens x inner_dim -- together twice the attention's input, on every rank --, Gemma
4's patch coordinates feed a one-hot position embedding and the rotary table, both batch x tokens x dims. The zoo's
``plain_from_sharded`` report named them.

Routed here (``st.register_function``), the module is handed the positions of the rank's own tokens, as a
ShardTensor laid out like the tokens, through an argument it already takes for given positions (LTX-Video's
``video_coords``, Gemma 4's ``patch_coord``), computed so that its own code gives the single-device values; the
table and what follows run on the library's op rules, each rank holding its tokens' rows. Layouts that the
positions cannot follow (a split the patch size does not divide, a pending sum) run the module as it is."""
from __future__ import annotations

import inspect

import torch

from .. import Replicate, Shard, device_mesh, from_local, is_shard_tensor, local_offsets, placements, \
    sharding_shapes, to_local
from .relative_position_bias import query_positions


def _scalar(value):
    """A Python number or a one-element tensor's value, else None."""
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not is_shard_tensor(value):
        return value
    return None


def _ltx_video_coords(rope, tokens, num_frames: int, height: int, width: int, scale, batch: int):
    """The ``video_coords`` (batch x 3 x tokens) for which ``LTXVideoRotaryPosEmbed.forward``'s own path gives
    what it computes from the grid: ``video_coords / base`` there equals ``(position * scale * patch) / base``, as
    the grid path computes it, or the position itself without a scale (``position * base`` is exact: integers)."""
    f = torch.div(tokens, height * width, rounding_mode="floor")
    h = torch.remainder(torch.div(tokens, width, rounding_mode="floor"), height)
    w = torch.remainder(tokens, width)
    grid = [t.to(torch.float32) for t in (f, h, w)]
    bases = (rope.base_num_frames, rope.base_height, rope.base_width)
    patches = (rope.patch_size_t, rope.patch_size, rope.patch_size)
    if scale is None:
        coords = [g * b for g, b in zip(grid, bases)]
    else:
        factors = [_scalar(s) for s in scale]
        if len(factors) != 3 or any(s is None for s in factors):
            return None
        coords = [g * s * p for g, s, p in zip(grid, factors, patches)]
    return torch.stack(coords, 0).unsqueeze(0).expand(batch, 3, -1)


def _routed(forward, fill, suffix: str):
    """The handler of a routed forward: its arguments bound, ``fill`` sets the positions argument when it applies."""
    signature = inspect.signature(forward)

    def handler(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        fill(bound.arguments)
        return forward(*bound.args, **bound.kwargs)

    handler.__name__ = f"{forward.__qualname__}_{suffix}"
    return handler


def _ltx_fill(a) -> None:
    rope, hidden = a["self"], a["hidden_states"]
    sizes = [a.get(k) for k in ("num_frames", "height", "width")]
    if a.get("video_coords") is None and is_shard_tensor(hidden) and hidden.dim() == 3 and \
            all(isinstance(s, int) for s in sizes) and sizes[0] * sizes[1] * sizes[2] == hidden.shape[1]:
        tokens = query_positions(hidden, 1)
        if tokens is not None:
            coords = _ltx_video_coords(rope, tokens, *sizes, a.get("rope_interpolation_scale"), hidden.shape[0])
            if coords is not None:
                a["video_coords"] = coords


def _gemma4_patch_coord(x, ph: int, pw: int):
    """Gemma 4's default ``patch_coord`` (batch x rows*cols x 2, ``(y, x)``, row-major) for the patches this rank
    holds: built over the rank's patch rows and columns laid out like ``x`` (batch, H, W splits mapped; a channel
    split replicated), then flattened by the view rule that flattens the patches themselves. None when a split
    does not follow the patches or a sum is pending."""
    pl, shapes, offsets, local = placements(x), sharding_shapes(x), local_offsets(x), to_local(x)
    patch = {2: ph, 3: pw}
    layout, extents = [], {}
    for m, p in enumerate(pl):
        if p.is_partial():
            return None
        if not p.is_shard() or p.dim == 1:
            layout.append(Replicate())
            continue
        step = patch.get(p.dim, 1)
        if any(e % step for e in shapes[m]):
            return None
        layout.append(Shard({0: 0, 2: 1, 3: 2}[p.dim]))
        extents[m] = [e // step for e in shapes[m]]
    if offsets[2] % ph or offsets[3] % pw or local.size(2) % ph or local.size(3) % pw:
        return None
    ys = torch.arange(offsets[2] // ph, (offsets[2] + local.size(2)) // ph, device=local.device)
    xs = torch.arange(offsets[3] // pw, (offsets[3] + local.size(3)) // pw, device=local.device)
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    own = torch.stack([grid_y, grid_x], dim=-1).unsqueeze(0).expand(local.size(0), -1, -1, -1).contiguous()
    rows, cols = x.shape[2] // ph, x.shape[3] // pw
    coords = from_local(own, device_mesh(x), layout, sharding_shapes=extents,
                        global_shape=[x.shape[0], rows, cols, 2], check=False)
    return coords.reshape(x.shape[0], rows * cols, 2)


def _gemma4_fill(a) -> None:
    embed, x = a["self"], a["x"]
    if is_shard_tensor(x) and x.dim() == 4 and a.get("patch_coord") is None and a.get("patch_valid") is None:
        ph, pw = embed.patch_size
        if x.shape[2] % ph == 0 and x.shape[3] % pw == 0:
            coords = _gemma4_patch_coord(x, ph, pw)
            if coords is not None:
                a["patch_coord"] = coords


# library module -> (class, what sets its positions argument, the handler's name suffix)
_MODULES = {
    "diffusers.models.transformers.transformer_ltx": ("LTXVideoRotaryPosEmbed", _ltx_fill, "own_tokens"),
    "timm.models.gemma4_vit": ("Gemma4PatchEmbed", _gemma4_fill, "own_patches"),
}


def install(module) -> None:
    """Route the position module's forward that the imported library module defines."""
    from . import _route_forwards
    class_name, fill, suffix = _MODULES[module.__name__]
    _route_forwards(module, (class_name,), lambda forward: _routed(forward, fill, suffix))
