"""The two ways a ``DataParallel`` holds its module, behind one contract (:class:`Front`).

::

    front = BucketFront(module, world, group, shard=None, ...)  # whole parameters, gradients reduced in buckets
    front = UnitFront(module, world, group, units=..., ...)     # shard="parameters": sharded, gathered per unit
    out = front.forward(module, sync, training, args, kwargs)   # one training or eval forward
    front.reduce_pending()                                      # reduce now what backward did not
    with front.whole(): ...                                     # every parameter whole inside
    front.named(named), front.groups(), front.close()

``BucketFront`` (``shard=None``, ``"optimizer"``, ``"gradients"``) is the
gradient engine (``_bucket.py``) with, when sharded, a :class:`Sharding` of
its buckets (ZeRO-1/2, ``_sharded.py``): the same two objects
``DistributedOptimizer`` is built on. ``UnitFront`` (``shard="parameters"``,
ZeRO-3) is :class:`ParamShards`: units gathered for forward and backward and
reduce-scattered when their backward ends. ``DataParallel`` (``_parallel.py``)
validates its arguments, keeps the buffers in step and delegates the rest
here, so neither path is written inside the other.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .._errors import InvalidArgumentError, UsageError
from .._groups import Group
from .._objects import broadcast_object
from .._sync import synchronize
from .._world import World
from ._bucket import GradientBuckets
from ._common import Compression, GradientOp, verify_same_structure
from ._engine_owner import EngineOwner
from ._finite import NonFinitePolicy
from ._param_shards import ParamShards, pick_units
from ._repoint import optimizers_holding, repoint
from ._shard_group import ShardGroup
from ._shard_plan import check_elementwise
from ._shard_state import keep_whole_module, keep_whole_optimizer
from ._shard_tensor import ShardedTensor
from ._sharded import Sharding
from ._trainable import Trainable

__all__ = ["BucketFront", "Front", "UnitFront"]


class Front(Protocol):
    """What ``DataParallel`` asks of the object that holds its module's parameters across ranks."""

    shards_parameters: bool

    @property
    def engine(self) -> GradientBuckets: ...

    @property
    def nonfinite(self) -> NonFinitePolicy | None: ...

    @nonfinite.setter
    def nonfinite(self, policy: NonFinitePolicy | None) -> None: ...

    def nonfinite_ranks(self) -> list[int]: ...

    def forward(self, module: torch.nn.Module, sync: bool, training: bool, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any: ...

    def reduce_pending(self) -> None: ...

    def whole(self) -> contextlib.AbstractContextManager[None]: ...

    def named(self, named: Iterator[tuple[str, torch.nn.Parameter]]) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def groups(self) -> list[ShardGroup]: ...

    def close(self) -> None: ...


class BucketFront(EngineOwner):
    """Whole parameters on every rank; gradients reduced in buckets while backward runs (DDP), and with
    ``shard`` each rank updating its slices only (ZeRO-1/2, a :class:`Sharding` of the engine)."""

    shards_parameters = False

    def __init__(self, module: torch.nn.Module, world: World, group: Group | None, call: str, *, op: GradientOp,
                 bucket_cap_mb: float, compression: Compression | None, nonfinite: NonFinitePolicy | None,
                 check_steps: bool | None, shard: str | None) -> None:
        self.call = call
        named = list(module.named_parameters())
        self._trainable = Trainable(named)
        # The engine first: it checks that the ranks wrap the same parameters, naming the first difference.
        self._engine = GradientBuckets([p for _, p in named], [n for n, _ in named], call=call, op=op,
                                       bucket_cap_mb=bucket_cap_mb, compression=compression, group=group,
                                       pad=world.size if shard == "gradients" and world.size > 1 else None)
        self.nonfinite = nonfinite
        default = world.size > 1  # one rank has no peer to disagree with: its step costs nothing
        self._engine.check_steps = default if check_steps is None else bool(check_steps)
        self._engine.steps_by_reduction = False  # forward() counts the steps (step_label): a skipped backward shows
        self._reduced_at_forward = -1  # the engine's reduction count at the last training forward
        with torch.no_grad():
            synchronize(module, root=0, group=group)  # rank 0's parameters and buffers
        self.sharding: Sharding | None = None
        if shard is not None and world.size > 1:  # one rank has nothing to split
            self.sharding = Sharding(self._engine, shard, call, group)
            for register, fn in ((register_optimizer_step_pre_hook, _before_step),
                                 (register_optimizer_step_post_hook, _after_step)):
                hook = register(functools.partial(fn, weakref.ref(self)))
                weakref.finalize(self, hook.remove)
            for optimizer in optimizers_holding(self.sharding.plan.params):  # made before wrapping
                self.sharding.adopt(optimizer)
                keep_whole_optimizer(optimizer)

    def forward(self, module: torch.nn.Module, sync: bool, training: bool, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        self._trainable.check(self.call, "call `model.close()` and wrap `model.module` again after changing "
                              "it (on every rank)")
        engine = self._engine
        engine.sync = sync  # DDP decides at forward time, too
        if training and torch.is_grad_enabled():
            engine.step_label += 1  # the training step the next reduction belongs to
            self._reduced_at_forward = engine.reductions
        return module(*args, **kwargs)

    def reduce_pending(self) -> None:
        engine = self._engine
        if engine.reductions > self._reduced_at_forward:  # no forward of its own (a rank without
            engine.step_label += 1  # a batch this step): it stands for that step's forward
        engine.reduce()

    def whole(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # whole anyway

    def named(self, named: Iterator[tuple[str, torch.nn.Parameter]]) -> Iterator[tuple[str, torch.nn.Parameter]]:
        if self.sharding is None:
            yield from named
            return
        slices = {id(p): s for p, s in zip(self.sharding.plan.params, self.sharding.shards, strict=True)}
        for name, p in named:
            yield name, slices.get(id(p), p)  # type: ignore[misc]  # a ShardedTensor is an nn.Parameter

    def groups(self) -> list[ShardGroup]:
        return [] if self.sharding is None else list(self.sharding.plan.groups)

    def close(self) -> None:
        self._engine.close()
        self.sharding = None


class UnitFront:
    """Every parameter sharded across the ranks and gathered unit by unit (ZeRO-3, :class:`ParamShards`):
    no bucket engine, no non-finite check, gradients always averaged."""

    shards_parameters = True

    def __init__(self, module: torch.nn.Module, world: World, group: Group | None, call: str, *, units: Any,
                 reshard_after_forward: bool, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None) -> None:
        self.call = call
        self.closed = False
        named = list(module.named_parameters())
        verify_same_structure(call, [f"{n}: {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}"
                                     for n, p in named], group=group)
        verify_same_structure(call, [f"{n} ({type(m).__name__})" for n, m in pick_units(call, module, units)],
                              what="unit", group=group,
                              fix="Every rank must gather the same modules together: pass the same `units=` "
                                  "on every rank (module classes, or a callable that picks the same modules).")
        meta = any(p.is_meta for _, p in named)
        before = [weakref.ref(p) for _, p in module.named_parameters(remove_duplicate=False)]
        del named
        with contextlib.ExitStack() as stack:
            if meta:  # built on the meta device: materialized unit by unit, from rank 0's generator
                stack.enter_context(torch.random.fork_rng(devices=[]))  # (the same values at every N)
                torch.set_rng_state(broadcast_object(torch.get_rng_state(), root=0, allow_pickle=True, group=group))
            else:
                with torch.no_grad():
                    synchronize(module, root=0, group=group)  # rank 0's parameters and buffers
            self.params = ParamShards(module, units, world, group, call, reshard_after_forward,
                                      param_dtype, reduce_dtype)
        self._adopted: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        keep_whole_module(module)  # state_dict() whole, the wrapper's (which calls it) and the module's own
        after = [p for _, p in module.named_parameters(remove_duplicate=False) if isinstance(p, ShardedTensor)]
        held = [(p, shard) for r, shard in zip(before, after, strict=True) if (p := r()) is not None]
        if held:  # still referenced from outside the model: an optimizer made before wrapping?
            moved = {id(p): shard for p, shard in held}
            for optimizer in optimizers_holding([p for p, _ in held]):
                repoint(optimizer, moved)
                self.adopt(optimizer)
        hook = register_optimizer_step_pre_hook(functools.partial(_adopt_before_step, weakref.ref(self)))
        weakref.finalize(self, hook.remove)

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer updating these shards: its own state_dict() whole from now on (once)."""
        if optimizer not in self._adopted and any(
                isinstance(p, ShardedTensor) and p._spec.owner is self.params
                for g in optimizer.param_groups for p in g["params"]):
            self._adopted.add(optimizer)
            keep_whole_optimizer(optimizer)

    @property
    def engine(self) -> GradientBuckets:
        raise UsageError(
            f"phalanx.{self.call}(shard='parameters').engine: sharded parameters are reduce-scattered unit by "
            "unit as each unit's backward ends, not in the gradient engine's buckets, so there is no engine "
            "to extend. Use shard='gradients' (or None) for a custom reducer or hooks.")

    @property
    def nonfinite(self) -> NonFinitePolicy | None:
        return None

    @nonfinite.setter
    def nonfinite(self, policy: NonFinitePolicy | None) -> None:
        if policy is not None:
            raise InvalidArgumentError(
                f"phalanx.{self.call}(shard='parameters').nonfinite = {policy!r}: sharded parameters have no "
                "non-finite check yet. Leave it None, use ShardedGradScaler, or use shard='gradients'.")

    def nonfinite_ranks(self) -> list[int]:
        return []

    def forward(self, module: torch.nn.Module, sync: bool, training: bool, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        self.params.sync = sync and not self.closed
        return self.params.forward(module, *args, **kwargs)

    def reduce_pending(self) -> None:
        self.params.reduce_pending()

    def whole(self) -> contextlib.AbstractContextManager[None]:
        return self.params.whole()

    def named(self, named: Iterator[tuple[str, torch.nn.Parameter]]) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return named  # the module's parameters are the shards already

    def groups(self) -> list[ShardGroup]:
        return list(self.params.groups())

    def close(self) -> None:
        self.closed = True  # the units still gather to run (the module holds only shards); nothing is reduced


def _adopt_before_step(ref: weakref.ref[UnitFront], optimizer: torch.optim.Optimizer, args: Any,
                       kwargs: Any) -> None:
    """Before any optimizer's step: one made on a shard="parameters" model's shards keeps its state whole."""
    front = ref()
    if front is not None:
        front.adopt(optimizer)


def _before_step(ref: weakref.ref[BucketFront], optimizer: torch.optim.Optimizer, args: Any,
                 kwargs: Any) -> None:
    """Before any optimizer's step: one that updates a sharded DataParallel's slices must be element-wise."""
    front = ref()
    sharding = None if front is None else front.sharding
    if sharding is not None and sharding.updates(optimizer):
        check_elementwise(sharding.call, optimizer, sharding.shard)
        keep_whole_optimizer(optimizer)  # its own state_dict() whole from now on (once)


def _after_step(ref: weakref.ref[BucketFront], optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any optimizer's step: if it updates a sharded DataParallel's slices, all-gather them (and
    release the whole gradients: the next backward writes fresh ones)."""
    front = ref()
    sharding = None if front is None else front.sharding
    if sharding is None or not sharding.updates(optimizer):
        return
    sharding.gather()
    if sharding.shard == "optimizer":
        sharding.zero_grad(set_to_none=True)
