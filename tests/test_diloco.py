"""DiLoCo, Streaming DiLoCo and LocalSGD on worlds of 1, 2 and 3 ranks (local, mpi, gloo).

One world per backend and size runs every behaviour of ``worlds_diloco``: each
method against one process that plays every worker (float64, to 1e-10), a
resume mid-window, compressed exchanges that leave every rank with the same
bits, error feedback, and the errors for bad or disagreeing arguments.
"""

from __future__ import annotations

import pytest

import worlds_diloco as bodies
from conftest import world_params

WORLD = {"timeout": 180, "op_timeout": 30}
WORLDS = [("local", 1), ("mpi", 2), ("mpi", 3), ("gloo", 2), ("gloo", 3)]


@pytest.mark.parametrize("behaviour", bodies.DILOCO.names)
@pytest.mark.parametrize("backend,n", world_params(WORLDS))
def test_diloco(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.diloco, backend, n, behaviour, **WORLD)
