"""A DataParallel rank that skips a backward: every rank raises CollectiveMismatchError before any
gradient of one step is averaged with another step's, on mpi and gloo, by default."""

from __future__ import annotations

import pytest

import worlds_skipped_backward as bodies
from conftest import world_params
from phalanx.testing import run_world


@pytest.mark.parametrize("check_steps,logging", [(None, True), (None, False), (True, False)],
                         ids=["default-with-a-logging-allreduce", "default-alone", "check-steps-true"])
@pytest.mark.parametrize("backend,n", world_params([("mpi", 2), ("gloo", 2)]))
def test_a_skipped_backward_is_named_before_steps_mix(backend: str, n: int, check_steps: bool | None,
                                                      logging: bool) -> None:
    results = run_world(bodies.skipped_backward, n, backend, op_timeout=10, timeout=60,
                        args=(check_steps, logging))
    print(f"\n{backend}-{n}: " + "; ".join(f"rank {r} raised {x['type']} at step {x['step']} after "
                                           f"{x['seconds']:.2f} s" for r, x in enumerate(results)))
    for rank, result in enumerate(results):
        assert result["type"] == "CollectiveMismatchError", (rank, result)
        assert result["seconds"] < 5, (rank, result)
        assert result["unchanged"], f"rank {rank} applied an update mixing steps: {result}"
    # Rank 0 learns it in step 1 (logging) or step 2 (its backward meets rank 1's next one):
    # never later, and never after averaging step 2's gradients with step 3's.
    assert results[0]["step"] in (1, 2) and results[1]["step"] in (1, 2), results
