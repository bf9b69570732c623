"""The contract between the gradient engine and what plugs into it: what a reducer or hook may use.

::

    def launch(self, engine: Engine, index: int) -> Request:   # a reducer's method
        bucket = engine.buckets[index]                          # read: call, world, params, views, buckets
        ...
    engine.bucket_hooks.append(fn)                              # fn(engine, bucket)

:class:`~phalanx.torch._bucket.GradientBuckets` satisfies :class:`Engine`
(mypy checks it where the engine hands itself to its reducer and hooks);
reducers (:class:`BucketReducer`: the plain allreduce, PowerSGD's, the
sharded reduce-scatter, CUDA staging) and hooks are typed against it, not
against the engine's class, so they see only what ``docs/design.md``
("Extension points of the engine") promises them. Everything else of the
engine is private. A leaf module: it imports no other module of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from .._world import World
    from ._bucket_hot import Bucket

__all__ = ["BucketHook", "BucketReducer", "Engine", "EngineHook", "Request"]


class Request(Protocol):
    """A reduction in flight: ``test()`` polls (True once complete), ``wait(timeout)`` completes it."""

    def test(self) -> bool: ...

    def wait(self, timeout: float) -> Any: ...


class BucketReducer(Protocol):
    """How the engine reduces one bucket (the contract of ``engine.reducer``; the cycle's order is in
    :mod:`phalanx.torch._engine_hooks`)."""

    def launch(self, engine: Engine, index: int) -> Any: ...

    def prepare(self, engine: Engine, index: int) -> None: ...

    def flush(self, engine: Engine) -> None: ...

    def complete(self, engine: Engine, bucket: Bucket) -> None: ...


EngineHook = Callable[["Engine"], None]
"""A pass or reduction hook: called with the engine."""
BucketHook = Callable[["Engine", "Bucket"], None]
"""A bucket hook: called with the engine and a bucket whose reduced values are in place."""


class Engine(Protocol):
    """What a reducer or hook may read of the gradient engine, and the few members it may set.

    Read: ``call`` (the wrapper's name, for errors), ``world``, ``params`` (the reduced parameters,
    in engine order) with their ``names``, ``views`` (each parameter's gradient view into its
    bucket), ``buckets``, ``prescale``, ``check_finite``, ``check_steps``. Set or extend:
    ``reducer``, the three hook lists, ``shadows`` (tensors whose ``.grad`` is dropped with the
    parameters', e.g. their shards) and ``shard_plan`` (the sharding's plan, for its reducer).
    """

    reducer: BucketReducer
    shadows: list[torch.Tensor]
    shard_plan: Any

    @property
    def call(self) -> str: ...

    @property
    def world(self) -> World: ...

    @property
    def params(self) -> list[torch.Tensor]: ...

    @property
    def names(self) -> list[str]: ...

    @property
    def views(self) -> list[torch.Tensor]: ...

    @property
    def buckets(self) -> list[Bucket]: ...

    @property
    def prescale(self) -> float: ...

    @property
    def check_finite(self) -> bool: ...

    @property
    def check_steps(self) -> bool: ...

    @property
    def pass_hooks(self) -> list[EngineHook]: ...

    @property
    def reduction_hooks(self) -> list[EngineHook]: ...

    @property
    def bucket_hooks(self) -> list[BucketHook]: ...
