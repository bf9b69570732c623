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
from typing import Any, Literal

import torch

from .._errors import InvalidArgumentError, UsageError
from .._groups import Group, world_for
from ._bucket import GradientBuckets
from ._common import Compression, GradientOp, backend_call, check_options
from ._finite import NonFinitePolicy, check_policy
from ._fronts import BucketFront, Front, UnitFront
from ._shard_group import ShardGroup
from ._sharded import check_shard

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


class _Done:
    """What ``unshard(async_op=True)`` returns: FSDP2's handle, already complete."""

    def wait(self) -> None:
        """Return at once: the gather is done."""


class DataParallel(torch.nn.Module):
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
            training forwards so far (grad enabled, ``model.train()``; one
            small agreement per step, within the noise of a step of the
            benchmark MLP), so a rank that skipped a backward, or that calls
            another collective instead, is named on every rank before any
            gradient moves. Default on (with more than one rank); ``False`` turns it off.

    Sharding (ZeRO stages 1 and 2, as torch's FSDP does it; ``docs/sharding.md``):
        shard: ``"optimizer"`` or ``"gradients"``: :meth:`parameters` (and
            ``named_parameters``) yield this rank's slice of each parameter
            (sharded tensors shaped like the parameters, sharing their memory), so the optimizer
            made on them keeps state for about 1/N of the model; after each
            ``optimizer.step()`` the updated slices are all-gathered into the
            parameters. ``"gradients"`` also reduce-scatters the gradients:
            the model's ``p.grad`` is None after backward and only the slices
            carry gradients. After a step the whole ``p.grad`` is released
            (``"optimizer"``). Element-wise optimizers only (SGD, Adam, AdamW,
            ...); clip with :meth:`clip_grad_norm_`, scale with
            :class:`ShardedGradScaler`. ``"parameters"`` (ZeRO stage 3):
            each rank keeps 1/N of every parameter as a :class:`ShardedTensor`
            with the parameter's shape (what ``parameters()`` yields and the
            optimizer updates); each unit is all-gathered just before its
            forward and freed after it, gathered again for its backward, and
            its gradients are reduce-scattered when its backward ends. Use
            torch's own ``clip_grad_norm_``; ``state_dict()`` is whole
            (collective). None (default): no sharding.
        units: with ``shard="parameters"``, the modules gathered together:
            module classes (``[Block]``), a callable picking modules, or None
            (default: each element of the model's ``nn.ModuleList``s, else each
            direct child); parameters no unit holds alone (tied ones) are
            gathered with the whole model.
        param_dtype, reduce_dtype: with ``shard="parameters"``, mixed
            precision: each gathered unit is a ``param_dtype`` copy (e.g.
            ``torch.bfloat16``; floating-point inputs are cast to it), its
            gradients are reduce-scattered in ``reduce_dtype`` (default
            ``param_dtype``; ``torch.float32`` for exact sums), and the shards,
            their gradients and the optimizer state stay in the parameters'
            own dtype (float32 master weights). None (default): no casts.
        reshard_after_forward: with ``shard="parameters"``, free each unit
            after its forward (default True) or keep it until its backward
            (one all-gather less per unit, more memory).

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
                 group: Group | None = None, shard: Literal["optimizer", "gradients", "parameters"] | None = None,
                 units: Any = None, reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_options(_CALL, op, bucket_cap_mb, compression)
        check_policy(_CALL, nonfinite)
        check_shard(_CALL, shard, compression, group)
        if not isinstance(reshard_after_forward, bool):
            raise InvalidArgumentError(
                f"phalanx.{_CALL}(reshard_after_forward={reshard_after_forward!r}): True (free each unit after "
                "its forward, gather it again for backward) or False (keep it until its backward). An int, in "
                "FSDP2, reshards to a smaller group of ranks after forward; phalanx has no such group yet.")
        self.module = module
        self.broadcast_buffers = bool(broadcast_buffers)
        self._unsharded: contextlib.ExitStack | None = None
        self._world = world_for(group, _CALL)
        self._require_sync = True
        self._front: Front
        if shard == "parameters":
            if op != "avg" or nonfinite is not None:
                raise InvalidArgumentError(
                    f"phalanx.{_CALL}(shard='parameters', op={op!r}, nonfinite={nonfinite!r}): sharded "
                    "parameters average their gradients (op='avg') and have no non-finite check yet. Leave op "
                    "and nonfinite out, or use shard='gradients'.")
            self._front = UnitFront(module, self._world, group, _CALL, units=units,
                                    reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                                    reduce_dtype=reduce_dtype)
        else:
            if param_dtype is not None or reduce_dtype is not None:
                raise InvalidArgumentError(
                    f"phalanx.{_CALL}(param_dtype={param_dtype}, reduce_dtype={reduce_dtype}): mixed precision "
                    f"with float32 master weights shards the parameters; use shard='parameters' (got "
                    f"shard={shard!r}), or compression='bf16' to reduce 16-bit gradients.")
            if units is not None:
                raise InvalidArgumentError(f"phalanx.{_CALL}(units=...): units are what shard='parameters' gathers "
                                           f"together; with shard={shard!r} every parameter stays whole. Use "
                                           "shard='parameters', or leave units out.")
            self._front = BucketFront(module, self._world, group, _CALL, op=op, bucket_cap_mb=bucket_cap_mb,
                                      compression=compression, nonfinite=nonfinite, check_steps=check_steps,
                                      shard=shard)
        buffers = list(module.buffers())
        self._pack = _BufferPack(buffers) if buffers and self._world.size > 1 else None

    # -- what the front holds (_fronts.py) --------------------------------------------------------------
    @property
    def engine(self) -> GradientBuckets:
        """The gradient engine reducing these gradients while backward runs, for code that changes how
        gradients are reduced: a ``reducer`` (how each bucket is reduced) and hooks run at each backward
        pass (``pass_hooks``), before each reduction (``reduction_hooks``) and after each bucket
        (``bucket_hooks``); ``docs/design.md``, "Gradient reduction", has their order and contract. With
        ``shard="parameters"`` there is none (UsageError): units are reduce-scattered as they finish."""
        return self._front.engine

    @property
    def nonfinite(self) -> NonFinitePolicy | None:
        """The non-finite gradient policy: None (no check), ``"raise"`` or ``"skip"``; settable."""
        return self._front.nonfinite

    @nonfinite.setter
    def nonfinite(self, policy: NonFinitePolicy | None) -> None:
        self._front.nonfinite = policy

    def nonfinite_ranks(self) -> list[int]:
        """The ranks whose own gradients held NaN/Inf in the last reduction ([] if none, or without
        ``nonfinite``); the same list on every rank."""
        return self._front.nonfinite_ranks()

    @property
    def shards_parameters(self) -> bool:
        """Whether every rank keeps only its part of the parameters (``shard="parameters"``): then the
        whole state exists on no rank, and checkpoints should be written with ``save_sharded``."""
        return self._front.shards_parameters

    def shard_groups(self) -> list[ShardGroup]:
        """The shard groups, each with its :class:`~phalanx.torch._shard_group.GroupState`: one per
        gradient bucket with ``"optimizer"``/``"gradients"`` (whole between steps), one per unit and dtype
        with ``"parameters"`` (free between steps); none unsharded or in a world of one."""
        return self._front.groups()

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Inside, ``model.module`` holds every parameter whole (collective on entry: each unit is
        gathered; on exit they are freed), so forwards need not run on every rank alike, e.g. evaluating
        each rank's own, uneven, part of a dataset. Gradients are not reduced in there. Without
        ``shard="parameters"`` the parameters are whole anyway and this does nothing (torch FSDP's
        ``summon_full_params``)."""
        with self._front.whole():
            yield

    # -- FSDP2's names ----------------------------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch for gradient accumulation: False makes backward accumulate without reducing
        (what :meth:`no_sync` does inside its block) until it is set True again; the next synced backward
        reduces everything accumulated. ``recurse`` is accepted for FSDP2's signature (one wrapper here)."""
        self._require_sync = bool(requires_gradient_sync)

    def unshard(self, async_op: bool = False) -> _Done | None:
        """FSDP2's ``unshard()``: every unit gathered and kept whole until :meth:`reshard` (collective), as
        inside :meth:`full_parameters`, for evaluation or generation. Gradients are not reduced while
        unsharded, so a training forward (grad enabled, ``model.train()``) raises a UsageError there.
        With ``async_op=True`` it returns a handle whose ``wait()`` returns at once (the gather is done).
        Without ``shard="parameters"`` the parameters are whole anyway and this does nothing."""
        if self._unsharded is None and self.shards_parameters:
            stack = contextlib.ExitStack()
            stack.enter_context(self._front.whole())
            self._unsharded = stack
        return _Done() if async_op else None

    def reshard(self) -> None:
        """FSDP2's ``reshard()``: free what :meth:`unshard` gathered (nothing if it was not called)."""
        stack, self._unsharded = self._unsharded, None
        if stack is not None:
            stack.close()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The module's state, ``module.``-prefixed; with shard="parameters" every parameter whole, under
        its own name and shape (collective: every rank calls it and gets the same tensors).
        ``load_state_dict`` takes such a whole state: each rank keeps its elements of every parameter."""
        return super().state_dict(*args, **kwargs)  # whole: the module's own state_dict hook (_shard_state.py)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The module's parameters; sharded, this rank's slice of each one the gradients of which are
        reduced (what the optimizer must update), under the parameter's name."""
        return self._front.named(super().named_parameters(prefix, recurse, remove_duplicate))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the reduced gradients, sharded or not: the total norm
        is over every rank's slices (one small allreduce; call it on every rank after backward)."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)  # sharded: global norms

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)``, after broadcasting rank 0's buffers in training mode."""
        if self._unsharded is not None and self.training and torch.is_grad_enabled():
            raise UsageError(
                f"phalanx.{_CALL}: a training forward after model.unshard(): unsharded, the units' hooks stand "
                "aside and backward would reduce nothing. Call `model.reshard()` before training, or run this "
                "forward under `torch.no_grad()` or in `model.eval()`.")
        if self.training and self.broadcast_buffers and self._pack is not None:
            self._sync_buffers(self._pack)
        return self._front.forward(self.module, self._require_sync, self.training, args, kwargs)

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
        self._front.reduce_pending()

    def close(self) -> None:
        """Stop reducing gradients (removes the hooks); ``module`` is unchanged. With
        ``shard="parameters"`` the units still gather to run (the module holds only this rank's shards:
        load ``state_dict()`` into an unwrapped copy for a plain module); backward reduces nothing."""
        self._front.close()

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

