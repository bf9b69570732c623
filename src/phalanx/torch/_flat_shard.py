"""One unit's parameters of one dtype, flattened end to end and split in N chunks: :class:`FlatShard`.

::

    flat = FlatShard(owner, unit, [(name, p), ...])   # every rank: the same parameters, in the same order
    flat.shards[i]        # parameter i as a ShardedTensor Parameter: this rank's elements, its shape
    flat.gather()         # every rank's chunk into the whole flat buffer (collective); flat.wholes[i]: views
    flat.free()           # the whole buffer's memory released; the shards stay
    flat.reduce(sync)     # the wholes' .grad reduce-scattered into the shards' .grad (collective)
    flat.state            # its GroupState (a ShardGroup that rests FREE): the hooks move it along

With ``param_dtype`` (mixed precision) the master shard keeps the
parameters' own dtype (float32) and the whole parameters are 16-bit copies,
made by casting this rank's chunk before the all-gather; their gradients
are reduce-scattered in ``reduce_dtype`` (default ``param_dtype``) and the
shards' ``.grad`` are in the master dtype, as the optimizer's state.

The parameters (``n`` elements together) are laid end to end and padded to
``N * k`` with ``k = ceil(n / N)`` (at least 1; the layout of
:mod:`phalanx._layout`); rank ``r`` keeps elements ``[r*k, (r+1)*k)`` in
:attr:`local`, its master shard. A parameter's shard is the part of it
inside that chunk (possibly empty). Gathering is one
all-gather of the chunks straight into the whole buffer, whose views are the
unit's whole parameters (one leaf tensor each, the same object at every
gather, so autograd's saved tensors see the data again when backward
regathers a unit freed after forward). Reducing copies the wholes'
gradients into one ``N * k`` buffer and reduce-scatters it: each rank
receives its chunk, averaged, and each shard's ``.grad`` is its part
(accumulated into an existing ``.grad``, as torch accumulates ``p.grad``).
The collectives are :mod:`phalanx.torch._transfers`' (``post_gather``,
``post_reduce_scatter``, ``land``), as every level's are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .._layout import chunk_size, offsets, padded_size, param_bounds, rank_range
from ._engine_contract import Request
from ._shard_group import GroupState, ShardGroup
from ._shard_tensor import ShardedTensor, ShardSpec
from ._transfers import Comm, finish, land, post_gather, post_reduce_scatter

__all__ = ["FlatShard"]


class FlatShard(ShardGroup):
    """This rank's chunk of one unit's parameters of one dtype and device (see the module docstring)."""

    def __init__(self, owner: Any, unit: str, named: list[tuple[str, torch.nn.Parameter]],
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> None:
        world = owner.world
        super().__init__(unit or "(the root)", keeps_whole=False)
        self.owner, self.world, self.unit = owner, world, unit
        size, rank = world.size, world.rank
        first = named[0][1]
        self.dtype, self.device = first.dtype, first.device  # the master shard's: the parameters' own
        mixed = param_dtype is not None and first.is_floating_point()
        self.compute_dtype = param_dtype if mixed else self.dtype  # the gathered whole parameters'
        self.reduce_dtype = reduce_dtype if mixed and reduce_dtype is not None else self.compute_dtype
        numels = [p.numel() for _, p in named]
        self.offsets: list[int] = offsets(numels)
        self.n = n = sum(numels)
        self.k = k = chunk_size(n, size, minimum=1)
        self.padded = padded_size(n, size, minimum=1)  # size * k
        self.lo = lo = rank_range(self.padded, size, rank)[0]  # where this rank's chunk starts
        self.local = torch.zeros(k, dtype=self.dtype, device=self.device)  # the master shard
        self.whole = torch.zeros(self.padded, dtype=self.compute_dtype, device=self.device)
        self.shards: list[ShardedTensor] = []  # nn.Parameters (``_is_param``), as DTensor parameters are
        self.wholes: list[torch.nn.Parameter] = []
        self.ranges: list[tuple[int, int]] = []  # each parameter's elements in this rank's chunk
        with torch.no_grad():
            for (name, p), off, m in zip(named, self.offsets, numels, strict=True):
                bounds = param_bounds(off, m, n, size)
                a, b = bounds[rank]
                self.ranges.append((a, b))
                spec = ShardSpec(name, p.shape, unit, owner, a, b, bounds)
                view = self.local[off + a - lo:off + b - lo] if b > a else self.local[:0]
                view.copy_(p.detach().reshape(-1)[a:b])  # this rank's elements, in the parameter's dtype
                shard = ShardedTensor(view, spec, requires_grad=p.requires_grad)
                shard._is_param = True  # an nn.Parameter, as torch's own subclasses of it are
                self.shards.append(shard)
                self.wholes.append(torch.nn.Parameter(self.whole[off:off + m].view(p.shape),
                                                      requires_grad=p.requires_grad))
        # each shard's part of this rank's reduced chunk: (start, stop) in it
        self.parts = [(off + a - lo, off + b - lo) if b > a else (0, 0)
                      for off, (a, b) in zip(self.offsets, self.ranges, strict=True)]
        self.live = True  # the whole buffer's memory is allocated (FREE: released)
        self.pending: Request | None = None  # the posted all-gather (GATHERING), until finish_gather
        self.state = GroupState.WHOLE  # made whole above; freed now: only this rank's chunk is kept
        self.free()

    @property
    def comm(self) -> Comm:
        return Comm(self.world, self.owner.call)

    # -- the whole parameters -------------------------------------------------------
    @torch.no_grad()
    def gather(self) -> None:
        """Every rank's chunk into the whole buffer (collective); the whole parameters hold the values."""
        self.start_gather()
        self.finish_gather()

    @torch.no_grad()
    def start_gather(self) -> None:
        """Post the all-gather into the whole buffer (collective; :meth:`finish_gather` waits for it, so a
        unit's gather can run while the one before it computes). Writing the buffer is not a change
        autograd should see: a unit regathered for backward holds the values its forward saved."""
        if self.pending is not None:
            return
        self.advance(GroupState.GATHERING)
        if not self.live:
            self.whole.untyped_storage().resize_(self.whole.numel() * self.whole.element_size())
            self.live = True
        send = self.local if self.compute_dtype == self.dtype else self.local.to(self.compute_dtype)
        with self._abandoned_on_error(), torch.autograd._unsafe_preserve_version_counter((self.whole, *self.wholes)):
            self.pending = post_gather(self.comm, send, self.whole)

    @torch.no_grad()
    def finish_gather(self) -> None:
        """Wait for the all-gather :meth:`start_gather` posted (nothing when none is pending)."""
        request, self.pending = self.pending, None
        if request is None:
            return
        with self._abandoned_on_error(), torch.autograd._unsafe_preserve_version_counter((self.whole, *self.wholes)):
            finish(self.comm, request)
        self.advance(GroupState.WHOLE)

    @contextlib.contextmanager
    def _abandoned_on_error(self) -> Iterator[None]:
        """A transfer that raised (its world is broken) leaves the group at rest, so that the next
        call reaches the backend and raises its error there, never computing on a half-gathered buffer."""
        try:
            yield
        except BaseException:
            self.pending = None
            self.settle()
            raise

    def free(self) -> None:
        """Release the whole buffer's memory (the whole parameters keep their shapes, without data)."""
        self.finish_gather()
        if self.state is not GroupState.FREE:
            self.advance(GroupState.FREE)
        if self.live:
            self.whole.untyped_storage().resize_(0)
            self.live = False

    def follow_requires_grad(self) -> None:
        """The whole parameters require gradients exactly where their shards do (frozen, or unfrozen
        since wrapping)."""
        for shard, w in zip(self.shards, self.wholes, strict=True):
            if w.requires_grad != shard.requires_grad:
                w.requires_grad_(shard.requires_grad)

    # -- gradients ---------------------------------------------------------------------
    def has_grads(self) -> bool:
        return any(w.grad is not None for w in self.wholes)

    @torch.no_grad()
    def reduce(self, average: bool) -> None:
        """Reduce-scatter the whole parameters' gradients (collective; ``average``: divide by N) into
        the shards' ``.grad``; the wholes' ``.grad`` are released. A parameter no rank had a gradient
        for keeps its shard's ``.grad`` unchanged (None: the optimizer skips it, as it would the whole)."""
        request, seen = self.post_reduce()
        with self._abandoned_on_error():
            chunk = finish(self.comm, request)
        self.land_reduced(chunk, seen, average)

    def post_reduce(self) -> tuple[Request, torch.Tensor]:
        """Pack the wholes' gradients (released) into one ``N * k`` buffer and post its reduce-scatter,
        with the presence of each parameter's gradient summed beside it: (the request, the presence)."""
        self.advance(GroupState.REDUCING)
        send = torch.zeros(self.padded, dtype=self.reduce_dtype, device=self.device)
        seen = torch.zeros(len(self.wholes), dtype=torch.float32, device=self.device)
        for j, (w, off) in enumerate(zip(self.wholes, self.offsets, strict=True)):
            if w.grad is not None:
                send[off:off + w.numel()].copy_(w.grad.reshape(-1))
                seen[j] = 1
                w.grad = None
        with self._abandoned_on_error():
            return post_reduce_scatter(self.comm, send, seen), seen

    def land_reduced(self, chunk: torch.Tensor, seen: torch.Tensor, average: bool) -> None:
        """This rank's reduced ``chunk`` (in the reduce dtype) into its shards' ``.grad``, in the master
        dtype (``average``: divided by N)."""
        if chunk.dtype != self.dtype:  # reduced in 16 bits (reduce_dtype): the master shard's dtype
            chunk = chunk.to(self.dtype)
        if average and self.world.size > 1:
            chunk.div_(self.world.size)
        land(self.shards, self.parts, chunk, seen.tolist())  # one host synchronization, not one per parameter
        self.advance(GroupState.REDUCED)
