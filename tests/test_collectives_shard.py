"""The collectives of sharded training on worlds of 1, 2 and 3 ranks per backend (nccl where a GPU is).

The backends' ``ireduce_scatter``/``iallgather_into`` (what the gradient engine posts) and
``phalanx.reduce_scatter``/``allgather`` with ``counts=`` and ``out=``.
"""

from __future__ import annotations

import pytest

import worlds_collectives_shard as bodies
from conftest import ALL_WORLDS, world_params
from phalanx.testing import available_backends

WORLDS = ALL_WORLDS + ([("nccl", 1)] if "nccl" in available_backends() else [])


@pytest.mark.parametrize("behaviour", bodies.SHARD.names)
@pytest.mark.parametrize("backend,n", world_params(WORLDS))
def test_sharding_collectives(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.shard, backend, n, behaviour, args=(backend, n))
