"""Horovod's gradient compression: ``hvd.Compression.none`` and ``hvd.Compression.fp16``.

::

    opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16)

The compressors keep Horovod's interface (``compress(tensor) -> (tensor, ctx)``,
``decompress(tensor, ctx)``), so code that calls them directly works. Given to
``DistributedOptimizer``, they select the wire format of phalanx's gradient
buckets: ``fp16`` sends each bucket in float16 (after the ``1/size`` scaling),
``none`` in full precision. A compressor of your own cannot be given to
``DistributedOptimizer`` (the buckets are fused, not per tensor):
:func:`wire_compression` refuses it, naming it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..._errors import UnsupportedArgumentError

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Horovod's compressor interface: ``compress`` before the reduction, ``decompress`` after."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return ``(compressed tensor, context for decompress)``."""
        raise NotImplementedError("Compressor.compress is abstract: subclass it")

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the tensor ``compress`` was given, from its compressed form and context."""
        raise NotImplementedError("Compressor.decompress is abstract: subclass it")


class NoneCompressor(Compressor):
    """No compression: gradients travel in their own dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return ``(tensor, None)`` unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return ``tensor`` unchanged."""
        return tensor


class FP16Compressor(Compressor):
    """Floating-point gradients travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return ``(tensor as float16, its dtype)``; non-floating tensors are returned as they are."""
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return ``tensor`` cast back to ``ctx`` (the dtype ``compress`` saw)."""
        if isinstance(ctx, torch.dtype) and ctx.is_floating_point:
            return tensor.type(ctx)
        return tensor


class Compression:
    """The compression algorithms of ``DistributedOptimizer(compression=...)``: ``none`` (the default)
    and ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def wire_compression(call: str, compression: Any) -> str | None:
    """The bucket engine's compression for Horovod's ``compression`` argument: None or ``"fp16"``.

    Raises UnsupportedArgumentError for anything but ``Compression.none``/``Compression.fp16``
    (class or instance).
    """
    kind = compression if isinstance(compression, type) else type(compression)
    if compression is None or kind is NoneCompressor:
        return None
    if kind is FP16Compressor:
        return "fp16"
    raise UnsupportedArgumentError(
        f"phalanx.horovod.torch.{call}(compression={getattr(kind, '__qualname__', kind)!r}): only "
        "hvd.Compression.none and hvd.Compression.fp16 are supported. Gradients are reduced in fused "
        "buckets whose wire format is float16 or full precision, so a compressor of your own (its "
        "compress/decompress per tensor) cannot run there; use Compression.fp16, or call your "
        "compressor around hvd.allreduce yourself.")
