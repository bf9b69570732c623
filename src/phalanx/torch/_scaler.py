"""``phalanx.torch.ShardedGradScaler``: torch's GradScaler, with its inf/NaN verdict agreed across ranks.

::

    scaler = phalanx.torch.ShardedGradScaler()
    opt = phalanx.torch.DistributedOptimizer(torch.optim.AdamW(params), shard="gradients")
    scaler.scale(loss).backward(); scaler.unscale_(opt); opt.clip_grad_norm_(1.0)
    scaler.step(opt); scaler.update()

A sharded optimizer's ``param_groups`` hold this rank's slices only, so
torch's GradScaler would find an inf on the rank whose slice holds it and
skip the step there alone. This subclass takes the maximum of each found-inf
flag over the optimizer's ranks (one small allreduce per unscale) so every
rank skips, and updates the scale, alike. With an unsharded optimizer every
rank already sees the same gradients and it behaves as torch's (torch's FSDP
has the same class for the same reason).
"""

from __future__ import annotations

from typing import Any

import torch

from ._shard_tensor import ShardedTensor
from ._sharded import sharding_of

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (same arguments and methods) whose inf/NaN check is agreed across the
    ranks of a sharded optimizer (a :class:`DistributedOptimizer`, or an optimizer over a sharded
    :class:`DataParallel`'s ``parameters()``); use it with ``shard="optimizer"`` or ``"gradients"``
    (with a sharded DistributedOptimizer torch's own raises a UsageError).

    Arguments (torch's): device (``"cuda"``, ``"cpu"``), init_scale (the first loss scale),
    growth_factor and backoff_factor (how the scale grows after ``growth_interval`` steps without
    inf/NaN, and shrinks after one with), enabled (False: every method is a no-op).

    Raises:
        CollectiveTimeoutError, RankFailedError: a peer stopped before agreeing on the inf check.
    """

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        sharding = sharding_of(optimizer)
        shard = next((p for g in optimizer.param_groups for p in g["params"] if isinstance(p, ShardedTensor)), None)
        target: Any = optimizer
        if sharding is not None and sharding.shard == "optimizer":
            # every rank holds the whole reduced gradients, and the slices' are views of them: unscale the
            # whole ones, so that code reading p.grad after unscale_ (torch's clip_grad_norm_ on the
            # model's parameters) sees them unscaled everywhere, not only in this rank's slice
            target = _Whole([{"params": sharding.plan.params}])
        found = super()._unscale_grads_(target, inv_scale, found_inf, allow_fp16)
        if shard is not None:  # this rank saw only its elements of each gradient: agree on the verdict
            from .._collectives import allreduce

            group: Any = shard._spec.owner.group
            local = max((float(f.max()) for f in found.values()), default=0.0)  # one flag per device
            agreed = float(allreduce(local, op="max", group=group))
            if not found:  # no gradient on this rank: still record the verdict, as every rank must
                found[found_inf.device] = found_inf
            for flag in found.values():
                flag.fill_(agreed)
            if sharding is not None:
                sharding.inf_agreed = True
        return found


class _Whole:
    """Parameter groups to unscale in place of an optimizer's (what ``_unscale_grads_`` reads of it)."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        self.param_groups = param_groups
