"""The gradient engine's per-step data work: one bucket's record, and the 1/N scaling folded into the copy.

::

    adopt_scaled(view, p.grad, 0.5)                        # view := grad * 0.5 (one pass), in the hook
    left = scale_unscaled(bucket, views, scaled, cycle, 0.5)  # at launch: the views no hook scaled

The engine copies each fresh ``.grad`` autograd makes (after
``zero_grad(set_to_none=True)``) into its bucket anyway; multiplying by
``1/N`` in that copy makes averaging free, where scaling the bucket at launch
was one more pass over every gradient (``docs/design.md``, "Gradient
reduction"). Gradients autograd accumulated into the bucket's view directly
(``set_to_none=False``, several passes per step) are scaled at launch.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Bucket", "adopt_scaled", "scale_unscaled"]


class Bucket:
    """One flat buffer of gradients reduced by one collective, and its state in the open cycle."""

    __slots__ = ("params", "flat", "grads", "presence", "flag", "found", "wire", "request", "absent", "tail",
                 "live")

    def __init__(self, params: list[int], flat: torch.Tensor, numel: int, wire: torch.Tensor | None,
                 tail: torch.Tensor | None = None) -> None:
        self.params = params      # parameter indices, in layout order
        self.flat = flat          # gradients, one presence slot per parameter, one non-finite flag
        self.grads = flat[:numel]
        self.tail = tail          # a padded layout's presence slots and flag, apart from flat (else None)
        meta = flat[numel:] if tail is None else tail
        self.presence = meta[:len(params)]
        self.flag = meta[-1:]     # with check_finite: 1 on a rank whose own gradients were not finite
        self.found = torch.zeros(1, dtype=torch.float32, device=flat.device)  # this rank's flag
        self.wire = wire          # 16-bit copy of flat when compressed
        self.request: Any = None  # the backend request in flight
        self.absent: list[int] = []  # positions (in params) with no local gradient this cycle
        self.live = True          # flat's memory is allocated (a sharding reducer releases it between cycles)

    def release(self) -> None:
        """Free the memory of ``flat`` (and ``wire``); the views into it stay valid objects, unusable
        until :meth:`revive`."""
        for t in (self.flat, self.wire):
            if t is not None:
                t.untyped_storage().resize_(0)
        self.live = False

    def revive(self) -> None:
        """Allocate ``flat`` (and ``wire``) again, every view into it valid; the padding after the
        gradients is zeroed, the gradients are left for the engine to write."""
        for t in (self.flat, self.wire):
            if t is not None:
                t.untyped_storage().resize_(t.numel() * t.element_size())
        self.flat[self.grads.numel():].zero_()
        self.live = True


def adopt_scaled(view: torch.Tensor, grad: torch.Tensor, scale: float) -> None:
    """``view := grad * scale`` in one pass (a sparse ``grad`` densified; ``scale`` 1.0: a plain copy)."""
    if grad.is_sparse:
        grad = grad.to_dense()
    if scale != 1.0:
        torch.mul(grad, scale, out=view)
    else:
        view.copy_(grad)


def scale_unscaled(bucket: Bucket, views: list[torch.Tensor], scaled: list[int], cycle: int,
                   scale: float) -> float:
    """Before a launch: scale the views of ``bucket`` not scaled in ``cycle`` (``scaled[i]``), and
    return the factor still to apply to the whole bucket: ``scale`` when none was, else 1.0."""
    if scale == 1.0:
        return 1.0
    raw = [i for i in bucket.params if scaled[i] != cycle]
    if len(raw) == len(bucket.params):
        return scale
    for i in raw:
        views[i].mul_(scale)
    return 1.0
