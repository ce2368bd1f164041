"""Losses, logsumexp, cumsum and flip over sharded dims against single-device results: every reduction,
segmentation-style cross entropy with sharded spatial or class dims, class weights and ignore_index, uneven shards."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, uneven_extents


def case_pointwise_losses(seed):
    m = mesh()
    x, t = randn(4, 9, seed=seed), randn(4, 9, seed=seed + 1)
    lay = ([st.Shard(1)], {0: uneven_extents(9, m.size(), seed)})
    for red in ("none", "mean", "sum"):
        check_op(lambda a, b: F.mse_loss(a, b, reduction=red), [x, t], [lay, lay], m, what=f"mse {red}")
        check_op(lambda a, b: F.l1_loss(a, b, reduction=red), [x, t], [lay, None], m, what=f"l1 {red}")
        check_op(lambda a, b: F.smooth_l1_loss(a, b, reduction=red, beta=0.5), [x, t], [lay, lay], m, what=f"smooth_l1 {red}")
        check_op(lambda a, b: F.huber_loss(a, b, reduction=red, delta=0.7), [x, t], [lay, lay], m, what=f"huber {red}")
    return True


def case_cross_entropy(seed):
    m = mesh()
    w = m.size()
    logits = randn(2, 5, 7, 4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 5, (2, 7, 4), generator=g)
    target[0, 0, :2] = -100
    cls_w = torch.rand(5, generator=g) + 0.5
    lay_x = ([st.Shard(2)], {0: uneven_extents(7, w, seed)})
    lay_t = ([st.Shard(1)], {0: uneven_extents(7, w, seed)})
    for red in ("mean", "sum", "none"):
        check_op(lambda a, t: F.cross_entropy(a, t, reduction=red), [logits, target], [lay_x, lay_t], m,
                 rtol=1e-5, atol=1e-5, what=f"cross_entropy {red}")
        # Class weights are constants (nll_loss is not differentiable in them).
        check_op(lambda a, t: F.cross_entropy(a, t, weight=cls_w, reduction=red), [logits, target],
                 [lay_x, lay_t], m, rtol=1e-5, atol=1e-5, what=f"weighted cross_entropy {red}")
    flat, tflat = randn(11, 5, seed=seed + 3), torch.randint(0, 5, (11,), generator=g)
    check_op(lambda a, t: F.cross_entropy(a, t), [flat, tflat],
             [([st.Shard(0)], {0: uneven_extents(11, w, seed + 1)}), ([st.Shard(0)], {0: uneven_extents(11, w, seed + 1)})],
             m, rtol=1e-5, atol=1e-5, what="2-d cross_entropy batch-sharded")
    return True


def case_cross_entropy_class_sharded(seed):
    """Cross entropy with the class dim sharded (vocab-parallel logits, a channel-sharded field): each rank picks the
    targets in its own classes, the loss and total weight sum over the class mesh dim, the gradient stays on each
    rank's classes; ignore_index, class weights, every reduction, a rank without classes; a 2-D mesh with the batch
    sharded too."""
    m = mesh()
    w = m.size()
    g = torch.Generator().manual_seed(seed)
    logits = randn(6, 7, 3, seed=seed)
    target = torch.randint(0, 7, (6, 3), generator=g)
    target[0, 0] = -100
    target[1, 2] = 3
    cls_w = torch.rand(7, generator=g) + 0.5
    target3 = target.clone()
    target3[0, 0] = 3  # ignore_index=3 below: -100 would be out of range there, as on one device
    lays = [([st.Shard(1)], {0: uneven_extents(7, w, seed)})]
    if w == 3:
        lays.append(([st.Shard(1)], {0: [3, 0, 4]}))
    with st.use_strict():
        for lay in lays:
            for red in ("mean", "sum", "none"):
                check_op(lambda a, t: F.cross_entropy(a, t, reduction=red), [logits, target], [lay, None], m,
                         rtol=1e-5, atol=1e-5, what=f"cross_entropy classes sharded {red}")
                check_op(lambda a, t: F.cross_entropy(a, t, weight=cls_w, reduction=red, ignore_index=3),
                         [logits, target3], [lay, None], m, rtol=1e-5, atol=1e-5,
                         what=f"weighted cross_entropy classes sharded, ignore 3, {red}")
            check_op(lambda a, t: F.nll_loss(a, t), [logits[:, :, 0], target[:, 0]], [lay, None], m,
                     rtol=1e-5, atol=1e-5, what="nll_loss (N, C)")
            check_op(lambda a, t: F.nll_loss(a, t, reduction="sum"), [logits[0, :, 0], target[2, 0]],
                     [([st.Shard(0)], lay[1]), None], m, rtol=1e-5, atol=1e-5, what="nll_loss (C)")
    return True


def case_cross_entropy_class_sharded_2d(seed):
    m = mesh((2, 2), ("batch", "classes"))
    g = torch.Generator().manual_seed(seed)
    logits = randn(4, 6, 5, 3, seed=seed)
    target = torch.randint(0, 6, (4, 5, 3), generator=g)
    lay = ([st.Shard(0), st.Shard(1)], {0: [1, 3], 1: [4, 2]})
    with st.use_strict():
        for red in ("mean", "none"):
            check_op(lambda a, t: F.cross_entropy(a, t, reduction=red), [logits, target], [lay, None], m,
                     rtol=1e-5, atol=1e-5, what=f"cross_entropy batch and classes sharded {red}")
    return True


def case_scans(seed):
    m = mesh()
    x = randn(3, 8, 5, seed=seed)
    lay = ([st.Shard(1)], {0: uneven_extents(8, m.size(), seed)})
    check_op(lambda t: torch.logsumexp(t, 1), [x], [lay], m, rtol=1e-5, atol=1e-5, what="logsumexp sharded")
    check_op(lambda t: torch.logsumexp(t, (0, 1), keepdim=True), [x], [lay], m, rtol=1e-5, atol=1e-5, what="logsumexp 2 dims")
    check_op(lambda t: torch.logsumexp(t, 2), [x], [lay], m, what="logsumexp unsharded")
    check_op(lambda t: torch.cumsum(t, 1), [x], [lay], m, rtol=1e-5, atol=1e-5, what="cumsum sharded")
    check_op(lambda t: torch.cumsum(t, 0), [x], [lay], m, what="cumsum unsharded")
    check_op(lambda t: torch.flip(t, (1, 2)), [x], [lay], m, what="flip")
    # Scans along the sharded dim (strict: rules), including a rank without rows when there are three.
    zlay = ([st.Shard(1)], {0: [3, 0, 5]}) if m.size() == 3 else lay
    y = 0.8 + 0.4 * torch.rand(3, 8, 5, generator=torch.Generator().manual_seed(seed))  # products stay moderate
    with st.use_strict():
        for lay_ in (lay, zlay):
            check_op(lambda t: torch.cumprod(t, 1), [y], [lay_], m, rtol=1e-5, atol=1e-6, what="cumprod sharded")
            check_op(lambda t: torch.cumprod(t, 1, dtype=torch.float64), [y], [lay_], m, rtol=1e-5, atol=1e-6,
                     what="cumprod float64")
            check_op(lambda t: torch.logcumsumexp(t, 1), [x], [lay_], m, rtol=1e-5, atol=1e-5,
                     what="logcumsumexp sharded")
        check_op(lambda t: torch.cumprod(t, 2), [y], [lay], m, what="cumprod unsharded")
        # zeros: aten's gradient writes into a plain zeros tensor of the global size; the rule's own formula
        # (first zero of each slice, zeros after it, a slice without zeros, two zeros) keeps the layout
        yz = y.clone()
        yz[0, 1, :] = 0
        yz[1, 3, 2] = yz[1, 6, 2] = 0
        yz[2, 7, 4] = 0
        for lay_ in (lay, zlay):
            check_op(lambda t: torch.cumprod(t, 1), [yz], [lay_], m, rtol=1e-5, atol=1e-6, what="cumprod zeros")
        check_op(lambda t: torch.cumprod(t, 2), [yz], [lay], m, rtol=1e-5, atol=1e-6, what="cumprod zeros unsharded")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_pointwise_losses(world):
    harness.run(world, case_pointwise_losses, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cross_entropy(world):
    harness.run(world, case_cross_entropy, world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_cross_entropy_class_sharded(world):
    harness.run(world, case_cross_entropy_class_sharded, world)


def test_cross_entropy_class_sharded_2d():
    harness.run(4, case_cross_entropy_class_sharded_2d, 4)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_scans(world):
    harness.run(world, case_scans, world)


def case_scans_empty_block(seed):
    """Scans along a split dim on a 2x2 mesh whose other mesh dim gives half the ranks no batch rows: their totals
    are empty, and the prefix exchange must still give every rank its (empty) result instead of raising on some
    ranks only (which left the others waiting in their next collective)."""
    m = mesh((2, 2), ("b", "h"))
    x = randn(1, 4, 14, 6, seed=seed, dtype=torch.float64)
    lay = ([st.Shard(0), st.Shard(2)], {0: [0, 1], 1: [10, 4]})
    y = 0.8 + 0.4 * torch.rand(1, 4, 14, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    with st.use_strict():
        check_op(lambda t: torch.cumsum(t, 2), [x], [lay], m, what="cumsum, empty batch block")
        check_op(lambda t: torch.cumprod(t, 2), [y], [lay], m, what="cumprod, empty batch block")
        check_op(lambda t: torch.logcumsumexp(t, 2), [x], [lay], m, what="logcumsumexp, empty batch block")
        check_op(lambda t: F.interpolate(torch.cumsum(t, 2), scale_factor=2), [x], [lay], m,
                 what="cumsum then a halo op")
    return True


def test_scans_empty_block():
    harness.run(4, case_scans_empty_block, 4)


def case_binary_cross_entropy(seed):
    """Segmentation-style BCE over sharded spatial dims (uneven), with and without logits, every reduction, per-pixel
    weights, a per-channel pos_weight (plain), and the targets sharded or plain; gradients of input and target."""
    m = mesh()
    x = randn(2, 3, 7, 5, seed=seed) * 3
    p = torch.sigmoid(randn(2, 3, 7, 5, seed=seed + 2))
    t = torch.rand(2, 3, 7, 5, generator=torch.Generator().manual_seed(seed + 1))
    w = randn(2, 3, 7, 5, seed=seed + 3).abs()
    pw = torch.tensor([0.5, 2.0, 3.0]).view(3, 1, 1)
    lay = ([st.Shard(2)], {0: uneven_extents(7, m.size(), seed)})
    ws = st.distribute_tensor(w, m, *lay)   # weights take no gradient: sharded for the sharded call

    def weight_for(a):
        return ws if isinstance(a, st.ShardTensor) else w

    for red in ("none", "mean", "sum"):
        check_op(lambda a, b: F.binary_cross_entropy_with_logits(a, b, reduction=red), [x, t], [lay, lay], m,
                 what=f"bce logits {red}")
        check_op(lambda a, b: F.binary_cross_entropy_with_logits(a, b, weight=weight_for(a), pos_weight=pw,
                                                                 reduction=red),
                 [x, t], [lay, None], m, what=f"bce logits weighted {red}")
        check_op(lambda a, b: F.binary_cross_entropy(a, b, reduction=red), [p, t], [lay, lay], m, what=f"bce {red}")
        check_op(lambda a, b: F.binary_cross_entropy(a, b, weight=w, reduction=red), [p, t], [lay, lay], m,
                 what=f"bce weighted {red}")
    # A float64 input with float32 targets (torchvision's RPN): torch computes in the target's dtype and returns it;
    # so must the rule (it promoted to float64 before: a 6e-8 relative difference, a float32 result expected).
    x64, t32 = x.double(), (t > 0.5).float()
    for red in ("none", "mean"):
        ref = F.binary_cross_entropy_with_logits(x64, t32, reduction=red)
        out = F.binary_cross_entropy_with_logits(st.distribute_tensor(x64, m, *lay), t32, reduction=red)
        assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
        close(full(out), ref, rtol=1e-7, atol=1e-7, what=f"bce logits mixed dtypes {red}")
    # A value outside [0, 1] on one rank only: every rank raises torch's error (no rank left in a collective).
    bad = p.clone()
    bad[0, 0, -1, 0] = 1.5
    with st.use_strict():
        try:
            F.binary_cross_entropy(st.distribute_tensor(bad, m, lay[0], lay[1]), t)
        except RuntimeError as e:
            assert "between 0 and 1" in str(e), e
        else:
            raise AssertionError("no error for an input outside [0, 1]")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_binary_cross_entropy(world):
    harness.run(world, case_binary_cross_entropy, world)


def case_margin_losses(world):
    """multi_margin_loss and multilabel_margin_loss (composed above autograd from sharded ops): batch split (the
    target split alike or whole) and class split, p 1 and 2, a margin, class weights, every reduction, 1-D inputs;
    strict mode (no fallback). A split batch stays split with reduction='none'."""
    m = mesh()
    d64 = dict(dtype=torch.float64)
    tight = dict(rtol=1e-9, atol=1e-10)
    N, C = 7, 5
    x = randn(N, C, seed=1, **d64)
    y = torch.tensor([0, 4, 2, 2, 1, 3, 0])
    w = randn(C, seed=2, **d64).abs()
    rows = ([st.Shard(0)], {0: uneven_extents(N, world, seed=3)})
    cols = ([st.Shard(1)], {0: uneven_extents(C, world, seed=4)})
    target_rows = ([st.Shard(0)], {0: rows[1][0]})
    with st.use_strict():
        for red in ("none", "mean", "sum"):
            for p in (1, 2):
                for lay, ylay in ((rows, target_rows), (cols, None)):
                    check_op(lambda a, t: F.multi_margin_loss(a, t, p=p, margin=0.7, reduction=red), [x, y],
                             [lay, ylay], m, **tight, what=f"multi_margin {red} p={p}")
                check_op(lambda a, t: F.multi_margin_loss(a, t, p=p, weight=w, reduction=red), [x, y], [rows, None], m,
                         **tight, what=f"multi_margin weighted {red} p={p}")
        out = check_op(lambda a, t: F.multi_margin_loss(a, t, reduction="none"), [x, y], [rows, target_rows], m, **tight,
                       what="multi_margin stays split")
        assert st.placements(out) == (st.Shard(0),), st.placements(out)
        check_op(lambda a: F.multi_margin_loss(a, torch.tensor([3])), [x[0]], [([st.Shard(0)], None)], m, **tight,
                 what="multi_margin 1-D")
        # Targets end at a row's first -1; repeated targets count once per entry.
        yl = torch.tensor([[3, 0, -1, 1, 2], [1, 2, 3, 4, -1], [0, 0, -1, 1, 1], [-1, 0, 0, 0, 0], [4, 3, 2, 1, 0],
                           [2, -1, 3, 3, 3], [1, 1, 1, 1, 1]])
        for red in ("none", "mean", "sum"):
            for lay, ylay in ((rows, target_rows), (rows, None), (cols, None), (cols, ([st.Shard(1)], {0: cols[1][0]}))):
                check_op(lambda a, t: F.multilabel_margin_loss(a, t, reduction=red), [x, yl], [lay, ylay], m, **tight,
                         what=f"multilabel_margin {red}")
        check_op(lambda a: F.multilabel_margin_loss(a, yl[0]), [x[0]], [([st.Shard(0)], None)], m, **tight,
                 what="multilabel_margin 1-D")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_margin_losses(world):
    harness.run(world, case_margin_losses, world)


def case_ctc_loss(seed):
    """CTC loss with the batch split (a speech model's frame logits, per-sample targets): each rank runs aten's
    kernel on its own samples -- 2-D and concatenated 1-D targets, list and tensor lengths, every reduction,
    zero_infinity with an impossible sample, uneven and empty batch shards -- in strict mode (no gather); the frames
    split decline to the fallback (the alpha recursion runs along them), strict mode refuses them on every rank."""
    m = mesh()
    w = m.size()
    g = torch.Generator().manual_seed(seed)
    T, N, C, S = 12, 5, 6, 4
    x = randn(T, N, C, seed=seed)
    target_lengths = [3, 0, 4, 2, 4]
    input_lengths = [12, 7, 9, 12, 3]   # the last sample cannot emit its 4 labels in 3 frames: an infinite loss
    targets2d = torch.randint(1, C, (N, S), generator=g)
    targets1d = torch.cat([targets2d[i, :n] for i, n in enumerate(target_lengths)])
    lays = [([st.Shard(1)], {0: uneven_extents(N, w, seed)})]
    if w == 3:
        lays.append(([st.Shard(1)], {0: [3, 0, 2]}))
    with st.use_strict():
        for lay in lays:
            for red in ("none", "mean", "sum"):
                for tg, kind in ((targets2d, "2-D"), (targets1d, "1-D")):
                    for tensors in (False, True):
                        il = torch.tensor(input_lengths) if tensors else input_lengths
                        tl = torch.tensor(target_lengths) if tensors else target_lengths
                        check_op(lambda a, t: F.ctc_loss(a.log_softmax(2), t, il, tl, reduction=red,
                                                         zero_infinity=True),
                                 [x, tg], [lay, None], m, rtol=1e-5, atol=1e-5,
                                 what=f"ctc {red} {kind} targets, lengths as {'tensors' if tensors else 'lists'}")
            # without zero_infinity the impossible sample's loss is inf on one device and here (its gradient NaN)
            check_op(lambda a, t: F.ctc_loss(a.log_softmax(2), t, input_lengths, target_lengths, reduction="none"),
                     [x, targets2d], [lay, None], m, grad=False, what="ctc inf loss")
            # the targets split like the batch (a user who distributed them too)
            check_op(lambda a, t: F.ctc_loss(a.log_softmax(2), t, input_lengths, target_lengths, blank=0,
                                             zero_infinity=True),
                     [x, targets2d], [lay, ([st.Shard(0)], {0: lay[1][0]})], m, rtol=1e-5, atol=1e-5,
                     what="ctc targets split")
        # a blank outside the classes: refused on every rank, a rank without samples too (it runs no kernel)
        with pytest.raises(ValueError, match="blank"):
            F.ctc_loss(st.distribute_tensor(x.log_softmax(2), m, *lays[-1]), targets2d, input_lengths,
                       target_lengths, blank=C)
    if w > 1:
        frames = st.distribute_tensor(x.clone(), m, [st.Shard(0)])
        with st.use_strict(), pytest.raises(NotImplementedError, match="only the batch"):
            F.ctc_loss(frames.log_softmax(2), targets2d, input_lengths, target_lengths)
        # without strict mode the fallback gives one device's value
        check_op(lambda a, t: F.ctc_loss(a.log_softmax(2), t, input_lengths, target_lengths, zero_infinity=True),
                 [x, targets2d], [([st.Shard(0)], None), None], m, rtol=1e-5, atol=1e-5, what="ctc frames split")
    return True


def case_ctc_loss_2d(seed):
    """A 2x2 mesh: the batch on one mesh dim, the other replicated (a data x domain mesh whose domain dim ends
    replicated at the head)."""
    m = mesh((2, 2), ("batch", "rep"))
    x = randn(9, 5, 4, seed=seed)
    targets = torch.randint(1, 4, (5, 3), generator=torch.Generator().manual_seed(seed))
    il, tl = [9, 8, 9, 5, 9], [3, 1, 2, 3, 0]
    with st.use_strict():
        check_op(lambda a, t: F.ctc_loss(a.log_softmax(2), t, il, tl), [x, targets],
                 [([st.Shard(1), st.Replicate()], {0: [2, 3]}), None], m, rtol=1e-5, atol=1e-5, what="ctc 2x2")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ctc_loss(world):
    harness.run(world, case_ctc_loss, world)


def test_ctc_loss_2d():
    harness.run(4, case_ctc_loss_2d, 4)
