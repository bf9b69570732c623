"""How the ranks of an MPI job ended, as far as the launcher can tell.

Neither mpiexec tells the launcher which rank died by a signal except in its
own message ("BAD TERMINATION ... PID 123" / "process rank 1 with PID 123 ...
exited on signal 9"), so mpiexec's output passes through the launcher, which
keeps its tail, and :class:`Watch` notices the moment each rank on this host
exits (Linux pidfds, opened from the ``pid-rank<r>`` files the workers leave).
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import time

from ._jobdir import pid_files
from ._report import ECHOES, Death

__all__ = ["HOST", "Watch", "deaths_from"]

HOST = socket.gethostname()


def deaths_from(text: str, code: int, records: dict[int, dict[str, object]],
            seen: dict[int, float]) -> dict[int, Death]:
    """How the ranks without a failure record ended, and which of them failed first.

    Open MPI names the failing rank and its status. Hydra names neither reliably (its
    "PID ... RUNNING AT" line is often another rank that it killed afterwards) but its
    "EXIT STRING" and exit status are the failing rank's: the rank is the one the launcher
    saw die first.
    """
    deaths = {rank: Death(at=at, by_launcher=True) for rank, at in seen.items() if rank not in records}
    found = False
    # Open MPI: "process rank 1 with PID 4242 on node x exited on\nsignal 9 (Killed)."
    for rank, sig in re.findall(r"process rank (\d+) with PID \d+ on node \S+ exited on\s+signal (\d+)", text):
        deaths[int(rank)] = Death(-int(sig), seen.get(int(rank)))
        found = True
    # Open MPI 4: "Process name: [[1234,1],1]\n  Exit code: 3"; 5: "[prterun-host-1234@1,1]"
    for rank, status in re.findall(r"Process name:\s*\[\S*?,(\d+)\]\s*\n\s*Exit code:\s*(\d+)", text):
        deaths[int(rank)] = Death(int(status), seen.get(int(rank)))
        found = True
    causes = [r for r, rec in records.items() if rec.get("type") not in ECHOES]
    if not found and not causes and deaths:
        first = min(deaths, key=lambda r: (deaths[r].at or 0.0, r))
        sig = re.search(r"EXIT STRING: .*\(signal (\d+)\)", text)
        deaths[first].code = -int(sig.group(1)) if sig else (code if code > 0 else None)
        deaths[first].by_launcher = False
        if deaths[first].code == -signal.SIGKILL and len(deaths) > 1:
            # Hydra stops the other ranks with SIGKILL too, and a killed process can take longer to
            # go than its peers take to be killed: the order seen is then the only (weak) clue.
            deaths[first].notes.append(f"(Hydra kills the other ranks with SIGKILL too; rank {first} is the "
                                       "first rank the launcher saw die, which is usually the one that failed.)")
    return deaths


class Watch:
    """Notices the moment each rank on this host exits (Linux pidfds; elsewhere it sees nothing).

    The ranks are mpiexec's grandchildren, so their exit status is out of reach, but the
    order of their deaths tells which one failed first."""

    def __init__(self, job_dir: str) -> None:
        self.job_dir = job_dir
        self.fds: dict[int, int] = {}  # pidfd -> rank
        self.known: set[int] = set()
        self.dead: dict[int, float] = {}
        self.poller = select.poll() if hasattr(os, "pidfd_open") else None

    def wait(self, timeout: float) -> None:
        if self.poller is None:
            time.sleep(timeout)
            return
        for rank, (pid, host) in pid_files(self.job_dir, skip=self.known).items():
            self.known.add(rank)
            if host != HOST:
                continue
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # already gone
                continue
            self.fds[fd] = rank
            self.poller.register(fd, select.POLLIN)
        ready = self.poller.poll(timeout * 1000)
        now = time.time()
        for fd, _ in ready:
            self.dead[self.fds.pop(fd)] = now
            self.poller.unregister(fd)
            os.close(fd)
        if not self.fds and timeout:
            time.sleep(timeout)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
