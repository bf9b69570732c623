"""Which elements of the training state each rank keeps when the optimizer is sharded (ZeRO).

::

    plan = ShardPlan(engine, call, group)        # after the engine laid out its buckets
    plan.shards[i]                           # parameter i's slice on this rank: a ShardedTensor Parameter (its
                                             # shape, this rank's elements), sharing the parameter's memory
    plan.positions[i]                        # where that slice starts in this rank's chunk of its bucket
    plan.groups[b]                           # bucket b's ShardGroup (kept whole; its GroupState)
    plan.gather()                            # after the update: every rank's slices into every parameter

Each bucket's gradients (``n`` elements, in the engine's layout) split into
``size`` chunks of ``k = ceil(n / size)`` (the layout of :mod:`phalanx._layout`):
rank ``r`` owns elements ``[r*k, min((r+1)*k, n))``, so shards differ by at
most ``k`` elements per bucket and the last ranks' may be shorter or empty.
The same split serves the reduce-scatter of ``shard="gradients"`` (the
bucket padded to ``size * k``) and the all-gather of the updated
parameters. A parameter's slice is the part of its flattened elements
inside this rank's chunk; its shard parameter is a view of the parameter's
own memory, so the optimizer's in-place update changes the model's
parameter directly, and the all-gather writes the other ranks' slices next
to it.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch

from .._errors import InvalidArgumentError
from .._layout import chunk_size, param_bounds, rank_bounds, rank_range
from ._engine_contract import Engine, Request
from ._shard_group import GroupState, ShardGroup
from ._shard_tensor import ShardedTensor, ShardOwner, ShardSpec
from ._transfers import Comm, finish, post_broadcast, post_gather

__all__ = ["ELEMENTWISE", "ShardPlan", "check_elementwise"]

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop",
               "Rprop")
"""torch.optim optimizers whose update of an element reads only that element's state and gradient
(and per-parameter counters), so a slice of a parameter updates exactly as the whole would."""
PIECE_BYTES = 4 << 20  # per rank and all-gather: the transient is WINDOW * (size + 1) pieces
DIRECT_BYTES = 1 << 20  # gathering by broadcast: a rank's part of a parameter this large goes in place
WINDOW = 2  # all-gathers in flight at once: overlap without a full-size transient


def check_elementwise(call: str, optimizer: torch.optim.Optimizer, shard: str) -> None:
    """InvalidArgumentError naming the optimizer unless it is a torch.optim class in ELEMENTWISE."""
    cls = type(optimizer)
    if cls.__module__.startswith("torch.optim") and cls.__name__ in ELEMENTWISE:
        return
    raise InvalidArgumentError(
        f"phalanx.{call}(shard={shard!r}) cannot shard a {cls.__module__}.{cls.__qualname__}: it shards "
        "parameters element by element, exact only for optimizers whose update of an element depends on "
        f"that element alone (torch.optim {', '.join(ELEMENTWISE)}). Optimizers that couple the elements of "
        "a parameter (LAMB, LARS, Adafactor, Muon, Shampoo, LBFGS) or subclasses phalanx cannot inspect "
        "would silently change. Use shard=None (every rank keeps the whole optimizer state).")


class ShardPlan(ShardOwner):
    """This rank's slice of every parameter of ``engine`` (a GradientBuckets), and the all-gather."""

    def __init__(self, engine: Engine, call: str, group: Any = None, front: Any = None) -> None:
        """``front``: the object that made this plan and owns it (a ``Sharding``), held weakly and found
        from any slice through its spec (``shard_of(slice).owner.front()``)."""
        self.front = None if front is None else weakref.ref(front)
        # the engine's buckets, parameters and world, not the engine: it holds this plan (no cycle)
        self.buckets, self.params, self.world = engine.buckets, engine.params, engine.world
        self.names = engine.names
        self.bucket_of = [0] * len(engine.params)
        self.call = call
        self.group = group
        world = engine.world
        size, rank = world.size, world.rank
        self.size = size
        self._chunks: list[tuple[int, int, int]] = []
        self.slices: list[tuple[int, int]] = [(0, 0)] * len(engine.params)  # param-local [a, b)
        self.offsets: list[int] = [0] * len(engine.params)  # each parameter's start in its bucket
        for bucket in engine.buckets:
            n = bucket.grads.numel()
            self._chunks.append((chunk_size(n, size), *rank_range(n, size, rank)))
            base = int(bucket.flat.storage_offset())
            offs = [int(engine.views[i].storage_offset()) - base for i in bucket.params]
            mine = rank_bounds(offs, [engine.params[i].numel() for i in bucket.params], n, size, rank)
            for i, off, ab in zip(bucket.params, offs, mine, strict=True):
                self.bucket_of[i] = len(self._chunks) - 1
                self.slices[i] = ab
                self.offsets[i] = off
        # where each parameter's slice starts in this rank's chunk of its bucket
        self.positions = [self.offsets[i] + self.slices[i][0] - self._chunks[self.bucket_of[i]][1]
                          for i in range(len(engine.params))]
        self.shards = [self._shard(p, i) for i, p in enumerate(engine.params)]
        self.groups = [ShardGroup(f"{call}: bucket {b}", keeps_whole=True) for b in range(len(engine.buckets))]
        self._group_of = {id(bucket): group for bucket, group in zip(engine.buckets, self.groups, strict=True)}
        self._casts: list[tuple[int, list[tuple[int, int, int]], bool]] | None = None  # see _plan_casts
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}  # _broadcast_all's pieces

    def _shard(self, p: torch.Tensor, i: int) -> ShardedTensor:
        if not p.is_contiguous():
            raise InvalidArgumentError(
                f"phalanx.{self.call}: parameter #{i} (shape {list(p.shape)}) is not contiguous, so its "
                "slice cannot share its memory. Make it contiguous before wrapping (e.g. "
                "`p.data = p.data.contiguous()`), or use shard=None.")
        a, b = self.slices[i]
        spec = ShardSpec(self.names[i], p.shape, "", self, a, b, self.bounds(i))
        shard = ShardedTensor(p.detach().view(-1)[a:b], spec, requires_grad=p.requires_grad)
        shard._is_param = True  # an nn.Parameter, as torch's own subclasses of it are
        return shard

    def group_of(self, bucket: Any) -> ShardGroup:
        """The shard group of one of the engine's buckets."""
        return self._group_of[id(bucket)]

    # -- after the update: every rank's slices everywhere -------------------------
    @torch.no_grad()
    def gather(self) -> None:
        """All-gather the updated slices into every parameter (collective: every rank, after every
        update). Where the backend gathers by broadcast (gloo, mpi), each rank's part of a large parameter
        is broadcast straight into the parameter's memory (no copy, no transient) and the small ones in
        packed pieces; elsewhere each bucket's chunks are all-gathered in pieces. Either way a piece
        holds at most ``PIECE_BYTES`` per rank, ``WINDOW`` pieces in flight: the transient memory stays
        a few MiB whatever the bucket size. Every bucket's group goes through ``GATHERING`` to ``WHOLE``."""
        self.world.ready(self.call)  # a broken world raises its own error before any group moves
        for group in self.groups:
            group.advance(GroupState.GATHERING)
        try:
            if self.size == 1:
                pass
            elif self.world.backend.gathers_by_broadcast:
                self._broadcast_all()
            else:
                self._gather_pieces()
        except BaseException:
            for group in self.groups:  # abandoned with its world: nothing of it is in flight
                group.settle()
            raise
        for group in self.groups:
            group.advance(GroupState.WHOLE)

    def _gather_pieces(self) -> None:
        """Each bucket's chunks all-gathered in pieces of at most ``PIECE_BYTES`` per rank."""
        size = self.size
        comm = Comm(self.world, self.call)
        flight: deque[tuple[int, int, int, Request, tuple[torch.Tensor, torch.Tensor]]] = deque()
        free: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for b, bucket in enumerate(self.buckets):
            k, lo, hi = self._chunks[b]
            step = max(1, PIECE_BYTES // bucket.flat.element_size())
            pool = free.setdefault((bucket.flat.dtype, bucket.flat.device), [])
            for j in range(0, k, step):
                length = min(step, k - j)
                slot = pool.pop() if pool else (bucket.flat.new_empty(step), bucket.flat.new_empty(step * size))
                send, out = slot[0][:length], slot[1][:length * size]  # past hi: padding nobody reads
                self._copy(b, lo + j, min(lo + j + length, hi), send, into_params=False)
                request = post_gather(comm, send, out)
                flight.append((b, j, length, request, slot))
                if len(flight) >= WINDOW:
                    done = self._unpack(*flight.popleft())
                    free[(done[0].dtype, done[0].device)].append(done)
        while flight:
            self._unpack(*flight.popleft())

    def _unpack(self, b: int, j: int, length: int, request: Request,
                slot: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for piece ``j`` of bucket ``b`` and copy every rank's part into the parameters; return
        its buffers for the next piece."""
        finish(Comm(self.world, self.call), request)
        out = slot[1][:length * self.size]
        n = self.buckets[b].grads.numel()
        for r in range(self.size):
            lo, hi = rank_range(n, self.size, r)
            start, stop = lo + j, min(lo + j + length, hi)  # piece j of rank r's chunk
            if stop > start:
                self._copy(b, start, stop, out[r * length:r * length + stop - start], into_params=True)
        return slot

    def _copy(self, b: int, start: int, stop: int, buf: torch.Tensor, into_params: bool) -> None:
        """Between ``buf`` and the parameters' elements at bucket ``b``'s positions ``[start, stop)``."""
        for i in self.buckets[b].params:
            off, m = self.offsets[i], self.params[i].numel()
            first, last = max(start, off), min(stop, off + m)
            if last > first:
                flat = self.params[i].view(-1)[first - off:last - off]
                piece = buf[first - start:last - start]
                (flat if into_params else piece).copy_(piece if into_params else flat)

    def _broadcast_all(self) -> None:
        """Every rank's slices by broadcast from their owner: a part of ``DIRECT_BYTES`` or more in place
        in its parameter, smaller ones packed in pieces of at most ``PIECE_BYTES`` (their buffers, at most
        ``WINDOW`` per dtype and device, are kept from step to step)."""
        if self._casts is None:
            self._casts = self._plan_casts()
        rank = self.world.rank
        comm = Comm(self.world, self.call)
        flight: deque[tuple[Request, list[torch.Tensor], torch.Tensor | None, list[torch.Tensor]]] = deque()
        packed = 0  # packed pieces in flight
        for root, parts, direct in self._casts:
            views = [self.params[i].detach().view(-1)[a:b] for i, a, b in parts]
            if direct:
                buf, into, whole, pool = views[0], [], None, []
            else:
                pool = self._free.setdefault((views[0].dtype, views[0].device), [])
                count = sum(v.numel() for v in views)
                whole = (pool.pop() if pool and pool[-1].numel() >= count
                         else views[0].new_empty(max(count, PIECE_BYTES // views[0].element_size())))
                buf = whole[:count]
                if rank == root:
                    torch.cat(views, out=buf)
                into = [] if rank == root else views
                packed += 1
            request = post_broadcast(comm, buf, root)
            flight.append((request, into, whole, pool))
            while packed >= WINDOW:
                packed -= self._land(*flight.popleft())
        while flight:
            self._land(*flight.popleft())

    def _land(self, request: Request, into: list[torch.Tensor], whole: torch.Tensor | None,
              pool: list[torch.Tensor]) -> int:
        """Wait for one broadcast, unpack a packed piece into its parameters and return its buffer to
        ``pool``; 1 for a packed piece, 0 for one broadcast in place."""
        finish(Comm(self.world, self.call), request)
        if whole is None:
            return 0
        at = 0
        for view in into:
            view.copy_(whole[at:at + view.numel()])
            at += view.numel()
        pool.append(whole)
        return 1

    def _plan_casts(self) -> list[tuple[int, list[tuple[int, int, int]], bool]]:
        """The broadcasts of :meth:`_broadcast_all`, the same list on every rank: (root, [(parameter,
        first, stop) of its flattened elements], whether in place)."""
        casts: list[tuple[int, list[tuple[int, int, int]], bool]] = []
        for bucket in self.buckets:
            width = bucket.flat.element_size()
            limit = max(1, PIECE_BYTES // width)
            order = sorted(bucket.params, key=lambda i: self.offsets[i])
            every = {i: self.bounds(i) for i in order}
            for r in range(self.size):
                run: list[tuple[int, int, int]] = []
                count = 0
                for i in order:
                    a, e = every[i][r]
                    if e > a and (e - a) * width >= DIRECT_BYTES:
                        casts.append((r, [(i, a, e)], True))
                        continue
                    while e > a:
                        take = min(e - a, limit - count)
                        run.append((i, a, a + take))
                        count, a = count + take, a + take
                        if count >= limit:
                            casts.append((r, run, False))
                            run, count = [], 0
                if run:
                    casts.append((r, run, False))
        return casts

    # -- where each parameter's slice lies on every rank -------------------------------
    def bounds(self, i: int) -> tuple[tuple[int, int], ...]:
        """Parameter ``i``'s slice on each rank, in rank order: ``(start, stop)`` of its flattened elements."""
        n = self.buckets[self.bucket_of[i]].grads.numel()
        return param_bounds(self.offsets[i], self.params[i].numel(), n, self.size)
