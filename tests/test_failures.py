"""Failures end in a clear phalanx error on every rank, within a bounded time.

Worlds here use a small collective timeout (``op_timeout``) and a hard outer
timeout, so a hang fails the test instead of the CI job.
"""

from __future__ import annotations

import re
import time

import pytest

import worlds_failures as bodies
from conftest import ALL_WORLDS, MULTI_WORLDS, world_params
from phalanx.testing import WorldFailed, run_world

OP_TIMEOUT = 4.0


@pytest.mark.parametrize("behaviour", bodies.MISMATCHES.names)
@pytest.mark.parametrize("backend,n", world_params(MULTI_WORLDS))
def test_mismatched_calls_raise_on_every_rank(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.mismatches, backend, n, behaviour, op_timeout=OP_TIMEOUT)


@pytest.mark.parametrize("behaviour", bodies.CALL_SITE.names)
@pytest.mark.parametrize("backend,n", world_params([("mpi", 2), ("gloo", 2)]))
def test_debug_mode_catches_calls_out_of_order(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.call_site_mismatch, backend, n, behaviour, env={"PHALANX_DEBUG": "1"})


@pytest.mark.parametrize("behaviour", bodies.BAD_INPUT.names)
@pytest.mark.parametrize("backend,n", world_params(ALL_WORLDS))
def test_bad_input_fails_before_anything_is_sent(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.bad_input, backend, n, behaviour, op_timeout=OP_TIMEOUT)


@pytest.mark.parametrize("backend,n", world_params(MULTI_WORLDS))
def test_a_rank_that_never_arrives_is_a_timeout_naming_it(backend: str, n: int) -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailed) as failed:
        run_world(bodies.sleeper_skips_allreduce, n, backend, op_timeout=OP_TIMEOUT, timeout=50)
    assert time.monotonic() - start < OP_TIMEOUT + 25
    # The first waiting rank to give up ends the job (MPI aborts it; the launcher stops the
    # rest), so the launcher's report carries its error; the others may not get to print theirs.
    report = str(failed.value)
    assert "CollectiveTimeoutError" in report, report
    assert "phalanx.allreduce" in report and f"never reached a phalanx call: [{n - 1}]" in report, report
    assert any("CollectiveTimeoutError" in failed.value.outputs[r] for r in range(n - 1))


@pytest.mark.parametrize("backend,n", world_params(MULTI_WORLDS))
def test_a_rank_that_raises_ends_the_job_with_its_traceback(backend: str, n: int) -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailed) as failed:
        run_world(bodies.raises_on_rank_1, n, backend, op_timeout=30, timeout=50)
    assert time.monotonic() - start < 25
    # the launcher's report names rank 1 as the first to fail, with its error (the sentence, not the
    # "--- rank 1 output ---" header every report has)
    report = failed.value.report
    first = r"^phalanx run: rank 1 failed first( \(exit code 1\))? after [\d.]+ s: ValueError: boom on rank 1$"
    assert re.search(first, report, re.M), report
    assert report in str(failed.value)


@pytest.mark.parametrize("backend,n", world_params(MULTI_WORLDS))
def test_a_killed_rank_ends_the_job(backend: str, n: int) -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailed) as failed:
        run_world(bodies.killed_rank_1, n, backend, op_timeout=30, timeout=50)
    assert time.monotonic() - start < 25
    assert failed.value.returncode != 0
    report = failed.value.report
    # killed: no record, so the launcher names it from its death (mpiexec may not pass on the signal)
    first = r"^phalanx run: rank 1 failed first( after [\d.]+ s)?: [^\n]*, without a Python traceback"
    assert re.search(first, report, re.M), report
    assert report in str(failed.value)
