"""WavLM's relative position bias computed for the queries a rank holds (transformers' ``WavLMAttention``,
torchaudio's ``WavLMSelfAttention``).

The first attention layer of WavLM builds a bias of ``heads x L x L`` from the sequence length alone
(``compute_bias(L, L)``: ``arange`` positions, their differences bucketed, an embedding lookup) and repeats it over
the batch; every later layer receives it. With the frames split across ranks the length is the global one and the
positions plain, so every rank built and carried the whole ``batch x heads x L x L`` bias -- P times the attention
scores a rank computes, the largest tensor of the model -- while its queries are only its own rows.

Routed here (``st.register_function``), the layer's forward, given a sequence split along the frames and no bias yet,
gets a bias computed by the layer's own bucket function and embedding from the *query* positions this rank holds
(a ShardTensor laid out like the frames; the key positions whole), repeated as the library repeats it: each rank
holds ``batch x heads x L_own x L``, and the gate, the mask and the attention that follow run on the library's code
through the op rules. The embedding's gradient is the single-device one (a plain weight used with ShardTensors)."""
from __future__ import annotations

import inspect

import torch

from .. import Replicate, Shard, device_mesh, from_local, is_shard_tensor, local_offsets, placements, \
    sharding_shapes, to_local

def query_positions(x, dim: int):
    """The global positions along ``dim`` of the rows of ``x`` this rank holds: a 1-D int64 ShardTensor split like
    that dim (Replicate over the mesh dims that split other dims), or None unless exactly one mesh dim splits it."""
    pl = placements(x)
    split = [m for m, p in enumerate(pl) if p.is_shard() and p.dim == dim]
    if len(split) != 1:
        return None
    (m,) = split
    own, start = to_local(x), local_offsets(x)[dim]
    local = torch.arange(start, start + own.size(dim), dtype=torch.long, device=own.device)
    layout = [Shard(0) if i == m else Replicate() for i in range(len(pl))]
    return from_local(local, device_mesh(x), layout, sharding_shapes={m: list(sharding_shapes(x)[m])},
                      global_shape=[x.shape[dim]], check=False)


def _bias_for_own_queries(layer, queries, length: int, bidirectional: bool):
    """``layer.compute_bias(length, length)`` for the query rows this rank holds: heads x L_own x L (Shard(1))."""
    context = query_positions(queries, 1)
    if context is None:
        return None
    memory = torch.arange(length, dtype=torch.long, device=context.device)
    relative = memory[None, :] - context[:, None]
    buckets = layer._relative_positions_bucket(relative, bidirectional=True) if bidirectional \
        else layer._relative_positions_bucket(relative)
    values = layer.rel_attn_embed(buckets.to(layer.rel_attn_embed.weight.device))
    return values.permute([2, 0, 1])


def _handler_for(forward, queries_name: str, bidirectional: bool, repeat):
    signature = inspect.signature(forward)

    def handler(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        layer, queries = bound.arguments["self"], bound.arguments[queries_name]
        if getattr(layer, "rel_attn_embed", None) is not None and bound.arguments.get("position_bias") is None \
                and is_shard_tensor(queries) and queries.dim() == 3:
            bias = _bias_for_own_queries(layer, queries, queries.shape[1], bidirectional)
            if bias is not None:
                bound.arguments["position_bias"] = repeat(bias, queries.shape[0], layer.num_heads)
        return forward(*bound.args, **bound.kwargs)

    handler.__name__ = f"{forward.__qualname__}_own_queries"
    return handler


# what each library does with compute_bias's result before using it (the lines after the call in its forward)
def _transformers_repeat(bias, batch: int, heads: int):
    length = bias.shape[2]
    return bias.unsqueeze(0).repeat(batch, 1, 1, 1).view(batch * heads, length, length)


def _torchaudio_repeat(bias, batch: int, heads: int):
    return bias.unsqueeze(0).repeat(batch, 1, 1, 1)


# library module -> (the attention class, its queries' argument, whether its bucket function takes
# ``bidirectional``, the library's repeat of the bias)
_LAYERS = {
    "transformers.models.wavlm.modeling_wavlm": ("WavLMAttention", "hidden_states", False, _transformers_repeat),
    "torchaudio.models.wav2vec2.wavlm_attention": ("WavLMSelfAttention", "query", True, _torchaudio_repeat),
}


def install(module) -> None:
    """Route the WavLM attention layer's forward that the imported module defines."""
    from . import _route_forwards
    class_name, queries_name, bidirectional, repeat = _LAYERS[module.__name__]
    _route_forwards(module, (class_name,), lambda forward: _handler_for(forward, queries_name, bidirectional, repeat))
