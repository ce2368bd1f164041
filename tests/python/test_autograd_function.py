"""torch.autograd.Function applied to ShardTensors and plain tensors that require grad (shardtensor/_patches.py,
``_promoting_apply``): the Function gets its arguments unchanged, and the gradients its backward returns for the
plain ones come back plain, whole and equal to one device's. An adjoint method passes the model's parameters only
to name what its backward differentiates (``torch.autograd.grad`` of the model's output with respect to them, as
torchdiffeq's ``odeint_adjoint`` does): with stand-ins for them, their gradients were silently zero."""
import torch

import harness
import shardtensor as st
from cases_util import close, mesh, randn, uneven_extents


class _Adjoint(torch.autograd.Function):
    """y = layer(x); the backward differentiates the layer again with respect to the parameters it was given."""

    @staticmethod
    def forward(ctx, layer, x, *params):
        ctx.layer = layer
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, g):
        x, *params = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            out = ctx.layer(x)
            grads = torch.autograd.grad(out, (x, *params), g, allow_unused=True)
        return (None, *grads)


def case_adjoint_parameters(seed):
    m = mesh()
    torch.manual_seed(seed)
    layer = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    ref = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    ref.load_state_dict(layer.state_dict())
    x = randn(2, 3, 7, 6, seed=seed).double()
    xr = x.clone().requires_grad_(True)
    (_Adjoint.apply(ref, xr, *ref.parameters()) ** 2).sum().backward()
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: uneven_extents(7, m.size(), seed)})
    xs.requires_grad_(True)
    (_Adjoint.apply(layer, xs, *layer.parameters()) ** 2).sum().backward()
    for (name, p), q in zip(layer.named_parameters(), ref.parameters()):
        assert not st.is_shard_tensor(p.grad), f"{name}: a ShardTensor gradient for a plain parameter"
        close(p.grad, q.grad, what=f"{name} gradient through the adjoint")
    close(xs.grad.full_tensor(), xr.grad, what="input gradient through the adjoint")
    return True


def test_adjoint_parameters():
    for world in (1, 2, 3):
        harness.run(world, case_adjoint_parameters, 7 + world)
