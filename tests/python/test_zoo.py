"""The model-zoo lane: unmodified models from timm, torchvision, MONAI, segmentation-models-pytorch, diffusers,
neuraloperator, PhysicsNeMo, Hugging Face transformers, torch-harmonics, kornia, MONAI's losses, metrics and transforms and torchaudio (random init, small inputs), run by sharding only their input, against one process: one training step
(output, input gradient, every parameter gradient, every buffer) and one eval forward, and the work must stay
divided (``benchmarks/zoo/zoo_models.py`` builds and judges them; ``benchmarks/zoo/bench.py`` runs the longer
list). Uneven extents, 2 ranks mostly, some at 3, and a 2 x 2 mesh sharding H and W.

The libraries are optional test dependencies (``tests/requirements-zoo.txt``, installed by the Makefile's venv
step); a model whose library is missing is skipped with that reason. A model that fails today because of an
issue-17 item someone is fixing is a strict xfail naming the item: it turns into a failure (to flip) the day the
fix lands. The judge itself is checked on three tiny models that are wrong, not parallel and unsupported on
purpose.
"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import harness  # noqa: E402
import shardtensor as st  # noqa: E402
from benchmarks.zoo import zoo_models  # noqa: E402
from benchmarks.zoo.zoo_models import MODELS, model, run_model  # noqa: E402


def case_zoo(name, mesh_shape=None, shard_dims=None):
    return run_model(name, mesh_shape, shard_dims)


def xfail(item, why):
    return pytest.mark.xfail(strict=True, reason=f"issue 17 item {item}: {why}")


# (model, world, mesh shape, shard dims): every library, every kind of layer the zoo exercises.
ZOO = [
    ("timm/resnet18", 2, None, None),
    ("timm/efficientnet_b0", 3, None, None),
    ("timm/vit_tiny", 2, None, None),
    ("timm/swin_tiny", 2, None, None),
    ("timm/levit_128s", 2, None, None),
    ("monai/SegResNet", 3, None, None),
    ("monai/ViT", 2, None, None),
    ("monai/UNet", 2, None, None),
    ("monai/BasicUNet", 2, None, None),
    ("monai/DenseNet", 4, (2, 2), None),
    ("monai/MaskedAutoEncoderViT", 4, (2, 2), None),  # batch moved onto a mesh dim, x[arange(B)[:, None], ids]
    ("smp/Unet-resnet18", 2, None, None),
    ("smp/FPN", 2, None, None),
    ("diffusers/UNet2DModel", 2, None, None),
    ("neuralop/FNO", 2, None, None),
    ("neuralop/FNO-1d", 3, None, None),
    ("timm/halonet", 2, None, None),          # blocked attention with halos (Tensor.unfold)
    ("torchvision/mc3", 2, None, None),       # video: 3-D convolutions, the time dim sharded
    ("torchvision/raft_small", 2, None, None),  # optical flow: all-pairs correlation, grid_sample lookups
    ("monai/VoxelMorph2d", 3, None, None),    # registration: grid_sample warps of a split image by a split field
    ("timm/repvit_m1", 2, None, None),        # BatchNorm1d head of a global pool (a pending sum's gradient)
    ("timm/mobilenetv4_hybrid", 2, None, None),  # multi-query attention (one broadcast key/value head)
    ("timm/coat_lite", 2, None, None),        # class token sliced off the split tokens and put back (a local cat)
    ("monai/Quicknat", 4, (2, 2), None),      # max-pool indices and max_unpool with height and width split
    ("physicsnemo/GeoTransolver", 4, (2, 2), None),  # a lone Replicate() on a 2-D mesh
    ("monai/MaskedAutoEncoderViT", 3, None, None),  # a random token choice read by a whole index (a routed read)
    ("diffusers/Lumina2Transformer", 2, None, None),  # split tokens written into a new_zeros joint buffer
    ("transformers/swin", 2, None, None),     # Hugging Face: window padding and cyclic shifts in the model
    ("transformers/wav2vec2", 3, None, None),  # a waveform split along time: strided 1-D convs, group norm over time
    ("transformers/deformable_detr", 2, None, None),  # multi-scale deformable attention (grid_sample at offsets)
    ("torch_harmonics/SFNO", 2, None, None),  # spherical harmonic transforms over a split latitude (pending spectra)
    ("torch_harmonics/SphericalSegformer", 3, None, None),  # DISCO convolutions, neighbourhood attention on the sphere
    ("kornia/equalize_clahe", 2, None, None),  # tiles' histograms, bilinear blending between tiles, _assert_async
    ("kornia/LovaszSoftmaxLoss", 3, None, None),  # a loss over errors sorted across every pixel (a distributed sort)
    ("kornia/Canny", 2, None, None),          # non-maximum suppression, hysteresis by a data-dependent loop
    ("monai_losses/GlobalMutualInformationLoss", 2, None, None),  # a Parzen joint histogram over every voxel
    ("monai_losses/SoftclDiceLoss", 3, None, None),  # soft skeletons by iterated 3-D max pooling of a split depth
    ("monai_transforms/ScaleIntensityRangePercentiles", 2, None, None),  # global percentiles of a split volume
    ("monai_metrics/DiceMetric", 2, None, None),  # a metric: forward only
    ("torchvision_det/fasterrcnn_mobilenet_v3_large_320_fpn", 2, None, None),  # RPN, NMS, RoIAlign on split features
    ("tv_transforms/autocontrast", 3, None, None),  # a masked write into a pending per-image min
    ("torchaudio/lfilter_learnable", 3, None, None),  # IIR filters: a scan over the ranks (integrations)
    ("torchaudio/HDemucs", 2, None, None),  # waveform and spectrogram branches (stft / istft) of a split signal
    ("neuralop_losses/H1Loss_nonperiodic_abs", 3, None, None),  # one-sided differences written into zeros_like rows
    ("physicsnemo_healpix/HEALPixUNet", 4, (2, 2), None),  # every face split along H and W: HEALPix padding routed
    ("vit_pytorch/CCT", 2, None, (3,)),       # einops tokens `b (h w) c` of a W-split map, then `x += pos` in place
    ("ddpm/GaussianDiffusion", 2, None, None),  # a diffusion U-Net's training loss: linear and full attention
    ("nnunet/PlainConvUNet3d_deep_supervision", 2, None, None),  # nnU-Net: instance norm, outputs at every scale
    ("torchdiffeq/dopri5_adjoint", 2, None, None),  # neural ODE: adaptive steps agreed by norms, the adjoint backward
    ("aurora/Aurora_rollout", 4, (2, 2), None),  # weather: Perceiver from learned latents, 3-D Swin, a 2-step roll-out
    ("the_well/ReFNO2d", 3, None, None),  # spectral modes chosen by a mask (masked_select kept split, routed backward)
    ("pyg/GAT_knn", 3, None, None),           # PyG: split nodes, whole edge_index, messages scattered to their owners
    ("transformers/autoformer", 3, None, None),  # auto-correlation by FFT along a split time, rolled top-k delays
]
XFAIL = {}


def _param(entry):
    name, world, mesh_shape, dims = entry
    marks = [XFAIL[name]] if name in XFAIL else []
    tag = f"{name}-w{world}" + (f"-mesh{'x'.join(map(str, mesh_shape))}" if mesh_shape else "")
    return pytest.param(name, world, mesh_shape, dims, marks=marks, id=tag)


@pytest.mark.parametrize("name,world,mesh_shape,dims", [_param(e) for e in ZOO])
def test_zoo_model(name, world, mesh_shape, dims):
    reason = zoo_models.available(name)
    if reason:
        pytest.skip(reason)
    results = harness.run(world, case_zoo, name, mesh_shape, dims, timeout=300)
    verdicts = {r["result"] for r in results}
    if "raise" in verdicts:
        harness.discard(world)  # a rank may have raised while another waited in a collective
    assert len(verdicts) == 1, f"{name}: ranks disagree: {[r['result'] + ' ' + r.get('detail', '') for r in results]}"
    r = results[0]
    assert r["result"] == "pass", f"{name}: {r['result']}: {r.get('detail')}\n{r.get('traceback', '')}"


def test_zoo_covers_four_libraries():
    libs = {MODELS[e[0]].library for e in ZOO}
    assert len(ZOO) >= 12 and len(libs) >= 4, (len(ZOO), libs)


# ---- the judge: a wrong result, a replicated activation and an unsupported op are each reported as such; a
# ---- parameter left uninitialised by its library is the same on every rank

class _LocalNormalise(torch.nn.Module):
    """Subtracts the mean of what this rank holds: right on one device, silently wrong when sharded."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        if st.is_shard_tensor(y):
            local = st.to_local(y)
            return st.from_local(local - local.mean(), st.device_mesh(y), st.placements(y), check=False,
                                 sharding_shapes=st.sharding_shapes(y), global_shape=y.shape)
        return y - y.mean()


class _Gathers(torch.nn.Module):
    """Gathers the whole image before its convolutions: right values, but every rank does all the work."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        if st.is_shard_tensor(x):
            x = x.redistribute([st.Replicate()])
        return self.b(torch.relu(self.a(x)))


class _NoRule(torch.nn.Module):
    """An op without a rule (pdist) in strict mode (no fallback: refused on every rank)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        with st.use_strict():
            return torch.nn.functional.pdist(self.conv(x)[0, 0])


class _Uninitialised(torch.nn.Module):
    """A parameter its library forgets to initialise (``torch.empty``, as diffusers' LuminaNextDiT ``pad_token``),
    over memory that holds different values on different ranks: the harness must still give every rank the same
    model (it failed now and then before `zoo_models._build`)."""

    def __init__(self):
        super().__init__()
        import torch.distributed as dist
        rank = dist.get_rank() if dist.is_initialized() else 0
        junk = torch.full((2, 1, 1), float(rank + 1))   # freed just before: the allocator hands its block out again
        del junk
        self.offset = torch.nn.Parameter(torch.empty(2, 1, 1))
        self.conv = torch.nn.Conv2d(2, 2, 3, padding=1)
        torch.nn.init.zeros_(self.conv.bias)   # zero-initialised after it: its draw must not depend on the garbage

    def forward(self, x):
        return self.conv(x) + self.offset


class _GathersInCall(torch.nn.Module):
    """A function-wrapped call (the kornia set's modules) that gathers inside and returns a scalar: no leaf module
    shows it, the per-op count (``share_by_ops``) must."""

    share_by_ops = True

    def forward(self, x):
        if st.is_shard_tensor(x):
            x = x.redistribute([st.Replicate()])
        return torch.nn.functional.avg_pool2d(x.exp(), 3).sum()


for _cls in (_LocalNormalise, _Gathers, _NoRule, _Uninitialised):
    model("torch", f"judge/{_cls.__name__[1:]}", (1, 2, 12, 6))(_cls)
model("torch", "judge/GathersInCall", (1, 2, 12, 6), spatial_out=False)(_GathersInCall)


@pytest.mark.parametrize("name,verdict,detail", [
    ("judge/LocalNormalise", "wrong", "output 0"),
    ("judge/Gathers", "not-parallel", "not sharded"),
    ("judge/NoRule", "raise", "NotImplementedError"),
    ("judge/Uninitialised", "pass", ""),
    ("judge/GathersInCall", "not-parallel", "activations 1.00"),
])
def test_zoo_judge_reports(name, verdict, detail):
    results = harness.run(2, case_zoo, name)
    if verdict == "raise":
        harness.discard(2)
    for r in results:
        assert r["result"] == verdict and detail in r["detail"], r


def test_zoo_judge_relative_error():
    """The judge's comparison: equal non-finite values (NaN on both sides, the same infinity: a clamp bound left at
    +-inf) are equal and do not set the scale; a non-finite value on one side only, or a different infinity, is
    infinitely wrong."""
    from benchmarks.zoo.zoo_models import _rel_err
    inf, nan = float("inf"), float("nan")
    ref = torch.tensor([-inf, 2.0, inf, nan])
    assert _rel_err(ref.clone(), ref) == 0.0
    assert _rel_err(torch.tensor([-inf, 2.5, inf, nan]), ref) == pytest.approx(0.25)  # scaled by the finite max
    for wrong in ([inf, 2.0, inf, nan], [-inf, 2.0, 3.0, nan], [-inf, 2.0, inf, 1.0]):
        assert _rel_err(torch.tensor(wrong), ref) == inf, wrong
    assert _rel_err(torch.zeros(2), torch.zeros(3)) == inf
