"""What ranks say when a call's agreement fails: the mismatch, shutdown and timeout errors.

On a mismatch every rank reaches here together (the agreement failed on every
rank alike), exchanges a JSON description of its call, and builds the same
message from the same descriptions, so every rank raises the same error. On a
timeout the backend's diagnosis says where the peers are, within a deadline of
its own: a peer (or the store) that cannot answer must not delay the error.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

from ._errors import CollectiveMismatchError, CollectiveTimeoutError, RankFailedError
from .comm._base import Backend

__all__ = ["call_site", "diagnose", "mismatch_error", "timeout_error", "where"]

DIAGNOSIS_SLACK_S = 1.0  # on top of the grace: a diagnosis that takes longer is abandoned

_HINTS = {
    "step": "Ranks are at different steps: a rank whose step is ahead skipped a collective of an "
            "earlier step (or the others repeated one). Every rank must make the same collective "
            "calls in every step.",
    "call": "Ranks made different collective calls: every rank must make the same collective "
            "calls in the same order. A rank that skips a call (e.g. inside `if rank == 0:`) "
            "pairs its next call with the others' current one.",
    "buffer": "Every rank must pass a buffer of the same shape and dtype. Pad or cast on the "
              "ranks that differ (e.g. `x.astype(np.float32)`), or use allgather_object for "
              "ragged data.",
    "op": "Every rank must pass the same `op`.",
    "root": "Every rank must pass the same `root`.",
    "site": "Ranks reached this collective from different lines of code (debug mode): the "
            "calls are out of order on some rank.",
    "index": "Ranks have made a different number of collective calls so far.",
}


def call_site() -> str:
    """file:line of the first frame outside phalanx (debug mode only: walking frames costs)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("phalanx."):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def where(entry: dict[str, Any]) -> str:
    """``allreduce (call #3, step 7)``: where a rank is, from its description."""
    step = f", step {entry['step']}" if entry.get("step") is not None else ""
    return f"{entry['call']} (call #{entry['index']}{step})"


def _positions(entries: list[dict[str, Any]]) -> str:
    """One line per distinct position: which ranks are at which call (and step)."""
    groups: dict[str, list[int]] = {}
    for r, e in enumerate(entries):
        groups.setdefault(where(e), []).append(r)
    parts = [f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)} at {place}" for place, ranks in groups.items()]
    return "Where each rank is: " + "; ".join(parts) + "."


def _ranks(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else str(ranks)


def mismatch_error(call: str, rank: int, entries: list[dict[str, Any]]) -> Exception:
    """The error every rank raises when the ranks' calls differ (``entries``: every rank's description).

    A :class:`RankFailedError` when some rank is in ``phalanx.shutdown()`` and this
    one is not (that rank is leaving the world); else a :class:`CollectiveMismatchError`
    naming the field that differs and where every rank is.
    """
    leaving = [r for r, e in enumerate(entries) if e["call"] == "shutdown"]
    if leaving and entries[rank]["call"] != "shutdown":
        return RankFailedError(
            f"phalanx.{call} (call #{entries[rank]['index']} on rank {rank}): rank{'s' if len(leaving) > 1 else ''} "
            f"{_ranks(leaving)} called phalanx.shutdown() instead, so this call can never complete. "
            f"{_positions(entries)} Every rank must make the same collective calls before shutdown(); "
            "this world cannot be used any more.")
    lines = []
    for r, e in enumerate(entries):
        args = ", ".join(f"{k}={e[k]!r}" if k != "buffer" else e[k]
                         for k in ("buffer", "op", "root", "step") if e.get(k) is not None)
        site = f" at {e['site']}" if "site" in e else ""
        lines.append(f"  rank {r}: {e['call']}({args}) [call #{e['index']}]{site}")
    field = next((k for k in ("step", "call", "buffer", "op", "root", "site", "index")
                  if len({json.dumps(e.get(k)) for e in entries}) > 1), "index")
    return CollectiveMismatchError(
        f"phalanx.{call}: the ranks' calls do not match ({field} differs), so nothing was sent:\n"
        + "\n".join(lines) + f"\n{_positions(entries)}\n{_HINTS[field]}")


def diagnose(backend: Backend, call: str, index: int, grace: float) -> tuple[list[int], dict[int, str], str]:
    """``(missing ranks, {rank: where it waits}, note)`` from ``backend.diagnose``, which runs in a
    thread abandoned after ``grace`` + 1 s (the note then says so)."""
    outcome: list[Any] = []

    def ask() -> None:
        try:
            outcome.append(backend.diagnose(call, index, grace))
        except Exception as exc:  # noqa: BLE001 - diagnosis is best effort
            outcome.append(exc)

    thread = threading.Thread(target=ask, name="phalanx-diagnose", daemon=True)
    thread.start()
    thread.join(grace + DIAGNOSIS_SLACK_S)
    if not outcome:
        return [], {}, f" (the peers did not answer within {grace + DIAGNOSIS_SLACK_S:g} s)"
    if isinstance(outcome[0], Exception):
        return [], {}, f" (could not ask the peers: {outcome[0]})"
    missing, elsewhere = outcome[0]
    return missing, elsewhere, ""


def timeout_error(backend: Backend, call: str, index: int, timeout: float) -> CollectiveTimeoutError:
    """The error for call ``index`` (``call``) that waited ``timeout`` s, with the diagnosis."""
    grace = min(2.0, max(0.5, timeout / 4))
    missing, elsewhere, note = diagnose(backend, call, index, grace)
    parts = [f"phalanx.{call} (call #{index} on rank {backend.rank}) timed out after "
             f"{timeout:g} s waiting for the other ranks{note}."]
    if missing:
        parts.append(f"Ranks that never reached a phalanx call: {missing} (stuck computing, "
                     "waiting in non-phalanx code, finished early, or cut off: a lost host or link).")
    for r, place in sorted(elsewhere.items()):
        parts.append(f"Rank {r} is waiting in {place} instead.")
    parts.append("Every rank must make the same collective calls in the same order. If the wait "
                 "is legitimate (e.g. rank 0 evaluates alone), raise the limit with "
                 "`phalanx.init(timeout=...)` or PHALANX_TIMEOUT. This world cannot be used "
                 "after a timeout.")
    return CollectiveTimeoutError(" ".join(parts), missing_ranks=missing, elsewhere=elsewhere)
