"""Recovery in place across hosts: a cut-off host's rank is replaced on a spare host, the others go on.

Simulated hosts h0:2, h1:1, h2:1, h3:1 (h3 is a spare: ``-n 4`` fills h0 to h2), ``--backend gloo
--timeout 10 --max-restarts 1``, ``fit(elastic=True, global_batch_size=24)`` for 150 steps of
``tests/program_recovery.py``. When h2's rank (rank 3) is at step 40, h2's link goes down. The
survivors time out, the driver's coordinator finds rank 3 silent past the timeout, re-forms the
world on the 3 ranks that hold a majority, and starts a replacement for slot 3 on h3, the first
host with a free slot that did not go silent. One job, every behaviour a check of what it left:

* the job exits 0 without a whole restart, and the three processes on h0 and h1 keep their PIDs;
* the replacement runs on h3 and joins, and every finisher ends in the same epoch of 4 ranks;
* the final parameters equal the uninterrupted run's (one process) to 1e-9;
* h2's rank ends by itself with an error naming the partition (it lost the driver's store; its
  log, ``--log-dir``, says so: nothing crosses the cut), and nothing is left running on h2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest

from helpers import lose_while_running, requires_hosts
from test_recovery import TRAIN, Job, _equal_to_reference, _final, _initial

PHALANX = [sys.executable, "-m", "phalanx"]
STEPS, CUT_AT, CUT_RANK = 150, 40, 3


def _rank_at(marks: str, rank: int, step: int) -> bool:
    for name in os.listdir(marks):
        if name.startswith("steps-"):
            with open(os.path.join(marks, name)) as f:
                if any(int(s) >= step and int(r) == rank for s, _, r, *_ in (line.split() for line in f)):
                    return True
    return False


@pytest.fixture(scope="module")
def cut(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from phalanx.testing import simulated_hosts

    root = tmp_path_factory.mktemp("recovery-hosts")
    os.chmod(root, 0o777)
    reference = root / "reference"
    reference.mkdir()
    subprocess.run([sys.executable, TRAIN], check=True, timeout=120,
                   env=dict(os.environ, OMP_NUM_THREADS="1", MARKS=str(reference), STEPS=str(STEPS)))
    marks = root / "job"
    marks.mkdir()
    os.chmod(marks, 0o777)
    with simulated_hosts(4) as hosts:
        cmd = [*PHALANX, "run", "--hosts", "h0:2,h1:1,h2:1,h3:1", "-n", "4", "--rsh", hosts.rsh, "--backend", "gloo",
               "--timeout", "10", "--max-restarts", "1", "--log-dir", str(root / "logs"), TRAIN]
        start = time.monotonic()
        proc = hosts.popen(0, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1", PHALANX_TEST_MARKS=str(marks), PHALANX_TEST_STEPS=str(STEPS), PHALANX_TEST_FULL="4"))
        out, cut_at = lose_while_running(proc, lambda: _rank_at(str(marks), CUT_RANK, CUT_AT),
                                         f"rank {CUT_RANK} never reached step {CUT_AT}", lambda: hosts.cut(2), 150, 240)
        ended = time.monotonic()
        while hosts.pids(2) and time.monotonic() < ended + 15:
            time.sleep(0.1)
        left = hosts.pids(2)
    print(f"\ncut h2 {cut_at - start:.1f} s after the start; the job ended {ended - cut_at:.1f} s later")
    with open(root / "logs" / f"rank.{CUT_RANK}.log") as f:  # h2's rank's, then its replacement's
        log = f.read()
    return {"job": Job(str(marks), proc.returncode, out, ended - start), "left_on_h2": left, "log": log,
            "reference": _final(Job(str(reference), 0, "", 0).files("final-*.pt")[0])}


@requires_hosts
def test_a_cut_host_is_left_out_exits_0_without_a_whole_restart(cut: dict[str, Any]) -> None:
    job = cut["job"]
    assert job.code == 0 and "restart 1 of" not in job.output, job.output[-4000:]
    assert all(d["restart_count"] == "0" for d in job.done()), job.done()


@requires_hosts
def test_a_cut_host_is_left_out_the_others_keep_their_pids(cut: dict[str, Any]) -> None:
    job = cut["job"]
    initial = _initial(job)
    survivors = {d["pid"] for d in job.done()} & initial
    assert len(initial) == 4 and len(survivors) == 3, (initial, job.done(), job.output[-3000:])


@requires_hosts
def test_a_cut_host_is_left_out_its_replacement_starts_on_the_spare_host_and_joins(cut: dict[str, Any]) -> None:
    job = cut["job"]
    assert "starting the replacement for slot 3 on host h3" in job.output, job.output[-4000:]
    joined = [d for d in job.done() if d["joined"]]
    assert len(joined) == 1 and joined[0]["slot"] == CUT_RANK, job.done()
    assert len(job.done()) == 4 and {(d["size"], d["epoch"]) for d in job.done()} == {(4, job.done()[0]["epoch"])}


@requires_hosts
def test_a_cut_host_is_left_out_equal_to_the_uninterrupted_run(cut: dict[str, Any]) -> None:
    worst = _equal_to_reference(cut["job"], cut["reference"])
    print(f"largest difference from one process: {worst:.3g}")


@requires_hosts
def test_a_cut_host_is_left_out_its_rank_ends_naming_the_partition_and_nothing_is_left(cut: dict[str, Any]) -> None:
    said = [line for line in cut["log"].splitlines() if line.startswith("phalanx._errors.QuorumLostError")]
    assert said and "lost the launcher's rendezvous store" in said[0] and "partition" in said[0], cut["log"][-4000:]
    assert cut["left_on_h2"] == [], cut["left_on_h2"]
