"""The gradient engine's extension points: how one bucket is reduced (:class:`Reducer`), and the hooks.

::

    engine = model.engine                            # DataParallel / DistributedOptimizer: a GradientBuckets
    engine.pass_hooks.append(fn)                     # fn(engine): each backward pass that reaches the engine
    engine.reduction_hooks.append(fn)                # fn(engine): once per reduction, before anything is sent
    engine.bucket_hooks.append(fn)                   # fn(engine, bucket): each bucket, once it is reduced
    engine.reducer = MyReducer()                     # launch / flush / complete: how a bucket is reduced
    GradientBuckets(params, names, call=..., op="sum", prescale=0.25)   # the factor before the sum

One reduction cycle, in this order on every rank:

1. A backward pass reaches the engine (its first gradient hook): each of
   ``pass_hooks(engine)``, on every pass, reducing or accumulating. Raising
   aborts the pass before it touches the cycle (Horovod's "too many backward
   passes" check).
2. The first bucket is ready (or :meth:`~GradientBuckets.reduce` is called):
   the step agreement (``check_steps``), then each of
   ``reduction_hooks(engine)``, once per reduction, before any gradient is
   scaled or sent. Raising closes the cycle with nothing sent, so the next
   backward starts afresh: the place to agree on the step.
3. Each bucket, in bucket order: the engine scales this rank's gradients by
   ``prescale`` (``1/size`` with ``op="avg"``, else 1; the finite check rides
   in the same pass), then ``reducer.launch(engine, index)`` posts the
   reduction of ``engine.buckets[index]`` and returns its request
   (``test() -> bool``, ``wait(timeout)``). Later gradient hooks test the
   requests in order to let them progress.
4. After the last launch: ``reducer.flush(engine)``, before any wait (a
   reducer that defers its buckets reduces them here: PowerSGD).
5. Each bucket, in order: ``reducer.complete(engine, bucket)`` waits and
   leaves the reduced values in ``bucket.flat``; the engine re-attaches
   gradients absent on this rank but present on another; then each of
   ``bucket_hooks(engine, bucket)`` (Horovod's post-scaling).

A reducer that releases a bucket's memory between cycles (``bucket.live``
False) is asked to ``prepare(engine, index)`` it before backward first writes
it. Sharded gradients (``shard="gradients"``, ``_shard_reducer.py``) are such a
reducer: ``launch`` posts a reduce-scatter of the bucket, ``prepare``
completes the earlier buckets and revives this one, ``complete`` keeps this
rank's chunk and releases the bucket, and a bucket hook points the slices'
gradients at it; staging CUDA buckets through pinned host memory is a
reducer wrapping another (copy out in ``launch``, back in ``complete``:
``torch/_staged.py``); a world of one reduces nothing (:func:`reduces_nothing`); a
per-step check is a reduction hook. Hooks receive the engine instead of
closing over it, so a wrapper's hooks keep no reference cycle alive.
What each bucket holds: ``torch/_bucket_hot.py`` (:class:`Bucket`). The
design: ``docs/design.md`` ("Gradient reduction", "Extension points").
"""

from __future__ import annotations

from typing import Any

from .. import _trace
from ._bucket_hot import Bucket
from ._common import backend_call
from ._engine_contract import BucketHook, Engine, EngineHook
from ._powersgd import DEFERRED, PowerSGD, attach_powersgd
from ._staged import staged_if_needed

__all__ = ["BucketHook", "EngineHook", "PowerSGDReducer", "Reducer", "reducer_for", "reduces_nothing"]



class Reducer:
    """How the engine reduces one prepared bucket: the default is one non-blocking sum-allreduce over
    the engine's world, of the bucket's 16-bit copy when compressed. Subclass it (or give any object
    with these three methods) and set ``engine.reducer`` before the first backward."""

    def launch(self, engine: Engine, index: int) -> Any:
        """Post the reduction of ``engine.buckets[index]`` (its ``flat`` holds this rank's scaled
        gradients, presence slots and flag) and return the request: ``test() -> bool`` and
        ``wait(timeout)``. Called in bucket order, the same on every rank."""
        bucket = engine.buckets[index]
        send = bucket.flat if bucket.wire is None else bucket.wire.copy_(bucket.flat)
        world = engine.world
        request = backend_call(world, engine.call, world.backend.iallreduce, send, "sum", True)
        if _trace.ON:
            _trace.bucket_launch(bucket, engine.call, index, send, len(bucket.params))
        return request

    def prepare(self, engine: Engine, index: int) -> None:
        """Before ``engine.buckets[index]`` is first written in a cycle while its memory is released
        (``bucket.live`` is False: only a reducer that releases buckets sees this call): revive it."""
        engine.buckets[index].revive()

    def flush(self, engine: Engine) -> None:
        """After the last launch of a reduction, before any bucket is completed: nothing here."""

    def complete(self, engine: Engine, bucket: Bucket) -> None:
        """Wait for ``bucket.request`` (within the world's timeout) and leave the sum in ``bucket.flat``."""
        world = engine.world
        backend_call(world, engine.call, bucket.request.wait, world.timeout)
        if bucket.wire is not None:
            bucket.flat.copy_(bucket.wire)


class PowerSGDReducer(Reducer):
    """With PowerSGD: every bucket waits (``DEFERRED``) until the last is launched, then
    :meth:`PowerSGD.reduce` reduces them together, low-rank (plainly during warm-up)."""

    def __init__(self, state: PowerSGD) -> None:
        self.state = state

    def launch(self, engine: Engine, index: int) -> Any:
        return DEFERRED

    def flush(self, engine: Engine) -> None:
        self.state.reduce(engine)


def reducer_for(compression: Any, engine: Engine) -> Reducer:
    """The reducer a new engine starts with: PowerSGD's for that compression (its state laid out for
    ``engine``), else the plain allreduce (through pinned host buffers for CUDA buckets on a transport
    that reduces on the host: :func:`._staged.staged_if_needed`)."""
    state = attach_powersgd(compression, engine)
    return staged_if_needed(engine, Reducer()) if state is None else PowerSGDReducer(state)


def reduces_nothing(engine: Engine) -> bool:
    """Whether a reduction would leave every gradient as it is: a world of one with the plain reducer,
    no factor, no 16-bit wire, no check or hook. The engine then neither copies gradients into its
    buckets nor calls the backend (a world of one costs nothing)."""
    return (engine.world.size == 1 and type(engine.reducer) is Reducer
            and engine.prescale == 1.0 and not engine.check_finite and not engine.check_steps
            and not engine.reduction_hooks and not engine.bucket_hooks
            and all(b.wire is None and b.live and b.tail is None for b in engine.buckets))
