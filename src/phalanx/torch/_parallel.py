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
import functools
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .._errors import InvalidArgumentError
from .._groups import Group, world_for
from .._objects import broadcast_object
from .._sync import synchronize
from ._bucket import GradientBuckets
from ._common import Compression, GradientOp, backend_call, check_options, verify_same_structure
from ._engine_owner import EngineOwner
from ._finite import NonFinitePolicy, check_policy
from ._param_shards import ParamShards
from ._shard_plan import check_elementwise
from ._shard_state import full_state_dict
from ._sharded import Sharding, check_shard
from ._trainable import Trainable

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
        self._sharding: Sharding | None = None
        self._params: ParamShards | None = None
        check_options(_CALL, op, bucket_cap_mb, compression)
        check_policy(_CALL, nonfinite)
        check_shard(_CALL, shard, compression, group)
        self.module = module
        self.broadcast_buffers = bool(broadcast_buffers)
        self._world = world_for(group, _CALL)
        self._require_sync = True
        if shard == "parameters":
            self._init_parameters(module, op, nonfinite, group, units, reshard_after_forward, param_dtype,
                                  reduce_dtype)
            return
        if param_dtype is not None or reduce_dtype is not None:
            raise InvalidArgumentError(
                f"phalanx.{_CALL}(param_dtype={param_dtype}, reduce_dtype={reduce_dtype}): mixed precision with "
                f"float32 master weights shards the parameters; use shard='parameters' (got shard={shard!r}), "
                "or compression='bf16' to reduce 16-bit gradients.")
        if units is not None:
            raise InvalidArgumentError(f"phalanx.{_CALL}(units=...): units are what shard='parameters' gathers "
                                       f"together; with shard={shard!r} every parameter stays whole. Use "
                                       "shard='parameters', or leave units out.")
        named = list(module.named_parameters())
        self._trainable = Trainable(named)
        # The engine first: it checks that the ranks wrap the same parameters, naming the first difference.
        self._engine = GradientBuckets([p for _, p in named], [n for n, _ in named], call=_CALL, op=op,
                                       bucket_cap_mb=bucket_cap_mb, compression=compression, group=group,
                                       pad=self._world.size if shard == "gradients" and self._world.size > 1
                                       else None)
        self.nonfinite = nonfinite
        default = self._world.size > 1  # one rank has no peer to disagree with: its step costs nothing
        self._engine.check_steps = default if check_steps is None else bool(check_steps)
        self._engine.steps_by_reduction = False  # forward() counts the steps (step_label): a skipped backward shows
        self._reduced_at_forward = -1  # the engine's reduction count at the last training forward
        with torch.no_grad():
            synchronize(module, root=0, group=group)  # rank 0's parameters and buffers
        buffers = list(module.buffers())
        self._pack = _BufferPack(buffers) if buffers and self._world.size > 1 else None
        if shard is not None and self._world.size > 1:  # one rank has nothing to split
            self._sharding = Sharding(self._engine, shard, _CALL, group)
            for register, fn in ((register_optimizer_step_pre_hook, _before_step),
                                 (register_optimizer_step_post_hook, _after_step)):
                hook = register(functools.partial(fn, weakref.ref(self)))
                weakref.finalize(self, hook.remove)

    def _init_parameters(self, module: torch.nn.Module, op: GradientOp, nonfinite: Any, group: Group | None,
                         units: Any, reshard_after_forward: bool, param_dtype: torch.dtype | None,
                         reduce_dtype: torch.dtype | None) -> None:
        """shard="parameters": every parameter sharded, gathered unit by unit (``_param_shards.py``)."""
        if op != "avg" or nonfinite is not None:
            raise InvalidArgumentError(
                f"phalanx.{_CALL}(shard='parameters', op={op!r}, nonfinite={nonfinite!r}): sharded "
                "parameters average their gradients (op='avg') and have no non-finite check yet. Leave op "
                "and nonfinite out, or use shard='gradients'.")
        named = list(module.named_parameters())
        verify_same_structure(_CALL, [f"{n}: {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}"
                                      for n, p in named], group=group)
        self._engine = None  # type: ignore[assignment]
        if any(p.is_meta for _, p in named):  # built on the meta device: materialized unit by unit
            with torch.random.fork_rng(devices=[]):  # from rank 0's generator: the same values at every N
                torch.set_rng_state(broadcast_object(torch.get_rng_state(), root=0, allow_pickle=True, group=group))
                self._params = ParamShards(module, units, self._world, group, _CALL, reshard_after_forward,
                                           param_dtype, reduce_dtype)
        else:
            with torch.no_grad():
                synchronize(module, root=0, group=group)  # rank 0's parameters and buffers
            self._params = ParamShards(module, units, self._world, group, _CALL, reshard_after_forward,
                                       param_dtype, reduce_dtype)
        buffers = list(module.buffers())
        self._pack = _BufferPack(buffers) if buffers and self._world.size > 1 else None

    @property
    def shards_parameters(self) -> bool:
        """Whether every rank keeps only its part of the parameters (``shard="parameters"``): then the
        whole state exists on no rank, and checkpoints should be written with ``save_sharded``."""
        return self._params is not None

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Inside, ``model.module`` holds every parameter whole (collective on entry: each unit is
        gathered; on exit they are freed), so forwards need not run on every rank alike, e.g. evaluating
        each rank's own, uneven, part of a dataset. Gradients are not reduced in there. Without
        ``shard="parameters"`` the parameters are whole anyway and this does nothing (torch FSDP's
        ``summon_full_params``)."""
        if self._params is None:
            yield
            return
        with self._params.whole():
            yield

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The module's state, ``module.``-prefixed; with shard="parameters" every parameter whole, under
        its own name and shape (collective: every rank calls it and gets the same tensors).
        ``load_state_dict`` takes such a whole state: each rank keeps its elements of every parameter."""
        state = super().state_dict(*args, **kwargs)
        return state if self._params is None else full_state_dict(state)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The module's parameters; sharded, this rank's slice of each one the gradients of which are
        reduced (what the optimizer must update), under the parameter's name."""
        named = super().named_parameters(prefix, recurse, remove_duplicate)
        if self._sharding is None:
            yield from named
            return
        slices = {id(p): s for p, s in zip(self._sharding.plan.params, self._sharding.shards, strict=True)}
        for name, p in named:
            yield name, slices.get(id(p), p)  # type: ignore[misc]  # a ShardedTensor is an nn.Parameter

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the reduced gradients, sharded or not: the total norm
        is over every rank's slices (one small allreduce; call it on every rank after backward)."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)  # sharded: global norms

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)``, after broadcasting rank 0's buffers in training mode."""
        if self.training and self.broadcast_buffers and self._pack is not None:
            self._sync_buffers(self._pack)
        if self._params is not None:
            self._params.sync = self._require_sync
            return self._params.forward(self.module, *args, **kwargs)
        self._check_trainable()
        self._engine.sync = self._require_sync  # DDP decides at forward time, too
        if self.training and torch.is_grad_enabled():
            self._engine.step_label += 1  # the training step the next reduction belongs to
            self._reduced_at_forward = self._engine.reductions
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
        if self._params is not None:
            self._params.reduce_pending()
            return
        if self._engine.reductions > self._reduced_at_forward:  # no forward of its own (a rank without
            self._engine.step_label += 1  # a batch this step): it stands for that step's forward
        self._engine.reduce()

    def close(self) -> None:
        """Stop reducing gradients (removes the hooks); ``module`` is unchanged."""
        if self._engine is not None:
            self._engine.close()
        self._sharding = None

    def _check_trainable(self) -> None:
        """UsageError when a parameter's requires_grad changed since wrapping (``_trainable.py``)."""
        self._trainable.check(_CALL, "call `model.close()` and wrap `model.module` again after changing it "
                              "(on every rank)")

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


def _before_step(ref: weakref.ref[DataParallel], optimizer: torch.optim.Optimizer, args: Any,
                 kwargs: Any) -> None:
    """Before any optimizer's step: one that updates a sharded DataParallel's slices must be element-wise."""
    model = ref()
    sharding = None if model is None else model._sharding
    if sharding is not None and sharding.updates(optimizer):
        check_elementwise(_CALL, optimizer, sharding.shard)


def _after_step(ref: weakref.ref[DataParallel], optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any optimizer's step: if it updates a sharded DataParallel's slices, all-gather them (and
    release the whole gradients: the next backward writes fresh ones)."""
    model = ref()
    sharding = None if model is None else model._sharding
    if sharding is None or not sharding.updates(optimizer):
        return
    sharding.gather()
    if sharding.shard == "optimizer":
        sharding.zero_grad(set_to_none=True)
