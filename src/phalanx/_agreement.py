"""The agreement of the ranks on a call, and what they say when it fails: mismatch, shutdown, timeout.

:func:`agree` is the one agreement every check that is not a collective's own
fingerprint uses (``synchronize``'s structure, the gradient wrappers' and the
JAX reduction's structure, ``new_group``): a hash of a JSON value, one small
allreduce (``Backend.agree``), and on a mismatch one exchange of descriptions,
from which :func:`first_difference` names the first entry that differs.

On a mismatch every rank reaches here together (the agreement failed on every
rank alike), exchanges a JSON description of its call, and builds the same
message from the same descriptions, so every rank raises the same error. On a
timeout the backend's diagnosis says where the peers are, within a deadline of
its own: a peer (or the store) that cannot answer must not delay the error.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import zlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ._errors import CollectiveMismatchError, CollectiveTimeoutError, RankFailedError
from .comm._base import OPS, Backend

__all__ = ["MASK", "agree", "call_site", "diagnose", "first_difference", "mismatch_error", "timeout_error",
           "where"]

MASK = (1 << 62) - 1
"""Signatures are 62-bit: a signature and its negation both fit in an int64 (``Backend.agree``)."""

# Collective codes in fingerprints (and names in messages).
CALLS = ("allreduce", "broadcast", "reduce", "allgather", "gather", "reduce_scatter", "alltoall",
         "barrier", "iallreduce", "ibroadcast", "broadcast_object", "allgather_object", "shutdown",
         # the gradient engine's step agreements (phalanx.torch, check_steps)
         "torch.DistributedOptimizer", "torch.DistributedOptimizer.step", "torch.DataParallel",
         "new_group", "destroy_group", "horovod.torch.DistributedOptimizer", "split_group")
CALL_CODES = {name: i for i, name in enumerate(CALLS)}
OP_CODES = {name: i for i, name in enumerate(OPS)}

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


def fingerprint(call: str, buf: Any, op: str | None, root: int, step: int | None, debug: bool) -> int:
    """The 62-bit signature the ranks agree on before a collective moves data: the call, op and root,
    the buffer's dtype code and shape, the step label, and in debug mode the caller's line."""
    # Codes, not names: str hashes are salted per process, ints and tuples of ints are not.
    key: tuple[Any, ...] = (CALL_CODES[call], OP_CODES[op] if op else -1, root)
    if buf is not None:
        key += (buf.code, buf.shape)
    if step is not None:
        key += (-2, step)  # a marker, so a step never looks like a buffer's fields (not None: its
        # hash is its address before Python 3.12, different in every process)
    signature = hash(key)
    if debug:
        signature ^= zlib.crc32(call_site().encode()) << 20
    return signature & MASK


def describe_call(call: str, index: int, buf: Any, op: str | None, root: int, step: int | None,
                  debug: bool) -> dict[str, Any]:
    """What a rank says of its call when the fingerprints differ (JSON, exchanged on a mismatch)."""
    entry: dict[str, Any] = {"call": call, "index": index}
    if buf is not None:
        entry["buffer"] = buf.describe()
    if op:
        entry["op"] = op
    if root >= 0:
        entry["root"] = root
    if step is not None:
        entry["step"] = step
    if debug:
        entry["site"] = call_site()
    return entry


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


class Agreeing(Protocol):
    """What :func:`agree` uses of a :class:`phalanx._world.World` (or a group's)."""

    rank: int
    size: int
    calls: int
    timeout: float
    backend: Backend
    # a layer's rule on a mismatch (World.retry_mismatch): True makes this rank make its call again
    retry_mismatch: Callable[[Any, list[dict[str, Any]], bool], bool] | None

    def ready(self, call: str) -> None: ...
    def mark_broken(self, why: str) -> None: ...
    def guard(self, call: str) -> AbstractContextManager[Any]: ...
    def describe(self, call: str, buf: Any, op: str | None, root: int) -> dict[str, Any]: ...
    def allgather_json(self, call: str, value: Any) -> list[Any]: ...


def agree(world: Agreeing, call: str, value: Any, detail: Callable[[], Any] | None = None) -> list[Any] | None:
    """Whether every rank of ``world`` passed the same ``value``: None if so, else every rank's detail.

    ``value`` (JSON-able) is hashed; the ranks compare the hashes in one small
    allreduce (``Backend.agree``, the same exchange as a collective's
    fingerprint, so a rank that is in another collective meanwhile pairs with
    this one and both see a mismatch). Only on a mismatch the ranks exchange
    ``detail()`` (default: ``value``) and every rank returns the same list, in
    rank order, to build the same error from (:func:`first_difference` names
    where the ranks differ). Counts as one call of ``world``.

    Raises CollectiveMismatchError or RankFailedError when some rank is in
    another collective call (or in ``shutdown()``), CollectiveTimeoutError when
    a rank never comes, WorldBrokenError on a broken world.
    """
    world.ready(call)
    world.calls += 1
    if world.size == 1:
        return None
    text = json.dumps([call, value], separators=(",", ":"))
    signature = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & MASK
    with world.guard(call):
        if world.backend.agree(signature, world.timeout):
            return None
    mine = {**world.describe(call, None, None, -1), "detail": value if detail is None else detail()}
    entries = world.allgather_json(call, mine)
    if any(e["call"] != call for e in entries):  # some rank is in another call: the calls' mismatch
        error = mismatch_error(call, world.rank, entries)
        if isinstance(error, RankFailedError):
            world.mark_broken(f"a peer called shutdown() during {call}")  # a group's breaks its world too
        retry = world.retry_mismatch  # a layer's rule, as in World.explain_mismatch
        if retry is not None and not isinstance(error, RankFailedError) and retry(world, entries, True):
            return agree(world, call, value, detail)  # this rank makes the call again
        raise error
    return [e["detail"] for e in entries]


def first_difference(tables: Sequence[Sequence[Any]], show: Callable[[int, Any], str], *,
                     key: Callable[[Any], Any] | None = None, compare: Callable[[Any], Any] | None = None,
                     who: str = "rank", labels: Sequence[Any] | None = None) -> tuple[Any, list[Any], str] | None:
    """Where the lists of entries in ``tables`` first differ, and one line per list showing its entry there.

    Entries are matched by position, or by name when ``key`` names each entry
    (names in order of first appearance; a list without the name has None
    there). ``compare`` picks what is compared of an entry (default: all of it).
    Returns ``(position or name, each list's entry there, lines)``, one line
    ``"  rank 1: <show(1, entry)>"`` per list (``who`` and ``labels`` replace
    "rank" and the list's index), or None when no entry differs (the lists
    may still hold the same named entries in another order).
    """
    def compared(entry: Any) -> str:
        return json.dumps(None if entry is None else entry if compare is None else compare(entry), default=repr)

    places: Sequence[Any]
    if key is None:
        places = range(max(map(len, tables), default=0))
        at: Callable[[Any], list[Any]] = lambda i: [t[i] if i < len(t) else None for t in tables]  # noqa: E731
    else:
        named = [{key(e): e for e in t} for t in tables]
        places = list(dict.fromkeys(key(e) for t in tables for e in t))
        at = lambda name: [n.get(name) for n in named]  # noqa: E731
    for place in places:
        found = at(place)
        if len({compared(e) for e in found}) > 1:
            names = range(len(tables)) if labels is None else labels
            return place, found, "\n".join(f"  {who} {name}: {show(r, e)}"
                                           for r, (name, e) in enumerate(zip(names, found, strict=True)))
    return None


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


def timeout_error(backend: Backend, call: str, index: int, timeout: float,
                  members: Sequence[int] | None = None) -> CollectiveTimeoutError:
    """The error for call ``index`` (``call``) that waited ``timeout`` s, with the diagnosis.

    ``members``: on a group's backend, the world ranks of the group: the error
    then speaks of the group and names each member by group and world rank
    (and ``missing_ranks``/``elsewhere`` hold world ranks).
    """
    grace = min(2.0, max(0.5, timeout / 4))
    missing, elsewhere, note = diagnose(backend, call, index, grace)
    world = list(range(backend.size)) if members is None else list(members)  # rank -> world rank
    if members is None:
        scope, me, peers, they = "", f"on rank {backend.rank}", "ranks", "Ranks"
        named, busy, every = str(missing), "", "Every rank must make the same collective calls"
        ended = "This world cannot be used after a timeout."
    else:
        scope, peers, they = f" in group {world}", "members", "Members"
        me = f"of the group, on world rank {world[backend.rank]} = group rank {backend.rank}"
        named = (f"group ranks {missing} (world rank{'s' if len(missing) > 1 else ''} "
                 f"{', '.join(str(world[m]) for m in missing)})")
        busy = " or a collective of the world or another group"
        every = "Every member must make the same collective calls on the group"
        ended = "This group and its world cannot be used after a timeout."
    parts = [f"phalanx.{call}{scope} (call #{index} {me}) timed out after {timeout:g} s waiting for "
             f"the other {peers}{note}."]
    if missing:
        parts.append(f"{they} that never reached a phalanx call{' on this group' if scope else ''}: {named} "
                     f"(stuck computing, waiting in non-phalanx code{busy}, finished early, or cut off: a "
                     "lost host or link).")
    for r, place in sorted(elsewhere.items()):
        who = f"Rank {r}" if members is None else f"Group rank {r} (world rank {world[r]})"
        parts.append(f"{who} is waiting in {place}{' on this group' if scope else ''} instead.")
    parts.append(f"{every} in the same order. If the wait is legitimate (e.g. rank 0 evaluates alone), "
                 f"raise the limit with `phalanx.init(timeout=...)` or PHALANX_TIMEOUT. {ended}")
    return CollectiveTimeoutError(" ".join(parts), missing_ranks=[world[m] for m in missing],
                                  elsewhere={world[r]: p for r, p in elsewhere.items()})
