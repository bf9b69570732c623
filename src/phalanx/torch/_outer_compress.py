"""How DiLoCo's outer gradients travel: full precision, 16-bit, or int8/int4 with a scale per block.

::

    q = Quantize("int8", block=128, error_feedback=True)
    payload = q.encode(delta)                 # uint8: the codes, then one float32 scale per block
    q.decode(payload, delta.numel(), delta.dtype) == q.roundtrip(delta)
    mean, residual = average(delta, q, residual, group=None, step=t)   # the same bits on every rank

A compressed outer gradient is *all-gathered*, not summed on the wire: every
rank receives every rank's payload, decodes them all and adds them in rank
order, in the outer copy's dtype, then divides by their number. The same
inputs, the same operations, the same order: the mean is bitwise the same on
every rank, whatever the transport does to a sum (gloo's ring, MPI's tree,
MPI's float32 accumulation of 16-bit words) — so the outer copies never drift
apart. The 16-bit dtypes are the gradient engine's (``_common.wire_dtype``);
unlike there, nothing is scaled by ``1/size`` first: a 16-bit value is never
summed, so it cannot overflow.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from .._collectives import allgather
from .._errors import InvalidArgumentError
from .._groups import Group
from ._common import wire_dtype

__all__ = ["OuterCompression", "Quantize", "average", "outer_compression"]

Kind = Literal["bf16", "fp16", "int8", "int4"]
_LEVELS = {"int8": 127, "int4": 7}  # codes in [-L, L]: symmetric, so 0 stays exactly 0


class Quantize:
    """How DiLoCo compresses its outer gradient: 16-bit, or int8/int4 codes with a float32 scale per block.

    ::

        diloco = phalanx.torch.DiLoCo(model, inner, sync_every=100,
                                      compression=phalanx.torch.Quantize("int4", block=128))

    Arguments:
        kind: ``"bf16"``/``"fp16"`` (each value rounded to 16 bits: 2 bytes per
            value), ``"int8"`` (1 byte per value) or ``"int4"`` (half a byte: two
            codes per byte). For int8/int4 the values are cut into blocks of
            ``block``; a block's scale is its largest magnitude over ``L`` (127 for
            int8, 7 for int4, stored as float32) and each value travels as
            ``round(x / scale)`` clamped to ``[-L, L]``; decoding multiplies back.
        block: the values per scale, 64 to 256 (default 128; even for int4).
            Ignored by the 16-bit kinds.
        error_feedback: keep what compression lost on this rank, ``r = (Δ + r_prev)
            − decode(encode(Δ + r_prev))``, and add it to the next outer gradient
            of the same parameters (default True), so that over the rounds nothing
            is lost; ``r`` is part of ``DiLoCo.state_dict()``. The strings
            ``compression="int8"`` (etc.) mean ``Quantize(kind, error_feedback=False)``.

    Methods: ``encode(x)`` (a 1-D float tensor to its uint8 payload),
    ``decode(payload, n, dtype)`` (back to ``n`` values of ``dtype``),
    ``roundtrip(x)`` (``decode(encode(x))``), ``payload_bytes(n)``.

    Raises:
        InvalidArgumentError: an unknown ``kind``, a ``block`` outside 64..256 (or
            odd for int4), an ``error_feedback`` that is not a bool.
    """

    __slots__ = ("kind", "block", "error_feedback")

    def __init__(self, kind: Kind = "int8", *, block: int = 128, error_feedback: bool = True) -> None:
        call = "torch.Quantize"
        if kind not in ("bf16", "fp16", "int8", "int4"):
            raise InvalidArgumentError(f"phalanx.{call}(kind={kind!r}): use 'bf16', 'fp16', 'int8' or 'int4'.")
        if isinstance(block, bool) or not isinstance(block, int) or not 64 <= block <= 256 \
                or (kind == "int4" and block % 2):
            raise InvalidArgumentError(f"phalanx.{call}(block={block!r}): give the values per scale as an int "
                                       "from 64 to 256 (even for int4), e.g. block=128.")
        if not isinstance(error_feedback, bool):
            raise InvalidArgumentError(f"phalanx.{call}(error_feedback={error_feedback!r}): pass True or False.")
        self.kind, self.block, self.error_feedback = kind, block, error_feedback

    def __repr__(self) -> str:
        return f"Quantize({self.kind!r}, block={self.block}, error_feedback={self.error_feedback})"

    def _blocks(self, n: int) -> int:
        return -(-n // self.block)

    def payload_bytes(self, n: int) -> int:
        """The bytes one rank sends for ``n`` values."""
        if self.kind in ("bf16", "fp16"):
            return 2 * n
        codes = self._blocks(n) * self.block
        return (codes if self.kind == "int8" else codes // 2) + 4 * self._blocks(n)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (1-D, floating point, on the CPU) as a uint8 payload of :meth:`payload_bytes` bytes."""
        wire = wire_dtype(self.kind)
        if wire is not None:
            return x.to(wire).view(torch.uint8)
        level = _LEVELS[self.kind]
        n, nb = x.numel(), self._blocks(x.numel())
        blocks = torch.zeros(nb * self.block, dtype=x.dtype)
        blocks[:n] = x
        blocks = blocks.view(nb, self.block)
        scale = (blocks.abs().amax(dim=1) / level).to(torch.float32)
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).to(x.dtype)
        codes = torch.round(blocks / divisor[:, None]).clamp_(-level, level).to(torch.int8)
        if self.kind == "int8":
            packed = codes.view(torch.uint8).reshape(-1)
        else:  # two codes per byte, each offset to 1..15
            u = (codes + 8).to(torch.uint8)
            packed = (u[:, 0::2] | (u[:, 1::2] << 4)).reshape(-1)
        return torch.cat([packed, scale.view(torch.uint8)])

    def decode(self, payload: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The ``n`` values of ``dtype`` that ``payload`` (from :meth:`encode`) stands for."""
        wire = wire_dtype(self.kind)
        if wire is not None:
            return payload.clone().view(wire).to(dtype)
        nb = self._blocks(n)
        width = nb * self.block if self.kind == "int8" else nb * self.block // 2
        scale = payload[width:width + 4 * nb].clone().view(torch.float32).to(dtype)
        if self.kind == "int8":
            codes = payload[:width].clone().view(torch.int8).view(nb, self.block).to(dtype)
        else:
            u = payload[:width].view(nb, self.block // 2)
            codes = (torch.stack([u & 15, u >> 4], dim=-1).view(nb, self.block).to(torch.int16) - 8).to(dtype)
        return (codes * scale[:, None]).reshape(-1)[:n]

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``: the value every rank receives for ``x``."""
        return self.decode(self.encode(x), x.numel(), x.dtype)


OuterCompression = Literal["bf16", "fp16", "int8", "int4"] | Quantize


def outer_compression(call: str, compression: Any) -> Quantize | None:
    """``compression=`` as a Quantize (None: full precision); InvalidArgumentError naming ``call`` otherwise."""
    if compression is None or isinstance(compression, Quantize):
        return compression
    if isinstance(compression, str) and compression in ("bf16", "fp16", "int8", "int4"):
        return Quantize(compression, error_feedback=False)  # type: ignore[arg-type]
    raise InvalidArgumentError(
        f"phalanx.{call}(compression={compression!r}): use None (full precision), 'bf16', 'fp16', 'int8', "
        "'int4', or phalanx.torch.Quantize('int8', block=128, error_feedback=True) for error feedback.")


def average(delta: torch.Tensor, quantize: Quantize, residual: torch.Tensor | None, group: Group | None,
            step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mean over the ranks of their compressed ``delta`` (with ``residual`` added first), the same bits on
    every rank, and this rank's new residual (None without error feedback). Collective (one all-gather)."""
    x = delta + residual if residual is not None else delta
    payload = quantize.encode(x)
    kept = x - quantize.decode(payload, x.numel(), x.dtype) if quantize.error_feedback else None
    gathered = allgather(payload, step=step, group=group)
    total = quantize.decode(gathered[0], x.numel(), x.dtype)
    for j in range(1, gathered.shape[0]):  # in rank order, on every rank alike
        total = total + quantize.decode(gathered[j], x.numel(), x.dtype)
    return total / gathered.shape[0], kept
