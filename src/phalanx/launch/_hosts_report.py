"""The report of a ``phalanx run --hosts`` job that failed: the host and rank that failed first, and the rest.

The driver (:mod:`._from_one_host`) calls :func:`report` once every per-host launcher has ended;
each host's own report was relayed above it.
"""

from __future__ import annotations

import sys
from typing import Any

from ._procs import signal_name
from ._report import earliest

__all__ = ["describe_status", "report"]


def _first(remotes: list[Any]) -> Any:
    """The host that failed first: its rank's own error before any error that only echoes another's,
    earliest first; a launcher that ended without naming a rank counts from when it ended."""
    found: list[tuple[Any, str | None, float | None]] = []
    for remote in remotes:
        if remote.absorbed:  # ended in a job that went on without it
            continue
        outcome = remote.outcome or {}
        if outcome.get("rank") is not None:
            found.append((remote, outcome.get("type"), outcome.get("time")))
        elif remote.code not in (None, 0) and not outcome.get("stopped"):
            found.append((remote, None, remote.ended))
    return earliest(found)


def report(remotes: list[Any], start: float) -> int:
    """Print the line naming the host and rank that failed first (their reports are above); the exit status."""
    first = _first(remotes)
    if first is None:
        lines = ["phalanx run: the job failed on several hosts, but no host named a failing rank."]
    else:
        outcome = first.outcome or {}
        what = ": ".join(p for p in (outcome.get("type"), outcome.get("message")) if p)
        when = outcome.get("time") or first.ended
        after = f" after {when - start:.1f} s" if when else ""
        if outcome.get("rank") is not None:
            lines = [f"phalanx run: rank {outcome['rank']} on host {first.host} failed first{after}: {what} "
                     f"(host {first.host}'s report above has the details)."]
        elif outcome.get("message"):  # the per-host launcher refused the job (LaunchError)
            lines = [f"phalanx run: host {first.host} could not start its ranks: {outcome['message']}"]
        elif first.started:
            lines = [f"phalanx run: host {first.host} failed first{after}: its launcher ended with "
                     f"{describe_status(first.code)} without a report: the host, its processes or the connection to "
                     "it were lost."]
        else:  # the rsh could not start it: its own message says why
            said = f": {first.tail[-1]}" if first.tail else ""
            lines = [f"phalanx run: host {first.host} failed first{after}: the launcher could not be started "
                     f"there ({describe_status(first.code)}){said}"]
    others = [_summary(r) for r in remotes if r is not first and not r.absorbed]
    if others:
        lines.append(f"(other hosts: {'; '.join(others)}; every rank on every host was stopped)")
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()
    code = first.code if first is not None else None
    return code if code is not None and 0 < code < 256 else 1


def _summary(remote: Any) -> str:
    outcome = remote.outcome or {}
    if outcome.get("rank") is not None:
        how = f"raised {outcome['type']}" if outcome.get("type") else outcome.get("message", "failed")
        return f"{remote.host} rank {outcome['rank']} {how}"
    if outcome.get("stopped"):
        return f"{remote.host} stopped by the driver"
    return f"{remote.host} {describe_status(remote.code)}"


def describe_status(code: int | None) -> str:
    if code is None:
        return "no exit status"
    return f"exit status {code}" if code >= 0 else f"signal {signal_name(-code)}"
