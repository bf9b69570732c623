"""phalanx.horovod.torch: a rank's extra blocking operation fails on that rank alone (Horovod's
behaviour: its operations are matched by name), on mpi and gloo, at 3 ranks (with 2 there is no
majority and every rank raises, as phalanx's own API always does)."""

from __future__ import annotations

import pytest

import worlds_horovod_resync as bodies
from conftest import world_params
from phalanx.testing import run_world


@pytest.mark.parametrize("backend,n", world_params([("mpi", 3), ("gloo", 3)]))
def test_an_extra_operation_fails_alone_before_an_allreduce_and_before_add_process_set(backend: str,
                                                                                      n: int) -> None:
    results = run_world(bodies.extra_operation_fails_alone, n, backend, op_timeout=20, timeout=120)
    for r, seen in enumerate(results):
        assert (seen["summed"]["extra"] not in (None, "completed")) == (r == 2), (r, seen)
        assert seen["summed"]["then"] == [3.0, 3.0], (r, seen)  # 0 + 1 + 2: every rank's contribution
        assert (seen["grouped"]["extra"] not in (None, "completed")) == (r == 1), (r, seen)
        assert seen["grouped"]["then"] == [0, 1], (r, seen)
        assert seen["after"] == 3.0, (r, seen)
