"""Horovod's timeline: ``hvd.start_timeline``/``hvd.stop_timeline`` and ``HOROVOD_TIMELINE``.

::

    hvd.start_timeline("/tmp/timeline.json")   # on every rank: rank 0 records, as in Horovod
    ...
    hvd.stop_timeline()

    HOROVOD_TIMELINE=/tmp/timeline.json phalanx run -np 2 train.py   # from the start to the end

As in Horovod, only rank 0 writes the file. It is phalanx's trace
(:func:`phalanx.start_trace`): a Chrome-trace JSON with one event per
collective, non-blocking call and gradient-bucket reduction as rank 0 saw it
(start, duration including the wait for the other ranks, op, dtype, shape,
bytes), viewable in ``chrome://tracing`` or Perfetto. Horovod's negotiation
ticks per worker have no counterpart: phalanx agrees on each call in one
small allreduce. ``mark_cycles`` (``HOROVOD_TIMELINE_MARK_CYCLES=1``) marks
where each gradient-reduction cycle starts. ``HOROVOD_TIMELINE=DYNAMIC``
records nothing until ``start_timeline``, as in Horovod (which requires it
before ``start_timeline``; phalanx does not).
"""

from __future__ import annotations

import os

from ... import _trace
from ..._failure import env_rank
from ..._world import current_or_none
from .._errors import HorovodNotInitializedError

__all__ = ["start_timeline", "stop_timeline"]

_OWNERS = ("hvd.start_timeline", "HOROVOD_TIMELINE")


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording the timeline of phalanx's collectives into ``file_path`` (on rank 0 only).

    Call it on every rank, as Horovod scripts do: rank 0 writes a Chrome-trace
    JSON (one event per collective, non-blocking call and gradient-bucket
    reduction, with op, dtype, shape, bytes, start and duration), the others do
    nothing. A timeline already being recorded is closed first.

    Arguments:
        file_path: the JSON file to write (its directory must exist).
        mark_cycles: also mark where each gradient-reduction cycle starts.

    Returns None. Raises HorovodNotInitializedError (a ValueError) before
    ``hvd.init()``, InvalidArgumentError when the directory does not exist,
    UsageError while ``phalanx.start_trace`` records.
    """
    world = current_or_none()
    if world is None:
        raise HorovodNotInitializedError("start_timeline")
    if world.rank != 0:
        return
    if _trace.owner() in _OWNERS:
        _trace.close_trace()
    _trace.open_trace(os.fspath(file_path), 0, mark_cycles=bool(mark_cycles), owner="hvd.start_timeline")


def stop_timeline() -> None:
    """Stop recording the timeline and close its file (rank 0; elsewhere nothing happens).

    A timeline never stopped is closed when the process exits. Returns None.
    Raises HorovodNotInitializedError (a ValueError) before ``hvd.init()``.
    """
    if current_or_none() is None:
        raise HorovodNotInitializedError("stop_timeline")
    if _trace.owner() in _OWNERS:
        _trace.close_trace()


def start_from_env() -> None:
    """``HOROVOD_TIMELINE=path``: rank 0 records from now until exit (or ``stop_timeline``).

    Called when ``phalanx.horovod.torch`` is imported (and may be again by ``hvd.init``:
    a second call does nothing). The rank comes from the launcher's environment.
    """
    path = os.environ.get("HOROVOD_TIMELINE", "").strip()
    if not path or path == "DYNAMIC" or env_rank() != 0 or _trace.tracing() is not None:
        return
    mark = os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "").strip().lower() in ("1", "true", "yes", "on")
    _trace.open_trace(path, 0, mark_cycles=mark, owner="HOROVOD_TIMELINE")


start_from_env()
