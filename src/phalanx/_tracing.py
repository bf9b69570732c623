"""``phalanx.start_trace``/``stop_trace``: a Chrome-trace timeline of this rank's collectives.

::

    phalanx.start_trace("trace-{rank}.json")   # every rank records its own file
    ...                                        # collectives, optimizer steps
    phalanx.stop_trace()                       # closes the file: open it in chrome://tracing or Perfetto

The recorder and the hooks the core calls are in :mod:`._trace`.
"""

from __future__ import annotations

import os

from ._errors import InvalidArgumentError
from ._trace import close_trace, open_trace
from ._world import current

__all__ = ["start_trace", "stop_trace"]


def start_trace(path: str, *, mark_cycles: bool = False) -> str:
    """Record this rank's collectives into a Chrome-trace JSON file at ``path``, until :func:`stop_trace`.

    >>> phalanx.start_trace("trace-{rank}.json")   # on every rank: one file each

    One event per collective (name, op, dtype, shape, bytes, start, duration:
    from entering the call, agreement included, to its result), per
    non-blocking call (start to the ``wait()`` that returned it) and per
    gradient-bucket reduction of ``phalanx.torch`` (launch to completion), on
    rows per kind. Open the file in ``chrome://tracing`` or https://ui.perfetto.dev.
    Recording costs about 10 microseconds per call; not recording, one flag check (~15 ns).

    Arguments:
        path: the file to write; ``{rank}`` in it is replaced by this rank (without
            it, call this on one rank only, e.g. ``if phalanx.rank() == 0``).
        mark_cycles: also mark where each gradient-reduction cycle starts.

    Returns the path written. Raises NotInitializedError before :func:`phalanx.init`,
    UsageError when a trace is already being recorded, InvalidArgumentError when the
    directory of ``path`` does not exist.
    """
    rank = current("start_trace").rank
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"phalanx.start_trace(path={path!r}): give a file path (str), e.g. "
                                   "'trace-{rank}.json'.")
    target = os.fspath(path).replace("{rank}", str(rank))
    open_trace(target, rank, mark_cycles=bool(mark_cycles))
    return target


def stop_trace() -> str | None:
    """Stop the trace :func:`start_trace` began and close its file (also done at exit).

    Returns the path of the file written, or None when no trace was being recorded
    (calling it twice is harmless). Raises nothing.
    """
    return close_trace()
