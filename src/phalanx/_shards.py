"""Shards of unequal size and preallocated results, for ``reduce_scatter`` and ``allgather``.

``counts`` (one non-negative int per rank, summing to the first axis) says how
many rows of the first axis each rank owns; every rank passes the same
``counts``, and the call's fingerprint includes them (:class:`CountedBuffer`),
so ranks that disagree get ``CollectiveMismatchError`` before anything is sent.
The transports move equal chunks, so unequal shards travel padded to the
largest count (:func:`padded`, :func:`unpadded`, :func:`concatenated`); the
padding is never part of a result.

``out=``: a preallocated array or tensor of the result's shape, dtype and kind
(and device), written with the result and returned (:func:`check_out`,
:func:`write_out`).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._arrays import Buffer, JaxResult
from ._errors import InvalidArgumentError, UnsupportedArgumentError

__all__ = ["CountedBuffer", "check_counts", "check_out", "concatenated", "padded", "unpadded", "write_out"]


def check_counts(call: str, counts: Any, buf: Buffer, size: int, rows: int | None) -> tuple[int, ...]:
    """``counts`` as a tuple of ``size`` non-negative ints summing to ``rows`` (None: not checked)."""
    where = f"phalanx.{call}(counts={counts!r})"
    if not buf.shape:
        raise UnsupportedArgumentError(f"{where}: counts split the first axis, and a scalar has none; pass "
                                       "an array or tensor with at least one axis.")
    try:
        values = tuple(counts)
    except TypeError:
        raise InvalidArgumentError(f"{where}: counts must be a sequence of ints, one per rank (e.g. "
                                   f"counts=[3, 2, 2] on 3 ranks), the same on every rank.") from None
    if any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0 for c in values):
        raise InvalidArgumentError(f"{where}: every count must be a non-negative int (rows of the first "
                                   "axis owned by that rank); e.g. counts=[3, 2, 0].")
    values = tuple(int(c) for c in values)
    if len(values) != size:
        raise InvalidArgumentError(f"{where}: {len(values)} counts for {size} ranks; pass one count per "
                                   "rank, the same on every rank.")
    if rows is not None and sum(values) != rows:
        raise InvalidArgumentError(f"{where}: the counts sum to {sum(values)} but the first axis of x is "
                                   f"{rows} (shape {list(buf.shape)}); the counts must sum to x.shape[0].")
    return values


class CountedBuffer(Buffer):
    """A buffer whose fingerprint and description include ``counts`` and the result's ``shape``."""

    __slots__ = ("counts", "own")

    def __init__(self, buf: Buffer, counts: tuple[int, ...], shape: tuple[int, ...]) -> None:
        super().__init__(buf.data, buf.dtype, shape, buf.inplace, buf.is_torch, buf.scalar)
        self.counts, self.own = counts, buf.shape
        self.code = hash((buf.code, counts))  # ranks agree on the counts with the dtype

    def describe(self) -> str:
        kind = super().describe().rsplit(" ", 1)[1]
        return f"{self.dtype}{list(self.own)} {kind} counts={list(self.counts)}"


def _zeros(like: Any, shape: tuple[int, ...]) -> Any:
    return np.zeros(shape, like.dtype) if isinstance(like, np.ndarray) else like.new_zeros(shape)


def padded(x: Any, counts: tuple[int, ...], width: int, scatter: bool) -> Any:
    """``x`` with each rank's rows padded to ``width``: all ranks' segments (``scatter``) or this one's."""
    rest = tuple(x.shape[1:])
    if not scatter:
        if x.shape[0] == width:
            return x
        out = _zeros(x, (width, *rest))
        out[:x.shape[0]] = x
        return out
    out = _zeros(x, (len(counts) * width, *rest))
    start = 0
    for i, c in enumerate(counts):
        out[i * width:i * width + c] = x[start:start + c]
        start += c
    return out


def unpadded(result: Any, count: int) -> Any:
    """This rank's ``count`` rows of a padded reduce-scatter result."""
    return result if result.shape[0] == count else result[:count]


def concatenated(stacked: Any, counts: tuple[int, ...]) -> Any:
    """The ``(size, width, ...)`` stack of padded segments as one ``(sum(counts), ...)`` result."""
    if all(c == stacked.shape[1] for c in counts):
        return stacked.reshape((sum(counts), *stacked.shape[2:]))
    parts = [stacked[i, :c] for i, c in enumerate(counts)]
    if isinstance(stacked, np.ndarray):
        return np.concatenate(parts)
    return sys.modules["torch"].cat(parts)


def check_out(call: str, out: Any, buf: Buffer, shape: tuple[int, ...]) -> Any:
    """``out`` if it can take a result of ``shape`` like ``buf``'s; else the error naming the fix."""
    where = f"phalanx.{call}(out=...)"
    if type(buf.scalar) is JaxResult or _is_jax(out):
        raise UnsupportedArgumentError(f"{where}: JAX arrays are immutable, so a result cannot be written "
                                       "into one; drop out= and use the returned array.")
    want = "a torch tensor" if buf.is_torch else "a NumPy array"
    if buf.is_torch != (not isinstance(out, np.ndarray)) or not hasattr(out, "shape"):
        raise UnsupportedArgumentError(f"{where}: got {type(out).__name__} for {want} x; pass {want} of "
                                       f"shape {list(shape)} and x's dtype.")
    if tuple(out.shape) != shape:
        raise InvalidArgumentError(f"{where}: out has shape {list(out.shape)}, the result has {list(shape)}; "
                                   "pass an out of the result's shape.")
    dtype = str(out.dtype).removeprefix("torch.")
    if dtype != buf.dtype:
        raise InvalidArgumentError(f"{where}: out has dtype {dtype}, x has {buf.dtype}; pass an out of "
                                   "x's dtype.")
    if buf.is_torch and out.device != buf.data.device:
        raise InvalidArgumentError(f"{where}: out is on {out.device}, x on {buf.data.device}; pass an out "
                                   "on x's device.")
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise InvalidArgumentError(f"{where}: out is read-only; pass a writeable array.")
    return out


def write_out(out: Any, result: Any) -> Any:
    """``result`` written into ``out``; ``out``."""
    if isinstance(out, np.ndarray):
        out[...] = result
    else:
        out.detach().copy_(result)
    return out


def _is_jax(x: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)
