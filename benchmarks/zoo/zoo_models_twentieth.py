"""The model zoo's twentieth set: neural ODEs with torchdiffeq (the thirty-fourth session) -- a learned vector field
(two convolutions) integrated over a split 2-D field: the adaptive Dormand-Prince solver, whose step acceptance and
next step size come from an RMS norm of the error estimate over the whole field (every rank must take the same
decision, so the norm is a reduction over the split field and its comparison a collective), the fixed-grid RK4 and
Euler solvers, and the adjoint method (`odeint_adjoint`: the backward integrates the augmented adjoint ODE, calling
`torch.autograd.grad` for the vector-Jacobian products with respect to the state and the parameters). Registered like
zoo_models.py's (zoo_models.py imports this module at its end)."""
import torch
import torch.nn as nn

from benchmarks.zoo.zoo_models import model


class _Field(nn.Module):
    """dy/dt = conv(tanh(conv(y))) + a time-dependent bias: the learned vector field."""

    def __init__(self, channels=3, hidden=8):
        super().__init__()
        self.inp = nn.Conv2d(channels, hidden, 3, padding=1)
        self.out = nn.Conv2d(hidden, channels, 3, padding=1)
        self.time = nn.Parameter(torch.randn(channels, 1, 1) * 0.1)

    def forward(self, t, y):
        return self.out(torch.tanh(self.inp(y))) + t * self.time


class _ODE(nn.Module):
    """The state at t = 1 from the input at t = 0."""

    def __init__(self, method, adjoint=False, **options):
        super().__init__()
        self.field = _Field()
        self.method, self.adjoint, self.options = method, adjoint, options

    def forward(self, x):
        import torchdiffeq
        solve = torchdiffeq.odeint_adjoint if self.adjoint else torchdiffeq.odeint
        kw = dict(method=self.method, **self.options)
        if self.adjoint:
            kw["adjoint_params"] = tuple(self.field.parameters())
        t = torch.tensor([0.0, 1.0], dtype=x.dtype)
        return solve(self.field, x, t, **kw)[-1]


def _register(name, build, note):
    model("torchdiffeq", f"torchdiffeq/{name}", (2, 3, 24, 24), **{"note": note})(build)


_register("dopri5", lambda: _ODE("dopri5", rtol=1e-4, atol=1e-6),
          "adaptive Dormand-Prince: error norms over the split field decide every step")
_register("rk4", lambda: _ODE("rk4", options={"step_size": 0.25}), "fixed-grid RK4 (3/8 rule), four steps")
_register("euler", lambda: _ODE("euler", options={"step_size": 0.125}), "explicit Euler, eight steps")
_register("dopri5_adjoint", lambda: _ODE("dopri5", adjoint=True, rtol=1e-4, atol=1e-6),
          "the adjoint method: the backward solves the adjoint ODE with autograd.grad of the field")
_register("rk4_adjoint", lambda: _ODE("rk4", adjoint=True, options={"step_size": 0.25}),
          "the adjoint method on a fixed grid")
