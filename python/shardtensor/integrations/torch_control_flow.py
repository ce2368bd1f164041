"""torch's control-flow operators, ``torch.while_loop`` and ``torch.cond``, with ShardTensors among their arguments:
run in Python.

Both are higher-order ops: outside ``torch.compile`` they compile their own branches or loop body with
``fullgraph=True``, and inside Dynamo speculates those as subgraphs of plain fake tensors, which a ShardTensor (a
tensor subclass, traced as ``shardtensor._traced.TracedShard``) is not ("Expected FakeTensor, got TracedShard":
kornia's Canny edge detector, whose hysteresis uses ``torch.while_loop`` when compiled). Routed here
(``st.register_function``), a call with ShardTensors among its arguments runs as the op defines it --
``while cond_fn(*val): val = body_fn(*val)``, ``true_fn(*operands) if pred else false_fn(*operands)`` -- eagerly
(inside compiled code the route breaks the graph, as every routed function does). A condition computed from split
values (``(old != new).any()``, ``x.sum() > 0``) is reduced over the mesh, so every rank reads the same truth value
and takes the same path (its collectives stay in step)."""
from __future__ import annotations

import contextlib

import torch


def run_loop(cond_fn, body_fn, carried_inputs):
    """``torch.while_loop``'s semantics in Python: the final carried values as a tuple; clones of the inputs when
    the body never runs (the op never returns its inputs)."""
    with _closures_untraced((cond_fn, body_fn)):
        val, ran = tuple(carried_inputs), False
        while bool(cond_fn(*val)):
            val, ran = tuple(body_fn(*val)), True
        if ran:
            return val
        return tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in val)


@contextlib.contextmanager
def _closures_untraced(fns):
    """Inside compiled code the route gets the carried values as C++ ShardTensors (``functions.call_eagerly``), but
    a tensor the condition or the body captures from the compiled function (``torch.while_loop``'s "tensor
    closures") is still in its traced representation, which does not mix with them: those closure cells hold the
    C++ ShardTensor while the loop runs."""
    from .._traced import TracedShard, from_traced
    swapped = []
    for fn in fns:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:      # an empty cell
                continue
            if isinstance(value, TracedShard):
                swapped.append((cell, value))
                cell.cell_contents = from_traced(value)
    try:
        yield
    finally:
        for cell, value in swapped:
            cell.cell_contents = value


def run_cond(pred, true_fn, false_fn, operands=()):
    """``torch.cond``'s semantics in Python: the branch ``pred`` picks, called on the operands."""
    operands = tuple(operands)
    with _closures_untraced((true_fn, false_fn)):
        return true_fn(*operands) if bool(pred) else false_fn(*operands)


def install(module) -> None:
    """Route ``torch.while_loop`` (``torch._higher_order_ops.while_loop.while_loop``) or ``torch.cond``
    (``torch._higher_order_ops.cond.cond``), whichever the module defines."""
    from ..functions import register_function
    if module.__name__.endswith(".while_loop"):
        register_function(module.while_loop, run_loop)
    else:
        register_function(module.cond, run_cond)
