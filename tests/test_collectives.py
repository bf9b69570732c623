"""Every collective, op, dtype and container, on worlds of 1, 2 and 3 ranks per backend.

Each test starts one world and runs a whole body of checks in it (starting a
world costs seconds; a check costs microseconds).
"""

from __future__ import annotations

import pytest

import worlds_collectives as bodies
from conftest import ALL_WORLDS, world_params
from phalanx.testing import run_world


@pytest.mark.parametrize("backend,n", world_params(ALL_WORLDS))
def test_collectives_match_numpy_reference(backend: str, n: int) -> None:
    results = run_world(bodies.collectives, n, backend)
    assert len(results) == n
    assert all(res["checks"] > 200 for res in results), results


@pytest.mark.parametrize("behaviour", bodies.SCALARS_AND_EDGES.names)
@pytest.mark.parametrize("backend,n", world_params(ALL_WORLDS))
def test_scalars_and_edges(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.scalars_and_edges, backend, n, behaviour)


@pytest.mark.parametrize("backend,n", world_params(ALL_WORLDS))
def test_nonblocking_objects_and_identity(backend: str, n: int) -> None:
    results = run_world(bodies.mixed, n, backend)
    for r, res in enumerate(results):
        assert res["order"] == 6
        assert res["objects"] == [("rank", q) for q in range(n)]
        ident = res["identity"]
        assert (ident["rank"], ident["size"], ident["backend"]) == (r, n, backend)
        assert ident["initialized"] and ident["same_backend_again"]
        assert (ident["local_rank"], ident["local_size"]) == (r, n)  # one node
        expected_log = f"{r}/{n} opted in\n" if r else f"0/{n} from every rank?\n0/{n} opted in\n"
        assert ident["log"] == expected_log



@pytest.mark.parametrize("backend,n", world_params(ALL_WORLDS))
def test_large_16_bit_sums_equal_float32_arithmetic(backend: str, n: int) -> None:
    # MPI has no 16-bit float sum: from 64 KiB phalanx sends the 16-bit words and adds them in float32
    # itself (half the bytes of widening); the result must not change.
    import worlds_halfsum

    results = run_world(worlds_halfsum.sums, n, backend, timeout=120, op_timeout=60)
    assert all(r["checks"] == 27 for r in results), results
    assert all((r["sixteen_bit"] == 27) == (backend == "mpi" and n > 1) for r in results), results
