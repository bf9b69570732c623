"""A job whose ranks all run on this host listens on the loopback interface only.

While a 3-rank world is running (`phalanx run`, mpi and gloo), every process
of the job is listed with its listening TCP sockets and unconnected UDP
sockets (psutil). Every socket a rank opened itself must be bound to
127.0.0.1 or ::1: the gloo store and gloo's pairs, MPI's transports (UCX,
libfabric, Open MPI's TCP). Under MPICH the launcher starts the ranks with
`mpiexec.gforker`, which talks to them over socketpairs: nothing of the job
listens beyond loopback, mpiexec included. Hydra's control port (the
fallback where there is no forker) and Open MPI 5's `prterun` bind every
interface and cannot be told otherwise (Hydra: `-iface lo` and `-localhost
127.0.0.1` only change the address its proxies connect to; PRRTE refuses a
loopback-only out-of-band channel); a socket mpiexec holds too is
recognised as its own (Hydra's is inherited by the ranks), and those are
reported, not asserted (see docs/design.md, "The launcher").
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import AVAILABLE
from phalanx.launch._mpi_flavor import Flavor, find_mpiexec, mpiexec_flavor, single_host_forker

LOOPBACK = {"127.0.0.1", "::1"}
RANKS = 3

JOB = """\
    import os, sys, time
    import phalanx
    phalanx.init()
    phalanx.barrier()                      # every connection made: the world is up
    with open(os.path.join(sys.argv[1], f"up{phalanx.rank()}"), "w") as f:
        f.write(str(os.getpid()))
    while not os.path.exists(os.path.join(sys.argv[1], "go")):
        time.sleep(0.05)
    phalanx.barrier()
"""


def listeners(process: psutil.Process) -> set[tuple[str, int, str]]:
    """(address, port, kind) of each listening TCP socket and unconnected UDP socket of ``process``."""
    found = set()
    try:
        for conn in process.net_connections("inet"):
            if conn.status == psutil.CONN_LISTEN:
                found.add((conn.laddr.ip, conn.laddr.port, "tcp"))
            elif conn.type == 2 and not conn.raddr:  # SOCK_DGRAM
                found.add((conn.laddr.ip, conn.laddr.port, "udp"))
    except psutil.Error:
        pass
    return found


def job_listeners(tmp_path: Path, backend: str) -> tuple[dict[int, set], dict[str, set], set]:
    """Run the job; while it runs: rank -> its listeners, launcher process name -> its listeners,
    and the launcher's own (``phalanx run``'s) listeners."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    launcher = subprocess.Popen([sys.executable, "-m", "phalanx", "run", "-n", str(RANKS), "--backend", backend,
                                 str(script), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        # each rank writes its pid into up<r>: wait until every file holds it (created is not yet written)
        while not all((tmp_path / f"up{r}").exists() and (tmp_path / f"up{r}").read_text().strip()
                      for r in range(RANKS)):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.05)
        pids = {int((tmp_path / f"up{r}").read_text()): r for r in range(RANKS)}
        ranks: dict[int, set] = {}
        others: dict[str, set] = {}
        for process in psutil.Process(launcher.pid).children(recursive=True):
            if process.pid in pids:
                ranks[pids[process.pid]] = listeners(process)
            else:
                others.setdefault(f"{process.name()} ({process.pid})", set()).update(listeners(process))
        own = listeners(psutil.Process(launcher.pid))
        (tmp_path / "go").touch()
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, err
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    return ranks, others, own


def _forker() -> str | None:
    """The MPICH forker the launcher starts a one-host mpi job with, if this MPI has one."""
    mpiexec = find_mpiexec()
    return single_host_forker(mpiexec, mpiexec_flavor(mpiexec)) if mpiexec else None


@pytest.mark.parametrize("backend", [pytest.param(b, marks=[] if b in AVAILABLE else pytest.mark.skip(
    reason=f"no {b} backend here")) for b in ("mpi", "gloo")])
def test_a_single_host_job_listens_on_loopback_only(tmp_path: Path, backend: str) -> None:
    ranks, others, own = job_listeners(tmp_path, backend)
    assert sorted(ranks) == list(range(RANKS))
    held_by_mpiexec = set().union(*others.values()) if others else set()
    exposed = {rank: sorted(s for s in sockets - held_by_mpiexec if s[0] not in LOOPBACK)
               for rank, sockets in ranks.items()}
    assert not any(exposed.values()), f"rank sockets on other interfaces: {exposed}"
    assert not own, f"phalanx run itself listens: {own}"
    if backend == "gloo":  # no process between the launcher and the ranks
        assert not others, others
    outside = {name: sorted(s for s in sockets if s[0] not in LOOPBACK) for name, sockets in others.items()}
    if backend == "mpi" and _forker() is not None:  # MPICH: mpiexec.gforker, no control port at all
        exposed = {rank: sorted(s for s in sockets if s[0] not in LOOPBACK) for rank, sockets in ranks.items()}
        assert not any(exposed.values()) and not any(outside.values()), f"beyond loopback: {exposed} {outside}"
        assert any(name.startswith("mpiexec.gfork") for name in others), others
    print(f"mpiexec's own listeners beyond loopback (not confinable): {outside}")


def test_the_forker_is_mpichs_beside_mpiexec_and_none_elsewhere(tmp_path: Path) -> None:
    (tmp_path / "mpiexec").touch(mode=0o755)
    hydra = Flavor("mpich", (5, 0, 2), "Hydra 5.0.2 (MPICH)")
    assert single_host_forker(str(tmp_path / "mpiexec"), hydra) is None  # no forker there: Hydra, as before
    (tmp_path / "mpiexec.gforker").touch(mode=0o755)
    assert single_host_forker(str(tmp_path / "mpiexec"), hydra) == str(tmp_path / "mpiexec.gforker")
    for other in (Flavor("mpich", (2021, 10), "Intel(R) MPI Library for Linux* OS, Version 2021.10"),
                  Flavor("openmpi", (5, 0, 7), "mpiexec (Open MPI) 5.0.7")):
        assert single_host_forker(str(tmp_path / "mpiexec"), other) is None
