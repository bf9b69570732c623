"""Bounded failure across hosts: 2 simulated hosts x 2 ranks, ``phalanx run --hosts h0:2,h1:2 --rsh RSH``.

A loop of 16 MB allreduces (``program_host_failures.py loop``) runs until a fault:

* a partition (``hosts.cut(1)``) mid-loop: on **both** sides a rank raises
  ``CollectiveTimeoutError`` naming ``phalanx.allreduce`` within ``S + RAISE_GRACE``
  of the cut (on MPI the data phase is bounded too) and ends the job on its host, so
  its neighbour raises the same or is stopped; the reachable side's errors name the
  ranks behind the cut; the launcher exits non-zero within ``S + END_GRACE``;
* every process of host 1 SIGKILLed (``hosts.kill(1)``) mid-loop: the launcher exits
  non-zero within ``S + END_GRACE``, host 0's ranks end with a phalanx error naming
  the call or are stopped by the launcher;
* a 100 Mbit/s link: a few 16 MB allreduces complete at the default timeout.

After each job no process is left on any host (the hosts' holders aside). The
times from the fault to each rank's error are printed as ``TIMES`` (``-s``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import world_params
from helpers import requires_hosts
from phalanx.testing import SimulatedHosts, simulated_hosts

BODY = str(Path(__file__).with_name("program_host_failures.py"))
S = 5.0             # --timeout of the fault tests (seconds)
RAISE_GRACE = 4.0   # diagnosis (at most 2 s; S/4 here) plus 2 s of slack, from the fault to a rank's error
END_GRACE = 12.0    # the errors (diagnosis S/4), MPI_Abort's 5 s (ABORT_GRACE), SIGTERM's 3 s (GRACE), reporting
LEFT_BOUND = 10.0   # seconds after the launcher's end by which no process may be left on any host
START_S = 90.0      # for the job to start and run its first allreduces

pytestmark = [requires_hosts, pytest.mark.skipif(sys.platform != "linux", reason="simulated hosts need Linux")]


def _start(hosts: SimulatedHosts, backend: str, tmp: Path, args: list[str],
           timeout: float | None) -> tuple[subprocess.Popen[bytes], Path]:
    logs = tmp / "logs"
    cmd = [sys.executable, "-m", "phalanx", "run", "--backend", backend, "--hosts", "h0:2,h1:2",
           "--rsh", hosts.rsh, "--log-dir", str(logs), "--no-echo"]
    if timeout is not None:
        cmd += ["--timeout", f"{timeout:g}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "OMPI_", "PMI", "MASTER_"))}
    out = open(tmp / "launcher.out", "wb")  # noqa: SIM115 - the launcher writes it until it ends
    proc = hosts.popen(0, [*cmd, BODY, *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                       cwd=str(tmp))
    out.close()
    return proc, logs


def _log(logs: Path, r: int) -> str:
    try:
        return (logs / f"rank.{r}.log").read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _wait_iterations(proc: subprocess.Popen[bytes], logs: Path, count: int, tmp: Path) -> None:
    deadline = time.monotonic() + START_S
    while not all(len(re.findall(r"^ITER ", _log(logs, r), re.M)) >= count for r in range(4)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the job did not reach {count} allreduces on every rank "
                        f"(status {proc.poll()}):\n{(tmp / 'launcher.out').read_text(errors='replace')}")
        time.sleep(0.1)


def _wait_end(proc: subprocess.Popen[bytes], bound: float, tmp: Path) -> tuple[int, float]:
    start = time.monotonic()
    try:
        code = proc.wait(timeout=bound + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the launcher did not end within {bound + 30:g} s:\n"
                    f"{(tmp / 'launcher.out').read_text(errors='replace')[-4000:]}")
    return code, time.monotonic() - start


def _left(hosts: SimulatedHosts) -> dict[int, list[str]]:
    """The processes still on each host after LEFT_BOUND s at most: {host: [pid and command]}."""
    deadline = time.monotonic() + LEFT_BOUND
    while True:
        left = {i: hosts.pids(i) for i in range(len(hosts))}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {i: [f"{pid} {_cmdline(pid)}" for pid in pids] for i, pids in left.items() if pids}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "(gone)"


def _raised(logs: Path, r: int) -> tuple[float, str] | None:
    """(unix time, 'Type: message') of rank r's phalanx error, from its RAISED line."""
    m = re.search(r"^RAISED (\d+\.\d+) rank=\d+ (.*)$", _log(logs, r), re.M)
    return (float(m.group(1)), m.group(2)) if m else None


def _fault_run(backend: str, fault: str, tmp: Path) -> tuple[int, float, dict[int, tuple[float, str] | None], str]:
    """Start the loop on 2 x 2 ranks, apply ``fault`` to host 1; (status, launcher's end after the fault,
    {rank: (seconds from the fault, error) or None}, launcher output). Asserts no process is left."""
    with simulated_hosts(2) as hosts:
        proc, logs = _start(hosts, backend, tmp, ["loop"], S)
        _wait_iterations(proc, logs, 3, tmp)
        fault_at = time.time()
        hosts.cut(1) if fault == "cut" else hosts.kill(1, signal.SIGKILL)
        code, ended = _wait_end(proc, S + END_GRACE, tmp)
        left = _left(hosts)
    report = (tmp / "launcher.out").read_text(errors="replace")
    assert not left, f"processes left after the job ({fault}, {backend}): {left}\n{report[-3000:]}"
    raised = {}
    for r in range(4):
        got = _raised(logs, r)
        raised[r] = (got[0] - fault_at, got[1]) if got else None
    print(f"\nTIMES {backend} {fault}: launcher ended {ended:.2f} s after the {fault} (status {code}); "
          + ", ".join(f"rank {r} raised after {v[0]:.2f} s" if v else f"rank {r}: no error (stopped)"
                      for r, v in raised.items()))
    return code, ended, raised, report


@pytest.mark.parametrize("backend,n", world_params([("mpi", 4), ("gloo", 4)]))
def test_a_partition_mid_allreduce_ends_every_rank_on_both_sides_in_bounded_time(
        backend: str, n: int, tmp_path: Path) -> None:
    code, ended, raised, report = _fault_run(backend, "cut", tmp_path)
    assert code != 0, report[-3000:]
    assert ended < S + END_GRACE, f"the launcher took {ended:.1f} s after the cut\n{report[-3000:]}"
    # Behind the cut nothing reaches h1's ranks but their own deadline, so one of them raises. The
    # first rank to raise on a host ends the job there (MPI_Abort; on gloo the host's launcher stops
    # its other rank), so a neighbour whose deadline came a moment later (a loaded machine, or on
    # gloo a rank that left the cut call and waits in the next one) can be stopped before it prints
    # its own error; the same on h0's side.
    behind = [r for r in (2, 3) if raised[r] is not None]
    assert behind, f"h1's ranks raised no phalanx error\n{_log(tmp_path / 'logs', 2)[-3000:]}"
    for r in behind:
        seconds, error = raised[r]  # type: ignore[misc]
        assert error.startswith("CollectiveTimeoutError: phalanx.allreduce"), error
        assert seconds < S + RAISE_GRACE, f"rank {r} raised {seconds:.1f} s after the cut"
    reachable = [r for r in (0, 1) if raised[r] is not None]
    assert reachable, f"h0's ranks raised no error\n{report[-3000:]}"
    for r in reachable:
        seconds, error = raised[r]  # type: ignore[misc]
        assert error.startswith("CollectiveTimeoutError: phalanx.allreduce"), error
        assert "never reached a phalanx call: [2, 3]" in error, error
        assert seconds < S + RAISE_GRACE, f"rank {r} raised {seconds:.1f} s after the cut"


@pytest.mark.parametrize("backend,n", world_params([("mpi", 4), ("gloo", 4)]))
def test_a_host_whose_processes_are_all_killed_ends_the_job_in_bounded_time(
        backend: str, n: int, tmp_path: Path) -> None:
    code, ended, raised, report = _fault_run(backend, "kill", tmp_path)
    assert code != 0, report[-3000:]  # Open MPI's mpiexec exits 0 here: the launcher sees h0's ranks unfinished
    assert ended < S + END_GRACE, f"the launcher took {ended:.1f} s after the kill\n{report[-3000:]}"
    for r in (0, 1):  # a rank on h0 either raised a phalanx error naming the call, or the launcher stopped it
        if raised[r] is not None:
            seconds, error = raised[r]
            assert re.match(r"(RankFailedError|CollectiveTimeoutError): phalanx\.allreduce", error), error
            assert seconds < S + RAISE_GRACE, f"rank {r} raised {seconds:.1f} s after the kill"
    if backend == "gloo":
        assert "host h1 failed first" in report, report[-3000:]


@pytest.mark.parametrize("backend,n", world_params([("mpi", 4), ("gloo", 4)]))
def test_a_100_mbit_link_causes_no_false_timeout_at_the_default_timeout(
        backend: str, n: int, tmp_path: Path) -> None:
    with simulated_hosts(2, rate="100mbit") as hosts:
        start = time.monotonic()
        proc, logs = _start(hosts, backend, tmp_path, ["few", "3"], None)
        code, _ = _wait_end(proc, START_S + 60, tmp_path)
        elapsed = time.monotonic() - start
        left = _left(hosts)
    report = (tmp_path / "launcher.out").read_text(errors="replace")
    took = [float(t) for r in range(4) for t in re.findall(r"took=(\d+\.\d+)", _log(logs, r))]
    print(f"\nTIMES {backend} 100mbit: 3 allreduces of 16 MB, each {min(took, default=0):.2f}-"
          f"{max(took, default=0):.2f} s; job {elapsed:.1f} s")
    assert code == 0, report[-3000:]
    for r in range(4):
        assert f"DONE rank={r}" in _log(logs, r), _log(logs, r)[-2000:]
    assert max(took) > 0.5, f"the link was not slow: {took}"  # the shaping took effect
    assert not left, f"processes left after the job: {left}"
