"""Sharded training (ZeRO stages 1 and 2) on worlds of 1, 2 and 3 ranks (local, mpi, gloo) equals 1 process.

One world per backend and size runs every behaviour of ``worlds_sharding``:
``shard="optimizer"`` and ``shard="gradients"`` with SGD (momentum, Nesterov),
Adam, AdamW and parameter groups, accumulation, bf16, clipping over every
rank's slices, LR schedulers, SyncBatchNorm, parameters without gradients,
GradScaler, checkpoints between sharded and unsharded optimizers, the
memory each rank keeps, and the errors for bad input. And, at 2 and 3 ranks
on mpi and gloo, ``DistributedOptimizer`` at every ``shard`` value (None
too) in the code users write around it (``worlds_optimizer_idioms``).
"""

from __future__ import annotations

import pytest

import worlds_optimizer_idioms as idioms
import worlds_sharding as bodies
from conftest import MULTI_WORLDS, TRAINING_WORLDS, world_params

MULTI_RANK = [world for world in TRAINING_WORLDS if world[1] > 1]
WORLD = {"timeout": 180, "op_timeout": 30}


@pytest.mark.parametrize("behaviour", bodies.SHARDING.names)
@pytest.mark.parametrize("backend,n", world_params(TRAINING_WORLDS))
def test_sharding(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.sharding, backend, n, behaviour, **WORLD)


@pytest.mark.parametrize("behaviour", bodies.SHARDING_ACROSS.names)
@pytest.mark.parametrize("backend,n", world_params(MULTI_RANK))
def test_sharding_across_ranks(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.sharding, backend, n, behaviour, **WORLD)  # the same world as above


@pytest.mark.parametrize("behaviour", idioms.IDIOMS.names)
@pytest.mark.parametrize("backend,n", world_params(MULTI_WORLDS))
def test_distributed_optimizer_idioms(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(idioms.optimizer_idioms, backend, n, behaviour, **WORLD)
