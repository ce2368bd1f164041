"""nn.MultiheadAttention, nn.TransformerEncoderLayer and nn.TransformerEncoder on token-sharded inputs in eval()
under no_grad / inference_mode, where PyTorch's modules call their fused inference ops
(aten::_native_multi_head_attention, aten::_transformer_encoder_layer_fwd, the nested-tensor check), against the
single-device modules; training mode (the composite path) alongside for comparison. Uneven and zero extents,
1-D and 2-D meshes, every mask kind, need_weights both ways."""
import copy
import itertools

import pytest
import torch
import torch.nn as nn

import harness
import shardtensor as st
from cases_util import close, full, mesh, narrow_extents, randn, tiny_extents

TOL = dict(rtol=1e-4, atol=1e-5)


def close_nan(actual, expected, what):
    """Rows whose queries see no key are NaN on one device (fused kernel, need_weights): they must be NaN here too."""
    torch.testing.assert_close(actual, expected, **TOL, equal_nan=True, msg=lambda s: f"{what}: {s}")


MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "train": torch.enable_grad}


def _shard(x, m, token_dim, ext, batch_ext=None):
    """Tokens on the last mesh dim; on a 2-D mesh the batch dim (the other of dims 0/1) on the first."""
    if batch_ext is None:
        return st.distribute_tensor(x, m, [st.Shard(token_dim)], {0: ext})
    return st.distribute_tensor(x, m, [st.Shard(1 - token_dim), st.Shard(token_dim)], {0: batch_ext, 1: ext})


def _masks(b, t):
    kpm = torch.zeros(b, t, dtype=torch.bool)
    kpm[0, t - 2:] = True
    kpm[-1, 0] = True
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    return {"none": {}, "key_padding": {"key_padding_mask": kpm}, "causal": {"attn_mask": causal},
            "both": {"key_padding_mask": kpm, "attn_mask": causal}}


def case_multihead_attention(ext, batch_ext=None):
    """Every fast-path argument combination against the single-device module; the output keeps the input's
    placements. batch_first=False and training mode take the composite path (compared as well)."""
    m = mesh((2, 2)) if batch_ext else mesh()
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    mha_tf = nn.MultiheadAttention(8, 2, batch_first=False)
    mha_tf.load_state_dict(mha.state_dict())
    b, t = 3, sum(ext)
    x = randn(b, t, 8, seed=1)
    # With both batch and tokens sharded the composite path (training, batch_first=False) is checked separately
    # (test_multihead_attention_2d_mesh_composite: its views merge the two sharded dims and gather one).
    layouts, modes = ((True,), ("no_grad", "inference_mode")) if batch_ext else ((True, False), MODES)
    for (batch_first, need_weights, average, mask, mode) in itertools.product(
            layouts, (True, False), (True, False), ("none", "key_padding", "causal", "both"), modes):
        if average and not need_weights:
            continue
        mod = mha if batch_first else mha_tf
        mod.train(mode == "train")
        xin = x if batch_first else x.transpose(0, 1).contiguous()
        xs = _shard(xin, m, 1 if batch_first else 0, ext, batch_ext)
        kw = dict(_masks(b, t)[mask], need_weights=need_weights, average_attn_weights=average)
        what = f"mha batch_first={batch_first} need_weights={need_weights} average={average} mask={mask} {mode}"
        with MODES[mode]():
            ref, ref_w = mod(xin, xin, xin, **kw)
            out, out_w = mod(xs, xs, xs, **kw)
        close_nan(full(out), ref, what)
        assert st.placements(out) == st.placements(xs), what
        if need_weights:
            close_nan(full(out_w), ref_w, f"{what} weights")
        else:
            assert out_w is None and ref_w is None, what
    return True


@pytest.mark.parametrize("world,extents", [(2, tiny_extents(7, 2)), (3, tiny_extents(7, 3)), (3, [3, 0, 4]),
                                           (4, narrow_extents(7, 4))])
def test_multihead_attention(world, extents):
    harness.run(world, case_multihead_attention, extents)


def test_multihead_attention_2d_mesh():
    """Batch on the first mesh dim (a rank without samples included), tokens on the second."""
    harness.run(4, case_multihead_attention, [5, 0], [1, 2])


def case_mha_2d_composite(batch_first):
    """Batch and tokens both sharded on the composite path (training with grad, or eval with (L, B, E) inputs): its
    views merge the two sharded dims, so the view rule keeps the outer one and gathers the other
    (test_windows.py); forward, input gradient and parameter gradients equal one device."""
    m = mesh((2, 2))
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=batch_first)
    ref = copy.deepcopy(mha)
    x = randn(3, 5, 8, seed=1) if batch_first else randn(5, 3, 8, seed=1)
    xs = _shard(x, m, 1 if batch_first else 0, [2, 3], [1, 2]).requires_grad_()
    xr = x.clone().requires_grad_()
    mha.train(batch_first)
    ref.train(batch_first)
    out, _ = mha(xs, xs, xs, need_weights=False)
    out_ref, _ = ref(xr, xr, xr, need_weights=False)
    close(full(out), out_ref, rtol=1e-5, atol=1e-5, what=f"composite mha batch_first={batch_first}")
    w = randn(*out_ref.shape, seed=3)
    (out * w).sum().backward()
    (out_ref * w).sum().backward()
    close(full(xs.grad), xr.grad, rtol=1e-4, atol=1e-5, what="composite mha input grad")
    for (name, p), (_, r) in zip(mha.named_parameters(), ref.named_parameters()):
        close(p.grad, r.grad, rtol=1e-4, atol=1e-5, what=f"composite mha grad {name}")
    return True


def test_multihead_attention_2d_mesh_composite():
    for batch_first in (True, False):
        harness.run(4, case_mha_2d_composite, batch_first)


def case_native_op(ext):
    """torch._native_multi_head_attention called directly, as on one device: mask types 0 ([L, S]), 1 (key
    padding [B, S]) and 2 ([B, H, L, S]), boolean and 0/-inf masks, rows without any visible key (NaN, as the
    fused kernel), cross attention (query differs from key and value)."""
    m = mesh()
    b, t, e, h = 2, sum(ext), 8, 4
    q, kv, other = randn(b, t, e, seed=1), randn(b, t, e, seed=2), randn(b, t, e, seed=3)
    w_qkv, b_qkv, w_o, b_o = randn(3 * e, e, seed=4), randn(3 * e, seed=5), randn(e, e, seed=6), randn(e, seed=7)
    no_row = torch.zeros(t, t, dtype=torch.bool)
    no_row[1] = True  # query 1 sees no key
    kpm = torch.zeros(b, t, dtype=torch.bool)
    kpm[1, :2] = True
    full_mask = torch.rand(b, h, t, t, generator=torch.Generator().manual_seed(8)) < 0.3
    masks = [(None, None), (no_row, 0), (kpm.float().masked_fill(kpm, float("-inf")), 1), (full_mask, 2)]
    for (mask, mask_type), need_weights, average, inputs in itertools.product(
            masks, (True, False), (True, False), ("self", "key_is_value", "all_differ")):
        qi, ki, vi = {"self": (q, q, q), "key_is_value": (q, kv, kv), "all_differ": (q, kv, other)}[inputs]
        ref = torch._native_multi_head_attention(qi, ki, vi, e, h, w_qkv, b_qkv, w_o, b_o, mask, need_weights,
                                                 average, mask_type)
        shards = {id(t_): st.distribute_tensor(t_, m, [st.Shard(1)], {0: ext}) for t_ in (q, kv, other)}
        with torch.no_grad():
            out = torch._native_multi_head_attention(shards[id(qi)], shards[id(ki)], shards[id(vi)], e, h, w_qkv,
                                                     b_qkv, w_o, b_o, mask, need_weights, average, mask_type)
        what = f"mask_type={mask_type} need_weights={need_weights} average={average} {inputs}"
        close_nan(full(out[0]), ref[0], what)
        if need_weights:
            close_nan(full(out[1]), ref[1], f"{what} weights")
        else:
            assert out[1] is None and ref[1] is None, what
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_native_multi_head_attention_op(world):
    harness.run(world, case_native_op, tiny_extents(6, world))


def case_encoder_layer(ext, batch_ext=None):
    """nn.TransformerEncoderLayer: norm_first both ways, relu/gelu, masks; eval fast path and training."""
    m = mesh((2, 2)) if batch_ext else mesh()
    b, t = 3, sum(ext)
    x = randn(b, t, 8, seed=1)
    xs = _shard(x, m, 1, ext, batch_ext)
    masks = _masks(b, t)
    for norm_first, act in itertools.product((False, True), ("relu", "gelu")):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation=act, batch_first=True,
                                           norm_first=norm_first)
        # 2-D mesh: the fused path only (the composite one gathers a sharded dim, see above).
        modes = ("no_grad", "inference_mode") if batch_ext else MODES
        for mask, mode in itertools.product(("none", "key_padding", "causal", "both"), modes):
            layer.train(mode == "train")
            kw = {"src_" + k: v for k, v in masks[mask].items()}
            kw = {("src_mask" if k == "src_attn_mask" else k): v for k, v in kw.items()}
            with MODES[mode]():
                ref, out = layer(x, **kw), layer(xs, **kw)
            what = f"encoder layer norm_first={norm_first} {act} mask={mask} {mode}"
            close_nan(full(out), ref, what)
            assert st.placements(out) == st.placements(xs), what
    return True


@pytest.mark.parametrize("world,extents", [(2, [0, 6]), (3, tiny_extents(6, 3)), (4, narrow_extents(6, 4))])
def test_encoder_layer(world, extents):
    harness.run(world, case_encoder_layer, extents)


def test_encoder_layer_2d_mesh():
    harness.run(4, case_encoder_layer, [2, 4], [3, 0])


def case_encoder(ext):
    """nn.TransformerEncoder (2 layers, final norm). With a key padding mask and enable_nested_tensor=True one
    device packs the batch into a NestedTensor and returns zeros at padded positions; a ShardTensor stays dense:
    the valid positions equal that result, and the whole output equals the single-device dense computation
    (enable_nested_tensor=False)."""
    m = mesh()
    b, t = 3, sum(ext)
    x = randn(b, t, 8, seed=1)
    xs = st.distribute_tensor(x, m, [st.Shard(1)], {0: ext})
    kpm = _masks(b, t)["key_padding"]["key_padding_mask"]
    kpm[-1, 0] = False  # left-aligned padding, so one device really takes the nested path
    kpm[-1, t - 1] = True
    valid = ~kpm
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    nested = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8), enable_nested_tensor=True).eval()
    dense = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8), enable_nested_tensor=False).eval()
    dense.load_state_dict(nested.state_dict())
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            ref_nested, ref_dense = nested(x, src_key_padding_mask=kpm), dense(x, src_key_padding_mask=kpm)
            out = nested(xs, src_key_padding_mask=kpm)
            out_dense = dense(xs, src_key_padding_mask=kpm)
            out_causal = nested(xs, mask=nn.Transformer.generate_square_subsequent_mask(t))
            ref_causal = nested(x, mask=nn.Transformer.generate_square_subsequent_mask(t))
        assert (ref_nested[~valid] == 0).all(), "one device did not take the nested path"
        close(full(out)[valid], ref_nested[valid], **TOL, what=f"encoder valid positions {ctx.__name__}")
        close(full(out), ref_dense, **TOL, what=f"encoder dense {ctx.__name__}")
        close(full(out_dense), ref_dense, **TOL, what=f"encoder nested off {ctx.__name__}")
        close(full(out_causal), ref_causal, **TOL, what=f"encoder causal {ctx.__name__}")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_encoder(world):
    harness.run(world, case_encoder, tiny_extents(6, world))


def encoder_without_mask_check():
    m = mesh()
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=True, mask_check=False).eval()
    xs = st.distribute_tensor(randn(2, 5, 8, seed=1), m, [st.Shard(1)])
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0, 3:] = True
    with torch.no_grad():
        enc(xs, src_key_padding_mask=kpm)


def test_encoder_nested_without_mask_check_raises():
    harness.expect_error(2, encoder_without_mask_check, match="enable_nested_tensor=False",
                         kinds=("NotImplementedError",))


def case_sharded_key_padding_mask(ext):
    """A key padding mask sharded like the tokens, on the fast path and in training; the training path reshapes
    the expanded mask, which the view rule must copy (the local tensor cannot be viewed)."""
    m = mesh()
    b, t = 3, sum(ext)
    x = randn(b, t, 8, seed=1)
    xs = st.distribute_tensor(x, m, [st.Shard(1)], {0: ext})
    kpm = _masks(b, t)["key_padding"]["key_padding_mask"]
    kpm_s = st.distribute_tensor(kpm, m, [st.Shard(1)], {0: ext})
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    for mode, need_weights in itertools.product(MODES, (True, False)):
        mha.train(mode == "train")
        with MODES[mode]():
            ref = mha(x, x, x, key_padding_mask=kpm, need_weights=need_weights)[0]
            out = mha(xs, xs, xs, key_padding_mask=kpm_s, need_weights=need_weights)[0]
        close_nan(full(out), ref, f"sharded key padding mask {mode} need_weights={need_weights}")
    expanded = kpm_s.view(b, 1, 1, t).expand(-1, 2, -1, -1).reshape(b * 2, 1, t)
    close(full(expanded), kpm.view(b, 1, 1, t).expand(-1, 2, -1, -1).reshape(b * 2, 1, t), what="reshape expanded")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_key_padding_mask(world):
    harness.run(world, case_sharded_key_padding_mask, tiny_extents(6, world))
