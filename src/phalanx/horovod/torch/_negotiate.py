"""Horovod's name matching: asynchronous ``hvd`` operations run once every rank has submitted them.

An ``hvd`` ``*_async`` call (and ``barrier``) does not communicate: it queues an
:class:`Entry` under its name (or an automatic ``<call>.noname.<n>``, the n-th
unnamed such call of this rank on that process set). Whoever waits on an entry
(``synchronize``, ``barrier``) runs *negotiation rounds* on the entry's process
set until it is done. A round is two phalanx allgathers labelled
:data:`ROUND_STEP` (how many entries each rank has queued, then their names'
64-bit hashes); the names every rank has queued are then run, on every rank, in
the order the set's first rank queued them. Every rank sees the same gathered
lists, so every rank runs the same operations in the same order after the same
round: phalanx's order-matched core underneath is never fed diverging calls.

So submission order may differ between ranks, and an operation that one rank
never submits blocks nobody: the others' rounds simply never pick it. A rank
that waits on such an entry keeps running rounds with whoever else runs rounds;
past ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (60 s) it warns, naming the entry,
and past phalanx's timeout it raises CollectiveTimeoutError, leaving the world
usable (no collective was left half done). ``poll`` never communicates: it says
whether the entry has run. While ranks are joined (``hvd.join``), rounds are
replaced by running the queued entries in this rank's submission order through
the join exchange, as Horovod supports only allreduce then.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

import phalanx

from ..._errors import CollectiveMismatchError, CollectiveTimeoutError
from . import _impl, _join
from ._basics import _on_shutdown, _world
from ._process_sets import ProcessSet, global_process_set, set_group, set_size

__all__: list[str] = []

ROUND_STEP = 0x4E45474F  # "NEGO": the step label of negotiation rounds (named in the mismatches they meet)


class Entry:
    """One queued operation: its name, process set, how to run it, and, once run, its result or error."""

    __slots__ = ("key", "ps", "run", "result", "error", "done", "since", "warned", "name")

    def __init__(self, key: str, name: Any, ps: ProcessSet, run: Callable[[], Any]) -> None:
        self.key, self.name, self.ps, self.run = key, name, ps, run
        self.result: Any = None
        self.error: BaseException | None = None
        self.done, self.warned, self.since = False, False, time.monotonic()


_queues: dict[int, list[Entry]] = {}
_counters: dict[tuple[str, int], itertools.count[int]] = {}


def _drop_all() -> None:
    _queues.clear()
    _counters.clear()


_on_shutdown.append(_drop_all)


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 2


def _execute(entry: Entry) -> None:
    try:
        entry.result = entry.run()
    except Exception as exc:  # noqa: BLE001  # kept for synchronize(), which raises it
        entry.error = exc
    entry.done = True
    _impl.names_in_flight.discard(entry.name)


def submit(call: str, name: Any, ps: ProcessSet, run: Callable[[], Any]) -> Entry:
    """Queue ``run`` under ``name`` (None: this rank's next automatic name for ``call``); returns the entry."""
    if name is None:
        counter = _counters.setdefault((call, id(ps)), itertools.count())
        key = f"{call}.noname.{next(counter)}"
    else:
        key = f"name:{name}"
    entry = Entry(key, name, ps, run)
    if name is not None:
        _impl.names_in_flight.add(name)
    _queues.setdefault(id(ps), []).append(entry)
    return entry


def _run_local_order(queue: list[Entry]) -> None:
    """While ranks are joined: this rank's entries in submission order (the join exchange matches them)."""
    while queue:
        _execute(queue.pop(0))


def _stall_warnings(queue: list[Entry]) -> None:
    limit = float(os.environ.get("HOROVOD_STALL_CHECK_TIME_SECONDS", "60"))
    now = time.monotonic()
    for entry in queue:
        if not entry.warned and now - entry.since > limit:
            entry.warned = True
            warnings.warn(f"hvd: operation {entry.key!r} was submitted {now - entry.since:.0f} s ago on this rank "
                          "and some ranks of its process set have not submitted it yet (Horovod's stall warning).",
                          RuntimeWarning, stacklevel=3)


def negotiate(ps: ProcessSet, call: str) -> None:
    """One round on ``ps``: run, in an order every rank agrees on, the entries every rank has queued."""
    queue = _queues.setdefault(id(ps), [])
    if set_size(ps) == 1 or ps is global_process_set and _join.in_join_mode():
        _run_local_order(queue)
        return
    group = set_group(ps, call)
    hashes = np.array([_hash(e.key) for e in queue], dtype=np.int64)
    try:
        counts = np.asarray(phalanx.allgather(np.array([len(hashes)], dtype=np.int64), step=ROUND_STEP,
                                              group=group)).reshape(-1)
    except CollectiveMismatchError as exc:
        if ps is global_process_set and _join.is_join_mismatch(exc):
            _run_local_order(queue)
            return
        raise
    top = int(counts.max())
    if top == 0:
        return
    padded = np.full(top, -1, dtype=np.int64)
    padded[: len(hashes)] = hashes
    rows = np.asarray(phalanx.allgather(padded, step=ROUND_STEP, group=group)).reshape(len(counts), top)
    common = set(rows[0, : counts[0]].tolist())
    for r in range(1, len(counts)):
        common &= set(rows[r, : counts[r]].tolist())
    if not common:
        _stall_warnings(queue)
        return
    by_hash = {_hash(e.key): e for e in queue}
    for h in rows[0, : counts[0]].tolist():
        if h in common:
            entry = by_hash[h]
            queue.remove(entry)
            _execute(entry)
    _stall_warnings(queue)


def wait(entry: Entry, call: str) -> None:
    """Run rounds on the entry's process set until it has run; CollectiveTimeoutError past phalanx's timeout."""
    if entry.done:
        return
    timeout = _world(call).timeout
    deadline = time.monotonic() + timeout
    while not entry.done:
        negotiate(entry.ps, call)
        if not entry.done and time.monotonic() > deadline:
            queue = _queues.get(id(entry.ps), [])
            if entry in queue:
                queue.remove(entry)
            _impl.names_in_flight.discard(entry.name)
            raise CollectiveTimeoutError(
                f"hvd.{call}: operation {entry.key!r} was not submitted by every rank of its process set within "
                f"phalanx's timeout ({timeout:g} s); the other ranks kept negotiating without it. The world is "
                "still usable: submit the operation on every rank, or raise the timeout (PHALANX_TIMEOUT).")


def queued(ps: ProcessSet) -> list[Entry]:
    """The entries of ``ps`` this rank has queued that have not run yet."""
    return _queues.get(id(ps), [])
