"""Compiled code that runs partly eagerly on traced ShardTensors (shardtensor/_traced.py's TracedShard): a frame
Dynamo skips (a graph break inside a loop, the recompile limit) runs op by op on them, and every rank must issue the
same collectives and get the single-device values, as with C++ ShardTensors. Found by the model zoo under
torch.compile (benchmarks/results/zoo_compile_probe): PhysicsNeMo's HEALPix padding writes corner patches into
`x[..., i, j]` in a loop (the ranks issued different collectives: the write-back of the select copies ran twice on
ranks holding rows and once on a rank without), torchaudio's DeepSpeech runs a bidirectional nn.RNN (op by op in
compiled code its gradient came back plain), a gradient reaching a graph in another layout than traced, a graph
output outside the loss (autograd's plain zeros as its gradient), a plain output whose gradient comes back sharded
(Deformable DETR; ConViT's softmax of plain positional scores, a crash) and view rules given symbolic sizes (RT-DETR)."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import close, full, mesh, uneven_extents

BACKEND = "aot_eager"


def check_compiled(make, shape, dim, extents=None):
    """``make()`` (a module, built twice from one seed, or a function) compiled on ``x`` split along ``dim`` against
    one device: output, input gradient and parameter gradients under a random weighting of the output."""
    torch._dynamo.reset()
    m = mesh()
    torch.manual_seed(0)
    net = make()
    ref = make() if isinstance(net, torch.nn.Module) else net
    if isinstance(net, torch.nn.Module):
        ref.load_state_dict(net.state_dict())
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    xs = st.distribute_tensor(x, m, [st.Shard(dim)], sharding_shapes={0: list(extents)} if extents else None)
    xs.requires_grad_()
    xr = x.clone().requires_grad_()
    y = torch.compile(net, backend=BACKEND)(xs)
    y_ref = ref(xr)
    close(full(y), y_ref, what="output")
    w = torch.randn(y_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (y_ref * w).sum().backward()
    (y * st.distribute_tensor(w, m, st.placements(y), sharding_shapes=st.sharding_shapes(y))).sum().backward()
    close(full(xs.grad), xr.grad, what="input gradient")
    if isinstance(net, torch.nn.Module):
        for (n, p), (_, pr) in zip(net.named_parameters(), ref.named_parameters()):
            close(full(p.grad), pr.grad, what=n)
    return m


def corners(x):
    """HEALPix-padding-like corner writes along the split dim (H), in a loop with a graph break: Dynamo skips the
    frame and runs it eagerly on the traced shards."""
    ret = torch.zeros_like(x)[..., :2, :2]
    ret[..., -1, -1] = 0.5 * x[..., -1, 0] + 0.5 * x[..., 0, -1]
    for i in range(1, 2):
        ret[..., -i - 1, -i:] = x[..., -i - 1, :i]
        ret[..., -i:, -i - 1] = x[..., :i, -i - 1]
        torch._dynamo.graph_break()
    return torch.cat((ret, x[..., :2, :2]), dim=-1) * 2


def case_skipped_frame(extents):
    check_compiled(lambda: corners, (2, 3, 8, 8), 2, extents)
    return True


@pytest.mark.parametrize("extents", [(5, 3), (8, 0)], ids=["uneven", "empty"])
def test_skipped_frame_runs_like_eager(extents):
    harness.run(2, case_skipped_frame, extents)


class _RNNNet(torch.nn.Module):
    """DeepSpeech's pattern: a linear layer, a bidirectional RNN over a time-split sequence, the directions summed."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)
        self.rnn = torch.nn.RNN(6, 5, bidirectional=True, nonlinearity="relu")
        self.out = torch.nn.Linear(5, 3)

    def forward(self, x):
        h, _ = self.rnn(torch.relu(self.fc(x)))
        return self.out(h[..., :5] + h[..., 5:])


def case_rnn_in_compiled_model(extents):
    torch._dynamo.reset()
    m = mesh()
    torch.manual_seed(0)
    net = _RNNNet().double()
    ref = _RNNNet().double()
    ref.load_state_dict(net.state_dict())
    x = torch.randn(8, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    xs = st.distribute_tensor(x, m, [st.Shard(0)], sharding_shapes={0: list(extents)}).requires_grad_()
    xr = x.clone().requires_grad_()
    with st.CommCounter() as eager:
        net(xs.detach())
    with st.CommCounter() as compiled:
        y = torch.compile(net, backend=BACKEND)(xs)
    assert st.placements(y) == (st.Shard(0),)
    assert compiled.calls == eager.calls, (compiled.calls, eager.calls)    # the relay, as eagerly (not op by op)
    y_ref = ref(xr)
    close(full(y), y_ref, what="output")
    w = torch.randn(y_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (y_ref * w).sum().backward()
    (y * st.distribute_tensor(w, m, [st.Shard(0)], sharding_shapes=st.sharding_shapes(y))).sum().backward()
    close(full(xs.grad), xr.grad, what="input gradient")
    for (n, p), (_, pr) in zip(net.named_parameters(), ref.named_parameters()):
        close(full(p.grad), pr.grad, what=n)
    return True


@pytest.mark.parametrize("extents", [(5, 3), (8, 0)], ids=["uneven", "empty"])
def test_rnn_in_compiled_model(extents):
    harness.run(2, case_rnn_in_compiled_model, extents)


def case_tangent_in_another_layout():
    """AOTAutograd hands a graph's backward the runtime gradient of an output; one in another layout than the traced
    tangent (from code that ran eagerly) is redistributed to it, values unchanged, on every rank alike."""
    from shardtensor import _traced
    m = mesh()
    x = torch.randn(4, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a = _traced.to_traced(st.distribute_tensor(x, m, [st.Shard(1)], sharding_shapes={0: [7, 1]}))
    b = _traced.to_traced(st.distribute_tensor(x, m, [st.Shard(1)], sharding_shapes={0: [8, 0]}))
    assert a.__coerce_same_metadata_as_tangent__(a._layout) is a
    moved = b.__coerce_same_metadata_as_tangent__(a._layout)
    assert isinstance(moved, _traced.TracedShard) and moved._layout == a._layout
    close(full(_traced.from_traced(moved)), x, what="moved gradient")
    other_shape = _traced.to_traced(st.distribute_tensor(x[:2], m, [st.Shard(1)]))
    assert other_shape.__coerce_same_metadata_as_tangent__(a._layout) is None   # not a layout change: refuse
    assert b.__coerce_same_metadata_as_tangent__(a._layout, torch.Tensor) is None
    return True


def test_tangent_in_another_layout():
    harness.run(2, case_tangent_in_another_layout)


def partly_unused(x):
    a = x * 2
    b = torch.sin(x)
    torch._dynamo.graph_break()
    return b * a.detach()


def case_output_outside_the_loss():
    """A graph's ShardTensor output that takes no part in the loss (used detached after a graph break, as RT-DETR's
    encoder memory in its query selection) receives autograd's plain zeros as its gradient; AOTAutograd traced a
    ShardTensor tangent and raised ("a tensor subclass where we guessed its metadata incorrectly")."""
    check_compiled(lambda: partly_unused, (2, 6, 3), 1, (4, 2))
    return True


def test_output_outside_the_loss():
    harness.run(2, case_output_outside_the_loss)


class _PlainThenSharded(torch.nn.Module):
    """A plain tensor from parameters only (a query-side projection, as Deformable DETR's sampling offsets) meets
    the ShardTensor after a graph break: the first graph traced a plain tangent for it, the second returns the
    gradient as a ShardTensor."""

    def __init__(self):
        super().__init__()
        self.query = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.lin = torch.nn.Linear(3, 3).double()

    def forward(self, x):
        q = self.lin(self.query)
        torch._dynamo.graph_break()
        return x * q


def case_plain_output_used_with_shards():
    check_compiled(_PlainThenSharded, (2, 6, 3), 1, (4, 2))
    return True


def test_plain_output_used_with_shards():
    harness.run(2, case_plain_output_used_with_shards)


class _PositionalAttention(torch.nn.Module):
    """ConViT's gated positional attention in miniature: a softmax of plain positional scores (parameters only)
    applied to the sharded tokens; compiled, its gradient reaches the softmax's backward sharded while the softmax's
    output is plain (eagerly the promotion of the plain scores turns it plain first). The rule dereferenced the
    plain output's missing layout: a segmentation fault."""

    def __init__(self):
        super().__init__()
        self.scores = torch.nn.Parameter(torch.randn(4, 6, 6, dtype=torch.float64))

    def forward(self, x):
        return self.scores.softmax(-1) @ x


def case_softmax_of_plain_values_in_compiled_model():
    m = check_compiled(_PositionalAttention, (4, 6, 5), 2, (3, 2))
    # The rule itself, eagerly: a sharded gradient (Shard, Partial) with a plain output, softmax and log_softmax.
    y_plain = torch.randn(4, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).softmax(-1)
    g = torch.randn(4, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for op in (torch.ops.aten._softmax_backward_data.default, torch.ops.aten._log_softmax_backward_data.default):
        want = op(g, y_plain, -1, torch.float64)
        for gs in (st.distribute_tensor(g, m, [st.Shard(1)]),
                   st.distribute_tensor(g, m, [st.Shard(2)]),
                   st.from_local(g / m.size(), m, [st.Partial()])):
            close(full(op(gs, y_plain, -1, torch.float64)), want, what=f"{op} {st.placements(gs)}")
    return True


def test_softmax_of_plain_values_in_compiled_model():
    harness.run(2, case_softmax_of_plain_values_in_compiled_model)


class _WanAttention(torch.nn.Module):
    """diffusers' Wan VAE attention block (1x1 convolutions around attention over the pixels): compiled, the output
    projection's input gradient got channels-last strides from the meta kernel and contiguous ones from the CPU
    kernel, and the compiled backward's view of it failed at run time."""

    def __init__(self, dim=8):
        super().__init__()
        self.to_qkv = torch.nn.Conv2d(dim, dim * 3, 1).double()
        self.proj = torch.nn.Conv2d(dim, dim, 1).double()

    def forward(self, x):
        b, c, h, w = x.shape
        qkv = self.to_qkv(x).reshape(b, 1, c * 3, -1).permute(0, 1, 3, 2).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        y = y.squeeze(1).permute(0, 2, 1).reshape(b, c, h, w)
        return self.proj(y) + x


def case_wan_attention_in_compiled_model():
    check_compiled(_WanAttention, (1, 8, 4, 8), 2)
    return True


def test_wan_attention_in_compiled_model():
    harness.run(2, case_wan_attention_in_compiled_model)


def case_symbolic_view_sizes():
    """Dynamo fakeifies a graph input that is a view of a traced shard by replaying the view on its base with
    symbolic sizes once a dim turned dynamic (RT-DETR under torch.compile raised there: "SymIntArrayRef expected to
    contain only concrete integers"). The view rules plan from concrete values, so they specialize each (a guard)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
    env = ShapeEnv()
    s = env.create_unspecified_symint_and_symbol(4, ConstantSource("s"), DimDynamic.DYNAMIC)
    m = mesh()
    x = torch.randn(2, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    xs = st.distribute_tensor(x, m, [st.Shard(1)], sharding_shapes={0: [3, 1]})
    close(full(xs.view(2, s * 6)), x.view(2, 24), what="view")
    close(full(xs[:, : s - 1]), x[:, :3], what="slice")
    close(full(xs.select(1, s - 2)), x[:, 2], what="select")
    close(full(xs.expand(3, 2, s, 6)), x.expand(3, 2, 4, 6), what="expand")
    assert env.guards, "the symbolic sizes were not specialized"
    return True


def test_symbolic_view_sizes():
    harness.run(2, case_symbolic_view_sizes)


class _OptEinsumNet(torch.nn.Module):
    """neuraloperator's spectral weights contracted through tensorly's opt_einsum plugin: opt_einsum picks its array
    library from the operand's class, and inside compiled code the operand is a traced shard."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))

    def forward(self, x):
        import opt_einsum
        return opt_einsum.contract("bchw,co->bohw", x, self.w)


def case_opt_einsum(extents):
    check_compiled(_OptEinsumNet, (2, 3, 8, 5), 2, extents)
    return True


def test_opt_einsum_in_compiled_model():
    pytest.importorskip("opt_einsum", reason="opt_einsum (a zoo dependency, through tensorly) is not installed")
    harness.run(2, case_opt_einsum, (5, 3))


class _LoopAttention(torch.nn.Module):
    """Attention over a sequence-split (B, H, L, E) input in a loop with a graph break (Dynamo skips the frame):
    scaled_dot_product_attention, bound above autograd, decomposes there to the fused CPU kernel before the traced
    shard sees it (diffusers' Wan VAE eval forward raised at that kernel on every rank); the ring runs on it."""

    def __init__(self):
        super().__init__()
        self.wq = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.wk = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x):
        for causal in (False, True):
            y = torch.nn.functional.scaled_dot_product_attention(x * self.wq, x * self.wk, torch.tanh(x),
                                                                 is_causal=causal)
            x = x + y
            torch._dynamo.graph_break()
        return x


def case_loop_attention(extents):
    check_compiled(_LoopAttention, (2, 2, 9, 4), 2, extents)
    return True


def test_attention_in_skipped_frame():
    harness.run(2, case_loop_attention, (6, 3))


def _weighted(x, w):
    """A Python function routed (below) to a handler whose result is plain and whole: what a routed layer returns when
    its input is replicated (GINO's latent spectral layers)."""
    return x * w


st.register_function(_weighted, lambda x, w: st.full_tensor(x) * w)


class _RoutedPlainNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))

    def forward(self, x):
        return torch.tanh(x + _weighted(x, self.w))     # the plain result meets the traced shard after it


def case_routed_plain_result(extents):
    check_compiled(_RoutedPlainNet, (6, 8), 0, extents)
    return True


def test_routed_plain_result_in_compiled_model():
    """The compiled backward hands the routed call's plain result a traced gradient: it must be made plain before it
    enters the eager graph (neuraloperator's GINO raised in bmm's backward, a traced shard next to ShardTensors)."""
    harness.run(2, case_routed_plain_result, (4, 2))


def _grid_and_resample(x, s):
    """neuraloperator's pattern: a positional grid (plain, from the input's shape) joined to the field, then a resample
    to sizes computed from a float scale."""
    g = torch.linspace(0, 1, x.shape[-2], dtype=x.dtype).view(1, 1, -1, 1).expand(x.shape[0], 1, *x.shape[-2:])
    y = torch.cat((x, g), dim=1)
    return torch.nn.functional.interpolate(y, size=(round(x.shape[-2] * s), round(x.shape[-1] * s)),
                                           mode="bilinear", align_corners=True)


def case_symbolic_sizes():
    m = mesh()
    x = torch.randn(2, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for dim in (2, 3):
        torch._dynamo.reset()
        xs = st.distribute_tensor(x, m, [st.Shard(dim)])
        compiled = torch.compile(_grid_and_resample, backend=BACKEND)
        for s in (2.0, 1.5, 0.5):
            close(full(compiled(xs, s)), _grid_and_resample(x, s), what=f"dim {dim} scale {s}")
    return True


def test_sizes_from_a_dynamic_float():
    """A second call with another scale recompiles with the scale symbolic (Dynamo does not specialize floats), so
    the interpolation's output sizes reach the rule as symbols (neuraloperator's UNO raised "SymIntArrayRef expected
    to contain only concrete integers"); the rules specialize them (ops/concrete_ints.h)."""
    harness.run(2, case_symbolic_sizes)


def _spectrum_magnitude(x):
    return torch.fft.rfft(x, dim=-1).abs() * 2


def case_dynamic_local_sizes():
    torch._dynamo.reset()
    m = mesh()
    compiled = torch.compile(_spectrum_magnitude, backend=BACKEND)
    for n in (8, 10, 12):
        x = torch.randn(2, n, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        close(full(compiled(st.distribute_tensor(x, m, [st.Shard(1)]))), _spectrum_magnitude(x), what=f"length {n}")
    return True


def test_transform_of_a_dynamic_local():
    """A second global length recompiles with the split dim dynamic, so the traced local's sizes are symbolic: the FFT
    rule's empty-shard check read the local's numel() (neuraloperator's SFNO raised "Cannot call numel() on tensor
    with symbolic sizes"); it reads the layout's local shape."""
    harness.run(2, case_dynamic_local_sizes)


def _lerp_rows(x, idx, w):
    return torch.lerp(x[..., idx, :], x[..., idx + 1, :], w)


def case_lerp_dynamic_locals():
    torch._dynamo.reset()
    m = mesh()
    compiled = torch.compile(_lerp_rows, backend=BACKEND)
    for n in (8, 10, 12):
        g = torch.Generator().manual_seed(n)
        x = torch.randn(2, n, 6, dtype=torch.float64, generator=g)
        idx = torch.arange(0, n - 1, 2)
        w = torch.rand(idx.numel(), 1, dtype=torch.float64, generator=g)
        close(full(compiled(st.distribute_tensor(x, m, [st.Shard(1)]), idx, w)), _lerp_rows(x, idx, w),
              what=f"length {n}")
    return True


def test_lerp_of_dynamic_locals():
    """torch-harmonics' latitude upsampling (a spherical U-Net's eval forward): ``lerp`` of rows picked along the split
    dim with a plain weight, on a second global length (the locals' sizes symbols). Its Python meta kernel broadcasts
    by ``expand``, which ran without the tracer's Python dispatcher inside the rule (the C++ kernel: "SymIntArrayRef
    expected to contain only concrete integers"); local ops get it back (``_traced._RuleMode``)."""
    harness.run(2, case_lerp_dynamic_locals)


def _grow_until_stable(seeds, mask):
    """A hysteresis-like propagation (kornia's Canny): dilate the seeds inside the mask until nothing changes."""
    def changed(old, new):
        return ((old - new).abs() != 0).any()

    def step(old, new):
        return new.clone(), torch.nn.functional.max_pool2d(new, 3, 1, 1) * mask

    _, grown = torch.while_loop(changed, step, (-torch.ones_like(seeds), seeds))
    return grown


def case_while_loop(compiled):
    torch._dynamo.reset()
    m = mesh()
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(1, 1, 13, 9, generator=g) > 0.3).double()
    seeds = (torch.rand(1, 1, 13, 9, generator=g) > 0.95).double() * mask
    fn = torch.compile(_grow_until_stable, backend=BACKEND) if compiled else _grow_until_stable
    ext = {0: uneven_extents(13, m.size(), seed=5)}
    seeds_ref = seeds.clone().requires_grad_()
    seeds_split = st.distribute_tensor(seeds, m, [st.Shard(2)], ext).requires_grad_()
    out = fn(seeds_split, st.distribute_tensor(mask, m, [st.Shard(2)], ext))
    ref = _grow_until_stable(seeds_ref, mask)
    assert st.is_shard_tensor(out) and st.placements(out) == (st.Shard(2),)
    close(full(out), ref, what="grown")
    w = torch.randn(ref.shape, dtype=ref.dtype, generator=g)      # the gradient through the iterations run
    (ref * w).sum().backward()
    (out * st.distribute_tensor(w, m, [st.Shard(2)], ext)).sum().backward()
    close(full(seeds_split.grad), seeds_ref.grad, what="seeds' gradient")
    return True


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_while_loop_of_shards(compiled):
    """``torch.while_loop`` with split carried values (kornia's Canny hysteresis when compiled): a higher-order op
    whose subgraphs Dynamo speculates on plain fake tensors ("Expected FakeTensor, got TracedShard"), and which
    compiles itself when called eagerly; routed (``shardtensor.integrations.torch_control_flow``), the loop runs in
    Python, every rank the same iterations."""
    harness.run(2, case_while_loop, compiled)


def _branch_on_split_values(x, w):
    """``torch.cond`` on a condition reduced over a split tensor, each branch using a captured split tensor."""
    return torch.cond(x.sum() > 0, lambda a: torch.sin(a) * w, lambda a: torch.nn.functional.avg_pool1d(a, 3, 1, 1) - w,
                      (x,))


def case_cond(compiled):
    torch._dynamo.reset()
    m = mesh()
    fn = torch.compile(_branch_on_split_values, backend=BACKEND) if compiled else _branch_on_split_values
    ext = {0: uneven_extents(11, m.size(), seed=2)}
    for sign in (1.0, -1.0):     # both branches
        g = torch.Generator().manual_seed(4)
        x = torch.rand(2, 11, dtype=torch.float64, generator=g) * sign
        w = torch.randn(2, 11, dtype=torch.float64, generator=g)
        xr, xs = x.clone().requires_grad_(), st.distribute_tensor(x, m, [st.Shard(1)], ext).requires_grad_()
        ref, out = _branch_on_split_values(xr, w), fn(xs, st.distribute_tensor(w, m, [st.Shard(1)], ext))
        assert st.is_shard_tensor(out) and st.placements(out) == (st.Shard(1),)
        close(full(out), ref, what=f"branch {sign}")
        ref.sum().backward()
        out.sum().backward()
        close(full(xs.grad), xr.grad, what=f"gradient, branch {sign}")
    return True


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cond_of_shards(compiled):
    """``torch.cond`` with split operands and a condition reduced over them: routed like ``torch.while_loop``
    (``shardtensor.integrations.torch_control_flow``), the branch runs in Python, every rank the same one."""
    harness.run(2, case_cond, compiled)


def _plain_control_flow(x):
    y = torch.cond(x.sum() > 0, lambda a: a * 2, lambda a: a - 1, (x,))
    _, z = torch.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2), (torch.tensor(0), y))
    return z


def case_plain_control_flow():
    torch._dynamo.reset()
    compiled = torch.compile(_plain_control_flow, backend=BACKEND, fullgraph=True)
    for x in (torch.rand(4), -torch.rand(4)):
        close(compiled(x), _plain_control_flow(x), what="plain control flow")
    return True


def test_plain_control_flow_unchanged():
    """Without ShardTensors the routed ``torch.cond`` / ``torch.while_loop`` run their own bodies: plain code keeps
    compiling them into one graph (``fullgraph=True``)."""
    harness.run(1, case_plain_control_flow)


class _DiscoNet(torch.nn.Module):
    """torch-harmonics' DISCO convolution and its transpose (custom ops whose rule reads the filter's CSR indices,
    which a tracer's fake tensors do not hold) between traced ops."""

    def __init__(self):
        super().__init__()
        import torch_harmonics as th
        kw = dict(kernel_shape=(3, 3), basis_type="morlet", bias=True)
        self.down = th.DiscreteContinuousConvS2(2, 3, in_shape=(16, 32), out_shape=(8, 16), **kw).double()
        self.up = th.DiscreteContinuousConvTransposeS2(3, 2, in_shape=(8, 16), out_shape=(16, 32), **kw).double()

    def forward(self, x):
        return self.up(torch.tanh(self.down(x * 2)))


def case_disco(extents):
    check_compiled(_DiscoNet, (2, 2, 16, 32), 2, extents)
    return True


def test_disco_layers_in_compiled_model():
    """The layers are routed to their own bodies (shardtensor.integrations.torch_harmonics_disco): eagerly nothing
    changes, and compiled code breaks the graph around them and runs them eagerly (a spherical U-Net raised "data is
    not allocated yet" in the rule)."""
    pytest.importorskip("torch_harmonics", reason="torch-harmonics is an optional test dependency (the zoo's)")
    harness.run(2, case_disco, (10, 6))
