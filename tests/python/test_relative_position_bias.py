"""WavLM's relative position bias computed for the queries a rank holds (``shardtensor.integrations.
relative_position_bias``: transformers' ``WavLMAttention``, torchaudio's ``WavLMSelfAttention``), against one device.

The first layer builds the bias from the sequence length; without the integration every rank held the whole
``batch x heads x L x L`` bias (a plain tensor). Checked: the bias a layer returns is a ShardTensor split along the
queries with this rank's rows only, the attention output, the input gradient and every parameter gradient (the bias
embedding's included) equal one device's, with no gather fallback and no tensor made whole on the way, through a first layer and a second one that receives the bias; uneven and
one-row shards, 2-3 ranks, a 2x2 mesh (batch x frames); the routing in either import order."""
import copy

import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_integration_routing, close, full, mesh, needs_library, tiny_extents, uneven_extents

needs_transformers = needs_library("transformers", "transformers")
needs_torchaudio = needs_library("torchaudio", "torchaudio")

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)
HEADS, DIM = 2, 8


class _TwoLayers(torch.nn.Module):
    """A first layer that builds the bias and a second that receives it, as WavLM's encoder chains them."""

    def __init__(self, make, library):
        super().__init__()
        self.first, self.second, self.library = make(True), make(False), library

    def forward(self, x):
        if self.library == "transformers":
            y, _, bias = self.first(x)
            z, _, _ = self.second(y, position_bias=bias)
        else:
            y, bias = self.first(x)
            z, _ = self.second(y, position_bias=bias)
        return z, bias


def _transformers_layer(with_bias):
    from transformers.models.wavlm.modeling_wavlm import WavLMAttention
    return WavLMAttention(DIM, HEADS, num_buckets=32, max_distance=16, has_relative_position_bias=with_bias)


def _torchaudio_layer(with_bias):
    from torchaudio.models.wav2vec2.wavlm_attention import WavLMSelfAttention
    return WavLMSelfAttention(DIM, HEADS, num_buckets=32, max_distance=16, has_relative_attention_bias=with_bias,
                              gru_rel_pos=True)


_MAKE = {"transformers": _transformers_layer, "torchaudio": _torchaudio_layer}


def _compare(library, length, placements, extents=None):
    m = mesh() if len(placements) == 1 else mesh((2, 2))
    torch.manual_seed(0)
    ref = _TwoLayers(_MAKE[library], library).to(D).eval()
    net = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, length, DIM, dtype=D, generator=g)
    xr = x.clone().requires_grad_()
    xs = st.distribute_tensor(x, m, placements, sharding_shapes=extents).requires_grad_()
    y_ref, bias_ref = ref(xr)
    with st.use_strict(), st.CommCounter() as counter:     # no gather fallback, nothing made whole
        y, bias = net(xs)
    assert counter.replications == {}, counter.replications
    # the bias: split along the queries (dim 1 of heads-batch x L x L, or dim 2 of batch x heads x L x L), own rows
    q_dim = bias_ref.dim() - 2
    assert st.is_shard_tensor(bias), "the position bias is a plain tensor (whole on every rank)"
    frames = [mi for mi, p in enumerate(st.placements(xs)) if p.is_shard() and p.dim == 1][0]
    assert st.placements(bias)[frames] == st.Shard(q_dim), st.placements(bias)
    assert st.to_local(bias).size(q_dim) == st.to_local(xs).size(1)
    close(full(bias), bias_ref, what="position bias", **TOL)
    close(full(y), y_ref, what="output", **TOL)
    w = torch.randn(y_ref.shape, dtype=D, generator=torch.Generator().manual_seed(2))
    (y_ref * w).sum().backward()
    (y * st.distribute_tensor(w, m, st.placements(y), sharding_shapes=st.sharding_shapes(y))).sum().backward()
    close(full(xs.grad), xr.grad, what="input gradient", **TOL)
    for (n, p), (_, pr) in zip(net.named_parameters(), ref.named_parameters()):
        if pr.grad is not None:
            close(full(p.grad), pr.grad, what=n, **TOL)
    return True


def case_layers(library, kind):
    w = mesh().size()
    ext = tiny_extents(11, w) if kind == "tiny" else uneven_extents(11, w, seed=3)
    return _compare(library, 11, [st.Shard(1)], {0: ext})


def case_2d_mesh(library):
    return _compare(library, 9, [st.Shard(0), st.Shard(1)], {1: [5, 4]})


@needs_transformers
@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny")])
def test_transformers_wavlm(world, kind):
    assert all(harness.run(world, case_layers, "transformers", kind))


@needs_torchaudio
@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny")])
def test_torchaudio_wavlm(world, kind):
    assert all(harness.run(world, case_layers, "torchaudio", kind))


@needs_transformers
@needs_torchaudio
def test_2d_mesh():
    assert all(harness.run(4, case_2d_mesh, "transformers"))
    assert all(harness.run(4, case_2d_mesh, "torchaudio"))


@needs_transformers
def test_routing_either_import_order():
    check_integration_routing("shardtensor", "transformers.models.wavlm.modeling_wavlm",
                              "transformers.models.wavlm.modeling_wavlm", "WavLMAttention.forward")
