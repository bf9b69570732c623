"""What the ranks of a torch world ask its store after set-up: each rank's place on its node, and
which peers are stuck where when a call times out (the diagnosis). Every query is bounded."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from typing import Any

from ._base import DiagnosisUnavailable

__all__ = ["diagnose", "get_all", "node_ranks_from_store"]


def node_ranks_from_store(store: Any, rank: int, size: int, timeout: float) -> tuple[int, int]:
    """(local rank, local size) for a process group the user made: the launcher's, else counted
    from the hosts the ranks write to the group's store (one node when there is no store)."""
    local, count = os.environ.get("LOCAL_RANK", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and count.isdigit():
        return int(local), int(count)
    if store is None:  # only with a user's process group on an old torch: assume one node
        return rank, size
    me = socket.gethostname()
    keys = [f"phalanx/host/{r}" for r in range(size)]
    store.set(keys[rank], me)
    store.wait(keys, timedelta(seconds=timeout))
    here = [r for r, h in enumerate(get_all(store, keys)) if h.decode() == me]
    return here.index(rank), len(here)


def diagnose(store: Any, prefix: str, rank: int, size: int, call: str, index: int,
             grace: float) -> tuple[list[int], dict[int, str]]:
    """Leave this rank's stuck call in the store; read the peers' reports for ``grace`` s.

    Every store operation is bounded by ``grace`` too: a store that cannot be
    reached (its host is gone or cut off) makes this fail fast, not hang.
    """
    if store is None:
        raise DiagnosisUnavailable("the process group was made without a store to ask")
    store.set_timeout(timedelta(seconds=max(grace, 0.1)))
    store.set(f"{prefix}stuck/{rank}", json.dumps({"call": call, "index": index}))
    reports: dict[int, dict[str, Any]] = {}
    waiting = [r for r in range(size) if r != rank]
    deadline = time.monotonic() + grace
    while waiting and time.monotonic() < deadline:
        for r in [r for r in waiting if store.check([f"{prefix}stuck/{r}"])]:
            reports[r] = json.loads(store.get(f"{prefix}stuck/{r}"))
            waiting.remove(r)
        if waiting:
            time.sleep(0.02)
    elsewhere = {r: f"{rep['call']} (call #{rep['index']})" for r, rep in reports.items()
                 if rep["call"] != call or rep["index"] != index}
    return waiting, elsewhere


def get_all(store: Any, keys: list[str]) -> list[bytes]:
    """The values of ``keys``, in their order."""
    multi_get = getattr(store, "multi_get", None)  # one round trip, where torch has it
    return multi_get(keys) if multi_get is not None else [store.get(k) for k in keys]
