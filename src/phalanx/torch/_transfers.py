"""The shard groups' collectives, as free functions: gather a group, reduce-scatter a group, land a chunk.

::

    comm = Comm(world, call)                          # the world and the wrapper's name (for errors)
    request = post_gather(comm, send, whole)          # every rank's chunk into ``whole``
    request = post_reduce_scatter(comm, flat, tail)   # this rank's chunk of the sum, ``tail`` allreduced beside
    chunk = finish(comm, request)                     # waited for within the world's timeout
    land(shards, parts, chunk, seen)                  # each shard's part of the chunk into its ``.grad``

Every level of sharding moves its data through these: the ZeRO-2 reducer
posts one reduce-scatter per bucket (``_shard_reducer.py``), the ZeRO-1/2
plan gathers the updated slices in pieces (``_shard_plan.py``), ZeRO-3 gathers
and reduce-scatters a unit's flat shard (``_flat_shard.py``). A *request* is
the engine's :class:`~phalanx.torch._engine_contract.Request` (``test()``,
``wait(timeout)``); in a world of one the functions compute the result at
once and return a request that is already complete, so no caller
special-cases a world of one. The *tail* of a reduce-scatter is the group's
small float32 vector of presence slots (which ranks had each gradient) and
non-finite flag, summed on every rank (``_bucket_layout.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..comm._local import Done  # a request complete when made (a world of one)
from ._common import backend_call
from ._engine_contract import Request
from ._shard_tensor import ShardedTensor, land_grad

if TYPE_CHECKING:
    from .._world import World

__all__ = ["Comm", "finish", "land", "post_broadcast", "post_gather", "post_reduce_scatter"]


@dataclass(frozen=True)
class Comm:
    """The communicator a transfer runs on: a world (or a group's world) and the call it serves."""

    world: World
    call: str

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def rank(self) -> int:
        return self.world.rank


class _Pair:
    """A reduce-scatter and the allreduce of its tail, as one request (the reduce-scatter's result)."""

    __slots__ = ("scatter", "tail", "result", "done")

    def __init__(self, scatter: Request, tail: Request | None) -> None:
        self.scatter, self.tail, self.result, self.done = scatter, tail, None, False

    def test(self) -> bool:
        return self.done or (self.scatter.test() and (self.tail is None or self.tail.test()))

    def wait(self, timeout: float) -> Any:
        if not self.done:
            self.result = self.scatter.wait(timeout)
            if self.tail is not None:
                self.tail.wait(timeout)
            self.done = True
        return self.result


def post_gather(comm: Comm, send: torch.Tensor, whole: torch.Tensor) -> Request:
    """All-gather every rank's ``send`` (``whole.numel() / size`` elements each) into ``whole``, in rank
    order (collective)."""
    world = comm.world
    if world.size == 1:
        whole.copy_(send)
        return Done(whole)
    return backend_call(world, comm.call, world.backend.iallgather_into, send, whole)


def post_broadcast(comm: Comm, buf: torch.Tensor, root: int) -> Request:
    """Broadcast ``buf`` from ``root`` into every rank's ``buf``, in place (collective)."""
    world = comm.world
    if world.size == 1:
        return Done(buf)
    return backend_call(world, comm.call, world.backend.ibroadcast, buf, root, True)


def post_reduce_scatter(comm: Comm, send: torch.Tensor, tail: torch.Tensor | None = None) -> Request:
    """Sum ``send`` (``size * k`` elements) across ranks and keep this rank's ``k`` (``wait`` returns
    them); ``tail`` (presence slots and flag), when given, is summed in place on every rank beside it
    (collective)."""
    world = comm.world
    if world.size == 1:
        return Done(send)
    scatter = backend_call(world, comm.call, world.backend.ireduce_scatter, send, "sum")
    summed = None if tail is None else backend_call(world, comm.call, world.backend.iallreduce, tail, "sum", True)
    return _Pair(scatter, summed)


def finish(comm: Comm, request: Request) -> Any:
    """Wait for ``request`` within the world's timeout (its failures as phalanx errors naming the call);
    its result."""
    return backend_call(comm.world, comm.call, request.wait, comm.world.timeout)


def land(shards: Sequence[ShardedTensor], parts: Sequence[tuple[int, int]], chunk: torch.Tensor,
         seen: Sequence[float]) -> list[ShardedTensor | None]:
    """Each shard's part ``chunk[start:stop]`` of a reduced chunk added into its ``.grad`` (``land_grad``);
    a shard no rank had a gradient for (``seen[j] <= 0``) keeps its ``.grad`` (None: the optimizer
    skips it, as it would the whole parameter). The landed gradients, None where skipped."""
    landed: list[ShardedTensor | None] = []
    for shard, (start, stop), had in zip(shards, parts, seen, strict=True):
        if had <= 0:
            landed.append(None)
            continue
        landed.append(land_grad(shard, chunk[start:stop] if stop > start else chunk[:0]))
    return landed
