"""Elastic restart: a fixed global batch survives a smaller world, and ``phalanx run --max-restarts`` restarts.

* ``fit(global_batch_size=12)``: 3 ranks train 7 steps with checkpoints, 2 ranks resume mid-epoch to
  step 12 and end with the parameters of a one-process loop on the same global batch (mpi, gloo); a
  world that does not divide it is refused on every rank; a resume with another global batch warns.
* one host: a rank that raises (or is SIGKILLed) once is restarted (``PHALANX_RESTART_COUNT=1``, a
  fresh port) and the job ends equal to the one-process loop; restarts used up: non-zero exit with
  every report; ``--min-ranks`` above ``-n``: refused before anything starts; Ctrl-C: no restart.
* simulated hosts: the host of rank 2 of three is lost during ``fit`` (its processes killed and its
  link down, or only its link cut); the job restarts on the two hosts that answer and ends equal to
  the one-process loop.

Figures (the largest parameter difference, the times) are printed with ``-s``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

import worlds_elastic as bodies
from conftest import AVAILABLE
from helpers import lose_while_running, requires_hosts

SCRIPT = os.path.abspath(bodies.__file__)
PHALANX = [sys.executable, "-m", "phalanx"]
_DIRS: dict[str, str] = {}


def _backends(*backends: str) -> list[object]:
    return [pytest.param(b, id=b, marks=pytest.mark.skipif(b not in AVAILABLE, reason=f"backend {b!r} is not "
                                                            "available here (see `phalanx info`)"))
            for b in backends]


def _pairs(*pairs: tuple[str, str]) -> list[object]:
    """(backend, way) pairs: each backend meets each way of failing once, not in every combination (the
    restart is the launcher's, one code path whichever backend the ranks use)."""
    return [pytest.param(b, w, id=f"{b}-{w}", marks=pytest.mark.skipif(
        b not in AVAILABLE, reason=f"backend {b!r} is not available here (see `phalanx info`)")) for b, w in pairs]


def _shared_dir(factory: pytest.TempPathFactory, name: str) -> str:
    if name not in _DIRS:
        _DIRS[name] = str(factory.mktemp(name))
    return _DIRS[name]


# -- fit(global_batch_size=...): 3 ranks' checkpoint resumed on 2 -------------------------------------

@pytest.mark.parametrize("phase,behaviour", [("write", b) for b in bodies.WRITE.names]
                         + [("resume", b) for b in bodies.RESUME.names])
@pytest.mark.parametrize("backend", _backends("mpi", "gloo"))
def test_a_fixed_global_batch_resumed_on_fewer_ranks_equals_one_process(worlds, tmp_path_factory, backend: str,
                                                                        phase: str, behaviour: str) -> None:
    directory = _shared_dir(tmp_path_factory, f"shrink-{backend}")
    worlds.check(bodies.shrink, backend, 3, bodies.WRITE.names[0], timeout=120, op_timeout=60,
                 args=(directory, "write"))  # the resume needs the written checkpoint
    if phase == "write":
        worlds.check(bodies.shrink, backend, 3, behaviour, timeout=120, op_timeout=60, args=(directory, "write"))
        return
    worlds.check(bodies.shrink, backend, 2, behaviour, timeout=120, op_timeout=60, args=(directory, "resume"))
    figure = os.path.join(directory, "shrink-difference.json")
    if behaviour == bodies.RESUME.names[0] and os.path.exists(figure):
        print(f"\n{backend}: 3 ranks -> 2 ranks vs one process: max |diff| "
              f"{json.load(open(figure))['max_abs_diff']:.3g}")


# -- phalanx run --max-restarts on one host --------------------------------------------------------------

def _run(args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    start = time.monotonic()
    done = subprocess.run([*PHALANX, "run", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def _attempts(directory: str, rank: int = 0) -> list[list[str]]:
    with open(os.path.join(directory, f"attempts-rank{rank}")) as f:
        return [line.split() for line in f]


@pytest.mark.parametrize("backend,mode", _pairs(("mpi", "raise"), ("gloo", "kill")))
def test_a_rank_that_fails_once_is_restarted_and_the_job_ends_equal_to_one_process(tmp_path, backend: str,
                                                                                   mode: str) -> None:
    logs = tmp_path / "logs"
    code, out, elapsed = _run(["-n", "3", "--backend", backend, "--max-restarts", "2", "--log-dir", str(logs),
                               SCRIPT, str(tmp_path), mode, "1", "4"], timeout=180)
    print(f"\n{backend}/{mode}: job with one restart took {elapsed:.1f} s")
    assert code == 0, out
    assert "phalanx run: rank 1 failed first" in out, out
    assert "restart 1 of 2 (PHALANX_RESTART_COUNT=1): attempt 0 failed with exit status" in out, out
    assert f"(its logs: {logs / 'attempt-0'}); the new world: 3 ranks on this host." in out, out
    assert sorted(os.listdir(logs / "attempt-0")) == ["rank.0.log", "rank.1.log", "rank.2.log"]
    assert (logs / "rank.0.log").exists()  # the last attempt's
    if mode == "raise":
        assert "injected failure on rank 1 at step 4 (attempt 0)" in (logs / "attempt-0" / "rank.1.log").read_text()
    result = json.load(open(tmp_path / "result.json"))
    print(f"{backend}/{mode}: max |diff| from one process {result['max_abs_diff']:.3g}")
    assert result["attempt"] == "1" and result["size"] == 3 and result["steps"] == bodies.STEPS, result
    assert result["max_abs_diff"] < bodies.TOL, result
    attempts = _attempts(str(tmp_path))
    assert [a[0] for a in attempts] == ["0", "1"], attempts
    if backend == "gloo":
        assert attempts[0][2] != attempts[1][2], f"the restart reused the rendezvous port: {attempts}"


def _fastest() -> str:
    return "mpi" if "mpi" in AVAILABLE else "gloo"


def test_used_up_restarts_end_non_zero_with_every_report(tmp_path) -> None:
    code, out, elapsed = _run(["-n", "2", "--backend", _fastest(), "--max-restarts", "1", SCRIPT, str(tmp_path),
                               "always", "1", "1"], timeout=120)
    print(f"\n{_fastest()}: two failed attempts took {elapsed:.1f} s")
    assert code == 1, out
    assert out.count("phalanx run: rank 1 failed first") == 2, out
    assert "restart 1 of 1 (PHALANX_RESTART_COUNT=1)" in out, out
    assert ("not restarting: the job failed 2 times and --max-restarts 1 are used up (exit status 1; the "
            "reports above name the failing ranks)") in out, out
    assert [a[0] for a in _attempts(str(tmp_path))] == ["0", "1"]


def test_min_ranks_above_the_ranks_there_are_is_refused_before_anything_starts(tmp_path) -> None:
    code, out, _ = _run(["-n", "2", "--backend", _fastest(), "--max-restarts", "1", "--min-ranks", "3", SCRIPT,
                         str(tmp_path), "none"], timeout=60)
    assert code == 2, out
    assert ("phalanx run -n 2 --min-ranks 3: a restart never adds ranks, so the job could never run on 3; give "
            "--min-ranks 2 or less.") in out, out
    assert not os.listdir(tmp_path), "ranks were started"
    code, out, _ = _run(["-n", "2", "--max-restarts", "-1", SCRIPT, str(tmp_path), "none"], timeout=60)
    assert code == 2 and "--max-restarts -1: give a whole number of restarts, 0 or more" in out, out


@pytest.mark.parametrize("backend", _backends("gloo"))
def test_ctrl_c_to_the_launcher_is_not_followed_by_a_restart(tmp_path, backend: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PHALANX_STOP_GRACE="2")
    proc = subprocess.Popen([*PHALANX, "run", "-n", "2", "--backend", backend, "--max-restarts", "2", SCRIPT,
                             str(tmp_path), "wait", "1", "2"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "waiting-rank1").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "rank 1 never reached step 2"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out
    assert "restart" not in out, out
    assert [a[0] for a in _attempts(str(tmp_path))] == ["0"]


# -- simulated hosts: a host of three is lost during fit -------------------------------------------------

def _lose_host(tmp_path: Any, backend: str, loss: str, min_ranks: int) -> tuple[int | None, str]:
    """Start a 3-host job (one rank each) that resumes with --max-restarts 1; when rank 2 (on h2) is in
    step 4 of attempt 0, lose h2 (``power-off``: its processes killed and its link down; ``cut``: the link
    only; ``processes-killed``: its processes only). The launcher's exit status and output; the times are
    printed."""
    from phalanx.testing import simulated_hosts

    os.chmod(tmp_path, 0o777)
    with simulated_hosts(3) as hosts:
        cmd = [*PHALANX, "run", "--hosts", "h0:1,h1:1,h2:1", "--rsh", hosts.rsh, "--backend", backend,
               "--timeout", "10", "--max-restarts", "1", "--min-ranks", str(min_ranks), SCRIPT, str(tmp_path),
               "wait", "2", "4"]
        start = time.monotonic()
        proc = hosts.popen(0, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))

        def lose() -> None:
            if loss in ("power-off", "processes-killed"):
                hosts.kill(2)
            if loss in ("power-off", "cut"):
                hosts.cut(2)

        out, lost_at = lose_while_running(proc, (tmp_path / "waiting-rank2").exists, "rank 2 never reached step 4",
                                          lose, 120, 240)
    print(f"\n{backend}/{loss}: host lost after {lost_at - start:.1f} s; the launcher ended "
          f"{time.monotonic() - lost_at:.1f} s later")
    print("\n".join(line for line in out.splitlines() if line.startswith(("phalanx run: restart",
                                                                          "phalanx run: not restarting"))))
    return proc.returncode, out


@requires_hosts
@pytest.mark.parametrize("backend,loss", _pairs(("mpi", "power-off"), ("gloo", "cut")))
def test_a_lost_host_is_left_out_and_the_job_ends_equal_to_one_process(tmp_path, backend: str, loss: str) -> None:
    code, out = _lose_host(tmp_path, backend, loss, min_ranks=2)
    assert code == 0, out
    assert "host h2 is lost" in out and "the new world: 2 ranks on h0:1,h1:1." in out, out
    result = json.load(open(tmp_path / "result.json"))
    print(f"{backend}/{loss}: max |diff| from one process {result['max_abs_diff']:.3g}")
    assert result["attempt"] == "1" and result["size"] == 2 and result["steps"] == bodies.STEPS, result
    assert result["max_abs_diff"] < bodies.TOL, result
    attempts = _attempts(str(tmp_path))
    assert [a[:2] for a in attempts] == [["0", "3"], ["1", "2"]], attempts
    if backend == "gloo":
        assert attempts[0][2] != attempts[1][2], f"the restart reused the rendezvous port: {attempts}"


@requires_hosts
@pytest.mark.parametrize("backend", _backends("gloo"))
def test_a_host_whose_processes_died_but_answers_is_used_again(tmp_path, backend: str) -> None:
    code, out = _lose_host(tmp_path, backend, "processes-killed", min_ranks=2)
    assert code == 0, out
    assert "is lost" not in out and "the new world: 3 ranks on h0:1,h1:1,h2:1." in out, out
    result = json.load(open(tmp_path / "result.json"))
    assert result["attempt"] == "1" and result["size"] == 3 and result["max_abs_diff"] < bodies.TOL, result


@requires_hosts
@pytest.mark.parametrize("backend", _backends("gloo"))
def test_fewer_ranks_left_than_min_ranks_end_the_job_with_the_reason(tmp_path, backend: str) -> None:
    code, out = _lose_host(tmp_path, backend, "power-off", min_ranks=3)
    assert code not in (0, None), out
    assert "not restarting after attempt 0 failed (exit status" in out, out
    assert ("host h2 is lost" in out and "the hosts that answer (h0:1,h1:1) hold 2 ranks, fewer than "
            "--min-ranks 3") in out, out
    assert not (tmp_path / "result.json").exists()
