"""Non-finite gradients in the bucket engine: each rank's own gradients, checked as they are scaled.

::

    check_and_scale(bucket.grads, bucket.found, inv_scale)   # found = 1.0 iff NaN/Inf; grads *= 1/size
    bucket.flag.copy_(bucket.found)                          # travels with the bucket: summed over ranks

The check is GradScaler's fused kernel (one pass over the gradients that also
applies the ``1/size`` scaling the engine does anyway), so it costs about what
the scaling alone did. The flag slot makes "some rank had non-finite local
gradients" known to every rank alike when the reduction completes; only then
is there one more collective (an allgather of one int) to name those ranks.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from .._collectives import allgather
from .._errors import InvalidArgumentError, NonFiniteGradientError

__all__ = ["NonFinitePolicy", "any_set", "check_and_scale", "check_policy", "nonfinite_error", "ranks_with"]

NonFinitePolicy = Literal["raise", "skip"]
"""What the wrappers do when some rank's local gradients were NaN/Inf: raise on every rank, or skip the step."""


def check_policy(call: str, nonfinite: object) -> NonFinitePolicy | None:
    if nonfinite not in (None, "raise", "skip"):
        raise InvalidArgumentError(
            f"phalanx.{call}(nonfinite={nonfinite!r}): use None (no check, the default), 'raise' (every "
            "rank raises NonFiniteGradientError naming the ranks) or 'skip' (every rank skips the step).")
    return nonfinite


def check_and_scale(grads: torch.Tensor, found: torch.Tensor, scale: float, scale32: torch.Tensor,
                    one32: torch.Tensor) -> None:
    """``found`` := 1.0 if ``grads`` holds a NaN or Inf, else 0.0; then ``grads *= scale``.

    ``found``, ``scale32`` (``scale``) and ``one32`` (1.0): 1-element float32
    tensors on ``grads``' device. float64 gradients are scaled apart: the
    kernel's float32 factor would round ``1/size`` (e.g. 1/3) for them.
    """
    found.zero_()
    exact = grads.dtype == torch.float64 and scale != 1.0
    try:
        torch._amp_foreach_non_finite_check_and_unscale_([grads], found, one32 if exact else scale32)
    except (RuntimeError, NotImplementedError):  # a device or dtype the fused kernel lacks
        found.copy_(~torch.isfinite(grads).all())
        exact = scale != 1.0
    if exact:
        grads.mul_(scale)


def any_set(flags: list[torch.Tensor]) -> bool:
    """Whether any of these 1-element tensors is > 0 (one host sync per device)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for flag in flags:
        by_device.setdefault(flag.device, []).append(flag.float())
    return any(torch.cat(group).max().item() > 0 for group in by_device.values())


def ranks_with(local_bad: bool) -> list[int]:
    """Collective: the ranks that passed ``local_bad=True``."""
    rows = allgather(np.array([int(local_bad)], np.int64))
    return [r for r in range(rows.shape[0]) if rows[r, 0]]


def nonfinite_error(call: str, ranks: list[int]) -> NonFiniteGradientError:
    which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    return NonFiniteGradientError(
        f"phalanx.{call}(nonfinite='raise'): the local gradients of {which} held NaN or Inf before they "
        "were reduced, so every rank's averaged gradients do; every rank raises here and no update was "
        f"applied. Look for the cause on {which} (its batch, the loss, a learning rate that diverges; "
        "`torch.autograd.set_detect_anomaly(True)` finds the operation), or pass nonfinite='skip' to skip "
        "such steps on every rank.", ranks=ranks)
