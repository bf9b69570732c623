"""How the ranks of an MPI job ended, as far as the launcher can tell.

Neither mpiexec tells the launcher which rank died by a signal except in its
own message ("BAD TERMINATION ... PID 123" / "process rank 1 with PID 123 ...
exited on signal 9"), so mpiexec's output passes through the launcher, which
keeps its tail, and :class:`Watch` notices the moment each rank on this host
exits (Linux pidfds, opened from the ``pid-rank<r>`` files the workers leave).
"""

from __future__ import annotations

import functools
import json
import os
import re
import select
import signal
import socket
import sys
import threading
import time
from typing import BinaryIO

from .._failure import JOB_FILE_MARK
from .._files import write_atomically
from ._jobdir import pid_files
from ._report import ECHOES, Death

__all__ = ["HOST", "RecordSink", "Watch", "can_watch_deaths", "deaths_from"]

HOST = socket.gethostname()


def deaths_from(text: str, code: int, records: dict[int, dict[str, object]], seen: dict[int, float],
                culprit: int | None = None, statuses: dict[int, int] | None = None,
                pids: dict[int, tuple[int, str]] | None = None) -> dict[int, Death]:
    """How the ranks without a failure record ended, and which of them failed first.

    Open MPI names the failing rank and its status. Hydra names neither reliably (its
    "PID ... RUNNING AT" line is often another rank that it killed afterwards) but its
    "EXIT STRING" and exit status are the failing rank's. ``culprit``: the rank the launcher
    saw end first by itself while every other rank was still running (known when the
    launcher, not Hydra, stopped the others: ``_mpi_flavor.hydra_args``); without it the rank is the
    one the launcher saw die first, a weak clue, and the report says so. ``statuses``: exit
    statuses the launcher read itself (:attr:`Watch.status`), exact where Hydra's is not (it
    merges every rank's status with a bitwise or). ``pids``: rank -> (pid, host) of a job across
    hosts, where the launcher sees only its own host's ranks die: Hydra's "PID ... RUNNING AT
    host" then names the rank that failed (Hydra's first bad termination, before its clean-up).
    """
    deaths = {rank: Death(at=at, by_launcher=True) for rank, at in seen.items() if rank not in records}
    found = False
    # Open MPI: "process rank 1 with PID 4242 on node x exited on\nsignal 9 (Killed)."
    for rank, node, sig in re.findall(r"process rank (\d+) with PID \d+ on node (\S+) exited on\s+signal (\d+)",
                                      text):
        deaths[int(rank)] = Death(-int(sig), seen.get(int(rank)), host=node)
        found = True
    # Open MPI 4: "Process name: [[1234,1],1]\n  Exit code: 3"; 5: "[prterun-host-1234@1,1]"
    for rank, status in re.findall(r"Process name:\s*\[\S*?,(\d+)\]\s*\n\s*Exit code:\s*(\d+)", text):
        deaths[int(rank)] = Death(int(status), seen.get(int(rank)))
        found = True
    found = found or pids is not None and _hydra_named(text, records, pids, deaths)
    causes = [r for r, rec in records.items() if rec.get("type") not in ECHOES]
    if found or not deaths or culprit is None and causes:
        return deaths
    if culprit is not None and culprit not in deaths:
        return deaths  # the first rank to end left a failure record: the record tells
    first = culprit if culprit is not None else min(deaths, key=lambda r: (deaths[r].at or 0.0, r))
    sig = re.search(r"EXIT STRING: .*\(signal (\d+)\)", text)
    deaths[first].code = (statuses or {}).get(first, -int(sig.group(1)) if sig else (code if code > 0 else None))
    deaths[first].by_launcher = False
    if culprit is None and deaths[first].code == -signal.SIGKILL and len(deaths) > 1:
        # Hydra stops the other ranks with SIGKILL too, and a killed process can take longer to
        # go than its peers take to be killed: the order seen is then the only (weak) clue.
        deaths[first].notes.append(f"(Hydra kills the other ranks with SIGKILL too; rank {first} is the "
                                   "first rank the launcher saw die, which is usually the one that failed.)")
    return deaths


def _hydra_named(text: str, records: dict[int, dict[str, object]], pids: dict[int, tuple[int, str]],
                 deaths: dict[int, Death]) -> bool:
    """Hydra's "BAD TERMINATION ... PID 123 RUNNING AT h1 ... EXIT CODE: 9", for a rank that left no
    record: mark it in ``deaths`` as the failure (the code as Hydra tells it: a signal for a process it
    saw killed). True when it named a known rank."""
    match = re.search(r"PID (\d+) RUNNING AT (\S+)\s*\n\W*EXIT CODE: (\d+)", text)
    if match is None:
        return False
    pid, host, status = int(match.group(1)), match.group(2), int(match.group(3))
    rank = next((r for r, (p, h) in pids.items() if p == pid and h == host), None)
    if rank is None or rank in records:
        return False
    sig = re.search(r"EXIT STRING: .*\(signal (\d+)\)", text)
    killed = sig is not None or 0 < status < signal.NSIG and "CLEANING UP" in text
    deaths[rank] = Death(-int(sig.group(1)) if sig else -status if killed else status, host=host)
    return True


@functools.lru_cache(maxsize=1)
def can_watch_deaths() -> bool:
    """True when this system lets the launcher watch processes end (``pidfd_open``: Linux 5.3+).

    Probed once on the launcher itself: old kernels, gVisor and seccomp filters refuse it with
    ``ENOSYS``/``EPERM``, and there :class:`Watch` sees nothing rather than every rank dead.
    """
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        fd = os.pidfd_open(os.getpid())
    except OSError:
        return False
    os.close(fd)
    return True


def _zombie_status(pid: int) -> int | None:
    """The exit status of a process that has ended but not yet been reaped by its parent (Linux).

    Field 52 of ``/proc/PID/stat`` holds it in ``waitpid`` form; ``None`` once the parent
    (mpiexec's proxy) has reaped it, which is a race the launcher often, not always, wins.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # fields 3...: "state ppid ..."
    if len(fields) < 50 or fields[0] != b"Z":
        return None
    raw = int(fields[49])
    return -(raw & 0x7F) if raw & 0x7F else (raw >> 8) & 0xFF


class Watch:
    """Notices the moment each rank on this host exits (Linux pidfds; where :func:`can_watch_deaths`
    is false it sees nothing).

    The ranks are mpiexec's grandchildren, so their exit status is out of reach, but the
    order of their deaths tells which one failed first."""

    def __init__(self, job_dir: str) -> None:
        self.job_dir = job_dir
        self.fds: dict[int, int] = {}  # pidfd -> rank
        self.known: set[int] = set()
        self.dead: dict[int, float] = {}
        self.status: dict[int, int] = {}  # rank -> exit status (negative: signal), when it could be read
        self.pids: dict[int, int] = {}  # rank -> pid
        self.poller = select.poll() if can_watch_deaths() else None

    def wait(self, timeout: float) -> None:
        if self.poller is None:
            time.sleep(timeout)
            return
        for rank, (pid, host) in pid_files(self.job_dir, skip=self.known).items():
            self.known.add(rank)
            if host != HOST:
                continue
            self.pids[rank] = pid
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:  # gone before it could be watched: it ended before now
                self.dead.setdefault(rank, time.time())
                continue
            except OSError:  # e.g. out of file descriptors: this rank goes unwatched, not dead
                continue
            self.fds[fd] = rank
            self.poller.register(fd, select.POLLIN)
        ready = self.poller.poll(timeout * 1000)
        now = time.time()
        for fd, _ in ready:
            rank = self.fds.pop(fd)
            self.dead[rank] = now
            self.poller.unregister(fd)
            os.close(fd)
            if (status := _zombie_status(self.pids[rank])) is not None:
                self.status[rank] = status
        if not self.fds and timeout:
            time.sleep(timeout)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


class RecordSink:
    """Where mpiexec's stderr goes: the console, except the job-directory files of ranks on other
    hosts (``JOB_FILE_MARK`` lines from :func:`phalanx._failure.send_job_file`: their pid and host,
    their failure record), which it writes into the job directory as if those ranks had, so the
    launcher treats them like local ones.

    It also notes the first rank that called ``MPI_Abort`` (MPICH's own line, written by that rank:
    "application called MPI_Abort(MPI_COMM_WORLD, 7) - process 1"), as :attr:`aborted`: ``(rank,
    code)``. Hydra kills every rank at once then, and the forker leaves it to the launcher: either
    way the order of the deaths does not tell who aborted, this line does."""

    _MARK = JOB_FILE_MARK.encode()
    _NAMES = re.compile(r"^(?:failure-rank\d+\.json|pid-rank\d+)$")
    _ABORT = re.compile(rb"application called MPI_Abort\([^,()]*, (-?\d+)\) - process (\d+)")

    def __init__(self, job_dir: str, console: BinaryIO | None = None) -> None:
        self.job_dir = job_dir
        self.console = console if console is not None else sys.stderr.buffer
        self.partial = b""
        self.lock = threading.Lock()
        self.aborted: tuple[int, int] | None = None  # (rank, code) of the first MPI_Abort seen

    def write(self, data: bytes) -> None:
        with self.lock:
            *lines, self.partial = (self.partial + data).split(b"\n")
            if len(self.partial) > 1 << 16 and self._MARK not in self.partial:  # no newline coming soon
                lines.append(self.partial)
                self.partial = b""
            out = [self._filter(line) for line in lines]
            self._emit(b"".join(out))

    def flush(self) -> None:
        with self.lock:
            self.console.flush()

    def close(self) -> None:
        """Pass on a last line without a newline (the stream has ended)."""
        with self.lock:
            rest, self.partial = self.partial, b""
            self._emit(self._filter(rest) if rest.strip() else b"")

    def _filter(self, line: bytes) -> bytes:
        if self.aborted is None and (abort := self._ABORT.search(line)):
            self.aborted = (int(abort.group(2)), int(abort.group(1)))
        at = line.find(self._MARK)
        if at < 0:
            return line + b"\n"
        self._file(line[at + len(self._MARK):])
        return line[:at] + b"\n" if line[:at].strip() else b""

    def _emit(self, data: bytes) -> None:
        if data:
            try:
                self.console.write(data)
                self.console.flush()
            except (OSError, ValueError):
                pass

    def _file(self, text: bytes) -> None:
        try:
            sent = json.loads(text)
            name, content = str(sent["name"]), str(sent["text"])
            if self._NAMES.fullmatch(name):
                with write_atomically(os.path.join(self.job_dir, name), "w", durable=False) as f:
                    f.write(content)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged line: the report falls back on mpiexec's own words
