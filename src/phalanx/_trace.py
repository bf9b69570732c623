"""``phalanx.start_trace``/``stop_trace``: a Chrome-trace timeline of this rank's collectives.

::

    phalanx.start_trace("trace-{rank}.json")   # every rank records its own file
    ...                                        # collectives, optimizer steps
    phalanx.stop_trace()                       # closes the file: open it in chrome://tracing or Perfetto

The same recorder serves ``hvd.start_timeline`` (:func:`open_trace`, :func:`close_trace`).
The core checks one module global, :data:`ON`, before calling a hook here, so
a job that does not trace pays one attribute lookup per collective. The hooks:

* :func:`begin` (``World.enter``) and :func:`end` (after the data phase) time a
  blocking collective, agreement included: one complete event (``"ph": "X"``)
  on the rank's ``collectives`` row, with op, dtype, shape and bytes.
* :func:`span_begin`/:func:`span_end` time a non-blocking call (``iallreduce``,
  ``ibroadcast``) from its start to the ``wait()`` that returned it.
* :func:`bucket_launch`/:func:`bucket_done` time a gradient bucket's reduction
  from its launch (during backward) to the moment the engine saw it complete;
  each bucket has its own row, so overlapping reductions stay readable.
  ``mark_cycles`` adds an instant event where each reduction cycle starts.

Events are written as they complete (the file is a stream, closed at
``stop_trace`` or at exit), in the JSON object format (``{"traceEvents": [...]}``);
``pid`` is the rank and timestamps are microseconds of wall-clock time, so the
files of several ranks of one host line up when their events are merged.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import IO, Any

from ._current import current
from ._errors import InvalidArgumentError, UsageError

__all__ = ["ON", "begin", "bucket_done", "bucket_launch", "close_trace", "end", "open_trace", "owner",
           "span_begin", "span_end", "start_trace", "stop_trace", "tracing"]

ON = False  # the one global the core checks: True while a trace is being recorded in this process

_BYTES = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "float16": 2, "bfloat16": 2, "int32": 4,
          "float32": 4, "int64": 8, "float64": 8}
_COLLECTIVES, _NONBLOCKING, _BUCKETS = 0, 100, 200  # thread-id ranges of the rows


class _Tracer:
    """One open trace file and the calls in flight (by world, by handle, by bucket)."""

    def __init__(self, path: str, rank: int, mark_cycles: bool, owner: str) -> None:
        self.path, self.rank, self.mark_cycles, self.owner = path, rank, mark_cycles, owner
        self.lock = threading.Lock()
        self.file: IO[str] | None = open(path, "w", buffering=1 << 16)  # noqa: SIM115 - closed by close()
        self.file.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        self.offset = time.time_ns() / 1000 - time.perf_counter_ns() / 1000
        self.open: dict[int, tuple[float, str, dict[str, Any]]] = {}  # id(world) -> blocking call
        self.spans: dict[int, tuple[float, str, dict[str, Any], int]] = {}  # id(handle/bucket) -> span
        self.rows: dict[int, str] = {_COLLECTIVES: "collectives"}
        self.bucket_rows: dict[tuple[str, int], int] = {}
        self.events = 0

    def now(self) -> float:
        return time.perf_counter_ns() / 1000 + self.offset

    def emit(self, event: dict[str, Any]) -> None:
        event["pid"] = self.rank
        line = json.dumps(event, separators=(",", ":")) + ",\n"
        with self.lock:
            if self.file is not None:
                self.file.write(line)
                self.events += 1

    def complete(self, name: str, row: int, start: float, args: dict[str, Any], cat: str) -> None:
        self.emit({"name": name, "cat": cat, "ph": "X", "ts": round(start, 3),
                   "dur": round(max(self.now() - start, 0.0), 3), "tid": row, "args": args})

    def free_row(self) -> int:
        busy = {s[3] for s in self.spans.values()}
        row = _NONBLOCKING
        while row in busy:
            row += 1
        self.rows.setdefault(row, f"non-blocking {row - _NONBLOCKING}")
        return row

    def close(self) -> None:
        with self.lock:
            if self.file is None:
                return
            meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}},
                    {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
                     "args": {"sort_index": self.rank}}]
            meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": row, "args": {"name": name}}
                     for row, name in sorted(self.rows.items())]
            self.file.write(",\n".join(json.dumps(m, separators=(",", ":")) for m in meta) + "\n]}\n")
            self.file.close()
            self.file = None


_TRACER: _Tracer | None = None


def _describe(buf: Any, op: str | None, root: int) -> dict[str, Any]:
    args: dict[str, Any] = {}
    if buf is not None:
        shape = list(buf.shape)
        numel = 1
        for d in shape:
            numel *= d
        args.update(dtype=buf.dtype, shape=shape, bytes=numel * _BYTES.get(buf.dtype, 0))
    if op:
        args["op"] = op
    if root >= 0:
        args["root"] = root
    return args


def _group(world: Any, args: dict[str, Any]) -> dict[str, Any]:
    ranks = getattr(world, "ranks", None)  # a sub-world (phalanx.new_group) names its world ranks
    if ranks is not None:
        args["group"] = list(ranks)
    return args


# -- hooks the core calls (only when ON) ----------------------------------------------------------
def begin(world: Any, call: str, buf: Any, op: str | None, root: int) -> None:
    """``World.enter``: a collective starts on ``world`` (its agreement, then its data phase)."""
    tracer = _TRACER
    if tracer is not None:
        tracer.open[id(world)] = (tracer.now(), call, _group(world, _describe(buf, op, root)))


def end(world: Any) -> None:
    """A blocking collective's data phase returned on ``world``: emit its event."""
    tracer = _TRACER
    if tracer is not None:
        started = tracer.open.pop(id(world), None)
        if started is not None:
            tracer.complete(started[1], _COLLECTIVES, started[0], started[2], "collective")


def span_begin(key: object, call: str, buf: Any, op: str | None, root: int) -> None:
    """A non-blocking call (its handle ``key``) starts."""
    tracer = _TRACER
    if tracer is not None:
        with tracer.lock:
            row = tracer.free_row()
            tracer.spans[id(key)] = (tracer.now(), call, _describe(buf, op, root), row)


def span_end(key: object) -> None:
    """The non-blocking call of handle ``key`` completed (its ``wait()`` returned)."""
    tracer = _TRACER
    if tracer is not None:
        span = tracer.spans.pop(id(key), None)
        if span is not None:
            tracer.complete(span[1], span[3], span[0], span[2], "non-blocking")


def bucket_launch(bucket: object, call: str, index: int, data: Any, params: int) -> None:
    """The gradient engine ``call`` launched bucket ``index`` (``data``: the tensor sent)."""
    tracer = _TRACER
    if tracer is None:
        return
    key = (call, index)
    row = tracer.bucket_rows.get(key)
    if row is None:
        row = tracer.bucket_rows[key] = _BUCKETS + len(tracer.bucket_rows)
        tracer.rows[row] = f"{call} bucket {index}"
    start = tracer.now()
    if index == 0 and tracer.mark_cycles:
        tracer.emit({"name": "CYCLE_START", "cat": "cycle", "ph": "i", "s": "p", "ts": round(start, 3),
                     "tid": row})
    dtype = str(data.dtype).replace("torch.", "")
    args = {"bucket": index, "params": params, "dtype": dtype, "numel": int(data.numel()),
            "bytes": int(data.numel()) * int(data.element_size()), "op": "sum"}
    tracer.spans[id(bucket)] = (start, f"{call} bucket {index}", args, row)


def bucket_done(bucket: object) -> None:
    """The engine saw ``bucket``'s reduction complete (a test or its wait); later calls do nothing."""
    tracer = _TRACER
    if tracer is not None:
        span = tracer.spans.pop(id(bucket), None)
        if span is not None:
            tracer.complete(span[1], span[3], span[0], span[2], "gradient bucket")


# -- starting and stopping ---------------------------------------------------------------------
def tracing() -> str | None:
    """The path of the trace being recorded in this process, or None."""
    return _TRACER.path if _TRACER is not None else None


def owner() -> str | None:
    """Who started the trace being recorded (``"phalanx.start_trace"``, ``"hvd.start_timeline"``, ...), or None."""
    return _TRACER.owner if _TRACER is not None else None


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
    rank: int = current("start_trace").rank
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


def open_trace(path: str, rank: int, *, mark_cycles: bool = False, owner: str = "phalanx.start_trace") -> None:
    """Start recording into ``path`` (for :func:`start_trace` and ``hvd.start_timeline``)."""
    global ON, _TRACER
    if _TRACER is not None:
        raise UsageError(f"{owner}({path!r}): a trace is already being recorded into {_TRACER.path!r} "
                         f"(started by {_TRACER.owner}); stop it first (phalanx.stop_trace()).")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise InvalidArgumentError(f"{owner}({path!r}): the directory {directory!r} does not exist; create "
                                   "it first or give a path in an existing directory.")
    _TRACER = _Tracer(path, rank, mark_cycles, owner)
    ON = True


def close_trace() -> str | None:
    """Stop recording and close the file; its path, or None when nothing was being recorded."""
    global ON, _TRACER
    tracer, _TRACER = _TRACER, None
    ON = False
    if tracer is None:
        return None
    tracer.close()
    return tracer.path


atexit.register(close_trace)  # a job that never calls stop_trace (or fails) still gets a whole file
