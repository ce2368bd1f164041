"""The zoo's failure patterns: what each is, the issue item that covers it (issue 17 of the project) and a one-line
repro (``xs`` = a ShardTensor ``st.distribute_tensor(x, mesh, [st.Shard(2)])`` of an image ``x`` (B, C, H, W)
unless said otherwise). ``classify(row)`` names the first pattern whose regular expression matches a row's error;
``bench.py`` groups its failures by them. A new failure that matches none is listed as *unclassified*: add it here.
"""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass
class Pattern:
    key: str
    regex: str      # searched in the row's detail ("[stage] Type: first line")
    what: str
    repro: str


PATTERNS = [
    Pattern("rank-divergent refusal (as_strided_ on a Partial, channels-last global pooling)",
            r"as_strided_ has no domain-parallel rule",
            "`F.adaptive_avg_pool2d(x, 1)` of a channels-last sharded activation (timm's ConvNeXt/EdgeNeXt after "
            "their LayerNorm2d permutes) restrides its Partial(sum) result with `as_strided_`, which has no rule. "
            "Worse: only the ranks whose local strides differ reach that call (rank-local strides decide), so the "
            "other ranks go on to the next collective and wait until the Gloo timeout, and the process group is "
            "left unusable (the next model's first collective fails). Issue 17 item 4 (channels-last global "
            "pooling, strides of Partial results); the rank divergence breaks 'raise on every rank'.",
            "F.adaptive_avg_pool2d(xs.contiguous(memory_format=torch.channels_last), 1)"),
    Pattern("in-place op on a view under autograd (as_strided in backward)",
            r"as_strided has no domain-parallel rule \(only the identity",
            "A non-identity `as_strided` in the backward: autograd's replay of an in-place op on a view goes "
            "through `as_strided`. MONAI's BasicUNet/DynUNet/UNETR: `nn.LeakyReLU(inplace=True)` on InstanceNorm's "
            "output (a view of the batch-norm result; found with SHARDTENSOR_ZOO_ANOMALY=1); timm's GhostNet: "
            "in-place ReLU after `out[:, :c]`. Issue 17 item 2.",
            "F.leaky_relu(F.instance_norm(xs.requires_grad_()), inplace=True).sum().backward()"),
    Pattern("generic in-place pointwise (hardtanh_, ReLU6(inplace=True))", r"aten::(hardtanh_|\w+_) has no domain-parallel rule",
            "An in-place activation without a rule: `nn.ReLU6(inplace=True)` is `hardtanh_` (smp's mobilenet_v2 "
            "encoder). Issue 17 item 3.",
            "F.relu6(xs, inplace=True)"),
    Pattern("PReLU", r"_prelu_kernel has no domain-parallel rule",
            "`nn.PReLU` (MONAI's default activation in UNet/AttentionUnet, PhysicsNeMo's SRResNet) has no rule. "
            "Issue 17 item 3.",
            "F.prelu(xs, torch.tensor([0.25]))"),
    Pattern("flatten(0, 1) with an inner sharded dim", r"aten::view from \[[\d, ]+\] to \[\d+, \d+\] with \(Shard\(1\)\)",
            "Merging the batch dim into a sharded token or row dim (LeViT's `bn(x.flatten(0, 1)).reshape_as(x)`; "
            "diffusers' VQModel flattening (B, H, W, C) to (B*H*W, C) for its codebook distances). Issue 17 item 6.",
            "st.distribute_tensor(torch.randn(2, 16, 8), m, [st.Shard(1)]).flatten(0, 1)"),
    Pattern("view of a permuted sharded gradient (not covered by an item)",
            r"aten::view from \[\d+, \d+, \d+, \d+\] to \[\d+, \d+, \d+\] with \(Shard\(2\)\)",
            "In the backward of smp's MAnet position attention (`x.view(B, C, H*W).permute(0, 2, 1)` then `bmm`), "
            "the gradient reaches the view's backward laid out so that the merge [B, C, H, W] -> [B, H*W, C] is not a "
            "contiguous block with H outermost; refused. Not obviously one of issue 17's items (closest: item 1's "
            "stride audit).",
            "q = xs.view(2, 8, -1).permute(0, 2, 1); (q @ q.transpose(1, 2)).softmax(-1).bmm(q).sum().backward()"),
    Pattern("window partition (merge of the window grid into the batch)",
            r"aten::view from \[[\d, ]+\] to \[[\d, ]+\] with \(Shard",
            "Swin-style window partition `x.view(B, H//w, w, W//w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, w, w, "
            "C)` with H sharded (timm Swin, MONAI SwinUNETR), and MobileViT's unfolding of 2x2 patches into the "
            "batch. Issue 17 item 5 (views) and 6.",
            "xs.permute(0, 2, 3, 1).reshape(2, 2, 7, 2, 7, 8).permute(0, 1, 3, 2, 4, 5).reshape(-1, 7, 7, 8)  # x (2, 8, 14, 14)"),
    Pattern("FFT along a sharded dim (not covered by an item)", r"_fft_(r2c|c2r|c2c) has no domain-parallel rule",
            "Spectral layers (neuraloperator's FNO/TFNO/UNO SpectralConv, PhysicsNeMo's FNO and AFNO) take "
            "`torch.fft.rfftn` over every spatial dim, including the sharded one. Refused on every rank (no "
            "distributed FFT); no item of issue 17 covers it (a pencil/slab transpose: all-to-all to shard another "
            "dim, FFT, all-to-all back, would).",
            "torch.fft.rfft2(xs)"),
    Pattern("plain tensors look like ShardTensors (hasattr(t, 'redistribute'))",
            r"redistribute: expected a ShardTensor, got a plain tensor",
            "`import shardtensor` adds `redistribute`, `full_tensor` and `to_local` methods to every `torch.Tensor`, "
            "so duck typing breaks: PhysicsNeMo's physics attention checks `hasattr(qkv, 'redistribute')` to detect "
            "its own ShardTensor and then calls it on a plain tensor, so PhysicsNeMo's Transolver fails even in the "
            "single-process run once shardtensor is imported. Not covered by an item (the methods should raise "
            "AttributeError on plain tensors, as the properties already do).",
            "import shardtensor; hasattr(torch.randn(2), 'redistribute')  # True"),
    Pattern("the output lost its shard: a select of one index of a sharded dim was replicated (issue 29 item 3)",
            r"the output is \(Replicate\(\),\) \(not sharded\)",
            "PhysicsNeMo's Pangu folds (levels, lat, lon) into one token dim, `x.reshape(B, C, -1).transpose(1, 2)`, "
            "with lat sharded: a shard of a middle dim is not a block of the merged dim, so the merge re-lays it "
            "out as a block of the tokens, i.e. on the outer levels dim (an all-to-all; the work stays divided), and "
            "every later view keeps it there. `output[:, :, 0]` (the surface level) then lives on one rank; `select` "
            "used to replicate it, so the surface patch recovery ran whole on every rank and the surface output was "
            "Replicate. Fixed (issue 29 item 3): a select along a sharded dim whose result has 3 or more dims is "
            "scattered from the owner along the selected dim's neighbour (here lat: one all-to-all of the slice), so "
            "the surface output is sharded along lat and the upper-air output along its levels. FengWu's per-variable "
            "decoders `x[:, i]` (the 6-variable dim holds the shard after its tokens merge) were replicated the same "
            "way (act. share 0.69 on 2 ranks; now 0.5). A model matching this now replicates its output elsewhere.",
            "t = xs.unsqueeze(2).expand(-1, -1, 8, -1, -1).reshape(2, 8, -1)  # xs (2, 8, H, W) Shard(2): "
            "t's shard is on the 8 'levels'; t.view(2, 8, 8, H, W)[:, :, 0] was replicated, is now Shard(2)"),
    Pattern("peer failed (a rank raised or timed out earlier)", r"DistBackendError|Connection closed by peer",
            "A collective failed because another rank raised, died or issued a different collective (see that "
            "rank's error; the run restarts the pool after every failure).",
            ""),
]


def classify(row: dict) -> str:
    """The key of the first pattern matching a failed row's error, or ''."""
    if row.get("result") in ("pass", "skip"):
        return ""
    text = row.get("detail", "")
    for p in PATTERNS:
        if re.search(p.regex, text):
            return p.key
    return ""
