"""CUDA gradient buckets through pinned host memory: a reducer wrapping another, for worlds whose
transport reduces on the host (gloo, an MPI that is not GPU-aware: ``comm/_staging.py``).

::

    engine.reducer = staged_if_needed(engine, Reducer())   # what reducer_for does; else the reducer itself

``launch`` queues the bucket's device-to-host copy on a side stream (after
the gradients on the compute stream) into the bucket's own pinned twin,
allocated once, and returns a request that posts the inner reducer's launch
on the twin once that copy's event has completed: ``test()`` polls the event,
so backward runs on while the copy and the reduction progress; ``wait``
waits for that copy only. ``complete`` lets the inner reducer complete the
twin, then queues the copy back on the compute stream, non-blocking: every
later kernel there (the optimizer's) is ordered after it, and the next
cycle's copy out waits for it (the side stream waits on the compute stream).
No ``torch.cuda.synchronize()``: the host waits only for a bucket's copy out,
just before sending it. Buckets on the CPU, padded (sharded) layouts, worlds
of one and device-reducing transports are left to the inner reducer alone.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm._staging import stages_cuda
from ._bucket_hot import Bucket
from ._engine_contract import Engine

__all__ = ["StagedReducer", "staged_if_needed"]


def staged_if_needed(engine: Engine, inner: Any) -> Any:
    """``inner`` wrapped in a :class:`StagedReducer` where the engine's world stages CUDA buckets through
    the host (more than one rank, a host-reducing transport, some CUDA bucket, no padded layout);
    else ``inner`` itself."""
    buckets = engine.buckets
    if (engine.world.size == 1 or not stages_cuda(engine.world.backend)
            or not any(b.flat.is_cuda for b in buckets) or any(b.tail is not None for b in buckets)):
        return inner
    return StagedReducer(inner, engine)


class _HostSide:
    """What the inner reducer sees: the engine's world and call, and the buckets' pinned twins (a CPU
    bucket is its own twin)."""

    __slots__ = ("buckets", "world", "call")

    def __init__(self, engine: Engine) -> None:
        self.world, self.call = engine.world, engine.call
        self.buckets = [_twin(b) if b.flat.is_cuda else b for b in engine.buckets]


def _twin(bucket: Bucket) -> Bucket:
    """A pinned host bucket laid out as ``bucket`` (its 16-bit wire's dtype when compressed)."""
    source = bucket.flat if bucket.wire is None else bucket.wire
    host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
    return Bucket(bucket.params, host, bucket.grads.numel(), None)


class StagedRequest:
    """A staged bucket in flight: its copy out (``event``), then the inner reducer's request."""

    __slots__ = ("_reducer", "index", "_event", "inner")

    def __init__(self, reducer: StagedReducer, index: int, event: Any) -> None:
        self._reducer, self.index, self._event = reducer, index, event
        self.inner: Any = None
        if event is None:
            self._post()

    def _post(self) -> None:
        reducer = self._reducer
        self.inner = reducer.inner.launch(reducer.host, self.index)

    def test(self) -> bool:
        """True once the reduction is done; posts it once the copy out has completed."""
        if self.inner is None:
            if not self._event.query():
                return False
            self._post()
        return bool(self.inner.test())

    def wait(self, timeout: float) -> Any:
        """Wait for the copy out (posting the reduction), then for the reduction within ``timeout`` s."""
        self.start()
        return self.inner.wait(timeout)

    def start(self) -> None:
        """Post the reduction now (after waiting for this bucket's copy out, only it)."""
        if self.inner is None:
            self._event.synchronize()
            self._post()


class StagedReducer:
    """The wrapper of ``inner`` (any reducer: ``launch`` / ``prepare`` / ``flush`` / ``complete``); see
    the module docstring. ``inner`` sees twins whose ``flat`` is pinned host memory."""

    def __init__(self, inner: Any, engine: Engine) -> None:
        self.inner = inner
        self.host = _HostSide(engine)
        self._side = {b.flat.device: torch.cuda.Stream(b.flat.device) for b in engine.buckets if b.flat.is_cuda}

    def launch(self, engine: Engine, index: int) -> StagedRequest:
        """Queue the copy of ``engine.buckets[index]`` out to its twin; the reduction is posted once it lands."""
        bucket, twin = engine.buckets[index], self.host.buckets[index]
        if twin is bucket:
            return StagedRequest(self, index, None)
        source = bucket.flat if bucket.wire is None else bucket.wire.copy_(bucket.flat)
        compute, side = torch.cuda.current_stream(source.device), self._side[source.device]
        side.wait_stream(compute)  # after the gradients, and after the last cycle's copy back
        with torch.cuda.stream(side):
            twin.flat.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return StagedRequest(self, index, event)

    def prepare(self, engine: Engine, index: int) -> None:
        """As the inner reducer's (buckets are released only in padded layouts, which are not staged)."""
        self.inner.prepare(engine, index)

    def flush(self, engine: Engine) -> None:
        """Post every launched reduction (in bucket order), then the inner reducer's flush."""
        for bucket in engine.buckets:
            if isinstance(bucket.request, StagedRequest):
                bucket.request.start()
        self.inner.flush(self.host)

    def complete(self, engine: Engine, bucket: Bucket) -> None:
        """The inner reducer completes the twin; the sum goes back to ``bucket.flat`` on the compute stream."""
        request: StagedRequest = bucket.request
        twin = self.host.buckets[request.index]
        request.start()
        twin.request = request.inner
        try:
            self.inner.complete(self.host, twin)
        finally:
            twin.request = None
        if twin is bucket:
            return
        target = bucket.flat if bucket.wire is None else bucket.wire
        target.copy_(twin.flat, non_blocking=True)  # the allocator-free twin lives as long as the engine
        if bucket.wire is not None:
            bucket.flat.copy_(bucket.wire)
