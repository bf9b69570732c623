"""Elastic restart: ``phalanx run --max-restarts K [--min-ranks M]`` starts a failed job again.

::

    phalanx run -n 4 --max-restarts 3 train.py                       # one host: the same 4 ranks again
    phalanx run --hosts h0:2,h1:2,h2:2 --max-restarts 3 --min-ranks 4 train.py

When an attempt fails (a rank raises or dies, a host is lost), every rank of
it has already been stopped and reported on; the launcher then starts the
whole job again, up to K times. On one host it starts the same ``-n`` ranks.
With ``--hosts`` it first asks every host of the original list whether it
answers (``RSH HOST true`` through the job's ssh or ``--rsh`` command, with a
short timeout) and starts the job on those that do: ``-n`` ranks if their
slots hold them, else as many as their slots hold, but never fewer than
``--min-ranks`` (default 1): then it stops, saying which hosts answered. A
Ctrl-C or SIGTERM to the launcher is never followed by a restart.

Each attempt is a new job: a fresh job directory, rendezvous port and secret,
and ``PHALANX_RESTART_COUNT`` (0, 1, ...; like torchrun's
``TORCHELASTIC_RESTART_COUNT``) in every rank's environment; with a log
directory, a failed attempt's rank logs move to ``attempt-<k>/`` in it. Nothing is kept
in memory across attempts: the script continues from its last checkpoint,
e.g. ``phalanx.train.fit(..., global_batch_size=G, resume="latest")``, which
with a fixed global batch ends with the parameters of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import socket
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._errors import LaunchError
from .._net import is_local_address
from ._job import Launch, Signals, notice

__all__ = ["PROBE_TIMEOUT", "RESTART_COUNT", "check_elastic", "probe_hosts", "run_elastic"]

RESTART_COUNT = "PHALANX_RESTART_COUNT"
PROBE_TIMEOUT = 10.0  # seconds a host has to run `true` through the rsh before it counts as lost


def check_elastic(job: Launch) -> None:
    """Refuse restart settings no job can use (:class:`~phalanx.LaunchError` naming the flag and the fix)."""
    k = job.max_restarts
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise LaunchError(f"phalanx run --max-restarts {k!r}: give a whole number of restarts, 0 or more "
                          "(e.g. --max-restarts 3).")
    if k and (getattr(job, "nnodes", 1) > 1 or getattr(job, "node_rank", 0) or getattr(job, "master", None)):
        raise LaunchError(f"phalanx run --nnodes/--node-rank/--master with --max-restarts {k}: a restart needs the "
                          "one command that starts every host; use --hosts (or --hostfile) with --max-restarts, "
                          "or restart the per-host commands from outside (e.g. Slurm's --requeue).")
    m = job.min_ranks
    if m is None:
        return
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise LaunchError(f"phalanx run --min-ranks {m!r}: give a whole number of ranks, 1 or more.")
    if m > job.n:
        raise LaunchError(f"phalanx run -n {job.n} --min-ranks {m}: a restart never adds ranks, so the job "
                          f"could never run on {m}; give --min-ranks {job.n} or less.")


def run_elastic(job: Launch, signals: Signals, attempt: Callable[[Launch, Signals], int]) -> int:
    """Run ``job`` through ``attempt`` (one run of the job), again after a failure up to
    ``job.max_restarts`` times, on the hosts still reachable; the last attempt's exit status.

    Each attempt gets ``PHALANX_RESTART_COUNT`` in its ranks' environment. No restart follows
    a signal to the launcher, exhausted restarts, or fewer usable ranks than ``job.min_ranks``;
    a one-line notice on stderr says which, as it announces each restart.
    """
    current = job
    for count in range(job.max_restarts + 1):
        env = {**current.env, RESTART_COUNT: str(count), "PHALANX_MAX_RESTARTS": str(job.max_restarts)}
        code = attempt(dataclasses.replace(current, env=env), signals)
        if code == 0 or signals.received:
            return code
        if count + len(job.replaced) >= job.max_restarts:
            if job.max_restarts:
                notice(f"not restarting: the job failed {count + 1} times and --max-restarts {job.max_restarts} "
                       f"are used up (exit status {code}; the reports above name the failing ranks).")
            return code
        following, lost = _next_world(job, current)
        if signals.received:
            return code
        if following is None:
            notice(f"not restarting after attempt {count} failed (exit status {code}): {lost}")
            return code
        kept = _keep_logs(job.log_dir, count)
        notice(f"restart {count + 1} of {job.max_restarts} ({RESTART_COUNT}={count + 1}): attempt {count} "
               f"failed with exit status {code}{'; ' + lost if lost else ''}{kept}; the new world: "
               f"{describe_world(following)}.")
        current = following
    return code  # not reached: the loop returns


def _keep_logs(log_dir: str | None, count: int) -> str:
    """Move the failed attempt's ``rank.<r>.log`` files to ``log_dir/attempt-<count>/`` (the next attempt
    would overwrite them); returns a note saying where, or ``""``."""
    if log_dir is None or not os.path.isdir(log_dir):
        return ""
    kept = os.path.join(log_dir, f"attempt-{count}")
    moved = False
    for name in sorted(os.listdir(log_dir)):
        if name.startswith("rank.") and name.endswith(".log"):
            os.makedirs(kept, exist_ok=True)
            os.replace(os.path.join(log_dir, name), os.path.join(kept, name))
            moved = True
    return f" (its logs: {kept})" if moved else ""


def describe_world(job: Launch) -> str:
    """``"4 ranks on this host"`` or ``"2 ranks on h0:1,h1:1"``."""
    hosts = _hosts(job)
    where = "this host" if hosts is None else ",".join(str(h) for h in hosts)
    return f"{job.n} rank{'s' * (job.n != 1)} on {where}"


def _hosts(job: Launch) -> list[Any] | None:
    value = getattr(job, "hosts", None)
    if value is None:
        return None
    from ._hostlist import as_hosts

    return as_hosts(value)


def _next_world(job: Launch, current: Launch) -> tuple[Launch | None, str]:
    """The job to start next (None: none can start) and what was lost or why nothing can start."""
    hosts = _hosts(job)
    if hosts is None:
        return current, ""
    answers = probe_hosts([h.name for h in hosts], getattr(job, "rsh", None))
    usable = [h for h in hosts if answers[h.name] is None]
    lost = "; ".join(f"host {name} is lost ({why})" for name, why in answers.items() if why is not None)
    slots = sum(h.slots for h in usable)
    n = job.n if getattr(job, "oversubscribe", False) and usable else min(job.n, slots)
    least = job.min_ranks or 1
    if n < least:
        held = ",".join(map(str, usable)) or "none"
        return None, (f"{lost + '; ' if lost else ''}the hosts that answer ({held}) hold {n} rank"
                      f"{'s' * (n != 1)}, fewer than --min-ranks {least}. Bring the lost hosts back (or "
                      "lower --min-ranks) and run the same command again: the script resumes from its "
                      "last checkpoint.")
    return dataclasses.replace(current, hosts=usable, n=n), lost


def probe_hosts(names: list[str], rsh: str | None = None, timeout: float = PROBE_TIMEOUT) -> dict[str, str | None]:
    """Ask each host, at once, to run ``true`` through ``rsh`` (default ``ssh``): ``{name: None}`` for
    those that did within ``timeout`` seconds, else ``{name: why not}``. This host answers without asking."""
    command = shlex.split(rsh) if rsh else ["ssh"]
    if os.path.basename(command[0]) == "ssh":  # never wait for a password or a host-key question
        command += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}"]

    def ask(name: str) -> str | None:
        if is_local_address(name) or name in (socket.gethostname(), socket.getfqdn()):
            return None
        shown = f"`{shlex.join([*command, name, 'true'])}`"
        try:
            proc = subprocess.Popen([*command, name, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            return f"cannot run {command[0]!r}: {exc.strerror or exc}"
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the rsh and whatever it started
            with contextlib.suppress(subprocess.TimeoutExpired):  # a child that left the group may hold stderr
                proc.communicate(timeout=2)
            return f"{shown} gave no answer within {timeout:g} s"
        if proc.returncode == 0:
            return None
        said = err.decode(errors="replace").strip().splitlines()
        return f"{shown} exited with status {proc.returncode}" + (f": {said[-1]}" if said else "")

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(names)))) as pool:
        return dict(zip(names, pool.map(ask, names), strict=True))
