"""Sharded training (ZeRO stages 1 and 2) for the torch wrappers: ``shard="optimizer"`` and ``shard="gradients"``.

::

    sharding = Sharding(engine, "gradients", call, group)   # after the engine (laid out with pad=size)
    sharding.adopt(optimizer)     # its param_groups now hold this rank's slices (and their state)
    ...backward...                # shards' .grad: this rank's slice of the reduced gradients
    sharding.before_step()        # stage 1: point the shards' .grad at the reduced gradients
    optimizer.step()              # updates this rank's slices, in the parameters' own memory
    sharding.gather()             # every rank's updated slices into every parameter
    sharding.state_dict(optimizer)          # the whole (unsharded) state, on every rank (collective)

With ``"optimizer"`` the gradients are allreduced as without sharding
(``p.grad`` holds the whole reduced gradient) and each rank updates and
keeps optimizer state for its slice only. With ``"gradients"`` each bucket
is reduce-scattered (``_shard_reducer.py``): only the shards carry gradients
after backward, and ``p.grad`` is None or (``mirror_grads``) the shard's own
sharded gradient. Either way the updated
slices are all-gathered after each step. What each rank holds, the
memory formula and the checkpoint layout: ``docs/sharding.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import InvalidArgumentError, UsageError
from ._bucket_hot import Bucket
from ._common import verify_same_structure
from ._engine_contract import Engine
from ._powersgd import is_powersgd
from ._shard_group import GroupState
from ._shard_plan import ShardPlan, check_elementwise
from ._shard_reducer import ScatterReducer, unmirror_before_accumulating
from ._shard_state import ShardedOptimizerState, holds_sharded_tensors, local_part
from ._shard_tensor import ShardedTensor, shard_of

__all__ = ["SHARDS", "Sharding", "check_shard", "sharding_of", "whole_state"]

SHARDS = ("optimizer", "gradients")


def sharding_of(optimizer: torch.optim.Optimizer) -> Sharding | None:
    """The :class:`Sharding` whose slices ``optimizer`` updates, or None for an unsharded one (or one
    made on a ``shard="parameters"`` model, whose shards another owner holds): read from the slices'
    own spec (its owner, the plan, names the Sharding that made it)."""
    for group in optimizer.param_groups:
        for p in group["params"]:  # not only the first: it may be frozen, which the engine does not shard
            spec = shard_of(p)
            if spec is not None and isinstance(spec.owner, ShardPlan) and spec.owner.front is not None:
                front = spec.owner.front()
                return front if isinstance(front, Sharding) else None
    return None


def check_shard(call: str, shard: Any, compression: Any, group: Any, modules: bool = True) -> None:
    """InvalidArgumentError for an unknown ``shard`` or one that cannot combine with ``compression``
    (``modules``: the wrapper holds the model, so shard="parameters" is possible); then, collectively,
    CollectiveMismatchError unless every rank passed the same ``shard``."""
    if shard == "parameters" and not modules:
        raise InvalidArgumentError(
            f"phalanx.{call}(shard='parameters'): sharding the parameters needs the model, to gather each "
            "unit before its forward; an optimizer never sees the forward. Wrap the model instead: "
            "`model = phalanx.torch.DataParallel(model, shard='parameters')`, then make a plain torch "
            "optimizer on `model.parameters()`.")
    if shard == "parameters" and compression is not None:
        raise InvalidArgumentError(
            f"phalanx.{call}(shard='parameters', compression={compression!r}): sharded parameters reduce-scatter "
            "full-precision gradients. Leave compression out, or use shard='gradients' with it.")
    if shard is not None and shard not in (*SHARDS, "parameters"):
        raise InvalidArgumentError(
            f"phalanx.{call}(shard={shard!r}): use None (default: every rank keeps the whole training "
            "state), 'optimizer' (each rank keeps the optimizer state of 1/N of the parameters: ZeRO "
            "stage 1) or 'gradients' (also only 1/N of the reduced gradients: ZeRO stage 2) or 'parameters' (also only "
            "1/N of the parameters, gathered unit by unit to run: ZeRO stage 3, DataParallel only).")
    if shard is not None and is_powersgd(compression):
        raise InvalidArgumentError(
            f"phalanx.{call}(shard={shard!r}, compression=PowerSGD): PowerSGD reduces whole low-rank "
            "factors, which do not split into shards. Use shard with compression='bf16', 'fp16' or None, "
            "or PowerSGD with shard=None.")
    verify_same_structure(call, [f"shard={shard!r}"], what="setting", group=group)  # names each rank's value


class Sharding:
    """This rank's part of the training state, for one engine (``engine.shard_plan`` is its plan)."""

    def __init__(self, engine: Engine, shard: str, call: str, group: Any, mirror_grads: bool = False) -> None:
        """``mirror_grads``: with ``"gradients"``, each whole parameter's ``.grad`` is its shard's sharded
        gradient after backward (not None), so that torch's ``clip_grad_norm_(model.parameters())``
        clips by the global norm (``DistributedOptimizer``, whose user holds the model's parameters)."""
        self.shard = shard
        self.call = call
        self.inf_agreed = False  # set by ShardedGradScaler's agreed inf check, taken by the next step
        self.plan = engine.shard_plan = ShardPlan(engine, call, group, front=self)
        engine.shadows = list(self.plan.shards)  # nonfinite="skip" drops their gradients too
        self._hooks: list[Any] = []
        if shard == "gradients":
            engine.reducer = ScatterReducer(engine, mirror=mirror_grads)
            if mirror_grads:
                self._hooks = [unmirror_before_accumulating(p) for p in self.plan.params]
        else:  # the shards' gradients are views of the reduced ones as soon as each bucket is reduced
            engine.bucket_hooks.append(_view_grads)

    @property
    def shards(self) -> list[ShardedTensor]:
        return self.plan.shards

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Replace each parameter in ``optimizer``'s groups by this rank's slice of it, and cut any state
        it already has to the slice."""
        check_elementwise(self.call, optimizer, self.shard)
        index = {id(p): i for i, p in enumerate(self.plan.params)}
        for group in optimizer.param_groups:
            slices = []
            for p in group["params"]:
                i = index.get(id(p))
                if i is None:  # frozen: the engine does not reduce it, no rank updates it
                    slices.append(p)
                    continue
                shard = self.plan.shards[i]
                state = optimizer.state.pop(p, None)
                if state:
                    optimizer.state[shard] = {k: local_part(shard, k, v) for k, v in state.items()}
                slices.append(shard)
            group["params"] = slices

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        """The inverse of :meth:`adopt`, for a world that changed: the whole parameters back in
        ``optimizer``'s groups and its state dropped (the slices' state belongs to the old world's
        split; the caller loads a whole state afterwards, e.g. from a checkpoint)."""
        whole = {id(shard): p for shard, p in zip(self.plan.shards, self.plan.params, strict=True)}
        for group in optimizer.param_groups:
            group["params"] = [whole.get(id(p), p) for p in group["params"]]
        optimizer.state.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def before_step(self) -> None:
        """Stage 1: each shard's ``.grad`` is its slice of the parameter's reduced ``.grad`` (a view;
        again here, in case ``p.grad`` was replaced since the reduction)."""
        if self.shard == "optimizer":
            _point(self.plan, range(len(self.plan.params)))

    def updates(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` updates these slices."""
        return sharding_of(optimizer) is self

    def gather(self) -> None:
        """Every rank's updated slices into every parameter (collective, after every update)."""
        self.plan.gather()

    def zero_grad(self, set_to_none: bool) -> None:
        """The whole parameters' gradients too (the optimizer only sees the shards)."""
        for p in self.plan.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                elif not isinstance(p.grad, ShardedTensor):  # a mirrored one is its shard's, zeroed with it
                    p.grad.detach_().zero_()

    # -- gradients across shards --------------------------------------------------
    def scaler_found_inf(self, found: Any, scale: torch.Tensor | None) -> bool:
        """Whether a GradScaler's step must be skipped (``found``: its ``found_inf``), as
        :class:`ShardedGradScaler` agreed across ranks; unscales the gradients (``scale``: the scale they
        still carry, or None) when it is not. torch's own GradScaler checks only this rank's slices, so
        its verdict could differ between ranks: a UsageError, on every rank alike."""
        if not self.inf_agreed:
            raise UsageError(
                f"phalanx.{self.call}(shard={self.shard!r}) under torch's GradScaler: its inf/NaN check sees "
                "only this rank's slice of the gradients, so the ranks could disagree on skipping a step. "
                "Use `phalanx.torch.ShardedGradScaler()` (the same API; it agrees across ranks).")
        self.inf_agreed = False
        if torch.as_tensor(found).item() > 0:
            return True
        if scale is not None:
            self.unscale(scale)
        return False

    @torch.no_grad()
    def unscale(self, scale: torch.Tensor) -> None:
        """Divide the gradients by a GradScaler's ``scale`` (stage 1: the whole ones every rank holds)."""
        grads = ([s.grad.to_local() if isinstance(s.grad, ShardedTensor) else None for s in self.plan.shards]
                 if self.shard == "gradients" else [p.grad for p in self.plan.params])
        for g in grads:
            if g is not None:
                g.div_(scale.to(g.dtype))

    # -- checkpoints: whole states in, whole states out (_shard_state.py, as for shard="parameters") ----
    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` as the unsharded optimizer's would be (collective: every rank
        gathers every per-element entry from every rank; the same dict on every rank)."""
        return ShardedOptimizerState(optimizer).state_dict()

    def load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Load a whole (unsharded) optimizer state: each rank keeps its slices of it."""
        ShardedOptimizerState(optimizer).load_state_dict(state_dict)


def whole_state(optimizer: Any) -> Any:
    """``optimizer`` itself, or, when it updates sharded tensors (the slices of a :class:`Sharding` or a
    ``shard="parameters"`` model's shards), an object whose ``state_dict()``/``load_state_dict()`` are
    the whole (unsharded) state (collective)."""
    return ShardedOptimizerState(optimizer) if holds_sharded_tensors(optimizer) else optimizer


def _view_grads(engine: Engine, bucket: Bucket) -> None:
    """Stage 1's bucket hook: the shards of a reduced bucket's parameters get views of its gradients
    (its group: reduced, by the engine's own allreduce, which posted and completed it)."""
    plan: ShardPlan = engine.shard_plan
    _point(plan, bucket.params)
    group = plan.group_of(bucket)
    group.advance(GroupState.REDUCING)
    group.advance(GroupState.REDUCED)


@torch.no_grad()
def _point(plan: ShardPlan, indices: Any) -> None:
    for i in indices:
        g = plan.params[i].grad
        a, b = plan.slices[i]
        shard = plan.shards[i]
        shard.grad = None if g is None else ShardedTensor(g.reshape(-1)[a:b], shard._spec)
