"""Every collective, op, dtype and container, on worlds of 1, 2 and 3 ranks per backend.

Each body runs in one world per backend and size (starting a world costs seconds; a
check costs microseconds) and reports every behaviour by name; each is its own test id.
"""

from __future__ import annotations

import pytest

import worlds_collectives as bodies
import worlds_halfsum
from conftest import ALL_WORLDS, world_params


@pytest.mark.parametrize("behaviour", bodies.COLLECTIVES.names)
@pytest.mark.parametrize("backend,n", world_params(ALL_WORLDS))
def test_collectives_match_numpy_reference(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.collectives, backend, n, behaviour)


@pytest.mark.parametrize("behaviour", bodies.SCALARS_AND_EDGES.names)
@pytest.mark.parametrize("backend,n", world_params(ALL_WORLDS))
def test_scalars_and_edges(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.scalars_and_edges, backend, n, behaviour)


@pytest.mark.parametrize("behaviour", bodies.MIXED.names)
@pytest.mark.parametrize("backend,n", world_params(ALL_WORLDS))
def test_nonblocking_objects_and_identity(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.mixed, backend, n, behaviour, args=(backend, n))


# MPI has no 16-bit float sum: from 64 KiB phalanx sends the 16-bit words and adds them in float32
# itself (half the bytes of widening); the result must not change, and each behaviour checks which
# path its calls took.
@pytest.mark.parametrize("behaviour", worlds_halfsum.SUMS.names)
@pytest.mark.parametrize("backend,n", world_params(ALL_WORLDS))
def test_large_16_bit_sums_equal_float32_arithmetic(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(worlds_halfsum.sums, backend, n, behaviour, args=(backend, n), timeout=120, op_timeout=60)
