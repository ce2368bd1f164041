"""Routing plain Python functions to sharded implementations.

ShardTensors are ``torch.Tensor`` objects backed by C++, not a Python subclass, so ``__torch_function__`` never
sees them and ``torch.overrides.has_torch_function`` is ``False`` for them. A user's own function (``knn(points,
queries, k)``) is therefore intercepted at the function object itself: ``register_function(fn, handler)``
replaces ``fn.__code__`` by a small router, so every existing reference to ``fn`` (the module global, an
imported name, a dict of callbacks) reaches the router. The router calls ``handler`` when a ShardTensor is among
the arguments and ``fn``'s own body otherwise. Inside the handler, calls of ``fn`` on the same thread run the
body, so a handler can call ``fn`` on local shards (or hand the ShardTensors back to the op-by-op path).

The router costs one scan of the arguments (top level, and one level into lists, tuples and dicts) per call. It
reaches its route through a global of the function's module (``__shardtensor_dispatch__``) and a literal key, so
torch.compile can trace it: there a call with (traced) ShardTensors breaks the graph and runs the handler eagerly, a
call without runs the body in the graph.
"""
from __future__ import annotations

import inspect
import threading
import types

import torch

from . import _C

__all__ = ["register_function", "function_handler", "unregister_function", "has_shard_tensor"]

_DISPATCH = "__shardtensor_dispatch__"   # the name the router calls, set in the routed function's module globals
_KEY = 0x5eed_0000_0000                    # a literal in the template, replaced by the route's key
_active = threading.local()
_routes: dict = {}                         # key -> _Route


def _any_argument(args, kwargs, hit) -> bool:
    """True when ``hit`` holds for an argument: top level, or one level inside a list, tuple or dict."""
    for v in list(args) + list((kwargs or {}).values()):
        if hit(v):
            return True
        if isinstance(v, (list, tuple)) and any(hit(e) for e in v):
            return True
        if isinstance(v, dict) and any(hit(e) for e in v.values()):
            return True
    return False


def has_shard_tensor(args=(), kwargs=None) -> bool:
    """True when a ShardTensor is among ``args``/``kwargs`` (top level, or one level inside a list, tuple or
    dict)."""
    return _any_argument(args, kwargs, lambda v: isinstance(v, torch.Tensor) and _C.is_shard_tensor(v))


class _Route:
    """What the router of one function needs: the function's own body (a copy of the original function object)
    and the handler."""

    def __init__(self, fn, body, handler):
        self.fn, self.body, self.handler = fn, body, handler

    def call(self, args, kwargs):
        running = getattr(_active, "routes", None)
        if running is None:
            running = _active.routes = set()
        if id(self) in running or not has_shard_tensor(args, kwargs):
            return self.body(*args, **kwargs)
        running.add(id(self))
        try:
            return self.handler(*args, **kwargs)
        finally:
            running.discard(id(self))


def _traced_among(args, kwargs) -> bool:
    """True when a ShardTensor in its traced representation (``_traced.TracedShard``, what torch.compile traces) is
    among the arguments, where ``has_shard_tensor`` looks; Dynamo traces the checks."""
    from ._traced import TracedShard
    return _any_argument(args, kwargs, lambda v: isinstance(v, TracedShard))


def _eager_call(fn, args, kwargs):
    """``fn(*args, **kwargs)`` on C++ ShardTensors where traced ones (``_traced.TracedShard``) are given, its results
    traced again (both differentiable): what routed code runs from inside compiled code -- at a graph break, or in a
    frame Dynamo skipped (graph breaks in a loop, the recompile limit), which runs eagerly on traced ShardTensors."""
    from torch.utils._pytree import tree_leaves, tree_map
    from ._traced import _hook_plain_grads, from_traced, to_traced
    args, kwargs = tree_map(from_traced, (args, kwargs))
    out = fn(*args, **kwargs)
    # A plain result that requires grad (a routed layer whose output is whole) meets traced shards in the compiled
    # code after it, whose backward then hands it a traced gradient: made plain before it enters the eager graph.
    _hook_plain_grads(tree_leaves(out))
    return tree_map(to_traced, out)


# _eager_call behind torch.compiler.disable: called from code Dynamo traces, it breaks the graph; called from a frame
# Dynamo skipped, it keeps Dynamo from compiling the frames it calls on C++ ShardTensors (which it cannot fakeify).
# (Built at import: shardtensor imports Dynamo anyway, for its torch.compile boundary.)
call_eagerly = torch.compiler.disable(_eager_call, recursive=True)


def _dispatch(key, args, kwargs):
    """What every router calls. While torch.compile traces (Dynamo inlines the router and this function), a call with
    ShardTensors breaks the graph and runs the route eagerly (the routed implementations issue collectives and read
    layouts a graph cannot hold); a call without runs the function's own body, traced as without the library. No
    Python object of ours becomes a graph constant (Dynamo traces only literal constants)."""
    route = _routes[key]
    if _traced_among(args, kwargs):     # compiled code: Dynamo tracing it, or a frame it skipped running eagerly
        return call_eagerly(route.call, (args, kwargs), {})
    if torch.compiler.is_compiling():
        return route.body(*args, **kwargs)
    return route.call(args, kwargs)


def _router_code(freevars: tuple) -> types.CodeType:
    """The code of ``def f(*args, **kwargs): return __shardtensor_dispatch__(KEY, args, kwargs)``, with ``freevars``
    as free variables: a function's ``__code__`` may only be replaced by code with as many free variables as the
    function has closure cells. They are named in dead code, so the router never reads the (possibly empty) cells.
    The route is reached through a global and a literal key, not a constant object: Dynamo traces only literal
    constants."""
    names = ", ".join(freevars)
    src = ["def _outer():"]
    src += [f"    {n} = None" for n in freevars]
    src += ["    def _router(*args, **kwargs):"]
    if freevars:
        src += ["        if False:", f"            ({names},)"]
    src += [f"        return {_DISPATCH}({_KEY}, args, kwargs)", "    return _router"]
    namespace: dict = {}
    exec("\n".join(src), namespace)
    code = namespace["_outer"]().__code__
    if code.co_freevars != tuple(freevars):
        raise NotImplementedError(f"register_function: cannot build a router with free variables {freevars}")
    return code


def _copy_function(fn):
    body = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    body.__kwdefaults__ = fn.__kwdefaults__
    body.__qualname__ = fn.__qualname__
    body.__module__ = fn.__module__
    body.__doc__ = fn.__doc__
    body.__annotations__ = dict(fn.__annotations__)
    body.__dict__.update({k: v for k, v in fn.__dict__.items() if k != "_shardtensor_route"})
    return body


def register_function(fn, handler):
    """Route calls of the Python function ``fn`` to ``handler`` whenever a ShardTensor is among the arguments.

    ``handler`` receives exactly the call's arguments (``handler(*args, **kwargs)``) and returns the result. Calls
    without ShardTensor arguments run ``fn``'s own body; so do calls of ``fn`` made inside ``handler`` (same thread),
    which lets the handler run ``fn`` on local shards. ``fn`` is changed in place (its ``__code__``), so every
    reference to it is routed, including ones taken before registration; ``inspect.signature(fn)`` is kept.
    Registering again replaces the handler. Returns ``fn``.

    ``fn`` must be a Python function (``def`` or ``lambda``). Torch functions and aten ops reach ShardTensors
    through the dispatcher instead: use ``st.register_handler(op, handler)`` for them.
    """
    if not callable(handler):
        raise TypeError(f"register_function: handler must be callable, got {type(handler).__name__}")
    if isinstance(fn, types.MethodType):
        raise TypeError("register_function: pass the function (Class.method or the plain function), not a bound "
                        "method")
    if not isinstance(fn, types.FunctionType):
        what = getattr(fn, "__name__", type(fn).__name__)
        raise TypeError(f"register_function: {what} is not a Python function ({type(fn).__name__}); torch "
                        "functions and aten ops reach ShardTensors through the dispatcher: register a handler for "
                        "the aten op with st.register_handler(op, handler)")
    if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn):
        raise TypeError(f"register_function: {fn.__qualname__} is a generator or coroutine function; route a plain "
                        "function that returns the result")
    route = fn.__dict__.get("_shardtensor_route")
    if route is not None:
        route.handler = handler
        return fn
    body = _copy_function(fn)
    route = _Route(fn, body, handler)
    template = _router_code(fn.__code__.co_freevars)
    key = id(route)
    _routes[key] = route
    fn.__globals__[_DISPATCH] = _dispatch
    consts = tuple(key if (type(c) is int and c == _KEY) else c for c in template.co_consts)
    names = {"co_name": fn.__code__.co_name, "co_filename": fn.__code__.co_filename,
             "co_firstlineno": fn.__code__.co_firstlineno}
    if hasattr(fn.__code__, "co_qualname"):  # Python 3.11+
        names["co_qualname"] = fn.__code__.co_qualname
    code = template.replace(co_consts=consts, **names)
    signature = inspect.signature(fn)
    fn.__code__ = code
    fn.__signature__ = signature
    fn._shardtensor_route = route
    fn.__wrapped__ = body
    return fn


def function_handler(fn):
    """Decorator form of ``register_function``: ``@st.function_handler(knn)`` above the sharded implementation of
    ``knn`` registers it and returns it unchanged."""
    def decorate(handler):
        register_function(fn, handler)
        return handler
    return decorate


def unregister_function(fn) -> None:
    """Undo ``register_function``: ``fn`` runs its own body for every call again."""
    route = getattr(fn, "__dict__", {}).get("_shardtensor_route")
    if route is None:
        raise ValueError(f"unregister_function: {getattr(fn, '__qualname__', fn)!r} has no registered handler")
    fn.__code__ = route.body.__code__
    _routes.pop(id(route), None)
    for name in ("_shardtensor_route", "__wrapped__", "__signature__"):
        fn.__dict__.pop(name, None)
