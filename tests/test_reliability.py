"""Faults from the reliability run (issue 9) end in a phalanx error on every rank, promptly.

* step labels: a rank that skips a collective is caught at the first mismatched call;
* a single-host gloo job listens on loopback only;
* a rank that cannot reach the store's host (stopped by SIGSTOP, as behind a cut link) still
  raises within timeout + grace, and shutdown after a timeout is prompt;
* gloo ranks that cannot all meet raise RendezvousError saying who joined and who is missing;
* shutdown() on some ranks only: the others raise RankFailedError naming it, at once;
* non-blocking handles after a timeout: every later wait() raises the same phalanx error.

Times are measured inside the ranks and printed as ``TIMES ...`` (``-s`` shows them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

import worlds_reliability as bodies
from conftest import AVAILABLE, MULTI_WORLDS, world_params
from phalanx.launch._spawn import free_port
from phalanx.testing import WorldFailed, run_world

OP_TIMEOUT = 4.0
GRACE = 2.0 + 1.0  # the diagnosis' grace (at most 2 s) plus the second after which it is abandoned


def _times(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+)=(\d+\.\d+)", " ".join(
        line for line in text.splitlines() if "TIMES" in line))}


@pytest.mark.parametrize("behaviour", bodies.STEPS.names)
@pytest.mark.parametrize("backend,n", world_params(MULTI_WORLDS))
def test_step_labels_catch_a_skipped_collective(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.steps, backend, n, behaviour, op_timeout=OP_TIMEOUT)


@pytest.mark.parametrize("behaviour", bodies.LISTENERS.names)
@pytest.mark.parametrize("backend,n", world_params([("gloo", 2), ("gloo", 3)]))
def test_single_host_gloo_listens_on_loopback_only(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.listeners, backend, n, behaviour, op_timeout=OP_TIMEOUT)


def _failing_world(body: object, backend: str, n: int) -> tuple[str, dict[str, float], float]:
    """Run ``body``, which must fail, on ``n`` ranks: (the failure report, its TIMES, seconds to the end)."""
    start = time.monotonic()
    with pytest.raises(WorldFailed) as failed:
        run_world(body, n, backend, op_timeout=OP_TIMEOUT, timeout=60)
    report = str(failed.value)
    return report, _times(report), time.monotonic() - start


@pytest.mark.parametrize("backend,n", world_params(MULTI_WORLDS))
def test_unreachable_store_host_still_times_out_promptly_and_shutdown_is_prompt(backend: str, n: int) -> None:
    report, times, elapsed = _failing_world(bodies.store_host_stops, backend, n)
    print(f"\n{backend}-{n}: rank raised after {times.get('raised')} s, shutdown took "
          f"{times.get('shutdown')} s, world ended after {elapsed:.1f} s")
    assert times, report
    assert times["raised"] < OP_TIMEOUT + GRACE + 1.0, report
    assert times["shutdown"] < 3.0, report  # teardown is abandoned after 2 s at most
    assert "timed out after" in report, report
    assert elapsed < OP_TIMEOUT + GRACE + 25, report


@pytest.mark.parametrize("backend,n", world_params(MULTI_WORLDS))
def test_shutdown_on_one_rank_fails_the_waiting_ranks_at_once(backend: str, n: int) -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailed) as failed:
        run_world(bodies.early_shutdown, n, backend, op_timeout=30, timeout=60)
    elapsed = time.monotonic() - start
    report = str(failed.value)
    outputs = "\n".join(failed.value.outputs.values())
    times = _times(report + "\n" + outputs)
    print(f"\n{backend}-{n}: waiting rank raised after {times.get('raised')} s, rank 1's shutdown took "
          f"{times.get('shutdown')} s, world ended after {elapsed:.1f} s")
    assert "RankFailedError" in report and "rank 1 called phalanx.shutdown()" in report, report
    assert times.get("raised", 99) < 5.0, report
    assert elapsed < 25, f"the world took {elapsed:.1f} s to end (a wait of the 30 s timeout?)\n{report}"


@pytest.mark.parametrize("backend,n", world_params([("mpi", 2), ("gloo", 2)]))
def test_handles_raise_the_same_error_on_every_wait_after_a_timeout(backend: str, n: int) -> None:
    with pytest.raises(WorldFailed) as failed:
        run_world(bodies.handles_after_a_timeout, n, backend, op_timeout=2.0, timeout=60)
    report = str(failed.value)
    times = _times(report)
    print(f"\n{backend}-{n}: the barrier raised after {times.get('raised')} s")
    assert "every wait() raised the same CollectiveTimeoutError" in report, report
    assert times["raised"] < 2.0 + GRACE + 1.0, report


# -- rendezvous: ranks started by hand, as a launcher would -------------------------------------------

pytestmark_gloo = pytest.mark.skipif("gloo" not in AVAILABLE, reason="backend 'gloo' is not available here")

# torch imported before the clock starts: the bound is on init's own waiting, not on a loaded machine's imports
INIT = ("import sys, time, torch, phalanx\nt = time.monotonic()\ntry:\n    phalanx.init()\nfinally:\n"
        "    print(f'init took {time.monotonic() - t:.2f} s', file=sys.stderr, flush=True)\nprint('joined', flush=True)")


def _start_ranks(ranks: list[int], world_size: int, timeout: float) -> list[tuple[int, int, str, float]]:
    """Start ``ranks`` of a gloo world of ``world_size`` (no LOCAL_RANK); (rank, code, stderr, seconds in
    ``phalanx.init``)."""
    port = free_port()
    procs = []
    start = time.monotonic()
    for r in ranks:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "LOCAL_", "OMPI_", "PMI"))}
        env.update(RANK=str(r), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PHALANX_BACKEND="gloo", PHALANX_TIMEOUT=str(timeout))
        procs.append((r, subprocess.Popen([sys.executable, "-c", INIT], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)))
    results = []
    for r, proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err = "HUNG\n" + err
        took = re.findall(r"init took ([0-9.]+) s", err)
        results.append((r, proc.returncode, err, float(took[-1]) if took else time.monotonic() - start))
    return results


@pytestmark_gloo
@pytest.mark.parametrize("started,size", [([0, 1], 3), ([0, 2], 3), ([0], 2)])
def test_gloo_ranks_that_never_start_are_named_on_every_rank(started: list[int], size: int) -> None:
    timeout = 3.0
    missing = [r for r in range(size) if r not in started]
    for r, code, err, seconds in _start_ranks(started, size, timeout):
        print(f"\nstarted {started} of {size}: rank {r} ended after {seconds:.1f} s in init")
        assert code != 0 and "RendezvousError" in err, err
        assert f"only {len(started)} of {size} ranks joined" in err, err
        assert f"missing: rank{'s' if len(missing) > 1 else ''} {missing if len(missing) > 1 else missing[0]}" \
            in err, err
        assert "DistStoreError" not in err.split("RendezvousError")[-1], err
        assert seconds < timeout + 5, f"rank {r} took {seconds:.1f} s in init"


@pytestmark_gloo
def test_gloo_ranks_without_rank_0_say_the_store_is_unreachable() -> None:
    timeout = 3.0
    for r, code, err, seconds in _start_ranks([1, 2], 3, timeout):
        print(f"\nrank 0 never started: rank {r} ended after {seconds:.1f} s in init")
        assert code != 0 and "RendezvousError" in err, err
        assert "rank 0 has not started" in err or "Rank 0 has not started" in err, err
        assert seconds < timeout + 5, f"rank {r} took {seconds:.1f} s in init"


@pytest.mark.parametrize("where", ["backward", "step"],
                         ids=["silent-before-the-reduce-scatter", "silent-before-the-all-gather"])
@pytest.mark.parametrize("backend,n", world_params([("mpi", 2), ("gloo", 2)]))
def test_a_silent_peer_in_sharded_training_is_a_timeout_within_its_bound(backend: str, n: int,
                                                                         where: str) -> None:
    """shard="gradients": gloo's pairwise reduce-scatter and every backend's all-gather by broadcasts
    end in CollectiveTimeoutError on the waiting rank, within the timeout and its grace."""
    with pytest.raises(WorldFailed) as failed:
        run_world(bodies.sharded_peer_stalls, n, backend, op_timeout=2.0, timeout=60, args=("gradients", where))
    report = str(failed.value)
    times = _times(report)
    print(f"\n{backend}-{n} {where}: rank 0 raised after {times.get('raised')} s")
    assert "timed out after 2 s" in report and "raised" in times, report  # the type: raises() in the body
    assert times["raised"] < 2.0 + GRACE + 1.0, report


@pytest.mark.parametrize("backend,n", world_params(MULTI_WORLDS))
def test_a_rank_stepping_once_more_after_the_others_finished_times_out_naming_them(backend: str, n: int) -> None:
    """An uneven last batch: the rank with one more DistributedOptimizer step raises CollectiveTimeoutError
    within the timeout and its grace, naming the ranks that are shutting down (its gradient bucket skips
    the agreement, so on gloo it once paired with their shutdown agreement and gloo aborted a rank)."""
    report, times, elapsed = _failing_world(bodies.one_more_step, backend, n)
    print(f"\n{backend}-{n}: the extra step raised after {times.get('raised')} s, the world ended after {elapsed:.1f} s")
    assert "CollectiveTimeoutError" in report and "phalanx.torch.DistributedOptimizer" in report, report
    assert all(f"Rank {q} is waiting in shutdown" in report for q in range(1, n)), report
    assert "SIGABRT" not in report and "gloo aborted" not in report, report
    assert times["raised"] < OP_TIMEOUT + GRACE + 1.0, report
