"""``fit(shard="parameters")``: the user's plain model wrapped, and their optimizer moved onto its shards.

::

    model = shard_parameters(model, optimizer, units)   # DataParallel(shard="parameters"); optimizer follows

fit takes a plain model and a torch optimizer made on ``model.parameters()``.
Wrapping replaces the model's parameters by sharded ones, so the optimizer's
groups are rewritten to hold them, matched by name (the names do not
change); state the optimizer already had is cut to this rank's elements.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import InvalidArgumentError

__all__ = ["shard_parameters"]


def shard_parameters(model: torch.nn.Module, optimizer: Any, units: Any) -> Any:
    """``model`` wrapped in ``DataParallel(shard="parameters")``, and ``optimizer`` (made on the model's
    parameters) moved onto the sharded parameters, found by name; state it already has is cut to this
    rank's elements."""
    from ..torch import DataParallel, DistributedOptimizer
    from ..torch._shard_state import ShardedOptimizerState

    if isinstance(model, DataParallel) or isinstance(optimizer, DistributedOptimizer):
        raise InvalidArgumentError(
            "phalanx.train.fit(shard='parameters'): pass the plain model and a plain torch optimizer made on "
            "its parameters; fit wraps the model and moves the optimizer onto the sharded parameters itself.")
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if missing:
        raise InvalidArgumentError(
            f"phalanx.train.fit(shard='parameters'): the optimizer updates {len(missing)} tensor(s) that are not "
            "parameters of the model (shapes "
            f"{[list(p.shape) for p in missing[:3]]}); make it on `model.parameters()`.")
    whole = ShardedOptimizerState(optimizer).state_dict() if optimizer.state else None
    order = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    wrapped = DataParallel(model, shard="parameters", units=units)
    shards = dict(model.named_parameters())  # the same names, now sharded
    for group, group_names in zip(optimizer.param_groups, order, strict=True):
        group["params"] = [shards[n] for n in group_names]
    optimizer.state.clear()
    if whole is not None:
        ShardedOptimizerState(optimizer).load_state_dict(whole)
    return wrapped
