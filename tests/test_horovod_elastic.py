"""hvd.elastic on phalanx's restart model (tests/horovod_elastic_script.py, under ``phalanx run -n 2``):

* with ``--max-restarts 1``, a job that raises in epoch 1 is restarted, resumes from the last
  ``state.commit()`` (model, optimizer momentum, ElasticSampler position, epoch/batch counters),
  redoes only the batch after that commit, and ends with the parameters of an uninterrupted run;
* without ``--max-restarts`` the elastic script runs as an ordinary job and says so once;
* in place (horovodrun's ``--gloo -np 3 --min-np 2``): a SIGKILLed rank's two peers restore the last
  commit, reset (``hvd.elastic.run``'s loop, without restarting their processes) and finish the epochs
  on 2 ranks, every sample of each epoch trained.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import AVAILABLE

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "horovod_elastic_script.py")
BACKEND = "mpi" if "mpi" in AVAILABLE else "gloo"
NOTICE = "this job runs without restarts, as an ordinary job"


def _run(out: str, *flags: str, fail: bool | str, n: str = "2", backend: str = BACKEND) -> tuple[int, str, float]:
    start = time.monotonic()
    mode = fail if isinstance(fail, str) else "1" if fail else "0"
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", n, f"--{backend}", *flags,
                           SCRIPT, out, mode], capture_output=True, text=True, timeout=150,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PHALANX_ELASTIC_DIR=os.path.join(out, "commits")))
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def _lines(out: str, rank: int) -> list[list[str]]:
    with open(os.path.join(out, f"samples-rank{rank}")) as f:
        return [line.split() for line in f]


@pytest.mark.skipif(BACKEND not in AVAILABLE, reason="neither mpi nor gloo is available here")
def test_a_failed_elastic_job_resumes_from_its_last_commit_and_ends_as_an_uninterrupted_one(tmp_path) -> None:
    plain, restarted = str(tmp_path / "plain"), str(tmp_path / "restarted")
    os.makedirs(plain)
    os.makedirs(restarted)
    code, out, t_plain = _run(plain, fail=False)
    assert code == 0, out
    assert out.count(NOTICE) == 1, out  # said once, by rank 0
    code, out, t_restart = _run(restarted, "--max-restarts", "1", fail=True)
    print(f"\n{BACKEND}: uninterrupted {t_plain:.1f} s, with one restart {t_restart:.1f} s")
    assert code == 0, out
    assert "restart 1 of 1 (PHALANX_RESTART_COUNT=1)" in out, out
    assert "injected failure on rank" in out, out
    assert "restart 1: resuming from the commit in " + os.path.join(restarted, "commits", "state.pt") in out, out
    assert NOTICE not in out, out
    want, got = torch.load(os.path.join(plain, "result.pt")), torch.load(os.path.join(restarted, "result.pt"))
    assert got["attempt"] == 1, got
    diff = max((a - b).abs().max().item() for a, b in zip(want["params"], got["params"], strict=True))
    print(f"{BACKEND}: max |diff| from the uninterrupted run {diff:.3g}")
    assert diff == 0.0, diff
    for rank in (0, 1):
        first, second = _lines(plain, rank), _lines(restarted, rank)
        # attempt 0 got to epoch 1's batch 3 (committed after batch 2); attempt 1 redid batch 3 onwards
        assert [line[1:] for line in second if line[0] == "0"] == [line[1:] for line in first[:8]], second
        assert [line[1:] for line in second if line[0] == "1"] == [line[1:] for line in first[7:]], second


@pytest.mark.skipif("gloo" not in AVAILABLE, reason="needs the gloo backend")
def test_horovodrun_min_np_resets_in_place_after_a_killed_rank(tmp_path) -> None:
    reset_in_place(str(tmp_path), "gloo")


def reset_in_place(out: str, backend: str) -> None:
    """``horovodrun --<backend> -np 3 --min-np 2``, one rank SIGKILLed: the two others reset in place and
    finish every epoch's samples (also run on mpi under Open MPI 5's ULFM, by test_recovery_mpi.py)."""
    code, text, seconds = _run(out, "--min-np", "2", "--timeout", "10", fail="kill", n="3", backend=backend)
    print(f"\n{backend}: 3 ranks, one killed, reset in place: {seconds:.1f} s")
    assert code == 0, text
    assert "reset in place: epoch 1, 2 rank(s)" in text, text
    assert "restart 1 of" not in text, text
    killed = int(open(os.path.join(out, "killed")).read())
    done = {int(name.split("-")[1]): open(os.path.join(out, name)).read().split()
            for name in os.listdir(out) if name.startswith("done-")}
    assert killed not in done and sorted(v for v in done.values()) == [["0", "2", "1"], ["1", "2", "1"]], done
    lines = [line for r in range(3) if os.path.exists(os.path.join(out, f"samples-rank{r}"))
             for line in _lines(out, r)]
    for epoch in ("0", "1"):  # every sample trained in each epoch, on 3 ranks and then (epoch 1) on 2
        seen = {int(i) for line in lines if line[1] == epoch for i in line[2:]}
        assert seen == set(range(40)), (epoch, sorted(set(range(40)) - seen))
