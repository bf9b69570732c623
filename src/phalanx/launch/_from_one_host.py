"""gloo/nccl on several hosts, horovodrun's convention: ``phalanx run --hosts h0:2,h1:2 --backend gloo``.

::

    phalanx run --hosts h0:2,h1:2 --backend gloo train.py          # ssh to each host
    phalanx run --hosts h0:2,h1:2 --rsh 'ssh -p 2222' --backend gloo train.py

This process, the driver, starts one per-host launcher (:mod:`._remote`) on
every host through ``--rsh`` (default ``ssh -o BatchMode=yes``; a host that is
this machine is started directly), as
``cd <this directory> && exec <this Python> -m phalanx.launch._remote``: the
same Python and working directory on every host (a shared file system, as
for ``mpiexec``). Ranks fill the hosts' slots in order, as for MPI.

What the per-host launchers need, they get on their stdin, never on a command
line: the job, their ranks, the environment to forward (every ``PHALANX_*``,
``GLOO_*``, ``NCCL_*``, ``TORCH_*``, ``OMP_*``, ``MKL_*`` and ``PYTHON*``
variable of the driver, ssh passing none), and a secret made for this job
(``secrets.token_hex(32)``) that the ranks get as ``PHALANX_SECRET``. Node 0
picks the rendezvous address (its address on ``--iface``, else the one that
routes to the next host) and a free port, and tells the driver, which tells
the others.

The first per-host launcher to exit non-zero ends the job: the driver closes
every launcher's stdin (each stops its ranks at once on EOF), waits a grace
period, then terminates the rsh processes. The report names the host and
rank that failed first; each host's own report is relayed above it, every
stderr line prefixed with the host's name (``h1: ...``); stdout is relayed
line by line, unchanged. A Ctrl-C or SIGTERM stops every rank on every host (exit 130 or
143), with the same grace as on one host. If the driver itself dies, every
stdin reaches EOF: no rank outlives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from .._errors import LaunchError
from .._net import is_local_address
from ._epochs import wants_epochs
from ._epochs_hosts import InPlace
from ._hosts_report import describe_status, report
from ._job import GRACE, Launch, Signals
from ._on_each_host import MARK, check_nodes, run_node
from ._procs import child_setup, stop_groups
from ._spawn import run_spawn

__all__ = ["FORWARDED", "remote_command", "run_hosts", "torch_runner"]

POLL = 0.05
FORWARDED = ("PHALANX_", "GLOO_", "NCCL_", "TORCH_", "OMP_", "MKL_", "PYTHON", "HOROVOD_")  # prefixes of variables sent along
_NOT_FORWARDED = {"PHALANX_SECRET", "PHALANX_JOB_DIR", "PHALANX_RANK"}
# What the per-host launchers take of the job (the host list and restarts are the driver's business).
_REMOTE_FIELDS = ("n", "backend", "target", "log_dir", "echo", "timeout", "env", "stop_grace", "start_timeout",
                  "iface")
_END_WAIT = 5.0  # seconds, beyond the per-host launchers' own grace, before their rsh is terminated


@dataclass
class _Remote:
    """One host's launcher, seen from the driver."""

    host: str
    ranks: list[int]
    proc: subprocess.Popen[bytes]
    code: int | None = None
    ended: float | None = None  # time.time() when the driver saw it exit
    outcome: dict[str, Any] | None = None
    started: bool = False  # it has spoken to the driver (so the rsh did start it)
    absorbed: bool = False  # it ended, and the job goes on without it (in place)
    tail: list[str] = field(default_factory=list)  # its last stderr lines (a launcher that could not start)
    readers: list[threading.Thread] = field(default_factory=list)

    def poll(self) -> int | None:
        if self.code is None and (code := self.proc.poll()) is not None:
            self.code, self.ended = code, time.time()
        return self.code

    def send(self, **message: Any) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()


Runner = Callable[[Launch, dict[str, str], str, Signals], int]


def torch_runner(job: Launch) -> Runner:
    """How a gloo/nccl ``job`` runs: on its ``hosts`` (:func:`run_hosts`), as one of ``nnodes``
    launchers (:func:`._on_each_host.run_node`), or all here (:func:`._spawn.run_spawn`).

    Raises :class:`LaunchError` for settings :func:`._on_each_host.check_nodes` refuses.
    """
    check_nodes(job)
    if getattr(job, "hosts", None):
        return run_hosts
    if job.nnodes > 1 or job.master or job.node_rank:
        return run_node
    return run_spawn


def _is_here(name: str) -> bool:
    return is_local_address(name) or name in (socket.gethostname(), socket.getfqdn())


def remote_command(rsh: str | None, host: str, cwd: str) -> list[str]:
    """The argv that starts the per-host launcher on ``host`` (through ``rsh``, or directly when here)."""
    here = [sys.executable, "-m", "phalanx.launch._remote"]
    if _is_here(host):
        return here
    words = shlex.split(rsh) if rsh else ["ssh"]
    if os.path.basename(words[0]) == "ssh":  # never wait for a password, a host-key question or a dead host
        words += ["-o", "BatchMode=yes", "-o", "ConnectTimeout=30"]
    path = os.environ.get("PYTHONPATH")
    start = ["env", f"PYTHONPATH={path}", *here] if path else here
    # ssh joins its words with spaces for the remote shell: one quoted word keeps paths intact.
    return [*words, host, f"cd {shlex.quote(cwd)} && exec {shlex.join(start)}"]


def _forwarded() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED) and k not in _NOT_FORWARDED}


def _plan(job: Launch) -> list[tuple[str, list[int]]]:
    """(host, its global ranks) for every host that gets ranks, in host order."""
    from ._hostlist import as_hosts, placement

    hosts = as_hosts(job.hosts) or []
    where = placement(job.n, hosts)
    plan = [(h.name, [r for r, (name, _) in enumerate(where) if name == h.name]) for h in hosts]
    return [(name, ranks) for name, ranks in plan if ranks]


def _start(job: Launch, plan: list[tuple[str, list[int]]], secret: str,
           elastic: dict[str, Any] | None = None) -> list[_Remote]:
    """Start every per-host launcher and hand each its job on stdin; all or none started."""
    remotes: list[_Remote] = []
    try:
        for index, (host, ranks) in enumerate(plan):
            master = job.master if job.master else (None if index == 0 else "wait")
            remotes.append(_launch(job, host, ranks, secret, master, index, len(plan), elastic,
                                   peer=plan[1][0] if index == 0 and len(plan) > 1 else None))
    except BaseException:
        _end(remotes, 0.0)
        raise
    return remotes


def _launch(job: Launch, host: str, ranks: list[int], secret: str, master: str | None, index: int, nnodes: int,
            elastic: dict[str, Any] | None, peer: str | None = None) -> _Remote:
    """One per-host launcher on ``host`` for ``ranks``, its job sent on its stdin."""
    argv = remote_command(getattr(job, "rsh", None), host, os.getcwd())
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=os.getcwd(), start_new_session=True, preexec_fn=child_setup())
    except OSError as exc:
        raise LaunchError(f"phalanx run --hosts: cannot start {argv[0]!r} to reach host {host} "
                          f"({exc.strerror or exc}); install ssh or give --rsh CMD.") from None
    remote = _Remote(host, ranks, proc)
    spec = {k: v for k, v in asdict(job).items() if k in _REMOTE_FIELDS}
    remote.send(job=dict(spec, n=len(ranks)), ranks=ranks, world_size=job.n, nnodes=nnodes, node_rank=index,
                secret=secret, env=_forwarded(), master=master, host=host, peer=peer, elastic=elastic)
    return remote


def _in_place(job: Launch, plan: list[tuple[str, list[int]]], secret: str,
              start: Callable[[str, int, int, dict[str, Any]], _Remote]) -> InPlace | None:
    """The coordinator of a job that may re-form in place across hosts (gloo/nccl with --max-restarts or
    --min-ranks), its store on this machine's address toward the hosts; None for any other job."""
    if not wants_epochs(job):
        return None
    from .._net import interface_address, route_source
    from ._hostlist import as_hosts

    address = interface_address(job.iface) if job.iface else None
    for host in [host for host, _ in plan if not _is_here(host)]:
        if address is not None:
            break
        with contextlib.suppress(OSError):
            address = route_source(host, 9)  # this machine's address toward the first remote host it routes to
    hosts = [(h.name, h.slots) for h in as_hosts(job.hosts) or []]
    return InPlace(job, secret, address or "127.0.0.1", hosts, start)


def _relay(remote: _Remote, messages: queue.Queue[tuple[_Remote, dict[str, Any]]]) -> None:
    """Copy the launcher's stdout line by line, and its stderr too, each line prefixed with the host."""
    assert remote.proc.stdout is not None and remote.proc.stderr is not None
    prefix = f"{remote.host}: ".encode()

    def out(stream: IO[bytes]) -> None:
        for line in stream:  # whole lines: hosts' output never tears each other's lines
            _write(sys.stdout, line)

    def err(stream: IO[bytes]) -> None:
        for line in stream:
            text = line.decode(errors="replace")
            if text.startswith(MARK):
                remote.started = True
                with contextlib.suppress(ValueError):
                    messages.put((remote, json.loads(text[len(MARK):])))
                continue
            remote.tail = [*remote.tail[-4:], text.rstrip("\n")]
            _write(sys.stderr, prefix + line if line.endswith(b"\n") else prefix + line + b"\n")

    for target, stream in ((out, remote.proc.stdout), (err, remote.proc.stderr)):
        remote.readers.append(threading.Thread(target=target, args=(stream,), daemon=True, name="phalanx-relay"))
        remote.readers[-1].start()


_console = threading.Lock()


def _write(stream: Any, data: bytes) -> None:
    with _console, contextlib.suppress(OSError, ValueError):
        stream.buffer.write(data)
        stream.buffer.flush()


def run_hosts(job: Launch, env: dict[str, str], job_dir: str, signals: Signals) -> int:
    """Run ``job.n`` ranks on ``job.hosts`` (one per-host launcher each, through ``job.rsh``); the exit status.

    ``env`` and ``job_dir`` (this host's) are unused: every host makes its own. Prints the
    report naming the host and rank that failed first. Raises :class:`LaunchError` when a
    launcher cannot be started here (no ssh, a bad ``--rsh``).
    """
    plan = _plan(job)
    start, secret = time.time(), secrets.token_hex(32)
    messages: queue.Queue[tuple[_Remote, dict[str, Any]]] = queue.Queue()
    remotes: list[_Remote] = []
    master: dict[str, str] = {}  # node 0's rendezvous, once it chose it (for replacements)

    def replacement(host: str, slot: int, member: int, elastic: dict[str, Any]) -> _Remote:
        remote = _launch(job, host, [slot], secret, job.master or master.get("at"), len(plan), len(plan), elastic)
        remotes.append(remote)
        _relay(remote, messages)
        return remote

    in_place = _in_place(job, plan, secret, replacement)
    try:
        remotes.extend(_start(job, plan, secret, in_place.config() if in_place is not None else None))
        for remote in remotes:  # after the last fork: preexec_fn and running threads do not mix
            _relay(remote, messages)
        try:
            failed = _supervise(remotes, messages, signals, waiting=job.master is None,
                                start_by=time.monotonic() + (job.start_timeout or float("inf")), in_place=in_place,
                                master=master)
        finally:
            _stop(remotes, signals, job.stop_grace or 0.0)
            for remote in remotes:
                for thread in remote.readers:
                    thread.join(timeout=2)
            _drain(messages)
    finally:
        if in_place is not None:
            in_place.close()
    if signals.received:
        return signals.exit_code
    if not failed:
        return 0
    if in_place is not None and in_place.failure is not None:  # a rank's end the job did not absorb
        told = in_place.failure
        for remote in remotes:
            if remote.host == told["host"] and told["slot"] in remote.ranks:
                remote.outcome = {"rank": told["slot"], "time": told["time"], "type": told["type"],
                                  "message": told["message"] or describe_status(told["code"]), "code": told["code"]}
                remote.absorbed = False
    return report(remotes, start)


def _supervise(remotes: list[_Remote], messages: queue.Queue[tuple[_Remote, dict[str, Any]]],
               signals: Signals, waiting: bool, start_by: float = float("inf"), in_place: InPlace | None = None,
               master: dict[str, str] | None = None) -> bool:
    """Wait for the job's end (True: a host failed); hand node 0's master to the others on the way.
    A per-host launcher that has not spoken by ``start_by`` (a hung ssh, a host that never answers)
    fails the job: the start timeout bounds the start across hosts too. ``in_place``: the job may
    go on without a rank or a host (:mod:`._epochs_hosts`)."""
    while True:
        for remote, message in _drain(messages):
            if "master" in message and remote is remotes[0]:
                if master is not None:
                    master["at"] = message["master"]
                if waiting:
                    for other in remotes[1:]:
                        other.send(master=message["master"])
                    waiting = False
            if in_place is not None:
                in_place.message(remote, message)
        if in_place is not None and in_place.tick(remotes):
            return True
        for remote in remotes:
            if not remote.absorbed and remote.poll() not in (None, 0) and in_place is not None \
                    and _goes_on_without(remote, in_place):
                remote.absorbed = True
        codes = [r.poll() for r in remotes if not r.absorbed]
        if any(c not in (None, 0) for c in codes):
            return True
        if signals.received or all(c == 0 for c in codes):
            return False
        silent = [r.host for r in remotes if not r.started]
        if silent and time.monotonic() > start_by:
            _write(sys.stderr, (f"phalanx run --hosts: no launcher started on {', '.join(silent)} within the "
                                "start timeout (--start-timeout, PHALANX_START_TIMEOUT): the rsh hangs or the host "
                                f"does not answer; check that `ssh {silent[0]} true` (or your --rsh) returns at "
                                "once.\n").encode())
            return True
        time.sleep(POLL)


def _goes_on_without(remote: _Remote, in_place: InPlace) -> bool:
    """Whether the job, in place, goes on after ``remote`` ended non-zero: none of its ranks is still in
    the job, or it ended without naming a rank's own error (its host or the connection to it was lost:
    its ranks then count as stalled, and the coordinator decides)."""
    if not in_place.said_in_place:
        return False
    if in_place.absorbs(remote):
        return True
    outcome = remote.outcome or {}
    return outcome.get("rank") is None and not outcome.get("message")


def _drain(messages: queue.Queue[tuple[_Remote, dict[str, Any]]]) -> list[tuple[_Remote, dict[str, Any]]]:
    """The messages that have come; outcomes are also kept on their remote."""
    got: list[tuple[_Remote, dict[str, Any]]] = []
    while True:
        try:
            remote, message = messages.get_nowait()
        except queue.Empty:
            return got
        if "outcome" in message:
            remote.outcome = message["outcome"]
        got.append((remote, message))


def _stop(remotes: list[_Remote], signals: Signals, stop_grace: float) -> None:
    """End every per-host launcher still running: a signal is passed on (the ranks get ``stop_grace``),
    a failure closes their stdin (they stop their ranks at once); then their rsh is terminated."""
    alive = [r for r in remotes if r.poll() is None]
    if signals.received:
        for remote in alive:
            remote.send(stop=signals.received)
        _wait(alive, stop_grace + GRACE + _END_WAIT, signals)
    for remote in remotes:
        remote.close()
    _end(alive, GRACE + _END_WAIT, signals)


def _wait(remotes: list[_Remote], seconds: float, signals: Signals | None = None) -> None:
    deadline, hurried = time.monotonic() + seconds, 1
    while any(r.poll() is None for r in remotes) and time.monotonic() < deadline:
        if signals is not None and signals.count > hurried:  # another Ctrl-C: pass it on
            hurried = signals.count
            for remote in remotes:
                remote.send(stop=signals.received)
        time.sleep(0.02)


def _end(remotes: list[_Remote], seconds: float, signals: Signals | None = None) -> None:
    """Wait up to ``seconds`` for the launchers to exit, then SIGTERM their rsh, SIGKILL 2 s later."""
    for remote in remotes:
        remote.close()
    _wait(remotes, seconds, signals)
    stop_groups([r.proc.pid for r in remotes if r.poll() is None],
                lambda: [r.proc.pid for r in remotes if r.poll() is None], 2.0)
    for remote in remotes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            remote.proc.wait(timeout=1)
        remote.poll()

