"""Elementwise ops against the single-device computation: broadcasting with plain tensors and scalars,
uneven and zero-extent shards, mismatched shards, in-place and out= forms, gradients of inputs and plain
parameters, 1-D and 2-D meshes."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_grad_layout, check_op, close, full, mesh, randn, shard_of, uneven_extents


def case_binary_broadcast(seed):
    m = mesh()
    w = m.size()
    x = randn(6, 5, 4, seed=seed)
    b = randn(4, seed=seed + 1)      # plain, broadcast over the sharded dims
    c = randn(5, 1, seed=seed + 2)   # plain, broadcast along the last dim
    ext = {0: uneven_extents(6, w, seed)}
    lay = ([st.Shard(0)], ext)
    check_op(lambda x, b: x * b + 2.5, [x, b], [lay, None], m, what="x*b+2")
    check_op(lambda x, c: x - c, [x, c], [([st.Shard(1)], {0: uneven_extents(5, w, seed)}), None], m, what="x-c")
    check_op(lambda x, y: torch.maximum(x, y), [x, randn(6, 5, 4, seed=9)], [lay, lay], m, what="maximum")
    check_op(lambda x: torch.where(x > 0, x, 0.1 * x), [x], [lay], m, what="where")
    check_op(lambda x: x.masked_fill(x < -0.5, 3.0), [x], [lay], m, what="masked_fill")
    check_op(lambda x: x.clamp(-0.3, 0.4), [x], [lay], m, what="clamp")
    check_op(lambda x: (x > 0.1) & (x < 0.9), [x], [lay], m, grad=False, what="comparisons")
    check_op(lambda x: x.pow(2).sqrt().exp().log1p(), [x], [lay], m, what="unary chain")
    check_op(lambda x, y: torch.addcmul(x, x, y, value=0.5), [x, randn(6, 5, 4, seed=3)], [lay, None], m, what="addcmul")
    return True


def case_mismatched_shards(seed):
    m = mesh()
    w = m.size()
    x, y = randn(7, 3, seed=seed), randn(7, 3, seed=seed + 1)
    # Same dim, different extents: the second operand is re-split to match.
    check_op(torch.add, [x, y], [([st.Shard(0)], {0: uneven_extents(7, w, 1)}),
                                 ([st.Shard(0)], {0: uneven_extents(7, w, 2)})], m, what="re-split")
    # Different dims sharded: all-to-all.
    check_op(torch.mul, [x, y], [[st.Shard(0)], [st.Shard(1)]], m, what="shard(0)*shard(1)")
    # Sharded with replicated.
    check_op(torch.sub, [x, y], [[st.Replicate()], [st.Shard(0)]], m, what="replicate-shard")
    return True


def case_activations(seed):
    m = mesh()
    x = randn(5, 8, seed=seed)
    lay = ([st.Shard(0)], {0: uneven_extents(5, m.size(), seed)})
    for name, fn in [("relu", F.relu), ("gelu", F.gelu), ("silu", F.silu), ("tanh", torch.tanh),
                     ("sigmoid", torch.sigmoid), ("leaky_relu", lambda t: F.leaky_relu(t, 0.2)),
                     ("elu", F.elu), ("softplus", F.softplus), ("hardtanh", F.hardtanh), ("mish", F.mish),
                     ("hardswish", F.hardswish)]:
        check_op(fn, [x], [lay], m, what=name)
    return True


def case_untagged_elementwise(seed):
    """Elementwise ops without torch's pointwise tag (rsub, complex, polar, functional fill) and glu along an unsharded
    dim run locally (strict mode: no gather), forward and gradients equal one device; glu along the sharded dim
    gathers only the two row ranges each rank's output reads."""
    m = mesh()
    x, y = randn(5, 8, seed=seed).abs() + 0.1, randn(5, 8, seed=seed + 1)
    lay = ([st.Shard(0)], {0: uneven_extents(5, m.size(), seed)})
    with st.use_strict():
        check_op(lambda a, b: torch.rsub(a, b, alpha=2), [x, y], [lay, lay], m, what="rsub")
        check_op(lambda a: torch.rsub(a, 0.5), [x], [lay], m, what="rsub.Scalar")
        check_op(lambda a, b: torch.view_as_real(torch.complex(a, b)), [x, y], [lay, lay], m, what="complex")
        check_op(lambda a, b: torch.view_as_real(torch.polar(a, b)), [x, y], [lay, None], m, what="polar")
        check_op(lambda a: torch.fill(a, torch.tensor(0.25)) * a, [x], [lay], m, what="fill")
        # masked_fill with a 0-dim tensor value (untagged, unlike its .Scalar overload: it fell back), the value's
        # gradient a sum over the masked positions of every rank; the mask plain or sharded like the input.
        mask = randn(5, 8, seed=seed + 3) > 0
        for mlay in (None, lay):
            check_op(lambda a, mk, v: a.masked_fill(mk, v) * a, [x, mask, torch.tensor(0.75)], [lay, mlay, None], m,
                     what=f"masked_fill.Tensor mask {'sharded' if mlay else 'plain'}")
            check_op(lambda a, mk, v: a.clone().masked_fill_(mk, v), [x, mask, torch.tensor(0.75)], [lay, mlay, None],
                     m, what="masked_fill_.Tensor")
        check_op(lambda a: F.glu(a, 1), [x], [lay], m, what="glu")
        z = randn(8, 3, seed=seed + 2)
        zlay = ([st.Shard(0)], {0: uneven_extents(8, m.size(), seed + 2)})
        out = check_op(lambda a: F.glu(a, 0), [z], [zlay], m, what="glu along the sharded dim")
        assert st.placements(out) == (st.Shard(0),), st.placements(out)
        check_op(lambda a: F.glu(a, 0), [z], [([st.Shard(1)], None)], m, what="glu, other dim sharded")
    return True


def case_inplace_and_out(seed):
    m = mesh()
    x = randn(6, 4, seed=seed)
    y = randn(6, 4, seed=seed + 1)
    ext = {0: uneven_extents(6, m.size(), seed)}
    xs = st.distribute_tensor(x, m, [st.Shard(0)], ext)
    ys = st.distribute_tensor(y, m, [st.Shard(0)])  # default split: re-split to xs's extents in place
    xs.add_(ys, alpha=2).mul_(0.5)
    xs.relu_()
    close(xs.full_tensor(), ((x + 2 * y) * 0.5).relu(), what="in-place chain")
    assert st.sharding_shapes(xs) == ext, "in-place ops must keep the layout"
    out = st.distribute_tensor(torch.empty(6, 4), m, [st.Shard(0)], ext)
    torch.add(xs, 1.0, out=out)
    close(out.full_tensor(), ((x + 2 * y) * 0.5).relu() + 1, what="out=")
    # A plain tensor updated from a ShardTensor receives the full value.
    p = torch.zeros(6, 4)
    p.add_(ys)
    close(p, y, what="plain.add_(shard)")
    xs.zero_()
    assert full(xs).abs().sum() == 0
    return True


def case_param_grad_once(seed):
    """A plain parameter used with a sharded input gets exactly the single-device gradient."""
    m = mesh()
    x = randn(9, 4, seed=seed)
    wt = randn(4, seed=seed + 1, requires_grad=True)
    wt_ref = wt.detach().clone().requires_grad_(True)
    xs = st.distribute_tensor(x, m, [st.Shard(0)], {0: uneven_extents(9, m.size(), seed)})
    ((xs * wt).square().sum() + (xs + wt).mean()).backward()
    ((x * wt_ref).square().sum() + (x + wt_ref).mean()).backward()
    assert not st.is_shard_tensor(wt.grad)
    close(wt.grad, wt_ref.grad, what="plain param grad")
    return True


def case_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(5, 6, 3, seed=seed)
    y = randn(6, 3, seed=seed + 1)
    lay = ([st.Shard(0), st.Shard(1)], {0: uneven_extents(5, 2, seed), 1: uneven_extents(6, 2, seed + 1)})
    check_op(lambda x, y: (x * y).tanh() + x, [x, y], [lay, None], m, what="2-D mesh")
    check_op(lambda x, y: x / (y.abs() + 1), [x, y], [lay, ([st.Replicate(), st.Shard(0)], None)], m, what="2-D mixed")
    with st.use_strict():
        check_op(lambda x, v: x.masked_fill(x > 0.5, v), [x, torch.tensor(-2.0)], [lay, None], m,
                 what="2-D masked_fill.Tensor")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_binary_broadcast(world):
    harness.run(world, case_binary_broadcast, world)


@pytest.mark.parametrize("world", [2, 3])
def test_mismatched_shards(world):
    harness.run(world, case_mismatched_shards, world)


@pytest.mark.parametrize("world", [2, 4])
def test_activations(world):
    harness.run(world, case_activations, world)


@pytest.mark.parametrize("world", [1, 3])
def test_inplace_and_out(world):
    harness.run(world, case_inplace_and_out, world)


@pytest.mark.parametrize("world", [2, 4])
def test_param_grad_once(world):
    harness.run(world, case_param_grad_once, world)


def test_2d_mesh():
    harness.run(4, case_2d_mesh, 3)


# ---- in-place variants (derived from the schemas) ------------------------------------------------------------------

def _inplace_functionals():
    """Every function of torch.nn.functional with an ``inplace`` parameter, with the arguments that make it
    deterministic (evaluation mode for the dropouts and rrelu)."""
    import inspect

    def params(f):
        try:
            return inspect.signature(f).parameters
        except (TypeError, ValueError):
            return {}

    out = {}
    for name in sorted(dir(F)):
        f = getattr(F, name)
        if name.startswith("_") or not inspect.isfunction(f) or "inplace" not in params(f):
            continue
        args = (0.1, -2.0) if name == "threshold" else ()
        kwargs = {"training": False} if "training" in params(f) else {}
        out[name] = (f, args, kwargs)
    return out


def _inplace_modules():
    nn = torch.nn
    return {"ReLU": nn.ReLU(inplace=True), "ReLU6": nn.ReLU6(inplace=True), "ELU": nn.ELU(0.7, inplace=True),
            "SELU": nn.SELU(inplace=True), "CELU": nn.CELU(1.3, inplace=True),
            "Hardtanh": nn.Hardtanh(-0.5, 0.8, inplace=True), "LeakyReLU": nn.LeakyReLU(0.2, inplace=True),
            "RReLU": nn.RReLU(inplace=True).eval(), "SiLU": nn.SiLU(inplace=True),
            "Hardswish": nn.Hardswish(inplace=True), "Hardsigmoid": nn.Hardsigmoid(inplace=True),
            "Mish": nn.Mish(inplace=True), "Threshold": nn.Threshold(0.1, -2.0, inplace=True),
            "Dropout": nn.Dropout(0.3, inplace=True).eval(), "Dropout(p=0)": nn.Dropout(0.0, inplace=True)}


def test_inplace_functionals_enumerated():
    """The enumeration is not vacuous: it holds every activation the issue names."""
    names = set(_inplace_functionals())
    want = {"elu", "selu", "celu", "hardtanh", "relu6", "leaky_relu", "rrelu", "silu", "hardswish", "hardsigmoid",
            "mish", "threshold", "dropout", "relu"}
    assert want <= names, f"missing from torch.nn.functional's inplace=True functions: {want - names}"


def test_every_inplace_and_out_variant_bound():
    """Every in-place (`foo_`) and out= variant of an op that takes the pointwise rule has that rule: derived from
    the schemas, so no variant is left out (checked here independently, through torch's schema API)."""
    from torch._C import _dispatch_has_kernel_for_dispatch_key as has_kernel

    def schema(name):
        base, _, overload = name.partition(".")
        return torch._C._get_schema(base, overload)

    def args(s, skip=lambda a: False):
        return [(a.name, str(a.type)) for a in s.arguments if not skip(a)]

    def written(a):
        return a.alias_info is not None and a.alias_info.is_write

    untagged = {"aten::leaky_relu", "aten::hardswish", "aten::rrelu_with_noise", "aten::elu_backward",
                "aten::native_dropout", "aten::_prelu_kernel"}  # elementwise ops aten does not tag
    names = set(torch._C._dispatch_get_all_op_names())
    bindable = {n for n in names if n.startswith("aten::") and not has_kernel(n, "CompositeImplicitAutograd")}
    checked = []
    for name in sorted(bindable):
        base, _, overload = name.partition(".")
        s = schema(name)
        if not s.returns or not all(r.alias_info is not None and r.alias_info.is_write for r in s.returns):
            continue
        if base.endswith("_") and not base.endswith("__"):
            functional = base[:-1] + ("." + overload if overload else "")
            if not s.arguments or s.arguments[0].name != "self" or not written(s.arguments[0]):
                continue
            skip = lambda a: False  # noqa: E731
        elif overload == "out" or overload.endswith("_out"):
            functional = base + ("." + overload[:-4] if overload != "out" else "")
            skip = lambda a: a.kwarg_only and written(a)  # noqa: E731
        else:
            continue
        if functional not in bindable or args(s, skip) != args(schema(functional)):
            continue
        fbase, _, fov = functional.partition(".")
        tags = getattr(getattr(torch.ops.aten, fbase[6:]), fov or "default").tags
        if torch.Tag.pointwise not in tags and fbase not in untagged:
            continue
        if fbase == "aten::equal":
            continue  # tagged, but one bool for the whole tensors: its own rule
        assert st._C.has_handler(name), f"{name}: in-place/out= variant of pointwise {functional} has no rule"
        checked.append(name)
    assert len(checked) > 200, f"only {len(checked)} variants found: the enumeration is broken"
    for name in ["aten::elu_", "aten::hardtanh_", "aten::hardsigmoid_", "aten::mish_", "aten::celu_",
                 "aten::rrelu_with_noise_", "aten::leaky_relu_", "aten::silu_", "aten::hardswish_", "aten::abs_",
                 "aten::xlogy_.Scalar_Other", "aten::elu.out", "aten::hardtanh.out", "aten::add.Scalar_out",
                 "aten::_prelu_kernel", "aten::_prelu_kernel_backward"]:
        assert st._C.has_handler(name), f"{name} has no rule"


def case_inplace_activations(seed):
    """Every inplace=True activation, functional and module, after a non-leaf op, in grad mode: forward, input
    gradient and layout against one device; uneven extents (zero allowed)."""
    m = mesh()
    x = randn(7, 3, 5, seed=seed)
    lay = ([st.Shard(0)], {0: uneven_extents(7, m.size(), seed)})
    for name, (f, args, kwargs) in _inplace_functionals().items():
        if name.startswith("dropout") and name != "dropout":
            continue  # dropout1d/2d/3d want other ranks; in evaluation they return their input, like dropout
        out = check_op(lambda t: f(t * 1.5 - 0.2, *args, inplace=True, **kwargs), [x], [lay], m, what=f"F.{name}")
        assert st.placements(out) == (st.Shard(0),) and st.sharding_shapes(out) == lay[1], f"F.{name}: layout"
    check_op(lambda t: F.dropout(t * 1.5, 0.0, True, True), [x], [lay], m, what="dropout p=0 training")
    for name, mod in _inplace_modules().items():
        check_op(lambda t: mod(t + 0.3) * 2, [x], [lay], m, what=f"nn.{name}")
    return True


def case_inplace_tensor_methods(seed):
    """A sample of Tensor.xxx_ methods (several only reach the rule through the derivation), grad and no-grad."""
    m = mesh()
    x = randn(6, 4, seed=seed)
    y = randn(6, 4, seed=seed + 1)
    lay = ([st.Shard(0)], {0: uneven_extents(6, m.size(), seed)})
    other = ([st.Shard(1)], None)  # a differently sharded second operand: redistributed to the written layout
    unary = {"abs_": lambda t: t.abs_(), "celu_": lambda t: torch.celu_(t, 0.8), "sigmoid_": lambda t: t.sigmoid_(),
             "clamp_": lambda t: t.clamp_(-0.4, 0.5), "xlogy_": lambda t: t.abs_().xlogy_(2.0),
             "hardtanh_": lambda t: F.hardtanh_(t, -0.3, 0.6), "elu_": lambda t: F.elu_(t, 0.5),
             "leaky_relu_": lambda t: F.leaky_relu_(t, 0.3), "nan_to_num_": lambda t: t.log_().nan_to_num_(0.5),
             "pow_": lambda t: t.pow_(2), "exp_": lambda t: t.exp_()}
    for name, f in unary.items():
        check_op(lambda t: f(t * 1.0), [x], [lay], m, what=name)
    binary = {"copysign_": lambda a, b: a.copysign_(b), "mul_": lambda a, b: a.mul_(b),
              "heaviside_": lambda a, b: a.heaviside_(b), "lerp_": lambda a, b: a.lerp_(b, 0.3),
              "addcmul_": lambda a, b: a.addcmul_(b, b, value=0.5), "hypot_": lambda a, b: a.hypot_(b)}
    for name, f in binary.items():
        grad = name != "heaviside_"  # heaviside has no derivative
        check_op(lambda a, b: f(a * 1.0, b), [x, y], [lay, other], m, grad=grad, what=name)
        check_op(lambda a, b: f(a * 1.0, b), [x, y], [lay, None], m, grad=grad, what=f"{name} plain operand")
    # Comparisons in place write 0/1 in the written tensor's dtype (no gradient).
    for name in ["eq_", "ne_", "lt_", "le_", "gt_", "ge_"]:
        check_op(lambda a, b: getattr(a * 1.0, name)(b), [x, y], [lay, other], m, grad=False, what=name)
    a, b = torch.arange(12).reshape(6, 2) * 6, torch.arange(12).reshape(6, 2) + 2
    for name in ["gcd_", "lcm_"]:
        check_op(lambda s, t: getattr(s.clone(), name)(t), [a, b], [lay, None], m, grad=False, what=name)
    # No grad: the same ops on leaves and on views of a ShardTensor (an unsharded-dim slice, a sharded-dim slice).
    with torch.no_grad():
        for name, f in unary.items():
            xs = st.distribute_tensor(x.clone(), m, *lay)
            ref = x.clone()
            f(xs)
            f(ref)
            close(xs.full_tensor(), ref, what=f"no-grad {name}")
            assert st.sharding_shapes(xs) == lay[1], f"no-grad {name}: layout"
            for view in (lambda t: t[:, 1:3], lambda t: t[1:5]):
                xs = st.distribute_tensor(x.clone(), m, *lay)
                ref = x.clone()
                f(view(xs))
                f(view(ref))
                close(xs.full_tensor(), ref, what=f"no-grad {name} on a view")
    return True


def case_inplace_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(5, 6, 3, seed=seed)
    lay = ([st.Shard(0), st.Shard(1)], {0: uneven_extents(5, 2, seed), 1: uneven_extents(6, 2, seed + 1)})
    for name, (f, args, kwargs) in _inplace_functionals().items():
        if name.startswith("dropout") and name != "dropout":
            continue
        check_op(lambda t: f(t * 1.5, *args, inplace=True, **kwargs), [x], [lay], m, what=f"2-D F.{name}")
    return True


def case_inplace_refusals(seed):
    """What in-place and out= cannot do raises on every rank, naming the op."""
    m = mesh()
    which = seed
    xs = st.distribute_tensor(randn(6, 1, seed=1), m, [st.Shard(0)])
    ys = st.distribute_tensor(randn(6, 4, seed=2), m, [st.Shard(0)])
    if which == 0:
        xs.add_(ys)  # would broadcast the written tensor to [6, 4]
    elif which == 1:
        torch.add(ys, 1.0, out=torch.empty(0))  # an out= tensor that would be resized
    elif which == 2:
        noise = st.distribute_tensor(torch.empty(6, 4), m, [st.Replicate()])
        torch.ops.aten.rrelu_with_noise_(ys * 1.0, noise)  # written together, laid out differently
    return True


def case_plain_written_under_grad():
    """A plain tensor written from a ShardTensor that requires grad (neuraloperator's `out = torch.zeros(...);
    out[..., :m] = spectrum`): the plain tensor gets the full value and the ShardTensor the single-device gradient."""
    m = mesh()
    y = randn(6, 4, seed=3)
    w = randn(6, 4, seed=4)
    ref = y.clone().requires_grad_()
    ys = st.distribute_tensor(y, m, [st.Shard(0)], {0: uneven_extents(6, m.size(), seed=5)}).requires_grad_()
    outs = []
    for src in (ref, ys):
        p = torch.zeros(6, 4)
        p[:, 1:3] = src[:, 1:3] * 2
        p.add_(src.sin())
        (p * w).sum().backward()
        outs.append(p)
    assert not st.is_shard_tensor(outs[1])
    close(outs[1], outs[0], what="plain tensor written from a ShardTensor")
    check_grad_layout(ys, what="grad through a plain written tensor")
    close(full(ys.grad), ref.grad, what="grad through a plain written tensor")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_inplace_activations(world):
    harness.run(world, case_inplace_activations, world)


@pytest.mark.parametrize("world", [2, 3])
def test_inplace_tensor_methods(world):
    harness.run(world, case_inplace_tensor_methods, world)


def test_inplace_2d_mesh():
    harness.run(4, case_inplace_2d_mesh, 5)


@pytest.mark.parametrize("which,match", [(0, "would resize"), (1, "would resize"), (2, "written together")])
def test_inplace_refusals(which, match):
    harness.expect_error(3, case_inplace_refusals, which, match=match)


@pytest.mark.parametrize("world", [2, 3])
def test_plain_written_under_grad(world):
    harness.run(world, case_plain_written_under_grad)


# ---- PReLU -----------------------------------------------------------------------------------------------------------

def _prelu_pair(num_parameters, seed):
    torch.manual_seed(seed)
    mod = torch.nn.PReLU(num_parameters, init=0.2)
    with torch.no_grad():
        mod.weight.copy_(torch.linspace(-0.5, 0.7, num_parameters))  # distinct per-channel slopes
    ref = torch.nn.PReLU(num_parameters)
    ref.load_state_dict(mod.state_dict())
    return mod, ref


def _check_module(mod, ref, x, layout, m, what):
    """Forward, input gradient and every parameter gradient of a module on a sharded input vs one device."""
    xr = x.clone().requires_grad_(True)
    xs = st.distribute_tensor(x.clone(), m, *layout).requires_grad_(True)
    out_ref, out = ref(xr), mod(xs)
    close(out.full_tensor(), out_ref, what=f"{what} forward")
    assert st.placements(out) == st.placements(xs) and st.sharding_shapes(out) == st.sharding_shapes(xs), \
        f"{what}: output layout {st.placements(out)} {st.sharding_shapes(out)}"
    w = randn(*out_ref.shape, seed=5)
    (out_ref * w).sum().backward()
    (out * w).sum().backward()
    close(xs.grad.full_tensor(), xr.grad, what=f"{what} input grad")
    for (name, p), (_, pr) in zip(mod.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and not st.is_shard_tensor(p.grad), f"{what}: {name} gradient"
        close(p.grad, pr.grad, rtol=1e-5, atol=1e-5, what=f"{what} {name} grad")


def case_prelu(seed):
    m = mesh()
    w = m.size()
    x = randn(3, 4, 5, 6, seed=seed)
    for num in (1, 4):
        for dim in (0, 1, 2, 3):
            mod, ref = _prelu_pair(num, seed)
            lay = ([st.Shard(dim)], {0: uneven_extents(x.shape[dim], w, seed + dim)})
            _check_module(mod, ref, x, lay, m, what=f"PReLU({num}) Shard({dim})")
        # F.prelu with a plain weight and with a replicated ShardTensor weight.
        wt = torch.linspace(-0.3, 0.9, num)
        lay = ([st.Shard(2)], {0: uneven_extents(5, w, seed)})
        check_op(F.prelu, [x, wt], [lay, None], m, what=f"F.prelu plain weight ({num})")
        check_op(F.prelu, [x, wt], [lay, ([st.Replicate()], None)], m, what=f"F.prelu replicated weight ({num})")
        check_op(F.prelu, [x, wt], [([st.Shard(1)], {0: uneven_extents(4, w, seed)}), None], m,
                 what=f"F.prelu channel-sharded ({num})")
    # (N, C) input with the channel dim sharded; a Partial input is completed first.
    x2 = randn(5, 4, seed=seed + 3)
    check_op(F.prelu, [x2, torch.linspace(-0.3, 0.9, 4)], [([st.Shard(1)], {0: uneven_extents(4, w, seed)}), None], m,
             what="F.prelu (N, C)")
    # A MONAI-style block: convolution then PReLU(C), spatial dims sharded; every parameter gradient.
    torch.manual_seed(seed)
    block = torch.nn.Sequential(torch.nn.Conv2d(4, 3, 3, padding=1), torch.nn.PReLU(3))
    ref = torch.nn.Sequential(torch.nn.Conv2d(4, 3, 3, padding=1), torch.nn.PReLU(3))
    ref.load_state_dict(block.state_dict())
    _check_module(block, ref, x, ([st.Shard(2)], {0: uneven_extents(5, w, seed)}), m, what="conv+PReLU")
    return True


def case_prelu_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(2, 4, 5, 3, seed=seed)
    for num in (1, 4):
        for pl in ([st.Shard(1), st.Shard(2)], [st.Shard(2), st.Shard(3)], [st.Shard(0), st.Replicate()]):
            mod, ref = _prelu_pair(num, seed)
            ext = {i: uneven_extents(x.shape[p.dim], 2, seed + i) for i, p in enumerate(pl) if isinstance(p, st.Shard)}
            _check_module(mod, ref, x, (pl, ext), m, what=f"2-D PReLU({num}) {pl}")
    return True


def case_prelu_weight_reduced_once(seed):
    """The weight gradient's per-rank terms are summed by one all-reduce (the promote kernel's), not per use."""
    m = mesh()
    x = randn(3, 4, 6, seed=seed)
    mod, _ = _prelu_pair(4, seed)
    xs = st.distribute_tensor(x, m, [st.Shard(2)]).requires_grad_(True)
    out = mod(xs)
    loss = (out * out).sum()
    with st.CommCounter() as c:
        loss.backward()
    assert c.calls.get("all_reduce", 0) == 1, f"backward collectives {c.calls}"
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_prelu(world):
    harness.run(world, case_prelu, world)


def test_prelu_2d_mesh():
    harness.run(4, case_prelu_2d_mesh, 7)


@pytest.mark.parametrize("world", [2, 3])
def test_prelu_weight_reduced_once(world):
    harness.run(world, case_prelu_weight_reduced_once, world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_untagged_elementwise(world):
    harness.run(world, case_untagged_elementwise, world)




def case_pending_sum_times_shard(world):
    """A pending sum times a tensor sharded along an output dim (SwiftFormer's `attn * key`, `x * x.sum(1, keepdim)`):
    the small pending operand is completed (one all-reduce) and the product stays sharded — the large operand is
    never gathered; with a whole operand the pending sum is kept (no communication)."""
    m = mesh()
    a, k = randn(2, 9, 5, seed=60), randn(2, 9, 5, seed=61)
    lay = ([st.Shard(1)], {0: uneven_extents(9, world, seed=62)})
    a_s, k_s = shard_of(a, m, *lay), shard_of(k, m, *lay)
    s = a_s.sum(1, keepdim=True)
    assert type(st.placements(s)[0]).__name__ == "Partial"
    for op in (torch.mul, torch.div):
        with st.CommCounter() as c:
            out = op(s, k_s) if op is torch.mul else op(k_s, s)
        assert st.placements(out) == (st.Shard(1),), st.placements(out)
        assert dict(c.calls) == ({"all_reduce": 1} if world > 1 else {}), c.calls
        ref = a.sum(1, keepdim=True) * k if op is torch.mul else k / a.sum(1, keepdim=True)
        close(full(out), ref, what=f"{op.__name__} of a pending sum and a shard")
    with st.CommCounter() as c:
        kept = s * randn(2, 1, 5, seed=63)
    assert type(st.placements(kept)[0]).__name__ == "Partial" and not c.calls, (st.placements(kept), c.calls)
    check_op(lambda x, y: x.sum(1, keepdim=True) * y, [a, k], [lay, lay], m, what="pending sum times shard, grads")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_pending_sum_times_shard(world):
    harness.run(world, case_pending_sum_times_shard, world)


def case_pending_sum_linear_views(world):
    """Ops linear in a pending sum keep it pending, with no communication: clone (`.contiguous()`), complex(re, im)
    of two pending sums, view_as_real / view_as_complex, `.real` / `.imag`; and a pending spectrum padded for an
    inverse FFT (torch's irfft pads the last dim only but lists every dim) is completed into a shard of a spatial
    dim (one reduce-scatter), not replicated: a spherical harmonic transform's spectrum."""
    m = mesh()
    a = randn(2, 3, 8, 5, seed=70)
    p = st.distribute_tensor(a, m, [st.Shard(2)], sharding_shapes={0: uneven_extents(8, world, seed=71)}).sum(2)
    assert type(st.placements(p)[0]).__name__ == "Partial"
    ref = a.sum(2)
    with st.CommCounter() as c:
        outs = {"contiguous": p.transpose(0, 1).contiguous().transpose(0, 1), "clone": p.clone(),
                "complex": torch.complex(p, 2 * p)}
        outs["view_as_real"] = torch.view_as_real(outs["complex"])
        outs["real"], outs["imag"] = outs["complex"].real, outs["complex"].imag
        outs["view_as_complex"] = torch.view_as_complex(outs["view_as_real"])
    assert not c.calls, c.calls
    for name, out in outs.items():
        assert type(st.placements(out)[0]).__name__ == "Partial", (name, st.placements(out))
    z = torch.complex(ref, 2 * ref)
    expect = {"contiguous": ref, "clone": ref, "complex": z, "view_as_real": torch.view_as_real(z), "real": ref,
              "imag": 2 * ref, "view_as_complex": z}
    for name, out in outs.items():
        close(full(out), expect[name], what=name)
    spec = torch.complex(randn(2, 6, 4, 5, seed=72), randn(2, 6, 4, 5, seed=73))
    ps = st.from_local(spec / world, m, [st.Partial()])
    with st.CommCounter() as c:
        field = torch.fft.irfft(ps, n=16, dim=-1)
    assert st.placements(field) == (st.Shard(2),), st.placements(field)  # a spatial dim, not the channels
    assert dict(c.calls) == ({"all_to_all": 1} if world > 1 else {}), c.calls
    close(full(field), torch.fft.irfft(spec, n=16, dim=-1), what="irfft of a pending spectrum")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_pending_sum_linear_views(world):
    harness.run(world, case_pending_sum_linear_views, world)


class _TokenMixer(torch.nn.Module):
    """MLP-Mixer's token-mixing block (timm's MixerBlock without its channel MLP): two Linears over the token dim."""

    def __init__(self, tokens, channels, hidden):
        super().__init__()
        self.norm = torch.nn.LayerNorm(channels)
        self.fc1, self.fc2 = torch.nn.Linear(tokens, hidden), torch.nn.Linear(hidden, tokens)

    def forward(self, x):                                       # (B, N, C), N split
        y = self.fc1(self.norm(x).transpose(1, 2))              # contracts the split tokens: a pending sum
        self.hidden = F.gelu(y)                                 # completes it
        return x + self.fc2(self.hidden).transpose(1, 2)


def case_pending_sum_completed_split(world, mesh_shape):
    """A non-linear op on a large pending sum that no sharded operand places (MLP-Mixer's token MLP: fc1 contracts
    the split tokens, GELU completes the sum) completes it by a reduce-scatter into a split of an outer dim, so GELU
    and fc2 run on 1/P of the hidden layer on each rank instead of whole on every rank; forward, input and parameter
    gradients equal one device. A small pending sum (a squeeze-excitation gate) is all-reduced whole, as before."""
    m = mesh(mesh_shape)
    B, N, C, H = 2, 12, 64, 256                     # hidden (B, C, H): 32768 elements, above the split threshold
    torch.manual_seed(0)
    ref = _TokenMixer(N, C, H).double()
    mod = _TokenMixer(N, C, H).double()
    mod.load_state_dict(ref.state_dict())
    x = randn(B, N, C, seed=70, dtype=torch.float64)
    if len(m.mesh.shape) == 1:
        lay = ([st.Shard(1)], {0: uneven_extents(N, world, seed=71)})
    else:                                           # batch on mesh dim 0, tokens on mesh dim 1
        lay = ([st.Shard(0), st.Shard(1)], {1: uneven_extents(N, m.size(1), seed=71)})
    xs = shard_of(x, m, *lay).requires_grad_()
    xr = x.clone().requires_grad_()
    with st.CommCounter() as c:
        out = mod(xs)
    hidden = mod.hidden
    pl = st.placements(hidden)
    token_mesh_dim = len(pl) - 1
    # The hidden layer is split on the pending sum's mesh dim (the channels: the largest outer dim), not whole.
    assert pl[token_mesh_dim] == st.Shard(1), pl
    assert "all_reduce" not in c.calls, c.calls
    assert st.to_local(hidden).numel() < hidden.numel() * 0.75, (st.to_local(hidden).shape, hidden.shape)
    out_ref = ref(xr)
    close(full(out), out_ref, rtol=1e-10, atol=1e-12, what="token mixer forward")
    assert st.placements(out) == st.placements(xs), st.placements(out)
    g = randn(B, N, C, seed=72, dtype=torch.float64)
    out.backward(shard_of(g, m, *lay))
    out_ref.backward(g)
    close(full(xs.grad), xr.grad, rtol=1e-10, atol=1e-12, what="token mixer input gradient")
    for (name, p), q in zip(mod.named_parameters(), ref.parameters()):
        assert not st.is_shard_tensor(p.grad), name
        close(p.grad, q.grad, rtol=1e-10, atol=1e-12, what=f"token mixer {name}.grad")

    # A small pending sum stays whole: one all-reduce.
    split = [st.Shard(1)] if len(m.mesh.shape) == 1 else [st.Replicate(), st.Shard(1)]
    s = shard_of(randn(2, 9, 8, seed=73, dtype=torch.float64), m, split).sum(1)
    with st.CommCounter() as c:
        gate = torch.sigmoid(s)
    assert all(p.is_replicate() for p in st.placements(gate)), st.placements(gate)
    assert c.calls == ({"all_reduce": 1} if world > 1 else {}), c.calls
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_pending_sum_completed_split(world):
    harness.run(world, case_pending_sum_completed_split, world, None)


def test_pending_sum_completed_split_2d_mesh():
    harness.run(4, case_pending_sum_completed_split, 4, (2, 2))
