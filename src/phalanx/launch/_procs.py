"""Process plumbing shared by the launcher and :mod:`phalanx.testing`: no orphans, ever.

Every process the launcher starts gets its own session (so a terminal Ctrl-C
reaches only the launcher, which then decides how to stop the job) and, on
Linux, ``PR_SET_PDEATHSIG=SIGKILL`` (so a SIGKILLed launcher, which can run
no cleanup code, still takes its ranks down with it).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterable

__all__ = ["child_setup", "descendants", "kill_pids", "signal_name", "stop_groups"]

_PR_SET_PDEATHSIG = 1


def child_setup() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die with the launcher (Linux only).

    The death signal fires when the *thread* that forked the child exits, so
    start children from a thread that lives as long as they should (the
    launcher uses its main thread).
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork: no imports after it
    parent = os.getpid()

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return setup


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), read from ``/proc``; [] elsewhere."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_pids(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_groups(pgids: list[int], alive: Callable[[], list[int]], grace: float,
                hurry: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM each process group, wait up to ``grace`` s for ``alive()`` to empty, then SIGKILL.

    ``hurry()`` returning true (a second Ctrl-C) skips the rest of the grace period.
    """
    _signal_groups(pgids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive() and time.monotonic() < deadline and not hurry():
        time.sleep(0.02)
    _signal_groups(pgids, signal.SIGKILL)  # also the ranks' own children left in the groups


def _signal_groups(pgids: Iterable[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
