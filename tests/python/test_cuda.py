"""Every CUDA path of the library, against the single-device CUDA computation (a GPU machine runs these:
benchmarks/gpu_check.sh; skipped elsewhere).

Several ranks share one GPU over Gloo, so every collective stages CUDA tensors through host memory; NCCL, which
refuses two ranks on one GPU, runs as a 1-rank mesh. The custom kernels:
  csrc_cuda/halo_pack.cu              halos of conv / pad / pool / interpolate: pack (2-, 4- and 8-byte rows) and
                                      the atomic add of the backward (float and double, repeated rows of reflect pad)
  csrc_cuda/lse_merge.cu              the ring attention merge, after PyTorch's fused blocks (memory-efficient fp32,
                                      flash bf16) and the fp32 math blocks of masks
  csrc_cuda/neighborhood_attention.cu sharded 2-D neighbourhood attention, forward and backward
  csrc_cuda/point_search.cu           sharded knn / radius search (a ring of point blocks)
plus scatter_tensor from a CPU source onto a CUDA mesh, and a 2-D mesh. TF32 is off in every rank
(cases_util.setup_device), so the CPU suite's tolerances hold.

SHARDTENSOR_TEST_DEVICE=cpu runs the same cases on the CPU (the NCCL case is skipped there): the dry run of
benchmarks/gpu_check.sh checks the cases themselves on a machine without a GPU.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, narrow_extents, randn, rank, setup_device, suite_device, \
    tiny_extents, uneven_extents
from shardtensor.ops import knn, neighborhood_attention2d, radius_search

DEVICE = suite_device()
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these on a GPU machine; "
                                       "SHARDTENSOR_TEST_DEVICE=cpu runs them on the CPU)")
TIMEOUT = 300


def _on(device, *ts):
    return [t.to(device) for t in ts]


def case_elementwise(seed, device):
    device = setup_device(device)
    m = mesh()
    w = m.size()
    x, y = _on(device, randn(5, 7, 6, seed=seed), randn(7, 6, seed=seed + 1))
    lay = ([st.Shard(1)], {0: uneven_extents(7, w, seed)})
    check_op(lambda a, b: (a * b).relu().sum(1), [x, y], [lay, None], m, rtol=1e-4, atol=1e-5, what="pointwise/sum")
    check_op(lambda a: a.transpose(0, 1).reshape(7, 30).var(0), [x], [lay], m, rtol=1e-4, atol=1e-5, what="views/var")
    check_op(lambda a: F.layer_norm(a, (6,)), [x], [([st.Shard(2)], None)], m, rtol=1e-4, atol=1e-5, what="layer_norm")
    check_op(lambda a, b: a @ b.T, [x, y], [lay, None], m, rtol=1e-4, atol=1e-5, what="matmul (TF32 off)")
    return True


def case_halo(seed, device):
    device = setup_device(device)
    m = mesh()
    w = m.size()
    img = randn(2, 3, 11, 9, seed=seed).to(device)
    weight = randn(4, 3, 3, 3, seed=3).to(device)
    for ext in (uneven_extents(11, w, seed + 2), narrow_extents(11, w)):
        ilay = ([st.Shard(2)], {0: ext})
        check_op(lambda t, k: F.conv2d(t, k, padding=2, dilation=2), [img, weight], [ilay, None], m, rtol=1e-4,
                 atol=1e-4, what=f"conv halo {ext}")
        check_op(lambda t: F.pad(t, (1, 1, 2, 1), mode="reflect"), [img], [ilay], m,
                 what=f"reflect pad, repeated rows in backward {ext}")
        check_op(lambda t: F.max_pool2d(t, 3, stride=2, padding=1), [img], [ilay], m, what=f"max_pool {ext}")
        check_op(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), [img], [ilay], m, rtol=1e-4, atol=1e-5,
                 what=f"bilinear {ext}")
    # Even layouts: the window-free transposed convolution (border calls' rows sent home), the fused
    # interpolation kernel as the main call, adaptive average pooling over the halo without a window, and as a
    # plain pooling where the sizes divide.
    even = randn(2, 3, 12, 9, seed=seed + 5).to(device)
    elay = ([st.Shard(2)], {0: [12 // w] * w})
    tweight = randn(3, 4, 4, 4, seed=5).to(device)
    check_op(lambda t, k: F.conv_transpose2d(t, k, stride=2, padding=1), [even, tweight], [elay, None], m, rtol=1e-4,
             atol=1e-4, what="transposed conv, own rows written by the main call")
    for mode in ("bilinear", "bicubic", "nearest"):
        kw = {} if mode == "nearest" else dict(align_corners=False)
        check_op(lambda t: F.interpolate(t, scale_factor=2, mode=mode, **kw), [even], [elay], m, rtol=1e-4,
                 atol=1e-4, what=f"{mode} x2, fused main call")
    check_op(lambda t: F.adaptive_avg_pool2d(t, (5, 4)), [even], [elay], m, rtol=1e-4, atol=1e-5,
             what="adaptive avg over the halo")
    check_op(lambda t: F.adaptive_max_pool2d(t, (4, 3), return_indices=True), [even], [elay], m,
             what="adaptive max as a plain pooling")
    # 8-byte rows: packed and added back in double.
    lay = ([st.Shard(2)], {0: uneven_extents(11, w, seed + 3)})
    check_op(lambda t, k: F.conv2d(t, k, padding=1), [img.double(), weight.double()], [lay, None], m, rtol=1e-10,
             atol=1e-10, what="conv halo float64")
    if device.type == "cuda":
        # 2-byte rows (CPU convolutions lack fp16): forward only, against the same fp16 convolution on one device.
        check_op(lambda t, k: F.conv2d(t, k, padding=1), [img.half(), weight.half()], [lay, None], m, grad=False,
                 rtol=1e-2, atol=1e-2, what="conv halo float16")
    return True


def case_attention(seed, device):
    device = setup_device(device)
    m = mesh()
    w = m.size()
    q, k, v = _on(device, randn(1, 2, 9, 8, seed=4), randn(1, 2, 9, 8, seed=5), randn(1, 2, 9, 8, seed=6))
    slay = ([st.Shard(2)], {0: uneven_extents(9, w, seed + 3)})
    # Head dim 8: the ring's blocks run PyTorch's fused kernels on CUDA (memory-efficient fp32 forward and
    # backward, flash bf16 forward) and the log-sum-exp merge kernel; the mask takes the fp32 math path.
    mask = (randn(9, 9, seed=7) > 0).to(device) | torch.eye(9, dtype=torch.bool, device=device)
    for strategy in ("ring", "ring_contiguous", "all_to_all"):
        with st.use_attention_strategy(strategy):
            for causal in (False, True):
                check_op(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), [q, k, v],
                         [slay, slay, slay], m, rtol=1e-3, atol=1e-4, what=f"sdpa {strategy} causal={causal}")
            check_op(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask), [q, k, v],
                     [slay, slay, slay], m, rtol=1e-3, atol=1e-4, what=f"sdpa mask {strategy}")
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            args = [st.distribute_tensor(t.bfloat16(), m, slay[0], slay[1]) for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*args, is_causal=True).full_tensor().float()
            assert (out - ref).abs().max().item() < 3e-2, f"bf16 sdpa {strategy}"
    return True


def case_neighborhood(seed, device):
    device = setup_device(device)
    m = mesh()
    w = m.size()
    q, k, v = _on(device, randn(1, 11, 7, 2, 40, seed=seed), randn(1, 11, 7, 2, 40, seed=seed + 1),
                  randn(1, 11, 7, 2, 24, seed=seed + 2))
    for kernel, dil in (((5, 3), (1, 1)), ((3, 3), (2, 2))):
        for ext in (uneven_extents(11, w, seed), narrow_extents(11, w)):
            lay = ([st.Shard(1)], {0: ext})
            check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, kernel, dilation=dil), [q, k, v], [lay] * 3,
                     m, rtol=1e-4, atol=1e-5, what=f"neighbourhood attention K={kernel} d={dil} ext={ext}")
    return True


def case_point_search(seed, device):
    device = setup_device(device)
    m = mesh()
    w = m.size()
    rep = ([st.Replicate()], None)
    for dtype in (torch.float32, torch.float64):
        p, q = _on(device, randn(13, 3, seed=seed, dtype=dtype), randn(9, 3, seed=seed + 1, dtype=dtype))
        pl = ([st.Shard(0)], {0: tiny_extents(13, w)})
        ql = ([st.Shard(0)], {0: uneven_extents(9, w, seed)})
        for k in (1, 5, 13):  # register top-k lists
            check_op(lambda a, b: knn(a, b, k), [p, q], [pl, ql], m, rtol=1e-6, atol=1e-6, what=f"knn {dtype} k={k}")
        check_op(lambda a, b: knn(a, b, 4), [p, q], [pl, rep], m, rtol=1e-6, atol=1e-6, what=f"knn {dtype} q replicated")

        def radius(a, b):
            idx, d = radius_search(a, b, 1.2, 6)
            return idx, torch.where(idx >= 0, d, torch.zeros_like(d))

        check_op(radius, [p, q], [pl, ql], m, rtol=1e-6, atol=1e-6, what=f"radius {dtype}")
    # k > 32: the top-k list in the output row instead of registers.
    p = randn(45, 3, seed=seed + 2).to(device)
    check_op(lambda a, b: knn(a, b, 40), [p, q.float()], [([st.Shard(0)], {0: uneven_extents(45, w, seed)}), ql], m,
             rtol=1e-6, atol=1e-6, what="knn k=40")
    return True


_cuda_meshes = {}


def case_scatter_cpu_source(device):
    """A CPU tensor scattered onto a mesh of `device`'s type: every rank's shard lands on the mesh's device."""
    device = setup_device(device)
    w = dist.get_world_size()
    if device.type not in _cuda_meshes:
        _cuda_meshes[device.type] = init_device_mesh(device.type, (w,), mesh_dim_names=("domain",))
    m = _cuda_meshes[device.type]
    x = randn(5, 7, seed=11)
    for pl, ext in (([st.Shard(1)], {0: uneven_extents(7, w, 2)}), ([st.Replicate()], None)):
        s = st.scatter_tensor(x if rank() == 0 else None, 0, m, pl, sharding_shapes=ext)
        assert st.to_local(s).device == device, f"{pl}: shard on {st.to_local(s).device}, mesh on {device}"
        close(full(s).cpu(), x, what=f"scatter {pl}")
    return True


def case_two_d_mesh(device):
    device = setup_device(device)
    m = mesh((2, 2))
    img = randn(2, 3, 9, 10, seed=21).to(device)
    weight = randn(4, 3, 3, 3, seed=22).to(device)
    lay = ([st.Shard(2), st.Shard(3)], {0: [2, 7], 1: [10, 0]})
    check_op(lambda t, k: F.conv2d(t, k, padding=1), [img, weight], [lay, None], m, rtol=1e-4, atol=1e-4,
             what="2-D mesh conv halo")
    # Every rank window-free, forward and backward (gradient pieces home through the steps in reverse).
    check_op(lambda t, k: F.conv2d(t, k, padding=1), [img, weight], [([st.Shard(2), st.Shard(3)], None), None], m,
             rtol=1e-4, atol=1e-4, what="2-D mesh conv, window-free backward")
    check_op(lambda t: F.layer_norm(t, (10,)).sum((2, 3)), [img], [lay], m, rtol=1e-4, atol=1e-5,
             what="2-D mesh layer_norm + sum")
    return True


_nccl = {}


def case_nccl_one_rank():
    """NCCL as far as one GPU allows: a 1-rank NCCL mesh (no host staging) with CUDA tensors."""
    device = setup_device("cuda")
    if "mesh" not in _nccl:
        group = dist.new_group([dist.get_rank()], backend="nccl")
        _nccl["mesh"] = DeviceMesh.from_group(group, "cuda", mesh_dim_names=("domain",))
    m = _nccl["mesh"]
    img, weight = randn(2, 3, 11, 9, seed=31).to(device), randn(4, 3, 3, 3, seed=32).to(device)
    check_op(lambda t, k: F.conv2d(t, k, padding=1), [img, weight], [([st.Shard(2)], None), None], m, rtol=1e-4,
             atol=1e-4, what="nccl conv")
    q, k, v = (randn(1, 2, 9, 8, seed=s).to(device) for s in (33, 34, 35))
    lay = ([st.Shard(2)], None)
    check_op(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), [q, k, v], [lay] * 3, m,
             rtol=1e-3, atol=1e-4, what="nccl sdpa")
    s = st.scatter_tensor(img.cpu(), dist.get_rank(), m, [st.Shard(2)])
    assert st.to_local(s).device == device
    close(full(s), img, what="nccl scatter from a CPU source")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_elementwise(world):
    harness.run(world, case_elementwise, world, DEVICE, timeout=TIMEOUT)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_halo(world):
    harness.run(world, case_halo, world, DEVICE, timeout=TIMEOUT)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_attention(world):
    harness.run(world, case_attention, world, DEVICE, timeout=TIMEOUT)


@pytest.mark.parametrize("world", [2, 3])
def test_neighborhood(world):
    harness.run(world, case_neighborhood, world, DEVICE, timeout=TIMEOUT)


@pytest.mark.parametrize("world", [2, 3])
def test_point_search(world):
    harness.run(world, case_point_search, world, DEVICE, timeout=TIMEOUT)


def test_scatter_cpu_source():
    harness.run(2, case_scatter_cpu_source, DEVICE, timeout=TIMEOUT)


def test_two_d_mesh():
    harness.run(4, case_two_d_mesh, DEVICE, timeout=TIMEOUT)


@pytest.mark.skipif(DEVICE != "cuda", reason="NCCL needs CUDA tensors")
def test_nccl_one_rank():
    harness.run(1, case_nccl_one_rank, timeout=TIMEOUT)
