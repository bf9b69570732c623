"""Whole states of sharded parameters: a module's and an optimizer's, in and out.

::

    full_state_dict(model_state)        # ShardedTensor values -> whole tensors (collective)
    ShardedOptimizerState(opt)          # .state_dict(): whole; .load_state_dict(whole): this rank's elements
    keep_whole_module(module)           # its own state_dict() whole from now on (collective), as torch.save needs
    keep_whole_optimizer(opt)           # its own state_dict() whole; load_state_dict(whole) keeps this rank's part
    with local_states(): ...            # inside, both give this rank's shards (what save_sharded writes)

What :class:`~phalanx.torch.DataParallel` with ``shard="parameters"`` returns
from ``state_dict()``: whole tensors under their names (``module.``-prefixed,
as any wrapper's state) and shapes, so it loads into a wrapper at another
number of ranks or with another ``shard``. Every rank
calls these (each whole tensor is one all-gather, in the same order on
every rank). Loading needs no collective: each rank keeps its elements.

The user's own objects say the same once a ``shard="parameters"`` wrapper
has them (``keep_whole_module``/``keep_whole_optimizer``, through torch's
state-dict hooks): the wrapped module's ``state_dict()`` and a torch
optimizer's ``state_dict()`` hold plain whole tensors, so nanoGPT's
``torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()})``
writes what one process would, and loads at any number of ranks.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ._shard_tensor import ShardedTensor

__all__ = ["COUNTERS", "ShardedOptimizerState", "full_state_dict", "holds_sharded_tensors", "keep_whole_module",
           "keep_whole_optimizer", "local_part", "local_states", "per_element"]

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

    def state_dict(self) -> dict[str, Any]:
        """``optimizer.state_dict()`` with every per-element entry whole (collective)."""
        sd = self.optimizer.state_dict()
        return {"state": _whole_entries(sd["state"]), "param_groups": sd["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state: each rank keeps its elements of every entry shaped like its parameter."""
        sd = _local_optimizer_state(self.optimizer, state_dict)
        self.optimizer.load_state_dict({"state": sd["state"], "param_groups": sd["param_groups"]})


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


# -- the user's own module and optimizer, whole through torch's state-dict hooks ----------------------
_local = 0  # > 0 inside local_states()
_whole_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_whole_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


@contextlib.contextmanager
def local_states() -> Iterator[None]:
    """Inside, a kept-whole module's or optimizer's ``state_dict()`` holds this rank's ShardedTensors (what
    ``save_sharded`` and ``export_safetensors`` read one tensor at a time), not whole tensors."""
    global _local
    _local += 1
    try:
        yield
    finally:
        _local -= 1


def keep_whole_module(module: torch.nn.Module) -> None:
    """From now on ``module.state_dict()`` (and any wrapper's, which calls it) holds whole tensors in place
    of ShardedTensors (collective: every rank calls it). Once per module."""
    if module not in _whole_modules:
        _whole_modules.add(module)
        module.register_state_dict_post_hook(_whole_module_state)


def _whole_module_state(module: torch.nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    if _local:
        return
    mine = {k: v for k, v in state.items() if k.startswith(prefix) and isinstance(v, ShardedTensor)}
    state.update(full_state_dict(mine))


def keep_whole_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """From now on ``optimizer.state_dict()`` holds every per-element entry whole (collective) and
    ``optimizer.load_state_dict`` of a whole state keeps this rank's elements; whole entries loaded
    before (e.g. a checkpoint loaded before the first step) are cut to this rank's elements now.
    Once per optimizer."""
    if optimizer in _whole_optimizers:
        return
    _whole_optimizers.add(optimizer)
    optimizer.register_state_dict_post_hook(_whole_optimizer_state)
    optimizer.register_load_state_dict_pre_hook(_local_optimizer_state)
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = optimizer.state.get(p)
            if isinstance(p, ShardedTensor) and entry:
                optimizer.state[p] = {k: local_part(p, k, v) for k, v in entry.items()}


def _whole_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any] | None:
    if _local:
        return None
    sd["state"] = _whole_entries(sd["state"])
    return sd


def _whole_entries(state: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """An optimizer state_dict's ``state`` with every ShardedTensor whole (collective, in index order)."""
    return {j: {k: v.full_tensor() if isinstance(v, ShardedTensor) else v for k, v in entry.items()}
            for j, entry in sorted(state.items())}


def _local_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for j, entry in sd.get("state", {}).items():
        p = params[int(j)] if int(j) < len(params) else None
        state[j] = {k: local_part(p, k, v) for k, v in entry.items()} if isinstance(p, ShardedTensor) else entry
    return {**sd, "state": state}
