"""Optimizers made before their model was wrapped with ``shard=``, re-pointed at the wrapper's shards.

::

    for opt in optimizers_holding(params):            # at wrapping: the torch optimizers already made on them
        repoint(opt, {id(p): shard, ...})             # shard="parameters": each parameter replaced by its shard
        sharding.adopt(opt)                           # shard="optimizer"/"gradients": by its slice (_sharded.py)

nanoGPT and torchtitan make the optimizer and then wrap the model
(``configure_optimizers``, then FSDP). Sharding replaces what the model's
parameters are (ZeRO-3) or what the optimizer must update (ZeRO-1/2), so an
optimizer holding the whole parameters would step on gradients that no
longer arrive and train nothing, silently. Every optimizer of this process
that holds one of them is found once, when the wrapper is made (one walk of
the garbage collector's objects, only when such a parameter is still
referenced from outside the model), and takes the shards in their place with
the state it had, cut to this rank's elements: the result equals making the
optimizer after wrapping. The inner optimizer of a ``DistributedOptimizer``
is left alone (its own wrapper reduces it).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping

import torch

from ._optimizer import DistributedOptimizer
from ._shard_state import local_part
from ._shard_tensor import ShardedTensor

__all__ = ["optimizers_holding", "repoint"]


def optimizers_holding(params: Iterable[torch.Tensor]) -> list[torch.optim.Optimizer]:
    """The torch optimizers of this process whose groups hold any of ``params`` (not those a phalanx
    ``DistributedOptimizer`` wraps, nor the wrapper itself), in no particular order."""
    ids = {id(p) for p in params}
    if not ids:
        return []
    found, wrapped = [], set()
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that reads __class__, which some lazy module proxies warn on
        if issubclass(kind, DistributedOptimizer):
            wrapped.add(id(obj.optimizer))
        elif issubclass(kind, torch.optim.Optimizer) and any(
                id(p) in ids for g in obj.param_groups for p in g["params"]):
            found.append(obj)
    return [o for o in found if id(o) not in wrapped]


def repoint(optimizer: torch.optim.Optimizer, moved: Mapping[int, ShardedTensor]) -> bool:
    """Replace each parameter of ``optimizer``'s groups found in ``moved`` (by id) by its shard, with the
    state it had cut to this rank's elements; whether any was replaced."""
    changed = False
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            shard = moved.get(id(p))
            if shard is None:
                params.append(p)
                continue
            state = optimizer.state.pop(p, None)
            if state:
                optimizer.state[shard] = {k: local_part(shard, k, v) for k, v in state.items()}
            params.append(shard)
            changed = True
        group["params"] = params
    return changed
