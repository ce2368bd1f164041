"""Position tables built for the tokens a rank holds (``shardtensor.integrations.rotary_positions``: diffusers'
``LTXVideoRotaryPosEmbed``, timm's ``Gemma4PatchEmbed``), against one device.

Without the integration every rank built the tables from the global grid: LTX-Video's cos and sin, each batch x
tokens x dim (plain tensors, whole on every rank), Gemma 4's patch coordinates and what they feed (a one-hot
position embedding, the rotary table). Checked: the tables are ShardTensors split like the tokens with this rank's
rows only, equal to one device's bit for bit (LTX: with and without ``rope_interpolation_scale``, a dim that is not
a multiple of 6), uneven and tiny shards on 2-3 ranks, Gemma 4 with H, W and H x W splits (2x2 mesh) through a whole
small model's training step in strict mode; the routing."""
import copy

import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_integration_routing, close, full, mesh, needs_library, tiny_extents, uneven_extents

needs_diffusers = needs_library("diffusers", "diffusers")
needs_timm = needs_library("timm", "timm")


def case_ltx(kind):
    from diffusers.models.transformers.transformer_ltx import LTXVideoRotaryPosEmbed
    m = mesh()
    frames, height, width = 3, 4, 5
    tokens = frames * height * width
    ext = tiny_extents(tokens, m.size()) if kind == "tiny" else uneven_extents(tokens, m.size(), seed=2)
    hidden = torch.randn(2, tokens, 7, generator=torch.Generator().manual_seed(0))
    hs = st.distribute_tensor(hidden, m, [st.Shard(1)], sharding_shapes={0: ext})
    for dim, scale in ((24, None), (26, (torch.tensor(0.5), 2.0, 3.0)), (18, (1.5, 0.25, 1.0))):
        rope = LTXVideoRotaryPosEmbed(dim, base_num_frames=20, base_height=64, base_width=64, patch_size=2,
                                      patch_size_t=1)
        ref = rope(hidden, frames, height, width, rope_interpolation_scale=scale)
        with st.use_strict(), st.CommCounter() as counter:
            out = rope(hs, frames, height, width, rope_interpolation_scale=scale)
        assert counter.replications == {}, counter.replications
        for name, a, b in zip(("cos", "sin"), out, ref):
            assert st.is_shard_tensor(a), f"{name}: a plain table (whole on every rank)"
            assert st.placements(a) == (st.Shard(1),) and st.to_local(a).size(1) == st.to_local(hs).size(1)
            assert torch.equal(full(a), b), f"{name} dim={dim} scale={scale}: {(full(a) - b).abs().max()}"
    return True


def case_gemma4(layout, divided=True, strict=True):
    import timm
    m = mesh() if len(layout[0]) == 1 else mesh((2, 2))
    torch.manual_seed(0)
    ref = timm.create_model("gemma4_vit_167m", img_size=64, depth=2, embed_dim=32, num_heads=2).double()
    net = copy.deepcopy(ref)
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xr = x.clone().requires_grad_()
    xs = st.distribute_tensor(x, m, layout[0], sharding_shapes=layout[1]).requires_grad_()
    feats_ref = ref.encoder.patch_embed(xr)
    strict = strict and divided
    with st.use_strict(strict):
        feats = net.encoder.patch_embed(xs)
    for name, a, b in zip(("embeddings", "position_ids"), feats[:2], feats_ref[:2]):
        assert st.is_shard_tensor(a) or not divided, f"{name}: plain (whole on every rank)"
        close(full(a).double(), b.double(), rtol=1e-12, atol=1e-12, what=name)
    if divided:
        assert st.placements(feats[1]) == st.placements(feats[0]), (st.placements(feats[1]), st.placements(feats[0]))
    assert feats[2] is None and feats_ref[2] is None
    y_ref = ref(xr)
    with st.use_strict(strict):
        y = net(xs)
    close(full(y), y_ref, rtol=1e-9, atol=1e-10, what="logits")
    w = torch.randn(y_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (y_ref * w).sum().backward()
    with st.use_strict(strict):
        (y * w).sum().backward()
    close(full(xs.grad), xr.grad, rtol=1e-9, atol=1e-10, what="input gradient")
    for (n, p), (_, pr) in zip(net.named_parameters(), ref.named_parameters()):
        if pr.grad is not None:
            close(full(p.grad), pr.grad, rtol=1e-8, atol=1e-10, what=n)
    return True


@needs_diffusers
@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny")])
def test_ltx_video_rope(world, kind):
    assert all(harness.run(world, case_ltx, kind))


@needs_timm
@pytest.mark.parametrize("world,layout", [
    (2, ([st.Shard(2)], {0: [32, 32]})),
    (3, ([st.Shard(3)], {0: [16, 48, 0]})),
    (4, ([st.Shard(2), st.Shard(3)], {0: [16, 48], 1: [32, 32]})),
], ids=["H", "W-uneven", "HxW"])
def test_gemma4_patch_positions(world, layout):
    # H x W: the patches' flattening gathers the W split (one tensor dim takes one mesh dim), not strict there; the
    # coordinates follow the patches' layout all the same.
    assert all(harness.run(world, case_gemma4, layout, True, len(layout[0]) == 1))


@needs_timm
def test_gemma4_split_inside_a_patch():
    """A split the patch size does not divide: the module runs as it is (the plain coordinates), still right."""
    assert all(harness.run(2, case_gemma4, ([st.Shard(2)], {0: [24, 40]}), False))


@needs_diffusers
def test_routing():
    """shardtensor imported first, and the switch off (the library-first order is the import hook's, checked with
    WavLM's integration; the cases above import the libraries after shardtensor)."""
    check_integration_routing("shardtensor", "diffusers", "diffusers.models.transformers.transformer_ltx",
                              "LTXVideoRotaryPosEmbed.forward")
