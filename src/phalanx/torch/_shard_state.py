"""Whole states of sharded parameters: a module's and an optimizer's, in and out.

::

    full_state_dict(model_state)        # ShardedTensor values -> whole tensors (collective)
    ShardedOptimizerState(opt)          # .state_dict(): whole; .load_state_dict(whole): this rank's elements

What :class:`~phalanx.torch.DataParallel` with ``shard="parameters"`` returns
from ``state_dict()``: whole tensors under their names (``module.``-prefixed,
as any wrapper's state) and shapes, so it loads into a wrapper at another
number of ranks or with another ``shard``. Every rank
calls these (each whole tensor is one all-gather, in the same order on
every rank). Loading needs no collective: each rank keeps its elements.
"""

from __future__ import annotations

from typing import Any

import torch

from ._shard_tensor import ShardedTensor

__all__ = ["COUNTERS", "ShardedOptimizerState", "full_state_dict", "holds_sharded_tensors", "local_part",
           "per_element"]

COUNTERS = frozenset({"step", "eta", "mu", "mu_product"})  # per-parameter scalars in torch.optim states


def full_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every ShardedTensor replaced by its whole tensor (collective; a tensor shared
    under two names, e.g. tied weights, is gathered once)."""
    done: dict[int, torch.Tensor] = {}
    out = type(state)()
    for name, value in state.items():
        if isinstance(value, ShardedTensor):
            key = id(value._spec)
            if key not in done:
                done[key] = value.full_tensor()
            value = done[key]
        out[name] = value
    if hasattr(state, "_metadata"):
        out._metadata = state._metadata  # type: ignore[attr-defined]
    return out


def holds_sharded_tensors(optimizer: Any) -> bool:
    """Whether ``optimizer`` updates ShardedTensor parameters (made on a ``shard="parameters"`` model)."""
    return optimizer is not None and any(isinstance(p, ShardedTensor) for g in optimizer.param_groups
                                         for p in g["params"])


class ShardedOptimizerState:
    """An optimizer of ShardedTensor parameters seen through its whole state (what checkpoints hold):
    made on a ``shard="parameters"`` model's shards or holding ZeRO-1/2's slices alike, so a checkpoint
    is interchangeable with an unsharded optimizer's, at any number of ranks and any level."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def _params(self) -> list[Any]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """``optimizer.state_dict()`` with every per-element entry whole (collective)."""
        sd = self.optimizer.state_dict()
        state = {j: {k: v.full_tensor() if isinstance(v, ShardedTensor) else v for k, v in entry.items()}
                 for j, entry in sorted(sd["state"].items())}
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state: each rank keeps its elements of every entry shaped like its parameter."""
        params = self._params()
        state = {}
        for j, entry in state_dict.get("state", {}).items():
            p = params[int(j)] if int(j) < len(params) else None
            state[j] = entry if not isinstance(p, ShardedTensor) else {
                k: local_part(p, k, v) for k, v in entry.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})


def per_element(shape: torch.Size, key: Any, value: Any) -> bool:
    """Whether optimizer state entry ``key: value`` of a parameter shaped ``shape`` has one element per
    parameter element (sharded like the parameter), rather than being a counter or a setting kept whole.
    The one rule for every sharded level: a plain tensor shaped like the parameter, except the
    per-parameter scalars of torch.optim states (:data:`COUNTERS`) of a 0-dimensional parameter."""
    return (isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor) and value.shape == shape
            and (len(shape) > 0 or key not in COUNTERS))


def local_part(p: ShardedTensor, key: Any, value: Any) -> Any:
    """This rank's elements of a whole state entry of sharded parameter ``p`` (a copy, sharded like
    ``p``), or ``value`` itself where it is not per-element (:func:`per_element`: ``step``, ...)."""
    spec = p._spec
    if not per_element(spec.shape, key, value):
        return value
    local = value.detach().reshape(-1)[spec.start:spec.stop].to(p.dtype).clone()
    return ShardedTensor(local, spec)
