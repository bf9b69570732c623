"""Sharded training in nanoGPT's and torchtitan's idioms on worlds of 1, 2 and 3 ranks (local, mpi, gloo).

One world per backend and size runs every behaviour of ``worlds_zero3_idioms``:
the optimizer made before wrapping, ranks that disagree on ``units``, and
nanoGPT's ``torch.save`` checkpoint line resumed at another number of ranks.
"""

from __future__ import annotations

import pytest

import worlds_zero3_idioms as bodies
from conftest import world_params

WORLD = {"timeout": 180, "op_timeout": 30}
WORLDS = [("local", 1), ("mpi", 2), ("mpi", 3), ("gloo", 2), ("gloo", 3)]


@pytest.mark.parametrize("behaviour", bodies.IDIOMS.names)
@pytest.mark.parametrize("backend,n", world_params(WORLDS))
def test_zero3_idioms(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.zero3_idioms, backend, n, behaviour, **WORLD)
