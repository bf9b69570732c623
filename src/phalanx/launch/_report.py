"""The failure report: which rank failed first, how, and its traceback.

Ranks leave ``failure-rank<r>.json`` in the job directory when they raise
(:func:`phalanx._failure.record_failure`; read by :mod:`._jobdir`). A rank killed by a signal leaves
nothing; the launcher then knows only when it saw it die. The first failure
is the earliest of both, except that errors which only *echo* another rank's
death (a peer lost, a broken world) count only when nothing else explains the job's end.
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ._procs import signal_name

__all__ = ["ECHOES", "Death", "describe_exit", "earliest", "failure_report", "first_failure"]

T = TypeVar("T")

# Errors a rank raises because *another* rank failed: never the root cause when one is known.
ECHOES = ("RankFailedError", "WorldBrokenError", "DistBackendError")


@dataclass
class Death:
    """How one rank ended, as far as the launcher knows."""

    code: int | None = None  # exit status (negative: killed by that signal); None if unknown
    at: float | None = None  # time.time() when the launcher noticed
    by_launcher: bool = False  # the launcher stopped it after the first failure
    host: str | None = None  # where it ran, when known (mpiexec names it for ranks on other hosts)
    notes: list[str] = field(default_factory=list)

_GLOO_ABORT = re.compile(rb"what\(\):\s*(\[enforce fail at [^\]]*\]\s*)?([^\n]*)")


def aborted_by_gloo(deaths: dict[int, Death], tails: dict[int, bytearray]) -> None:
    """Note on the rank reported first what gloo said when it aborted a rank (SIGABRT after a C++
    ``terminate``, found in the rank's last output), and what it usually means."""
    aborted = [(rank, m) for rank, death in sorted(deaths.items()) if death.code == -signal.SIGABRT
               and (m := list(_GLOO_ABORT.finditer(bytes(tails.get(rank, b"")))))]
    if not aborted:
        return
    rank, found = aborted[0]
    said = found[-1].group(2).decode(errors="replace").strip()
    meaning = ("the ranks made different collective calls (one skipped a backward or a collective, or "
               "reduced a tensor of another size): phalanx's own calls are checked, torch.distributed's "
               "called directly are not" if "preamble.length" in said or "mismatch" in said else
               "gloo stopped the rank on an internal check")
    note = f"gloo aborted rank {rank}: {said} That usually means {meaning}."
    for death in deaths.values():
        death.notes.append(note)


def describe_exit(code: int) -> str:
    return f"killed by signal {-code} ({signal_name(-code)})" if code < 0 else f"exit code {code}"


def first_failure(records: dict[int, dict[str, Any]], deaths: dict[int, Death]) -> int | None:
    """The rank whose failure came first (see module docstring), or None."""
    failures: list[tuple[int, str | None, float | None]] = []
    for rank in sorted(set(records) | set(deaths)):
        if rank in records:
            failures.append((rank, records[rank].get("type"), float(records[rank].get("time", 0))))
        elif deaths[rank].code not in (None, 0) and not deaths[rank].by_launcher:
            failures.append((rank, None, deaths[rank].at))
    return earliest(failures)


def earliest(failures: Iterable[tuple[T, str | None, float | None]]) -> T | None:
    """Who failed first among ``failures`` (``(who, error type or None, time or None)``), or None.

    An error of one's own comes before any that only echoes another's death (:data:`ECHOES`);
    then the earliest time wins (an unknown time counts last), then the first in ``failures``.
    """
    found = list(failures)
    ranked = [(kind in ECHOES, math.inf if at is None else at, i) for i, (_, kind, at) in enumerate(found)]
    return found[min(ranked)[2]][0] if ranked else None


def failure_report(first: int | None, start: float, records: dict[int, dict[str, Any]],
                   deaths: dict[int, Death], stopper: str = "the launcher", others: str = "",
                   name_hosts: bool = False) -> str:
    """The text printed to stderr when a job fails.

    ``stopper`` names who ended the ranks that were still running; ``others`` adds a note
    about them (e.g. mpiexec's exit status); ``name_hosts``: say which host the first failing
    rank ran on (a job across hosts), where its record or mpiexec tells.
    """
    record = records.get(first) if first is not None else None
    death = deaths.get(first, Death()) if first is not None else Death()
    own_exit = death.code not in (None, 0) and not death.by_launcher
    when = float(record["time"]) if record else death.at
    after = f" after {when - start:.1f} s" if when else ""
    host = (record or {}).get("host") or death.host if name_hosts else None
    on = f" on {host}" if host else ""
    if first is None:
        lines = ["phalanx run: the job failed, but no rank reported an error or was seen to die."]
    elif record:
        how = f" ({describe_exit(death.code)})" if own_exit and death.code is not None else ""
        lines = [f"phalanx run: rank {first}{on} failed first{how}{after}: {record['type']}: {record['message']}",
                 record["traceback"].rstrip("\n")]
    else:
        how = describe_exit(death.code) if death.code is not None else "it ended"
        lines = [f"phalanx run: rank {first}{on} failed first{after}: {how}, without a Python traceback"
                 + (" (sys.exit or os._exit)." if (death.code or 0) > 0 else ".")]
        if death.code == -signal.SIGKILL:
            lines.append("A SIGKILL that nobody sent usually comes from the out-of-memory killer: check `dmesg`.")
    lines += death.notes

    rest, stopped = [], []
    for rank in sorted(set(records) | set(deaths)):
        other, end = records.get(rank), deaths.get(rank)
        if rank == first:
            continue
        if other:
            message = (other.get("message") or "").splitlines()
            rest.append(f"rank {rank} raised {other['type']}" + (f": {message[0]}" if message else ""))
        elif end and end.by_launcher:
            stopped.append(rank)
        elif end and end.code is not None:
            rest.append(f"rank {rank} " + ("had finished" if end.code == 0 else describe_exit(end.code)))
    if stopped:
        rest.append(f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} stopped by {stopper}")
    if others:
        rest.append(others)
    if rest:
        lines.append(f"(other ranks: {'; '.join(rest)})")
    return "\n".join(lines)
