"""``shard="gradients"``: each bucket is reduce-scattered, and only this rank's chunk of it is kept.

::

    engine.shard_plan = ShardPlan(engine, call)   # an engine laid out with pad=size
    engine.reducer = ScatterReducer(engine, mirror)   # installs its bucket hook too
    loss.backward()      # plan.shards[i].grad: this rank's reduced slice; p.grad None, or (mirror) the same

The engine lays each bucket out padded to ``size * k`` elements with its
presence slots and non-finite flag apart (``lay_out(pad=size)``), and keeps
its memory released between cycles. When backward first writes a bucket,
:meth:`ScatterReducer.prepare` completes the buckets launched before it, so
at most the bucket being filled, the one in flight and autograd's fresh
gradient exist at once; ``launch`` posts the reduce-scatter of the bucket
(its 16-bit copy when compressed) and an allreduce of its small tail
(which ranks had each gradient, and the flag); completing one keeps the
``k`` reduced elements of this rank and releases the bucket. A bucket hook
then lands each shard's part of the kept chunk in its ``.grad``
(``land_grad``; None where no rank had a gradient, so the optimizer skips it
exactly as it would the whole parameter) and sets each parameter's ``.grad``
to None, or with ``mirror`` (``DistributedOptimizer``) to that same sharded
gradient, which a tensor hook drops before autograd accumulates the next.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import _trace
from ._bucket_hot import Bucket
from ._engine_contract import Engine, Request
from ._engine_hooks import Reducer
from ._shard_group import GroupState
from ._shard_plan import ShardPlan
from ._shard_tensor import ShardedTensor
from ._transfers import Comm, finish, land, post_reduce_scatter

__all__ = ["ScatterReducer", "unmirror_before_accumulating"]

AT_ONCE_BYTES = 16 << 20  # a bucket this large is completed as soon as it is posted (see ScatterReducer)


class ScatterReducer(Reducer):
    """Reduce-scatter each bucket; keep this rank's chunk; release the bucket's memory.

    A bucket of ``AT_ONCE_BYTES`` or more is completed as soon as it is posted, before backward
    computes the next gradient: otherwise that gradient (as large) and this bucket exist together
    (the per-rank peak it saves: ``benchmarks/README.md``, "Figures behind design choices"); smaller
    buckets overlap backward."""

    def __init__(self, engine: Engine, mirror: bool = False) -> None:
        self.index = {id(b): n for n, b in enumerate(engine.buckets)}
        self.chunks: list[torch.Tensor | None] = [None] * len(engine.buckets)  # the kept reduced chunks
        self._pending: list[int] = []  # launched, not yet completed, in order
        self.mirror = mirror  # the whole parameters' .grad is their shard's (see _point_grads)
        engine.bucket_hooks.append(_point_grads)

    def prepare(self, engine: Engine, index: int) -> None:
        while self._pending and self._pending[0] < index:
            self._drain(engine, self._pending.pop(0))
        bucket = engine.buckets[index]
        if not _borrow(engine, bucket):
            bucket.revive()

    def launch(self, engine: Engine, index: int) -> Request:
        bucket = engine.buckets[index]
        group = _plan(engine).groups[index]
        if group.state is GroupState.REDUCING:  # the engine abandoned the cycle that posted it (an error)
            group.settle()
        group.advance(GroupState.REDUCING)
        send = bucket.flat if bucket.wire is None else bucket.wire.copy_(bucket.flat)
        request = post_reduce_scatter(Comm(engine.world, engine.call), send, bucket.tail)
        if _trace.ON:
            _trace.bucket_launch(bucket, engine.call, index, send, len(bucket.params))
        self._pending.append(index)
        if bucket.flat.numel() * bucket.flat.element_size() >= AT_ONCE_BYTES:
            bucket.request = request
            self._pending.remove(index)
            self._drain(engine, index)
        return request

    def complete(self, engine: Engine, bucket: Bucket) -> None:
        index = self.index[id(bucket)]
        if index in self._pending:
            self._pending.remove(index)
            self._drain(engine, index)

    def _drain(self, engine: Engine, index: int) -> None:
        bucket = engine.buckets[index]
        chunk = finish(Comm(engine.world, engine.call), bucket.request)
        self.chunks[index] = chunk if chunk.dtype == bucket.flat.dtype else chunk.to(bucket.flat.dtype)
        bucket.release()


def _borrow(engine: Engine, bucket: Bucket) -> bool:
    """A bucket of one parameter that fills it exactly (no padding, no 16-bit copy) takes over the
    memory of autograd's fresh gradient of it, which the engine then scales in place: no copy and no
    second gradient-sized buffer while it is reduced (the layer's gradient is the transient)."""
    if len(bucket.params) != 1 or bucket.wire is not None:
        return False
    i = bucket.params[0]
    g, flat = engine.params[i].grad, bucket.flat
    if g is None or g.is_sparse or not g.is_contiguous() or g.numel() != flat.numel() or g.dtype != flat.dtype \
            or g.device != flat.device:
        return False
    storage, offset, n = g.untyped_storage(), g.storage_offset(), flat.numel()
    flat.set_(storage, offset, (n,), (1,))
    bucket.grads.set_(storage, offset, (n,), (1,))
    engine.views[i].set_(storage, offset, g.shape, g.stride())
    bucket.live = True
    return True


def _point_grads(engine: Engine, bucket: Bucket) -> None:
    """After a bucket is reduced: its shards' ``.grad`` the kept chunk; its parameters' ``.grad`` None,
    or with ``mirror`` the same sharded gradient as their shard's (so that torch's ``clip_grad_norm_``
    over the model's parameters takes the global norm and scales the slices the optimizer updates)."""
    reducer = engine.reducer
    assert isinstance(reducer, ScatterReducer), reducer  # its own bucket hook, installed with it
    plan = _plan(engine)
    index = reducer.index[id(bucket)]
    chunk, reducer.chunks[index] = reducer.chunks[index], None  # the slices' .grad hold it from here
    assert chunk is not None, index  # _drain kept it when the bucket completed
    shards = [plan.shards[i] for i in bucket.params]
    parts = [(plan.positions[i], plan.positions[i] + plan.slices[i][1] - plan.slices[i][0]) for i in bucket.params]
    landed = land(shards, parts, chunk, bucket.presence.tolist())
    for i, grad in zip(bucket.params, landed, strict=True):
        engine.params[i].grad = (grad if grad is not None else plan.shards[i].grad) if reducer.mirror else None
    plan.groups[index].advance(GroupState.REDUCED)


def _plan(engine: Engine) -> ShardPlan:
    plan = engine.shard_plan
    assert isinstance(plan, ShardPlan), plan  # Sharding sets it before installing this reducer
    return plan


def unmirror_before_accumulating(param: torch.Tensor) -> Any:
    """A tensor hook for a whole parameter whose ``.grad`` mirrors its shard's: before autograd
    accumulates the next gradient into it, that ``.grad`` is dropped (the shard keeps the reduced sum,
    to which the next reduction adds), so autograd makes a fresh whole gradient for the engine."""
    ref = weakref.ref(param)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        p = ref()
        if p is not None and isinstance(p.grad, ShardedTensor):
            p.grad = None
        return grad

    return param.register_hook(hook)
