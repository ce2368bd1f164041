"""The paper's three workloads (benchmarks/models: HybridViT, Transolver, a StormScope-like DiT), written as plain
torch.nn models, run domain-parallel by sharding only their input: the forward output, the input gradient and
every parameter gradient equal the single-device run on the same data (tiny configurations, 1-3 ranks, uneven
shards, (batch, height) 2-D meshes for the ViT and the DiT). Also: the synthetic data generators are
deterministic and have the advertised shapes and channel counts.

StormScope's neighbourhood attention runs here through ``na2d_reference`` (dense SDPA with a NATTEN-neighbourhood
boolean mask: a plain mask, which the sharded SDPA applies to each rank's query rows), checked against a direct
loop over the windows; and through the library's ``shardtensor.ops.neighborhood_attention2d`` when the build
has it.
"""
import copy
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import harness  # noqa: E402
import shardtensor as st  # noqa: E402
from benchmarks.models import build, stormscope, synthetic, transolver  # noqa: E402
from cases_util import check_grad_layout, close, full, mesh, rank, uneven_extents  # noqa: E402

RTOL, ATOL = 1e-5, 1e-5       # fp32, single-device vs sharded
GRAD_ATOL = 2e-5


# --------------------------------------------------------------------------------- neighbourhood attention

def na_window_starts(length: int, kernel: int) -> torch.Tensor:
    """NATTEN's border rule: position i's window starts at clamp(i - K // 2, 0, L - K)."""
    return (torch.arange(length) - kernel // 2).clamp(0, length - kernel)


def na2d_mask(x: int, y: int, kernel: int) -> torch.Tensor:
    """(X*Y, X*Y) boolean: query (i, j) may attend key (a, b) iff a and b lie in its windows along X and Y."""
    def one(n):
        s = na_window_starts(n, kernel)
        pos = torch.arange(n)
        return (pos[None, :] >= s[:, None]) & (pos[None, :] < s[:, None] + kernel)    # (query, key)
    mx, my = one(x), one(y)
    return (mx[:, None, :, None] & my[None, :, None, :]).reshape(x * y, x * y)


def na2d_reference(q, k, v, kernel_size):
    """2-D neighbourhood attention (q/k/v (B, X, Y, heads, D), NATTEN semantics) as masked dense SDPA."""
    b, x, y, h, d = q.shape
    mask = na2d_mask(x, y, kernel_size)

    def seq(t):  # (B, X, Y, H, D) -> (B, H, X*Y, D): X is the outer dim of the merged token dim
        return t.reshape(b, x * y, h, d).transpose(1, 2)

    out = F.scaled_dot_product_attention(seq(q), seq(k), seq(v), attn_mask=mask)
    return out.transpose(1, 2).reshape(b, x, y, h, d)


def na2d_loop(q, k, v, kernel):
    """The same, window by window (the definition, for checking the masked form)."""
    b, x, y, h, d = q.shape
    sx, sy = na_window_starts(x, kernel), na_window_starts(y, kernel)
    out = torch.empty_like(q)
    for i in range(x):
        for j in range(y):
            kk = k[:, sx[i]:sx[i] + kernel, sy[j]:sy[j] + kernel].reshape(b, -1, h, d)
            vv = v[:, sx[i]:sx[i] + kernel, sy[j]:sy[j] + kernel].reshape(b, -1, h, d)
            att = torch.einsum("bhd,bkhd->bhk", q[:, i, j], kk) / math.sqrt(d)
            out[:, i, j] = torch.einsum("bhk,bkhd->bhd", att.softmax(-1), vv)
    return out


def library_na2d():
    """``shardtensor.ops.neighborhood_attention2d`` when this build has it, else None."""
    try:
        from shardtensor.ops import neighborhood_attention2d
    except ImportError:
        return None
    return neighborhood_attention2d


needs_library_na = pytest.mark.skipif(library_na2d() is None,
                                      reason="shardtensor.ops.neighborhood_attention2d is not in this build")
ATTENTION = {"reference": lambda: na2d_reference, "library": library_na2d}


def test_na2d_reference_matches_windows():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 9, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    for kernel in (3, 5):
        torch.testing.assert_close(na2d_reference(q, k, v, kernel), na2d_loop(q, k, v, kernel))


@needs_library_na
def test_library_na2d_matches_windows():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 7, 9, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    for kernel in (3, 5):
        torch.testing.assert_close(library_na2d()(q, k, v, kernel), na2d_loop(q, k, v, kernel))


# ------------------------------------------------------------------------------------------------ helpers

def _randomize(model, seed):
    """Seeded non-zero values for every parameter, so no gradient is trivially zero (adaLN-Zero would zero
    most of them on the first step)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def _check_grads(model, ref, what):
    n_nonzero = 0
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert r.grad is not None, f"{what}: no single-device grad for {name}"
        assert p.grad is not None, f"{what}: no sharded-run grad for {name}"
        assert not st.is_shard_tensor(p), f"{what}: parameter {name} became a ShardTensor"
        assert not st.is_shard_tensor(p.grad), f"{what}: grad of plain parameter {name} is a ShardTensor"
        close(p.grad, r.grad, rtol=RTOL, atol=GRAD_ATOL, what=f"{what} grad {name}")
        n_nonzero += bool(r.grad.abs().max() > 0)
    total = sum(1 for _ in ref.parameters())
    assert n_nonzero == total, f"{what}: only {n_nonzero}/{total} parameter gradients are non-zero"


def _check_no_gather(fwd, bwd, what, bwd_gathers=0):
    """The whole input or an activation is never gathered: no all-gather in forward; in backward only the
    gradients of plain parameters that met sharded operands at their full size (the positional embedding)."""
    assert "all_gather" not in fwd.calls, f"{what}: forward all-gathers {fwd.calls} {fwd.bytes}"
    assert bwd.calls.get("all_gather", 0) == bwd_gathers, f"{what}: backward collectives {bwd.calls} {bwd.bytes}"


def _check_input_grad(xs, x, what):
    assert st.is_shard_tensor(xs.grad), f"{what}: grad of the sharded input is plain"
    check_grad_layout(xs, what=f"{what}: input grad")
    close(full(xs.grad), x.grad, rtol=RTOL, atol=GRAD_ATOL, what=f"{what} input grad")


# ------------------------------------------------------------------------------------------------------ ViT

def case_vit(mesh_shape, config, layout, seed, strategy="auto"):
    """``layout``: "h" (Shard(2) on a 1-D mesh, uneven rows chosen from ``seed``), "batch_h" (2-D mesh:
    batch on mesh dim 0, height on mesh dim 1) or "h_w" (2-D mesh: height and width). ``strategy``: the
    sequence-parallel attention strategy."""
    with st.use_attention_strategy(strategy):
        return _case_vit(mesh_shape, config, layout, seed)


def _case_vit(mesh_shape, config, layout, seed):
    m = mesh(mesh_shape, ("ddp", "domain") if len(mesh_shape) == 2 else None)
    torch.manual_seed(100 + rank())             # different weights per rank ...
    model = build("vit", config)
    st.sync_module(model, m)                    # ... until synchronised from the mesh's first rank
    ref = copy.deepcopy(model)
    cfg = model.cfg
    x, labels = synthetic.random_images(2, cfg.in_channels, cfg.img_size, cfg.num_classes, seed=seed)
    p = cfg.patch_size
    if layout == "h":
        rows = [p * e for e in uneven_extents(cfg.img_size[0] // p, m.size(), seed)]
        xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: rows})
        ls = labels
    elif layout == "h_w":
        xs = st.distribute_tensor(x, m, [st.Shard(2), st.Shard(3)])
        ls = labels
    else:
        xs = st.distribute_tensor(x, m, [st.Shard(0), st.Shard(2)], sharding_shapes={1: [3 * p, cfg.img_size[0] - 3 * p]})
        ls = st.distribute_tensor(labels, m, [st.Shard(0), st.Replicate()])
    xs.requires_grad_()
    xr = x.clone().requires_grad_()
    with st.CommCounter() as fwd:
        out = model(xs)
    out_ref = ref(xr)
    assert st.is_shard_tensor(out)
    close(full(out), out_ref, rtol=RTOL, atol=ATOL, what="vit output")
    with st.CommCounter() as bwd:
        F.cross_entropy(out, ls).backward()
    F.cross_entropy(out_ref, labels).backward()
    if m.size() > 1 and layout != "h_w":  # h_w: the token flatten gathers the width (test_windows.py)
        _check_no_gather(fwd, bwd, "vit", bwd_gathers=1)  # pos_embed's gradient
    _check_input_grad(xs, xr, "vit")
    _check_grads(model, ref, "vit")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_vit_2d_image(world):
    harness.run(world, case_vit, (world,), "tiny", "h", world)


@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
def test_vit_attention_strategies(strategy):
    harness.run(3, case_vit, (3,), "tiny", "h", 21, strategy)


@pytest.mark.parametrize("world", [2, 3])
def test_vit_3d_volume(world):
    harness.run(world, case_vit, (world,), "tiny3d", "h", 10 + world)


def test_vit_2d_mesh_batch_and_height():
    harness.run(4, case_vit, (2, 2), "tiny", "batch_h", 5)


def test_vit_height_and_width():
    """Tokens "b c h w -> b (h w) c" with h and w sharded on two mesh dims: the flatten keeps the row shard and
    gathers the width (a merged dim is sharded by one mesh dim); the model equals one device."""
    harness.run(4, case_vit, (2, 2), "tiny", "h_w", 5)


# ----------------------------------------------------------------------------------------------- Transolver

def case_transolver(n_points, seed, eps=1e-2):
    m = mesh()
    torch.manual_seed(0)                         # identical seeding on every rank
    model = build("transolver", "tiny", eps=eps)
    ref = copy.deepcopy(model)
    data = synthetic.ellipsoid_surface(n_points, seed=seed, batch=2)
    ext = {0: uneven_extents(n_points, m.size(), seed)}
    emb, fx, target = data["embedding"], data["fx"], data["target"]
    embs = st.distribute_tensor(emb, m, [st.Shard(1)], sharding_shapes=ext).requires_grad_()
    fxs = st.distribute_tensor(fx, m, [st.Shard(1)], sharding_shapes=ext).requires_grad_()
    ts = st.distribute_tensor(target, m, [st.Shard(1)], sharding_shapes=ext)
    embr, fxr = emb.clone().requires_grad_(), fx.clone().requires_grad_()
    with st.CommCounter() as fwd:
        out = model(embs, fxs)
    out_ref = ref(embr, fxr)
    assert st.placements(out) == (st.Shard(1),), f"transolver output placements {st.placements(out)}"
    assert st.sharding_shapes(out) == ext
    close(full(out), out_ref, rtol=RTOL, atol=ATOL, what="transolver output")
    with st.CommCounter() as bwd:
        F.mse_loss(out, ts).backward()
    F.mse_loss(out_ref, target).backward()
    if m.size() > 1:
        _check_no_gather(fwd, bwd, "transolver")
    _check_input_grad(embs, embr, "transolver embedding")
    _check_input_grad(fxs, fxr, "transolver fx")
    _check_grads(model, ref, "transolver")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_transolver(world):
    """The paper's model, including the 1e-2 added to the summed slice weights (a Python scalar added to a
    Partial(sum): the library resolves the pending sum first, so it is added once)."""
    harness.run(world, case_transolver, 61, world)


@pytest.mark.parametrize("world", [2, 3])
def test_transolver_without_slice_eps(world):
    harness.run(world, case_transolver, 61, world, 0.0)


# ----------------------------------------------------------------------------------------------- StormScope

def case_stormscope(rows, seed, attention="reference", mesh_shape=None):
    """``rows``: the height extents on the (last) domain mesh dim; with a 2-D ``mesh_shape`` the batch is
    sharded on mesh dim 0 (the paper's (ddp, domain) layout)."""
    m = mesh(mesh_shape, ("ddp", "domain") if mesh_shape and len(mesh_shape) == 2 else None)
    torch.manual_seed(0)
    model = build("stormscope", "small", img_size=(sum(rows), 56), attention_fn=ATTENTION[attention]())
    _randomize(model, seed)
    ref = copy.deepcopy(model)
    cfg = model.cfg
    batch = synthetic.stormscope_batch(cfg.img_size[0], cfg.img_size[1], seed=seed, batch=2)
    x, sigma, target = batch["x"], batch["sigma"], batch["target"]
    if m.ndim == 1:
        lay = dict(placements=[st.Shard(2)], sharding_shapes={0: list(rows)})
    else:
        lay = dict(placements=[st.Shard(0), st.Shard(2)], sharding_shapes={1: list(rows)})
    xs = st.distribute_tensor(x, m, **lay).requires_grad_()
    ts = st.distribute_tensor(target, m, **lay)
    xr = x.clone().requires_grad_()
    with st.CommCounter() as fwd:
        out = model(xs, sigma)
    out_ref = ref(xr, sigma)
    assert out.shape == (2, stormscope.OUT_CHANNELS, *cfg.img_size)
    assert st.placements(out) == tuple(lay["placements"]), f"stormscope output placements {st.placements(out)}"
    close(full(out), out_ref, rtol=RTOL, atol=ATOL, what="stormscope output")
    with st.CommCounter() as bwd:
        F.mse_loss(out, ts).backward()
    F.mse_loss(out_ref, target).backward()
    if m.size() > 1:
        # pos_embed's gradient; with the batch sharded also the gradient of every (B, C) conditioning vector
        # (6 per block, 2 in the final layer), which is plain and broadcast over the batch-sharded grid.
        gathers = 1 + (6 * cfg.depth + 2 if m.ndim == 2 else 0)
        _check_no_gather(fwd, bwd, "stormscope", bwd_gathers=gathers)
    _check_input_grad(xs, xr, "stormscope")
    _check_grads(model, ref, "stormscope")
    return True


@pytest.mark.parametrize("world,rows", [(1, (32,)), (2, (12, 20)), (3, (8, 12, 12))])
def test_stormscope(world, rows):
    harness.run(world, case_stormscope, rows, world, "reference")


def test_stormscope_2d_mesh_batch_and_height():
    harness.run(4, case_stormscope, (20, 12), 4, "reference", (2, 2))


@needs_library_na
@pytest.mark.parametrize("world,rows", [(2, (12, 20)), (3, (8, 4, 20))])
def test_stormscope_library_attention(world, rows):
    """The same with the library's sharded neighbourhood attention (halo exchange; on 3 ranks the middle rank
    holds one token row, less than the kernel-5 halo)."""
    harness.run(world, case_stormscope, rows, world, "library")


def test_stormscope_default_attention_is_the_library_op():
    model = build("stormscope", "small")
    assert model.attention_fn is stormscope.default_attention
    model.attention_fn = na2d_reference
    assert all(blk.attn.attention_fn is na2d_reference for blk in model.blocks)


# ---------------------------------------------------------------------------------------- synthetic data

def test_configs_match_the_paper():
    vit = build("vit", "full").cfg
    assert (vit.img_size, vit.patch_size, vit.embed_dim, vit.depth, vit.num_heads, vit.mlp_ratio) == \
        ((1024, 1024), 8, 768, 16, 6, 4.0)
    tr = transolver.CONFIGS["drivaerml"]
    assert (tr.n_layers, tr.n_hidden, tr.n_head, tr.slice_num, tr.mlp_ratio, tr.in_dim, tr.out_dim) == \
        (8, 256, 8, 512, 2, 8, 4)
    ss = stormscope.CONFIGS["full"]
    assert (ss.img_size, ss.depth, ss.hidden_size, ss.num_heads, ss.patch_size, ss.attn_kernel) == \
        ((1024, 1792), 16, 768, 16, 4, 31)
    assert (ss.in_channels, ss.out_channels) == (22, 8)


def test_parameter_counts_match_the_paper_report():
    """Built on the meta device (no memory): the ViT's README count at 1024^2 and the report's estimates."""
    def count(*args, **kw):
        with torch.device("meta"):
            return sum(p.numel() for p in build(*args, **kw).parameters())
    assert count("vit", "full") == 126_907_624
    assert count("vit", "full", img_size=(256, 256)) == 115_111_144
    assert 3.9e6 < count("transolver", "drivaerml") < 4.1e6
    assert 2.5e8 < count("stormscope", "full") < 2.7e8          # ~170 M in the blocks + 88 M of pos_embed


def test_random_images_deterministic():
    a, la = synthetic.random_images(2, 3, (16, 24), 10, seed=3)
    b, lb = synthetic.random_images(2, 3, (16, 24), 10, seed=3)
    c, _ = synthetic.random_images(2, 3, (16, 24), 10, seed=4)
    assert a.shape == (2, 3, 16, 24) and a.dtype == torch.float32 and la.shape == (2,)
    assert torch.equal(a, b) and torch.equal(la, lb) and not torch.equal(a, c)
    assert int(la.min()) >= 0 and int(la.max()) < 10
    v, _ = synthetic.random_images(1, 1, (8, 8, 8), 5, seed=0)
    assert v.shape == (1, 1, 8, 8, 8)


def test_ellipsoid_surface():
    d = synthetic.ellipsoid_surface(4000, seed=1, batch=2)
    assert d["embedding"].shape == (2, 4000, 6) and d["fx"].shape == (2, 4000, 2)
    assert d["target"].shape == (2, 4000, 4) and d["areas"].shape == (2, 4000)
    e = synthetic.ellipsoid_surface(4000, seed=1, batch=2)
    assert all(torch.equal(d[k], e[k]) for k in d)
    assert not torch.equal(d["embedding"], synthetic.ellipsoid_surface(4000, seed=2, batch=2)["embedding"])
    # Points on the ellipsoid, unit normals along the gradient of the implicit surface.
    a, b, c = synthetic.CAR_SEMI_AXES
    pos = d["embedding"][..., :3].double() * torch.tensor(synthetic.REFERENCE_SCALE, dtype=torch.float64)
    axes = torch.tensor([a, b, c], dtype=torch.float64)
    torch.testing.assert_close(((pos / axes) ** 2).sum(-1), torch.ones(2, 4000, dtype=torch.float64), atol=1e-5, rtol=0)
    n = d["embedding"][..., 3:].double()
    torch.testing.assert_close(n.norm(dim=-1), torch.ones(2, 4000, dtype=torch.float64), atol=1e-6, rtol=0)
    grad = pos / axes ** 2
    assert ((grad / grad.norm(dim=-1, keepdim=True) - n).abs().max()) < 1e-5
    # The area weights sum to the ellipsoid's area (Knud Thomsen's formula, within its ~1% error).
    pw = 1.6075
    area = 4 * math.pi * (((a * b) ** pw + (a * c) ** pw + (b * c) ** pw) / 3) ** (1 / pw)
    assert abs(float(d["areas"][0].sum()) / area - 1) < 0.02
    # Potential flow: stagnation Cp = 1 at the nose and tail, the minimum on the equator.
    assert float(d["cp"].max()) <= 1.0 + 1e-6 and float(d["cp"].max()) > 0.95
    assert float(d["cp"].min()) < 0
    # The wall shear is tangential.
    assert (d["target"][..., 1:].double() * n).sum(-1).abs().max() < 1e-6


def test_ellipsoid_sphere_limit():
    """For a sphere the analytic solution is Cp = 1 - 9/4 sin^2(theta)."""
    assert abs(synthetic.ellipsoid_depolarisation(1.0, 1.0, 1.0) - 2 / 3) < 1e-7
    d = synthetic.ellipsoid_surface(500, seed=0, semi_axes=(1.0, 1.0, 1.0), dtype=torch.float64)
    nx = d["embedding"][0, :, 3]
    torch.testing.assert_close(d["cp"][0], 1 - 9 / 4 * (1 - nx ** 2))


def test_storm_fields():
    f = synthetic.storm_fields(32, 56, seed=2, batch=2)
    assert f["state"].shape == (2, 8, 32, 56) and f["target"].shape == (2, 8, 32, 56)
    assert f["condition"].shape == (2, len(stormscope.CONDITION_CHANNELS), 32, 56) == (2, 14, 32, 56)
    g = synthetic.storm_fields(32, 56, seed=2, batch=2)
    assert all(torch.equal(f[k], g[k]) for k in f)
    assert not torch.equal(f["state"], synthetic.storm_fields(32, 56, seed=3, batch=2)["state"])
    assert torch.equal(f["condition"][:, :8], f["state"])                      # conditioned on the input state
    assert not torch.equal(f["state"], f["target"])                            # the target is a later time
    # Unit-variance smooth fields: neighbouring pixels are strongly correlated.
    s = f["state"].double()
    assert 0.3 < float(s.std()) < 3
    corr = F.cosine_similarity(s[..., 1:].flatten(), s[..., :-1].flatten(), dim=0)
    assert float(corr) > 0.9
    b = synthetic.stormscope_batch(32, 56, seed=2, batch=2)
    assert b["x"].shape == (2, stormscope.IN_CHANNELS, 32, 56) == (2, 22, 32, 56)
    assert b["sigma"].shape == (2,) and bool((b["sigma"] > 0).all())
    assert b["target"].shape == (2, stormscope.OUT_CHANNELS, 32, 56)
    assert torch.equal(b["x"][:, 8:], f["condition"])


def test_storm_fields_full_size():
    f = synthetic.multiscale_field(1, 1024, 1792, seed=0)
    assert f.shape == (1, 1, 1024, 1792) and torch.isfinite(f).all()
