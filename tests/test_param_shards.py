"""``DataParallel(shard="parameters")`` (ZeRO-3) on worlds of 1, 2 and 3 ranks (local, mpi, gloo) equals 1 process.

One world per backend and size runs every behaviour of ``worlds_param_shards``:
a small GPT (tied output layer, frozen position embedding, a block called
twice) trained as nanoGPT trains it, the sharded parameters' shapes and
elements, whole state dicts in and out, and the refusals.
"""

from __future__ import annotations

import pytest

import worlds_param_shards as bodies
from conftest import TRAINING_WORLDS, world_params

WORLD = {"timeout": 180, "op_timeout": 30}


@pytest.mark.parametrize("behaviour", bodies.PARAMS.names)
@pytest.mark.parametrize("backend,n", world_params(TRAINING_WORLDS))
def test_param_shards(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.param_shards, backend, n, behaviour, **WORLD)
