"""mpi's ring allreduce (``comm/_ring.py``) on worlds of 1, 2 and 3 ranks of one host, forced on with
``PHALANX_MPI_RING=1`` (by default it runs only when the world spans hosts: ``test_host_failures.py`` and
``test_mpi_hosts.py`` run it there):

* buffers of 1 MiB and more take the ring, smaller ones MPI's own allreduce; a world of 1 has no ring;
* every op on float32/float64 equals NumPy, for one ring and for a buffer that goes round as several
  uneven rings; in place and not; bf16/fp16 summed in float32, rounded per hop, NaN kept;
* non-blocking handles waited in any order, a different one on each rank; the gradient engine's buckets give the single-process average;
* all of it again in two levels (``PHALANX_HIERARCHICAL=1``: the ring within the host, then the leaders'
  broadcast); ``test_mpi_hosts.py`` runs the two levels across hosts, where they are the default for
  hosts with several ranks.
"""

from __future__ import annotations

import pytest

import worlds_ring as bodies
from conftest import world_params

ENVS = {"flat": {"PHALANX_MPI_RING": "1"},
        # in two levels (comm/_hring.py): on one host, the host's ring then the leader's broadcast
        "two-levels": {"PHALANX_MPI_RING": "1", "PHALANX_HIERARCHICAL": "1"}}


@pytest.mark.parametrize("behaviour", bodies.RING.names)
@pytest.mark.parametrize("backend,n", world_params([("mpi", 1), ("mpi", 2), ("mpi", 3)]))
@pytest.mark.parametrize("levels", list(ENVS))
def test_mpi_ring(worlds, levels: str, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.ring, backend, n, behaviour, env=ENVS[levels], op_timeout=30.0, timeout=180)
