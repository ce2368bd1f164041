"""CUDA local tensors (run on a GPU machine; skipped elsewhere). Several ranks share one GPU over Gloo, so every
collective stages through host memory; this exercises the CUDA halo pack/add kernels (csrc_cuda/halo_pack.cu), the
staging paths and the CUDA dispatch of the handlers against single-device CUDA results."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, mesh, randn, uneven_extents

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run benchmarks/gpu_check.sh on the GPU machine)")


def _cuda(*ts):
    return [t.cuda() for t in ts]


def case_cuda_ops(seed):
    torch.cuda.set_device(0)
    m = mesh()
    w = m.size()
    x, y = _cuda(randn(5, 7, 6, seed=seed), randn(7, 6, seed=seed + 1))
    lay = ([st.Shard(1)], {0: uneven_extents(7, w, seed)})
    check_op(lambda a, b: (a * b).relu().sum(1), [x, y], [lay, None], m, rtol=1e-4, atol=1e-5, what="cuda pointwise/sum")
    check_op(lambda a: a.transpose(0, 1).reshape(7, 30).var(0), [x], [lay], m, rtol=1e-4, atol=1e-5, what="cuda views/var")
    check_op(lambda a: F.layer_norm(a, (6,)), [x], [([st.Shard(2)], None)], m, rtol=1e-4, atol=1e-5, what="cuda layer_norm")
    img = randn(2, 3, 11, 9, seed=seed).cuda()
    ilay = ([st.Shard(2)], {0: uneven_extents(11, w, seed + 2)})
    check_op(lambda t, k: F.conv2d(t, k, padding=2, dilation=2), [img, randn(4, 3, 3, 3, seed=3).cuda()], [ilay, None], m,
             rtol=1e-4, atol=1e-4, what="cuda conv halo")
    check_op(lambda t: F.pad(t, (1, 1, 2, 1), mode="reflect"), [img], [ilay], m, what="cuda reflect pad (repeated rows)")
    check_op(lambda t: F.max_pool2d(t, 3, stride=2, padding=1), [img], [ilay], m, what="cuda max_pool")
    check_op(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), [img], [ilay], m, rtol=1e-4, atol=1e-5,
             what="cuda bilinear")
    q, k, v = _cuda(randn(1, 2, 9, 8, seed=4), randn(1, 2, 9, 8, seed=5), randn(1, 2, 9, 8, seed=6))
    slay = ([st.Shard(2)], {0: uneven_extents(9, w, seed + 3)})
    # Head dim 8: the ring's blocks run the fused kernels (memory-efficient fp32 forward/backward, flash bf16
    # forward) and the CUDA log-sum-exp merge (csrc_cuda/lse_merge.cu); the mask takes the fp32 math path.
    for strategy in ("ring", "ring_contiguous", "all_to_all"):
        with st.use_attention_strategy(strategy):
            for causal in (False, True):
                check_op(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), [q, k, v],
                         [slay, slay, slay], m, rtol=1e-3, atol=1e-4, what=f"cuda sdpa {strategy} causal={causal}")
            mask = (randn(9, 9, seed=7) > 0).cuda() | torch.eye(9, dtype=torch.bool, device="cuda")
            check_op(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask), [q, k, v],
                     [slay, slay, slay], m, rtol=1e-3, atol=1e-4, what=f"cuda sdpa mask {strategy}")
            qb, kb, vb = (t.bfloat16() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            args = [st.distribute_tensor(t, m, slay[0], slay[1]) for t in (qb, kb, vb)]
            out = F.scaled_dot_product_attention(*args, is_causal=True).full_tensor().float()
            assert (out - ref).abs().max().item() < 3e-2, f"cuda bf16 sdpa {strategy}"
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_cuda_ops(world):
    harness.run(world, case_cuda_ops, world, timeout=300)
