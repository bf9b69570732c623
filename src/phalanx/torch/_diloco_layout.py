"""Where DiLoCo keeps its outer copy: the parameters cut into fragments, each a flat CPU buffer per dtype.

::

    bounds = split_fragments([p.numel() for p in params], 2)   # [0, 3, 6]: contiguous, balanced by elements
    slices = build_slices(params[0:3])                         # one _Slice per outer dtype of the fragment
    delta = slices[0].delta()                                  # outer - local, flat, on the CPU
    slices[0].apply(mix=0.5)                                   # local <- mix * outer + (1 - mix) * local

The outer copy of a parameter lives on the CPU in float64 when the parameter
is float64 and in float32 otherwise (bf16/fp16 parameters get a float32
master, as the outer step needs more bits than the local one keeps). The
copies of one fragment and dtype are views into one flat buffer, so an
outer gradient is one flat tensor and travels as one message.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Slice", "build_slices", "outer_dtype", "split_fragments"]


def outer_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's outer copy: float64 stays float64, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def split_fragments(sizes: list[int], fragments: int) -> list[int]:
    """Boundaries ``[0, b1, ..., len(sizes)]`` cutting ``sizes`` (in order) into ``fragments`` non-empty runs
    whose element counts are as close to equal as contiguous runs allow (each cut at the parameter boundary
    nearest to its share ``f * total / fragments``)."""
    total = sum(sizes)
    before = [0]
    for s in sizes:
        before.append(before[-1] + s)  # before[j]: elements of parameters 0..j-1
    bounds = [0]
    for f in range(1, fragments):
        target = f * total / fragments
        low, high = bounds[-1] + 1, len(sizes) - (fragments - f)  # leave one parameter for each fragment after
        bounds.append(min(range(low, high + 1), key=lambda j: (abs(before[j] - target), j)))
    bounds.append(len(sizes))
    return bounds


class Slice:
    """The parameters of one fragment that share an outer dtype: their outer copy (flat, CPU) and its views,
    and this rank's error-feedback residual for them (None until the first compressed exchange)."""

    __slots__ = ("params", "dtype", "flat", "views", "residual")

    def __init__(self, params: list[torch.Tensor], dtype: torch.dtype) -> None:
        self.params = params
        self.dtype = dtype
        self.flat = torch.cat([p.detach().reshape(-1).to("cpu", dtype) for p in params])
        self.views: list[torch.Tensor] = []
        at = 0
        for p in params:
            self.views.append(self.flat[at:at + p.numel()].view(p.shape))
            at += p.numel()
        self.residual: torch.Tensor | None = None

    def local(self) -> torch.Tensor:
        """This rank's parameters, flat, on the CPU, in the outer dtype."""
        return torch.cat([p.detach().reshape(-1).to("cpu", self.dtype) for p in self.params])

    def delta(self) -> torch.Tensor:
        """This rank's outer gradient: ``outer - local``."""
        return self.flat - self.local()

    def set_grads(self, mean: torch.Tensor) -> None:
        """Give the outer copies ``mean`` (flat) as their ``.grad``."""
        at = 0
        for v in self.views:
            v.grad = mean[at:at + v.numel()].view(v.shape)
            at += v.numel()

    def clear_grads(self) -> None:
        for v in self.views:
            v.grad = None

    @torch.no_grad()
    def apply(self, mix: float) -> None:
        """``local <- mix * outer + (1 - mix) * local`` (``local <- outer`` exactly for ``mix == 1``)."""
        for p, v in zip(self.params, self.views, strict=True):
            if mix == 1.0:
                p.copy_(v)
            else:
                p.copy_(mix * v + (1.0 - mix) * p.detach().to("cpu", self.dtype))


def build_slices(params: Sequence[torch.Tensor]) -> list[Slice]:
    """One :class:`Slice` per outer dtype among ``params`` (in the order the dtypes first appear)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(outer_dtype(p.dtype), []).append(p)
    return [Slice(ps, dtype) for dtype, ps in by_dtype.items()]
