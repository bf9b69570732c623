"""gloo jobs across simulated hosts: ``phalanx run --nnodes/--node-rank/--master`` (one launcher per host)
and ``phalanx run --hosts ... --rsh RSH --backend gloo`` (one driver that starts them all).

One set of three simulated hosts serves the whole module; each test runs one
job and checks several things of it: every rank's identity, host and
allreduce, the secret the ranks share (and that no command line shows it),
the report of a failure, the bound on the job's end, and that no process is
left on any host. Real processes in real namespaces: needs root, skipped
elsewhere with the reason (``requires_hosts``), except the refusal without a
secret, which needs no hosts.
"""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from conftest import AVAILABLE
from helpers import requires_hosts
from phalanx import LaunchError
from phalanx.launch import Launch, launch
from phalanx.launch._on_each_host import parse_master
from phalanx.testing import SimulatedHosts, simulated_hosts

pytestmark = pytest.mark.skipif("gloo" not in AVAILABLE, reason="no gloo backend here (torch.distributed)")

K = 3
JOB_TIMEOUT = 60  # seconds any one job may take here, end to end
LEFT_BOUND = 10.0  # seconds after a job's end (or its driver's death) by which no process may be left

# Every rank prints what it is, where, and what it got; options: --fail R, --sleep S, --secret-to FILE.
JOB = textwrap.dedent("""
    import hashlib, os, socket, sys, time
    import numpy as np
    import phalanx

    phalanx.init()
    rank, size = phalanx.rank(), phalanx.size()
    total = phalanx.allreduce(np.array([float(rank + 1)]))[0]
    secret = os.environ.get("PHALANX_SECRET", "")
    # One write per line: ranks of one host share a pipe, and print() writes the newline apart.
    sys.stdout.write(f"RESULT rank={rank} size={size} host={socket.gethostname()} local={os.environ['LOCAL_RANK']} "
                     f"local_size={os.environ['LOCAL_WORLD_SIZE']} group={os.environ.get('GROUP_RANK')} "
                     f"iface={os.environ.get('PHALANX_IFACE')} sum={total:g} "
                     f"secret={hashlib.sha256(secret.encode()).hexdigest()[:12]} secret_len={len(secret)}\\n")
    sys.stdout.flush()
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    if rank == 0 and "--secret-to" in args:
        with open(args["--secret-to"] + ".tmp", "w") as f:
            f.write(secret)
        os.rename(args["--secret-to"] + ".tmp", args["--secret-to"])
    if args.get("--fail") == str(rank):
        sys.stdout.write(f"FAILING at {time.time()}\\n")
        sys.stdout.flush()
        raise ValueError(f"boom on rank {rank}")
    time.sleep(float(args.get("--sleep", 0)))
    phalanx.barrier()
""")


@pytest.fixture(scope="module")
def hosts() -> Iterator[SimulatedHosts]:
    with simulated_hosts(K) as made:
        yield made


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gloo_hosts") / "job.py"
    path.write_text(JOB)
    return path


def results(stdout: str) -> dict[int, dict[str, str]]:
    """rank -> the fields its RESULT line printed."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            fields = dict(word.split("=", 1) for word in line.split()[1:])
            found[int(fields["rank"])] = fields
    return found


def check_world(found: dict[int, dict[str, str]], where: list[str], local_size: dict[str, int],
                iface: str | None = None) -> None:
    """Every rank ran on the host ``where[rank]``, knew its place and ``iface`` (``PHALANX_IFACE``),
    and got the right allreduce."""
    n = len(where)
    assert sorted(found) == list(range(n)), found
    for rank, fields in found.items():
        host = where[rank]
        assert fields["host"] == host, (rank, fields)
        assert fields["size"] == str(n) and fields["sum"] == f"{n * (n + 1) // 2:g}", (rank, fields)
        assert int(fields["local"]) == [r for r in range(n) if where[r] == host].index(rank), (rank, fields)
        assert fields["local_size"] == str(local_size[host]), (rank, fields)
        assert fields["iface"] == str(iface), (rank, fields)
    assert len({f["secret"] for f in found.values()}) == 1, "the ranks do not share one secret"


def no_process_left(hosts: SimulatedHosts, bound: float = LEFT_BOUND) -> tuple[dict[int, list[int]], float]:
    """(processes still on each host after ``bound`` s, or {} once none is; seconds it took)."""
    start = time.monotonic()
    while True:
        left = {i: hosts.pids(i) for i in range(K) if hosts.pids(i)}
        if not left or time.monotonic() - start > bound:
            return left, time.monotonic() - start
        time.sleep(0.1)


def driver(hosts: SimulatedHosts, spec: str, job: Path, *job_args: str,
           iface: str | None = None) -> subprocess.Popen[str]:
    """``phalanx run --hosts spec --rsh RSH --backend gloo [--iface iface] job`` started on host 0."""
    argv = [sys.executable, "-m", "phalanx", "run", "--hosts", spec, "--rsh", hosts.rsh, "--backend", "gloo",
            "--timeout", "30", *(["--iface", iface] if iface else []), str(job), *job_args]
    return hosts.popen(0, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lines_until(stream: IO[str], pattern: str, count: int, timeout: float) -> list[str]:
    """Read lines from ``stream`` until ``count`` of them match ``pattern`` (bounded by ``timeout``)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while sum(bool(re.match(pattern, g)) for g in got) < count:
        try:
            got.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            raise AssertionError(f"only {got} within {timeout} s") from None
    return got


@requires_hosts
def test_nnodes_node_rank_master_on_two_hosts_of_two_ranks(hosts: SimulatedHosts, job: Path) -> None:
    secret = os.urandom(32).hex()
    port = random.randrange(20000, 32000)
    procs = [hosts.popen(i, [sys.executable, "-m", "phalanx", "run", "--nnodes", "2", "--node-rank", str(i),
                             "--master", f"h0:{port}", "-n", "2", "--backend", "gloo", "--timeout", "30", str(job)],
                         env=dict(os.environ, PHALANX_SECRET=secret), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True) for i in (1, 0)]
    outs = [p.communicate(timeout=JOB_TIMEOUT) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    found = results(outs[0][0] + outs[1][0])
    check_world(found, ["h0", "h0", "h1", "h1"], {"h0": 2, "h1": 2})
    assert all(f["group"] == str(r // 2) for r, f in found.items()), found
    assert {f["secret_len"] for f in found.values()} == {str(len(secret))}
    assert no_process_left(hosts)[0] == {}


@requires_hosts
def test_hosts_two_by_two_from_host_0_and_the_secret_is_on_no_command_line(
        hosts: SimulatedHosts, job: Path, tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    proc = driver(hosts, "h0:2,h1:2", job, "--secret-to", str(secret_file), "--sleep", "2")
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not secret_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)
            time.sleep(0.05)
        secret = secret_file.read_bytes()
        # While the job runs: every process's command line on this machine (every host shares /proc).
        seen, launchers = [], 0
        for entry in os.listdir("/proc"):
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            launchers += b"phalanx.launch._remote" in cmdline
            if secret in cmdline:
                seen.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
        out, err = proc.communicate(timeout=JOB_TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert len(secret) == 64 and launchers >= 2, (secret, launchers)  # the scan saw the running job
    assert seen == [], f"the secret is on a command line: {seen}"
    found = results(out)
    check_world(found, ["h0", "h0", "h1", "h1"], {"h0": 2, "h1": 2})
    assert {f["secret_len"] for f in found.values()} == {"64"}
    assert no_process_left(hosts)[0] == {}


@requires_hosts
def test_hosts_three_by_one_with_iface(hosts: SimulatedHosts, job: Path) -> None:
    proc = driver(hosts, "h0,h1,h2", job, iface="eth0")
    out, err = proc.communicate(timeout=JOB_TIMEOUT)
    assert proc.returncode == 0, err
    check_world(results(out), ["h0", "h1", "h2"], {"h0": 1, "h1": 1, "h2": 1}, iface="eth0")
    assert no_process_left(hosts)[0] == {}


@requires_hosts
def test_a_rank_raising_on_host_1_ends_every_rank_on_every_host(hosts: SimulatedHosts, job: Path) -> None:
    proc = driver(hosts, "h0:2,h1:2", job, "--fail", "3", "--sleep", "60")
    out, err = proc.communicate(timeout=JOB_TIMEOUT)
    ended = time.time()
    failing = re.search(r"FAILING at ([0-9.]+)", out)
    assert proc.returncode == 1 and failing, (out, err)
    assert ended - float(failing[1]) < 10, f"the job took {ended - float(failing[1]):.1f} s to end after the failure"
    report = err[err.index("phalanx run: rank 3 on host h1"):]
    assert report.startswith("phalanx run: rank 3 on host h1 failed first"), err
    assert "ValueError: boom on rank 3" in report.splitlines()[0]
    assert "h1: ValueError: boom on rank 3" in err  # host 1's own report, relayed with its name
    assert len(results(out)) == 4
    assert no_process_left(hosts)[0] == {}


@requires_hosts
def test_a_host_whose_processes_are_all_killed_ends_the_job_on_every_host(hosts: SimulatedHosts, job: Path) -> None:
    proc = driver(hosts, "h0:1,h1:1,h2:1", job, "--sleep", "60")
    try:
        assert proc.stdout is not None
        lines_until(proc.stdout, "RESULT", 3, JOB_TIMEOUT)
        hosts.kill(1)
        start = time.monotonic()
        _, err = proc.communicate(timeout=JOB_TIMEOUT)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode != 0 and took < LEFT_BOUND, (proc.returncode, took, err)
    assert "phalanx run: host h1 failed first" in err and "without a report" in err, err
    assert no_process_left(hosts)[0] == {}


@requires_hosts
def test_killing_the_driver_leaves_no_process_on_any_host(hosts: SimulatedHosts, job: Path) -> None:
    proc = driver(hosts, "h0:1,h1:1,h2:1", job, "--sleep", "60")
    try:
        assert proc.stdout is not None
        lines_until(proc.stdout, "RESULT", 3, JOB_TIMEOUT)  # every rank is past init, sleeping
        assert all(hosts.pids(i) for i in range(K))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=5)
        left, took = no_process_left(hosts)
    finally:
        proc.kill()
    assert left == {}, f"left after {took:.1f} s: {left}"


@requires_hosts
def test_sigterm_to_the_driver_stops_every_rank_on_every_host_with_143(hosts: SimulatedHosts, job: Path) -> None:
    proc = driver(hosts, "h0:1,h1:1,h2:1", job, "--sleep", "60")
    try:
        assert proc.stdout is not None
        lines_until(proc.stdout, "RESULT", 3, JOB_TIMEOUT)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=JOB_TIMEOUT)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert took < LEFT_BOUND, f"the driver took {took:.1f} s to stop after SIGTERM"
    assert "stopped every rank after SIGTERM" in err, err
    assert no_process_left(hosts)[0] == {}


@requires_hosts
def test_a_host_whose_rsh_hangs_fails_the_start_within_the_start_timeout(hosts: SimulatedHosts, job: Path,
                                                                          tmp_path: Path) -> None:
    """An rsh that never returns for h1 (a hung ssh): the driver ends the job once the start timeout
    passes, naming h1, and leaves nothing on any host."""
    rsh = tmp_path / "rsh-hangs-for-h1"
    rsh.write_text(f'#!/bin/sh\ncase "$1" in h1) exec sleep 600;; esac\nexec {hosts.rsh} "$@"\n')
    rsh.chmod(0o755)
    argv = [sys.executable, "-m", "phalanx", "run", "--hosts", "h0:1,h1:1", "--rsh", str(rsh), "--backend", "gloo",
            "--start-timeout", "3", str(job)]
    start = time.monotonic()
    done = hosts.run(0, argv, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    took = time.monotonic() - start
    assert done.returncode not in (0, None), done.stdout + done.stderr
    assert "no launcher started on h1 within the start timeout" in done.stderr, done.stderr
    assert took < 3 + 15, f"the driver took {took:.1f} s (start timeout 3 s)"
    assert no_process_left(hosts)[0] == {}


@requires_hosts
def test_a_host_cut_off_ends_both_nnodes_launchers_through_timeouts(hosts: SimulatedHosts, tmp_path: Path) -> None:
    """torchrun's convention has no driver: each launcher must end once its ranks time out on their own."""
    loop = tmp_path / "loop.py"
    loop.write_text(textwrap.dedent("""
        import sys, time
        import numpy as np
        import phalanx

        phalanx.init()
        sys.stdout.write(f"RESULT rank={phalanx.rank()}\\n")
        sys.stdout.flush()
        while True:
            phalanx.allreduce(np.ones(1000))
            time.sleep(0.01)
    """))
    secret, port, timeout = os.urandom(32).hex(), random.randrange(20000, 32000), 5
    procs = [hosts.popen(i, [sys.executable, "-m", "phalanx", "run", "--nnodes", "2", "--node-rank", str(i),
                             "--master", f"h0:{port}", "-n", "1", "--backend", "gloo", "--timeout", str(timeout),
                             str(loop)], env=dict(os.environ, PHALANX_SECRET=secret), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        for proc in procs:
            assert proc.stdout is not None
            lines_until(proc.stdout, "RESULT", 1, JOB_TIMEOUT)
        hosts.cut(1)
        start = time.monotonic()
        errs = [proc.communicate(timeout=JOB_TIMEOUT)[1] for proc in procs]
        took = time.monotonic() - start
    finally:
        hosts.heal(1)
        for proc in procs:
            proc.kill()
    bound = timeout + 10  # the collective's timeout, its diagnosis, then the launcher's grace
    assert [p.returncode for p in procs] == [1, 1], errs
    assert took < bound, f"the launchers took {took:.1f} s to end after the cut (bound {bound} s)"
    for rank, err in enumerate(errs):
        assert f"phalanx run: rank {rank} failed first" in err and "CollectiveTimeoutError" in err, err
    assert no_process_left(hosts)[0] == {}


def test_nnodes_without_a_secret_is_refused(job: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_SECRET"}
    out = subprocess.run([sys.executable, "-m", "phalanx", "run", "--nnodes", "2", "--node-rank", "1", "--master",
                          "127.0.0.1", "-n", "1", "--backend", "gloo", str(job)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "RESULT" not in out.stdout, out
    message = " ".join(out.stderr.split())
    assert "needs a secret" in message and "PHALANX_SECRET is not set" in message, message
    assert "secrets.token_hex(32)" in message and "--hosts" in message, message


@pytest.mark.parametrize("settings,message", [
    ({"backend": "mpi", "nnodes": 2, "master": "h0"}, "only for --backend gloo or nccl"),
    ({"hosts": "localhost:1", "nnodes": 2, "master": "h0"}, "give either --hosts"),
    ({"nnodes": 2, "node_rank": 2, "master": "h0"}, "0 <= node-rank < nnodes"),
    ({"nnodes": 2}, "give --master HOST[:PORT]"),
    ({"nnodes": 2, "master": "h0:70000"}, "not a number in 1..65535"),
    ({"nnodes": 2, "master": "h0", "env_secret": "short"}, "it needs 16 or more"),
    ({"nnodes": 2, "master": "h0", "secret_file": "/nonexistent/secret"}, "cannot read it"),
], ids=["mpi", "with-hosts", "node-rank", "no-master", "bad-port", "short-secret", "no-secret-file"])
def test_multi_node_settings_no_job_can_use_are_refused_before_anything_starts(
        job: Path, monkeypatch: pytest.MonkeyPatch, settings: dict[str, object], message: str) -> None:
    settings = dict(settings)
    monkeypatch.setenv("PHALANX_SECRET", str(settings.pop("env_secret", "0123456789abcdef" * 4)))
    settings.setdefault("backend", "gloo")
    with pytest.raises(LaunchError, match=re.escape(message)):
        launch(Launch(n=1, target=[str(job)], **settings))  # type: ignore[arg-type]


def test_master_takes_a_host_and_an_optional_port_like_torchrun() -> None:
    assert parse_master("h0") == ("h0", 29500)
    assert parse_master("10.0.0.1:1234") == ("10.0.0.1", 1234)
    assert parse_master("[fd00::1]:1234") == ("fd00::1", 1234)


def test_secret_file_with_hosts_is_refused_since_each_job_makes_its_own(job: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "phalanx", "run", "--hosts", "localhost:1", "--backend", "gloo",
                          "--secret-file", "/nonexistent/secret", str(job)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "RESULT" not in out.stdout, out
    assert "makes a fresh secret for every job" in " ".join(out.stderr.split()), out.stderr
