"""opt_einsum (tensorly's einsum, so neuraloperator's spectral convolutions) picks an array library by the top-level
package of the first operand's class and falls back to NumPy for a package it does not know. Eagerly a ShardTensor's
class is ``torch.Tensor``; inside ``torch.compile`` a ShardTensor travels as ``shardtensor._traced.TracedShard``,
whose package opt_einsum does not know, so it converted the traced shard to NumPy (``.numpy()`` of a tensor
subclass: an error). The package is named an alias of opt_einsum's own torch backend, which the traced shard is."""
from __future__ import annotations


def install(module) -> None:
    """``module``: ``opt_einsum.backends.dispatch``; its ``_aliases`` maps a package name to the module that serves it."""
    module._aliases["shardtensor"] = "opt_einsum.backends.torch"
