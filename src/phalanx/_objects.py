"""Collectives of picklable Python objects (``broadcast_object``, ``allgather_object``): opt-in,
since unpickling what a peer sent can run code; arrays and scalars use :mod:`phalanx._collectives`."""

from __future__ import annotations

import pickle
from typing import Any

from ._collectives import _check_root, _run
from ._errors import UsageError
from ._groups import Group, world_for
from ._settings import settings

__all__ = ["allgather_object", "broadcast_object"]


def _require_pickle(call: str, allow_pickle: bool) -> None:
    if not (allow_pickle or settings.allow_pickle):
        raise UsageError(
            f"phalanx.{call} unpickles data sent by other ranks, which can run arbitrary code if a "
            "peer is not trusted. Opt in with `allow_pickle=True` (or PHALANX_ALLOW_PICKLE=1); for "
            "arrays and scalars use the array collectives, which never unpickle."
        )


def broadcast_object(obj: Any, root: int = 0, *, allow_pickle: bool = False, group: Group | None = None) -> Any:
    """Root's picklable ``obj`` on every rank (a copy made by unpickling, off the root).

    Arguments: ``obj`` (any picklable object; only root's is used), ``root`` (the
    sending rank), ``allow_pickle`` (must be True, or ``PHALANX_ALLOW_PICKLE=1``:
    unpickling what a peer sent can run code, so this is opt-in; arrays and
    scalars need no pickle, use :func:`broadcast`).

    ``group``: a :class:`Group` from :func:`new_group` runs the call among its members
    only (ranks and roots are group ranks); None (default) is the whole world; a rank
    outside the group gets NotInGroupError.

    Returns root's object. Raises UsageError without the opt-in,
    InvalidArgumentError for a bad root, CollectiveTimeoutError, RankFailedError.
    """
    _require_pickle("broadcast_object", allow_pickle)
    world = world_for(group, "broadcast_object")
    _check_root("broadcast_object", root, world)
    world.enter("broadcast_object", None, None, root)
    payload = pickle.dumps(obj) if world.rank == root else None
    data = _run(world, "broadcast_object", world.backend.broadcast_bytes, payload, root)
    return obj if world.rank == root else pickle.loads(data)  # noqa: S301 - opt-in, documented


def allgather_object(obj: Any, *, allow_pickle: bool = False, group: Group | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, as a list in rank order.

    Arguments: ``obj`` (any picklable object, may differ in size between ranks),
    ``allow_pickle`` (must be True, or ``PHALANX_ALLOW_PICKLE=1``: unpickling what a
    peer sent can run code, so this is opt-in).

    ``group``: a :class:`Group` from :func:`new_group` runs the call among its members
    only (ranks and roots are group ranks); None (default) is the whole world; a rank
    outside the group gets NotInGroupError.

    Returns a list of ``size()`` objects. Raises UsageError without the opt-in,
    CollectiveTimeoutError, RankFailedError.
    """
    _require_pickle("allgather_object", allow_pickle)
    world = world_for(group, "allgather_object")
    world.enter("allgather_object", None)
    parts = _run(world, "allgather_object", world.backend.allgather_bytes, pickle.dumps(obj))
    return [pickle.loads(p) for p in parts]  # noqa: S301 - opt-in, documented
