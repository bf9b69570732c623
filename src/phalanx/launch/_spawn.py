"""gloo/nccl jobs: start N ranks on this machine and supervise them.

Each rank gets the torch.distributed environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), Horovod's
(``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``) and
its own process group, so stopping a rank also stops what it started
(DataLoader workers). The supervisor polls every 50 ms; the first rank that
exits non-zero, dies by a signal or records an exception ends the job:
SIGTERM to every other rank's group, SIGKILL after a grace period. So does
the start timeout (:mod:`._start`) when a rank has not reached ``phalanx.init``.
On several hosts (:mod:`._on_each_host`, :mod:`._remote`) the ranks started here are a
:class:`Placement` in a larger world, and the job also ends when the driver is lost.
"""

from __future__ import annotations

import dataclasses
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._epochs import Coordinator, wants_epochs
from ._job import GRACE, Launch, Signals, notice, worker_command
from ._jobdir import any_record, read_records
from ._logs import Echo, log_path, pump
from ._procs import child_setup, signal_name, stop_groups
from ._report import ECHOES, Death, aborted_by_gloo, describe_exit, failure_report, first_failure
from ._start import StartClock

__all__ = ["Outcome", "Placement", "free_port", "run_spawn"]

POLL = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` (an address of this machine) a moment ago (rank 0's store binds it).

    Chosen below Linux's ephemeral range (32768+), where ``bind(0)`` would pick it: there the
    outgoing connections of other jobs could take it before rank 0 binds it.
    """
    for port in random.sample(range(20000, 32768), 32):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Placement:
    """Where the ranks this launcher starts sit in the job: the global ``ranks`` (one per local
    rank; default ``0..job.n - 1``) of ``world_size``, meeting rank 0's store at
    ``master_addr:master_port`` (a free port here when ``None``), plus ``env`` for every rank."""

    world_size: int
    ranks: tuple[int, ...] = ()
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    """How a failed job failed, for a driver that supervises several hosts (set by :func:`run_spawn`)."""

    rank: int | None = None  # the global rank that failed first (None: unknown)
    time: float | None = None  # when (time.time() of the record or of the launcher noticing its death)
    type: str = ""  # the exception's type name, "" when the rank left no record
    message: str = ""  # its message, or how the rank ended
    code: int | None = None  # the rank's own exit status
    stopped: str = ""  # why the launcher stopped ranks that had not failed (lost driver, signal)


def run_spawn(job: Launch, env: dict[str, str], job_dir: str, signals: Signals,
              placement: Placement | None = None, lost: Callable[[], str | None] | None = None,
              outcome: Outcome | None = None, epochs: Any = None) -> int:
    """Start ``job.n`` ranks here, supervise them to the end; returns the exit status (report on stderr).

    ``placement`` puts them in a larger world (default: ranks 0..n-1 of n, store on 127.0.0.1);
    ``lost()`` returning a reason ends the job (the driver of a multi-host job is gone);
    ``outcome`` receives the first failure; ``epochs``: this host's part of a world with epochs across
    hosts (:class:`._epochs_hosts.Relay`); on one host the :class:`Coordinator` is made here.
    """
    start = time.time()
    placement = placement or Placement(world_size=job.n, ranks=tuple(range(job.n)))
    if epochs is None and wants_epochs(job) and placement.world_size == job.n:  # the store here: the world re-forms in place
        # its own port: MASTER_PORT stays free for a script that makes torch.distributed's group itself
        epochs = Coordinator(job, free_port(), env["PHALANX_SECRET"], float(env.get("PHALANX_TIMEOUT") or 300.0))
        placement = dataclasses.replace(placement, master_port=placement.master_port or free_port())
    try:
        return _supervise(job, env, job_dir, signals, placement, lost, outcome, epochs, start)
    finally:
        if epochs is not None:
            epochs.close()


def _supervise(job: Launch, env: dict[str, str], job_dir: str, signals: Signals, placement: Placement,
               lost: Callable[[], str | None] | None, outcome: Outcome | None, epochs: Any,
               start: float) -> int:
    procs = _start_ranks(job, env, placement, epochs)
    # Readers start after the last fork: preexec_fn and running threads do not mix.
    readers: list[threading.Thread] = []
    files = []
    tails = {rank: bytearray() for rank in procs}  # what each rank wrote last: what gloo said, should it abort

    def read(rank: int, proc: subprocess.Popen[bytes], mode: str = "wb") -> None:
        if job.log_dir is not None:
            assert proc.stdout is not None
            files.append(open(log_path(job.log_dir, rank), mode))  # closed once its reader is done
            readers.append(pump(proc.stdout, [files[-1]], Echo(rank, job.echo), tail=tails[rank]))
        elif proc.stderr is not None:
            readers.append(pump(proc.stderr, [sys.stderr.buffer], tail=tails[rank]))

    for rank, proc in procs.items():  # a replacement's launcher adds to the log of the rank it replaces
        read(rank, proc, "ab" if getattr(epochs, "joining", None) is not None else "wb")
    ranks = _Ranks(procs)

    def respawn(slot: int, extra: dict[str, str]) -> int:
        """A replacement at ``slot`` (a world with epochs): started, read, supervised like the others."""
        proc = _popen(job, dict(_rank_env(env, placement, slot, str(placement.master_port)), **extra))
        procs[slot] = proc
        tails[slot] = bytearray()
        read(slot, proc, "ab")
        return proc.pid

    # Every rank here reports to this job directory only when the whole world runs here.
    timeout = (job.start_timeout or float("inf")) if placement.world_size == job.n else float("inf")
    clock = StartClock(job_dir, job.n, timeout)
    why_lost = None
    while True:
        running = ranks.reap()
        if epochs is not None and ranks.deaths:
            ended = {slot: procs[slot] for slot in ranks.deaths}
            for slot in epochs.tick(ranks.deaths, respawn):
                del ranks.deaths[slot]  # absorbed: the job goes on (a replacement may be at the slot)
                if procs[slot] is ended[slot]:
                    del procs[slot]
            running = ranks.reap()
        elif epochs is not None:
            epochs.tick({}, respawn)
        # A recorded exception ends the job at once, before its rank has finished exiting.
        failed = ranks.failed() or (epochs.failing(job_dir) if epochs is not None else any_record(job_dir))
        why_lost = lost() if lost is not None and not failed else None
        if failed or why_lost or signals.received or not running or clock.overdue(time.monotonic()):
            break
        time.sleep(POLL)
    if failed and not ranks.failed():  # only a record so far: a moment to see the rank that caused it die
        running = _await_cause(job_dir, ranks)
    if running:
        grace = signals.stop_grace if signals.received and not failed else GRACE
        for rank in _stop(procs, running, set(read_records(job_dir)), ranks.reap, lambda: signals.count > 1, grace):
            ranks.deaths[rank].by_launcher = True
    for thread in readers:
        thread.join(timeout=5)
    for f in files:
        f.close()
    if signals.received or why_lost:
        if outcome is not None:
            outcome.stopped = why_lost or signal_name(signals.received or 0)
        if why_lost and not signals.received:
            notice(f"{why_lost}: stopped every rank here.")
        return signals.exit_code if signals.received else 1
    if clock.report is not None and not failed:
        sys.stderr.write(clock.report + "\n")
        return 1
    if failed:
        aborted_by_gloo(ranks.deaths, tails)
    return _report(job_dir, ranks.deaths, start, outcome) if failed else 0


def _rank_env(env: dict[str, str], placement: Placement, local: int, port: str) -> dict[str, str]:
    """The environment of the ``local``-th rank started here: the torch.distributed and Horovod variables."""
    rank = placement.ranks[local]
    return dict(env, **placement.env, RANK=str(rank), WORLD_SIZE=str(placement.world_size),
                LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(len(placement.ranks)),
                MASTER_ADDR=placement.master_addr, MASTER_PORT=port,
                # what horovodrun's gloo launcher sets (Horovod scripts and tests read them)
                HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(placement.world_size),
                HOROVOD_LOCAL_RANK=str(local), HOROVOD_LOCAL_SIZE=str(len(placement.ranks)))


def _popen(job: Launch, rank_env: dict[str, str]) -> subprocess.Popen[bytes]:
    """One rank's process, in its own session (stopping it stops what it started)."""
    logs = job.log_dir is not None
    return subprocess.Popen(
        worker_command(job.target), env=rank_env, start_new_session=True, preexec_fn=child_setup(),
        stdout=subprocess.PIPE if logs else None, stderr=subprocess.STDOUT if logs else subprocess.PIPE,
    )


def _start_ranks(job: Launch, env: dict[str, str], placement: Placement,
                 epochs: Any = None) -> dict[int, subprocess.Popen[bytes]]:
    """Each rank with the torch.distributed environment, in its own session; all or none started."""
    port = str(placement.master_port or free_port())
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for local, rank in enumerate(placement.ranks):
            extra = epochs.env(rank) if epochs is not None else {}
            procs[rank] = _popen(job, dict(_rank_env(env, placement, local, port), **extra))
            if epochs is not None:
                epochs.started(rank, procs[rank].pid)
    except BaseException:
        stop_groups([p.pid for p in procs.values()], lambda: [p.pid for p in procs.values() if p.poll() is None],
                    GRACE)
        raise
    return procs


def _await_cause(job_dir: str, ranks: _Ranks, wait: float = 0.5) -> list[int]:
    """When every record so far is an echo (a peer lost, a broken world), wait up to ``wait`` s for
    its cause: a rank seen dying (e.g. SIGKILLed) or a record of another kind. Without this, a rank
    that died a moment before its peers reported the loss would be counted as stopped by the
    launcher, and the report would name a peer first. Returns the ranks still running."""
    deadline = time.monotonic() + wait
    while True:
        running = ranks.reap()
        records = read_records(job_dir)
        if (ranks.failed() or any(r.get("type") not in ECHOES for r in records.values())
                or time.monotonic() >= deadline):
            return running
        time.sleep(POLL)


class _Ranks:
    """The spawned ranks (global rank -> process) and how each ended (:class:`Death`, stamped when
    the launcher noticed)."""

    def __init__(self, procs: dict[int, subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.deaths: dict[int, Death] = {}

    def reap(self) -> list[int]:
        """Note the ranks that ended since the last look; return those still running."""
        now = time.time()
        for rank, proc in self.procs.items():
            if rank not in self.deaths and (code := proc.poll()) is not None:
                self.deaths[rank] = Death(code, now)
        return [rank for rank in self.procs if rank not in self.deaths]

    def failed(self) -> bool:
        return any(d.code != 0 for d in self.deaths.values())


def _report(job_dir: str, deaths: dict[int, Death], start: float, outcome: Outcome | None) -> int:
    """Print the failure report; return the first failing rank's own exit status (1 if unknown)."""
    records = read_records(job_dir)
    first = first_failure(records, deaths)
    sys.stderr.write(failure_report(first, start, records, deaths) + "\n")
    sys.stderr.flush()
    code = deaths[first].code if first is not None and first in deaths else None
    if outcome is not None and first is not None:
        record, death = records.get(first), deaths.get(first, Death())
        outcome.rank, outcome.code = first, code
        outcome.time = float(record["time"]) if record else death.at
        outcome.type = record["type"] if record else ""
        outcome.message = (record["message"].splitlines() or [""])[0] if record else (
            describe_exit(code) if code is not None else "ended")
    if first is None or code is None or code == 0 or deaths[first].by_launcher:
        return 1
    return code if code > 0 else 128 - code


def _stop(procs: dict[int, subprocess.Popen[bytes]], running: list[int], recorders: set[int],
          reap: Callable[[], list[int]], hurry: Callable[[], bool], grace: float = GRACE) -> list[int]:
    """Stop the ranks still running; return the ones the launcher had to signal.

    A rank that recorded its exception is already on its way out (a torch process takes
    ~0.5 s to exit): it gets the grace period to exit by itself, so the report shows its own
    exit status. The others get SIGTERM at once, SIGKILL after ``grace`` seconds.
    """
    others = [r for r in running if r not in recorders]
    leaving = [r for r in running if r in recorders]
    deadline = time.monotonic() + GRACE
    stop_groups([procs[r].pid for r in others], lambda: [r for r in reap() if r in others], grace, hurry)
    while [r for r in reap() if r in leaving] and time.monotonic() < deadline and not hurry():
        time.sleep(0.02)
    late = [r for r in reap() if r in leaving]
    stop_groups([procs[r].pid for r in late], lambda: [r for r in reap() if r in late], 1.0, hurry)
    for rank in others + late:
        procs[rank].wait()
    reap()
    return others + late
