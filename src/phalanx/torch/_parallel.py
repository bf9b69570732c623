"""``phalanx.torch.DataParallel``: a module whose gradients are averaged across ranks during backward.

::

    model = phalanx.torch.DataParallel(Net())            # rank 0's parameters and buffers everywhere
    opt = torch.optim.SGD(model.parameters(), lr=0.1)   # any optimizer, unchanged
    loss_fn(model(x), y).backward()                     # reduced when backward returns
    opt.step()

The counterpart of torch's ``DistributedDataParallel`` over any phalanx
backend, with the gradient engine of ``DistributedOptimizer`` (``_bucket.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .._groups import Group, world_for
from .._sync import synchronize
from ._bucket import GradientBuckets, check_options
from ._common import Compression, GradientOp, backend_call
from ._engine_owner import EngineOwner
from ._finite import NonFinitePolicy, check_policy

__all__ = ["DataParallel"]

_CALL = "torch.DataParallel"
_ALIGN = 16  # each buffer starts at a multiple of this in the packed bytes, so any dtype can view it


class _BufferPack:
    """The module's buffers packed into one byte tensor per device, allocated once."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.groups: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for b in buffers:
            by_device.setdefault(b.device, []).append(b)
        for device, items in by_device.items():
            offsets, total = [], 0
            for b in items:
                offsets.append(total)
                total += -(-b.numel() * b.element_size() // _ALIGN) * _ALIGN
            packed = torch.zeros(total, dtype=torch.uint8, device=device)
            views = [packed[o:o + b.numel() * b.element_size()].view(b.dtype).view(b.shape)
                     for o, b in zip(offsets, items, strict=True)]
            self.groups.append((packed, items, views))


class DataParallel(EngineOwner, torch.nn.Module):
    """``module``, with its gradients averaged across ranks while backward runs (torch's DDP, on any backend).

    ::

        model = phalanx.torch.DataParallel(Net())           # rank 0's parameters and buffers everywhere
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # any optimizer, unchanged
        loss_fn(model(x), y).backward()                    # reduced when backward returns
        opt.step()

    ``forward`` calls the wrapped module (``model.module``); ``state_dict``
    keys get the ``module.`` prefix, as with DDP. At construction, rank 0's
    parameters and buffers are broadcast and the ranks check once that they
    wrap the same parameters. Every rank must run backward every step: a rank
    that skips one leaves its peers waiting at the end of theirs (until the
    timeout); to skip a batch, backpropagate a zero loss, or call
    :meth:`reduce_gradients` instead of backward. :attr:`engine` is the
    gradient engine, for code that changes how gradients are reduced.

    Arguments:
        module: the model (any ``torch.nn.Module``).

    Reduction:
        op: ``"avg"`` (default: the mean over ranks) or ``"sum"``.
        bucket_cap_mb: bucket size in MB (default 25).
        compression: ``"bf16"``/``"fp16"`` send 16-bit gradients;
            ``"powersgd"`` or :class:`PowerSGD` low-rank factors with error
            feedback (lossy; ``docs/compression.md``); ``None`` (default) full precision.
        group: a :class:`phalanx.Group`: reduce among its members only (rank 0
            is its group rank 0); None (default) is the whole world.

    Buffers:
        broadcast_buffers: broadcast rank 0's buffers (BatchNorm statistics,
            counters) at the start of every *training-mode* forward (default
            True, DDP's policy: one fused broadcast into a buffer allocated
            once); eval mode communicates nothing, so rank 0 may evaluate
            alone. With :class:`SyncBatchNorm` the statistics agree anyway and
            False saves the broadcast. The buffer list is fixed at
            construction (a buffer later replaced by a new tensor is not
            broadcast).

    Failures (both off by default, at no cost):
        nonfinite: check each rank's *own* gradients for NaN/Inf as they are
            scaled for the reduction (one fused pass; the flag travels in the
            buckets). ``"raise"``: ``backward()`` raises NonFiniteGradientError
            on every rank, naming the ranks; ``"skip"``: every rank drops the
            gradients (``.grad = None``), so the optimizer's next ``step()``
            changes nothing. :meth:`nonfinite_ranks` names the ranks.
        check_steps: before each reduction the ranks agree on the number of
            reductions so far (one small agreement per step), so a rank that
            reduced once more or less is named on every rank before any
            gradient moves. Default: on when ``PHALANX_DEBUG=1``.

    Raises:
        InvalidArgumentError: an unknown ``op``/``compression`` or a bucket size <= 0.
        CollectiveMismatchError: the ranks wrap different parameters, on every
            rank alike, naming the first one.
        UsageError: another wrapper reduces some of these parameters and others too.
        NonFiniteGradientError: with ``nonfinite="raise"``, from backward, on every rank.
        CollectiveTimeoutError, RankFailedError: a peer stopped reducing.
    """

    def __init__(self, module: torch.nn.Module, *, op: GradientOp = "avg", bucket_cap_mb: float = 25,
                 compression: Compression | None = None, broadcast_buffers: bool = True,
                 nonfinite: NonFinitePolicy | None = None, check_steps: bool | None = None,
                 group: Group | None = None) -> None:
        super().__init__()
        check_options(_CALL, op, bucket_cap_mb, compression)
        check_policy(_CALL, nonfinite)
        self.module = module
        self.broadcast_buffers = bool(broadcast_buffers)
        self._world = world_for(group, _CALL)
        named = list(module.named_parameters())
        # The engine first: it checks that the ranks wrap the same parameters, naming the first difference.
        self._engine = GradientBuckets([p for _, p in named], [n for n, _ in named], call=_CALL, op=op,
                                       bucket_cap_mb=bucket_cap_mb, compression=compression, group=group)
        self.nonfinite = nonfinite
        self._engine.check_steps = self._world.debug if check_steps is None else bool(check_steps)
        with torch.no_grad():
            synchronize(module, root=0, group=group)  # rank 0's parameters and buffers
        buffers = list(module.buffers())
        self._pack = _BufferPack(buffers) if buffers and self._world.size > 1 else None
        self._require_sync = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)``, after broadcasting rank 0's buffers in training mode."""
        if self.training and self.broadcast_buffers and self._pack is not None:
            self._sync_buffers(self._pack)
        self._engine.sync = self._require_sync  # DDP decides at forward time, too
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward passes inside accumulate gradients locally; the next synced backward
        reduces everything accumulated."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def reduce_gradients(self) -> None:
        """Reduce the current gradients now (collective): for passes that did not reduce in backward,
        e.g. after ``no_sync()`` when no synced backward follows."""
        self._engine.reduce()

    def close(self) -> None:
        """Stop reducing gradients (removes the hooks); ``module`` is unchanged."""
        self._engine.close()

    def _sync_buffers(self, pack: _BufferPack) -> None:
        world = self._world
        root = world.rank == 0
        with torch.no_grad():
            for packed, buffers, views in pack.groups:
                if root:
                    torch._foreach_copy_(views, buffers)
                backend_call(world, _CALL, world.backend.broadcast, packed, 0, True, world.timeout)
                if not root:
                    torch._foreach_copy_(buffers, views)
