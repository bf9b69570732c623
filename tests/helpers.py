"""Helpers shared by test bodies (imported by pytest and by every rank; torch is imported lazily)."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["nan_in_backward", "raise_in_backward", "requires_cuda"]


@functools.cache
def _boom() -> Any:
    import torch

    class Boom(torch.autograd.Function):
        """Identity forward; backward raises the exception given to forward."""

        @staticmethod
        def forward(ctx: Any, x: Any, exc: BaseException) -> Any:
            ctx.exc = exc
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            if ctx.exc is None:  # nan_in_backward: a finite loss whose gradients are NaN
                return grad * float("nan"), None
            raise ctx.exc

    return Boom


def raise_in_backward(x: Any, exc: BaseException) -> Any:
    """``x`` unchanged, through an autograd node whose backward raises ``exc`` (a failure mid-backward)."""
    return _boom().apply(x, exc)


def nan_in_backward(x: Any) -> Any:
    """``x`` unchanged, through an autograd node whose backward makes every gradient below it NaN."""
    return _boom().apply(x, None)


def requires_cuda(gpus: int = 1) -> Any:
    """A pytest mark: skip, saying why, unless at least ``gpus`` CUDA GPUs are visible."""
    import pytest
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(visible < gpus, reason=f"needs {gpus} CUDA GPU{'s' * (gpus > 1)}, {visible} visible")
