"""gloo's interface and the guarded rendezvous, on this host's own address and on simulated hosts.

On this host: ranks meet at a non-loopback address of this machine (``MASTER_ADDR`` = the
first one listed), so the rendezvous is guarded exactly as across hosts. On 2 simulated hosts
whose names resolve to a loopback address on themselves (the layout Debian writes, which made
gloo fail with ``connectFullMesh ... remote=[127.0.0.1]``): no ``GLOO_SOCKET_IFNAME`` from the
user, or ``PHALANX_IFACE=eth0``. Each world also lets an intruder try the rendezvous without the
secret (a raw socket, torch's own ``TCPStore`` client, a guard with a wrong secret): every try is
refused, no key it tried to set exists, and rank 0's stderr names each refused connection.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from helpers import requires_hosts
from phalanx._net import interface_of, interfaces, is_loopback

PROGRAM = str(Path(__file__).with_name("program_rendezvous.py"))
SECRET = "5f1c0ffee0ddba11" * 4
REFUSAL = "phalanx: refused a rendezvous connection from "
_DROP = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "PHALANX_", "MASTER_", "TORCHELASTIC_", "LOCAL_", "RANK",
         "WORLD_SIZE")
Popen = Callable[..., "subprocess.Popen[str]"]


def own_address() -> str | None:
    """A non-loopback IPv4 address of this machine, or None."""
    found = [a for _, a in interfaces() if a and "." in a and not is_loopback(a)]
    return found[0] if found else None


def free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def rank_env(rank: int, size: int, master: str, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    env.update({"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": master, "MASTER_PORT": str(port),
                "PHALANX_TIMEOUT": "10", "PYTHONUNBUFFERED": "1", **extra})
    return {k: v for k, v in env.items() if v}


@dataclass
class Job:
    """What a world left: per rank its files (``up``, ``done``, ``error``, ``timeout``) and stderr."""

    out: Path
    stderr: dict[int, str] = field(default_factory=dict)
    intruder: dict[str, str] = field(default_factory=dict)
    port: int = 0
    codes: dict[int, int | None] = field(default_factory=dict)

    def file(self, kind: str, rank: int) -> dict[str, Any] | None:
        path = self.out / f"{kind}{rank}.json"
        return json.loads(path.read_text()) if path.exists() else None


def run_job(out: Path, popens: list[Popen], envs: list[dict[str, str]], body: str = "world",
            intrude: Callable[[], str] | None = None, until: Callable[[Job], bool] | None = None,
            limit: float = 60.0) -> Job:
    """Start one rank per ``popens[r]``; once ``until(job)`` (default: every rank is up, failed
    or gone), run ``intrude`` and let the ranks finish (``world``) or kill them; every process is
    gone on return."""
    out.mkdir(parents=True, exist_ok=True)
    job = Job(out)
    procs = [popen([sys.executable, PROGRAM, "rank", str(out), body], env=env, stderr=subprocess.PIPE,
                   stdout=subprocess.DEVNULL, text=True) for popen, env in zip(popens, envs, strict=True)]
    until = until or (lambda job: all(job.file("up", r) or job.file("error", r) or p.poll() is not None
                                      for r, p in enumerate(procs)))
    try:
        deadline = time.monotonic() + limit
        while not until(job):
            assert time.monotonic() < deadline, f"the ranks were not done in {limit:g} s"
            time.sleep(0.05)
        if intrude is not None:
            job.intruder = json.loads(intrude())
        (out / "go").touch()
        for r, p in enumerate(procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.stderr[r] = p.communicate(timeout=30 if body == "world" else 0.1)[1]
    finally:
        for r, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                job.stderr.setdefault(r, p.communicate()[1])
            job.codes[r] = p.returncode
    return job


def check_world(job: Job, size: int, iface: str, master: str, port: int) -> None:
    """The world formed through the guard on ``iface``; listeners as designed; none after shutdown."""
    for r in range(size):
        up = job.file("up", r)
        assert up is not None, f"rank {r}: {job.file('error', r)} {job.stderr.get(r)}"
        assert up["sum"] == size * (size + 1) / 2 and up["iface"] == iface, up
        done = job.file("done", r)
        assert done is not None and done["listening"] == [], (r, done, job.stderr.get(r))
    guard = [a for a in job.file("up", 0)["listening"] if a[1] == port]  # type: ignore[index]
    assert guard == [[master, port]], f"the guard must listen on {master}:{port} only: {guard}"
    others = [a for a in job.file("up", 0)["listening"] if a[1] != port]  # type: ignore[index]
    assert any(is_loopback(a) for a, _ in others), f"no loopback store on rank 0: {others}"
    assert not any(a in ("0.0.0.0", "::") for a, _ in job.file("up", 0)["listening"])  # type: ignore[index]


def check_intruder(job: Job, source: str) -> None:
    """Every intrusion failed, wrote nothing, and rank 0's stderr names each refused connection."""
    assert job.intruder, "the intruder did not run"
    for how, outcome in job.intruder.items():
        assert outcome.startswith(("closed", "failed")), (how, outcome)
    assert "PHALANX_SECRET differs" in job.intruder["wrong-secret"], job.intruder
    assert float(job.intruder["silent"].split()[-2]) < 7, job.intruder  # the handshake deadline (5 s)
    assert job.file("done", 0)["intruder_keys"] == []  # type: ignore[index]
    refusals = [line for line in job.stderr[0].splitlines() if line.startswith(REFUSAL + source + ":")]
    assert len(refusals) >= 4, job.stderr[0]
    assert all(line.endswith("(wrong or missing secret)") for line in refusals), refusals


# -- on this host, at its own non-loopback address ------------------------------------------------------------

HERE = own_address()
needs_address = pytest.mark.skipif(HERE is None, reason="this machine has no non-loopback IPv4 address")


def here(tmp: Path, size: int, body: str = "world", intrude: bool = False,
         until: Callable[[Job], bool] | None = None, **extra: str) -> Job:
    assert HERE is not None
    port = free_port(HERE)
    envs = [rank_env(r, size, HERE, port, **extra) for r in range(size)]

    def intruder() -> str:
        return subprocess.run([sys.executable, PROGRAM, "intruder", HERE, str(port)], capture_output=True,
                              text=True, timeout=60, check=True).stdout

    job = run_job(tmp, [subprocess.Popen] * size, envs, body, intruder if intrude else None, until)
    job.port = port
    return job


@pytest.fixture(scope="module")
def guarded_here(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return here(tmp_path_factory.mktemp("guarded"), 2, intrude=True, PHALANX_SECRET=SECRET)


@needs_address
def test_here_a_world_meets_through_the_guard_on_the_chosen_address_only(guarded_here: Job) -> None:
    assert HERE is not None
    check_world(guarded_here, 2, interface_of(HERE) or "", HERE, guarded_here.port)


@needs_address
def test_here_a_client_without_the_secret_is_refused_and_rank_0_says_so(guarded_here: Job) -> None:
    assert HERE is not None
    check_intruder(guarded_here, HERE)


@needs_address
def test_here_idle_connections_without_the_secret_do_not_keep_ranks_out(tmp_path: Path) -> None:
    """100 idle connections to rank 0's guard (more than it lets wait at once) before rank 1 starts:
    rank 1's connections closed unheard are retried, not taken as a verdict on its secret, and the
    world forms once the idle ones reach the handshake deadline (5 s)."""
    assert HERE is not None
    port = free_port(HERE)
    envs = [rank_env(r, 2, HERE, port, PHALANX_SECRET=SECRET) for r in range(2)]
    flood: list[socket.socket] = []

    def after_the_flood(argv: list[str], **kw: Any) -> subprocess.Popen[str]:
        deadline = time.monotonic() + 30
        while len(flood) < 100 and time.monotonic() < deadline:
            try:
                flood.append(socket.create_connection((HERE, port), timeout=1))
            except OSError:  # rank 0 is not listening yet
                time.sleep(0.05)
        assert len(flood) == 100, f"only {len(flood)} connections to rank 0's guard"
        return subprocess.Popen(argv, **kw)

    try:
        job = run_job(tmp_path, [subprocess.Popen, after_the_flood], envs)
    finally:
        for sock in flood:
            sock.close()
    check_world(job, 2, interface_of(HERE) or "", HERE, port)
    print(f"rank 1 joined after {job.file('up', 1)['init_s']:.2f} s")  # type: ignore[index]


@needs_address
def test_here_a_missing_secret_fails_every_rank_naming_the_fix(tmp_path: Path) -> None:
    job = here(tmp_path, 2)
    for r in range(2):
        error = job.file("error", r)
        assert error is not None and "RendezvousError" in error["error"], (r, job.stderr.get(r))
        assert "PHALANX_SECRET is not set" in error["error"] and "token_hex" in error["error"]


@needs_address
def test_here_an_unknown_iface_fails_listing_the_interfaces(tmp_path: Path) -> None:
    assert HERE is not None
    job = here(tmp_path, 2, PHALANX_SECRET=SECRET, PHALANX_IFACE="nosuch0")
    for r in range(2):
        error = job.file("error", r)
        assert error is not None and "PHALANX_IFACE=nosuch0" in error["error"], job.stderr.get(r)
        assert f"{interface_of(HERE)} {HERE}" in error["error"] and "lo 127.0.0.1" in error["error"], error


@needs_address
def test_here_a_rank_with_another_secret_is_refused_at_once(tmp_path: Path) -> None:
    assert HERE is not None
    port = free_port(HERE)
    envs = [rank_env(r, 2, HERE, port, PHALANX_SECRET=SECRET if r == 0 else SECRET[::-1],
                     PHALANX_TIMEOUT="3" if r == 0 else "60") for r in range(2)]
    job = run_job(tmp_path, [subprocess.Popen] * 2, envs)
    wrong, verdict = job.file("error", 1), job.file("error", 0)
    assert wrong is not None and "PHALANX_SECRET differs between ranks" in wrong["error"], job.stderr[1]
    print(f"rank 1 raised after {wrong['after_s']:.2f} s")
    assert wrong["after_s"] < 20, wrong  # once rank 0 answers, not after its 60 s: no retry mends another secret
    assert job.codes[1] == 3, (job.codes, job.stderr[1])  # and exits cleanly, torch's client still retrying
    assert verdict is not None and "missing: rank 1" in verdict["error"], job.stderr[0]
    assert "refused 1 connection(s) without the job's secret" in verdict["error"], verdict
    assert REFUSAL + HERE + ":" in job.stderr[0]


@needs_address
@pytest.mark.parametrize("body", ["diag", "stop"])
def test_here_diagnosis_goes_through_the_guard_in_bounded_time(tmp_path: Path, body: str) -> None:
    """diag: rank 2 sleeps, ranks 0 and 1 time out: rank 1 read rank 0's report through its guard
    (only rank 2 is named). stop: rank 0 (the store's host) stops dead: the others still raise
    within the timeout + 5 s, saying the peers did not answer."""
    waiting = [1, 2] if body == "stop" else [0, 1]
    job = here(tmp_path, 3, body, until=lambda job: all(job.file("timeout", r) for r in waiting),
               PHALANX_SECRET=SECRET, PHALANX_TIMEOUT="3")
    for r in waiting:
        report = job.file("timeout", r)
        assert report is not None and report["after_s"] < 3 + 5, (report, job.stderr.get(r))
        if body == "diag":
            assert "never reached a phalanx call: [2]" in report["error"], report
        else:
            assert "the peers did not answer within" in report["error"], report
        print(f"rank {r}: raised after {report['after_s']:.2f} s: {report['error'][:300]}")


# -- on simulated hosts whose names resolve to loopback on themselves -----------------------------------------

def debian_layout(hosts: Any, i: int, tmp: Path) -> Popen:
    """Popen on host ``i`` with /etc/hosts mapping the host's own name to 127.0.1.1 (Debian's layout)."""
    table = tmp / f"hosts-{i}"
    table.write_text("127.0.0.1\tlocalhost\n" + "".join(
        f"{'127.0.1.1' if j == i else a}\t{n}\n" for j, (a, n) in enumerate(zip(hosts.addresses, hosts.names, strict=True))))

    def popen(argv: list[str], **kw: Any) -> subprocess.Popen[str]:
        wrapped = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   f'mount --bind "{table}" /etc/hosts && exec "$@"', "sh", *argv]
        return hosts.popen(i, wrapped, **kw)

    return popen


@contextlib.contextmanager
def two_hosts() -> Iterator[Any]:
    from phalanx.testing import simulated_hosts

    with simulated_hosts(2) as hosts:
        yield hosts


@requires_hosts
@pytest.mark.parametrize("how", ["auto", "iface", "name"])
def test_hosts_a_world_forms_across_hosts_through_the_guard(tmp_path: Path, how: str) -> None:
    """auto: MASTER_ADDR=198.18.0.1, no interface variable: the interface that routes to the master
    is chosen. iface: MASTER_ADDR=h0 (loopback on h0 itself) and PHALANX_IFACE=eth0. name:
    MASTER_ADDR=h0 and no interface variable: on h0 the route to h0 is loopback, so its one other
    interface is chosen. An intruder on h1 is refused (auto)."""
    with two_hosts() as hosts:
        master = hosts.addresses[0] if how == "auto" else hosts.names[0]
        extra = {"PHALANX_SECRET": SECRET} | ({"PHALANX_IFACE": "eth0"} if how == "iface" else {})
        envs = [rank_env(r, 2, master, 29500, **extra) for r in range(2)]

        def intruder() -> str:
            return hosts.run(1, [sys.executable, PROGRAM, "intruder", hosts.addresses[0], "29500"],
                             env=rank_env(0, 1, "x", 0), capture_output=True, text=True, timeout=60,
                             check=True).stdout

        job = run_job(tmp_path, [debian_layout(hosts, i, tmp_path) for i in range(2)], envs,
                      intrude=intruder if how == "auto" else None)
        if how == "auto":
            check_world(job, 2, "eth0", hosts.addresses[0], 29500)
            check_intruder(job, hosts.addresses[1])
        else:
            if how == "name":
                assert all(job.file("up", r)["iface"] == "eth0" for r in range(2)), job.stderr  # type: ignore[index]
            assert [a for a in job.file("up", 0)["listening"] if a[1] == 29500] == sorted(  # type: ignore[index]
                [[hosts.addresses[0], 29500], ["127.0.1.1", 29500]]), job.file("up", 0)
            assert all(job.file("done", r) == {"listening": [], "intruder_keys": []} for r in range(2)), job.stderr
        print(f"rendezvous ({how}): init {[round(job.file('up', r)['init_s'], 3) for r in range(2)]} s")


@requires_hosts
def test_hosts_an_unknown_iface_fails_listing_the_hosts_interfaces(tmp_path: Path) -> None:
    with two_hosts() as hosts:
        envs = [rank_env(r, 2, hosts.addresses[0], 29500, PHALANX_SECRET=SECRET, PHALANX_IFACE="eth9")
                for r in range(2)]
        job = run_job(tmp_path, [debian_layout(hosts, i, tmp_path) for i in range(2)], envs)
        for r in range(2):
            error = job.file("error", r)
            assert error is not None and f"eth0 {hosts.addresses[r]}" in error["error"], job.stderr.get(r)
            assert "PHALANX_IFACE=eth9" in error["error"] and "--iface" not in error["error"][:40], error


TORCHRUN_JOB = """\
import os, numpy as np, phalanx
phalanx.init(backend="gloo")
total = phalanx.allreduce(np.array([1.0]))[0]
print(f"rank {phalanx.rank()} sum {total} iface {os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
phalanx.shutdown()
"""


@requires_hosts
def test_hosts_torchrun_across_hosts_needs_no_interface_from_the_user(tmp_path: Path) -> None:
    """The issue's first failure: `torchrun --nnodes 2` on hosts whose names resolve to loopback;
    gloo used to fail in connectFullMesh (remote=[127.0.1.1]). torchrun's agent serves the store,
    so no secret is needed (nor can phalanx guard it)."""
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_JOB)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with two_hosts() as hosts:
        env = {k: v for k, v in rank_env(0, 1, "x", 0).items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                             "MASTER_PORT")}
        procs = [debian_layout(hosts, i, tmp_path)(
            [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(i), "--master-addr",
             hosts.addresses[0], "--master-port", "29500", str(script)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=90)[0])
            finally:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        assert [p.returncode for p in procs] == [0, 0], outputs
        for r, output in enumerate(outputs):
            assert f"rank {r} sum 2.0 iface eth0" in output, output
