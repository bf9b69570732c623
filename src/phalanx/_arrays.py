"""What the collectives accept, normalized into one small record.

``as_buffer(x, call)`` takes a NumPy array, a torch tensor, or a Python/NumPy
scalar and returns a :class:`Buffer`: the contiguous array the backend moves
(the user's own memory when possible), its canonical dtype name, its shape,
whether it may be written in place, and how to turn the backend's result back
into what the user passed (a scalar stays a scalar). Nothing heavy is imported
here: torch is recognized through ``sys.modules``, never imported.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._errors import UnsupportedArgumentError

__all__ = ["DTYPE_CODES", "FLOAT_DTYPES", "NATIVE_NUMPY_DTYPES", "Buffer", "UnsupportedArgumentError",
           "as_buffer"]


# Canonical dtype names and their codes in call fingerprints.
DTYPE_CODES = {
    name: code
    for code, name in enumerate(
        ("bool", "uint8", "int8", "int16", "int32", "int64",
         "float16", "bfloat16", "float32", "float64")
    )
}
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
# dtype object -> name: ``dtype.name`` builds a new string on every access (microseconds).
_NUMPY_NAMES = {np.dtype(name): name for name in DTYPE_CODES if name != "bfloat16"}
# dtypes MPI reduces natively (no widening, no logical ops): backends' fast paths test membership.
NATIVE_NUMPY_DTYPES = frozenset(np.dtype(n) for n in ("uint8", "int8", "int16", "int32", "int64",
                                                      "float32", "float64"))


class Buffer:
    """One normalized collective argument (see module docstring)."""

    __slots__ = ("data", "dtype", "code", "shape", "inplace", "is_torch", "scalar")

    def __init__(self, data: Any, dtype: str, shape: tuple[int, ...], inplace: bool,
                 is_torch: bool, scalar: Any = None) -> None:
        self.data = data
        self.dtype = dtype
        self.code = DTYPE_CODES[dtype]  # the dtype's code in call fingerprints
        self.shape = shape
        self.inplace = inplace
        self.is_torch = is_torch
        self.scalar = scalar  # None, or the type to convert a 0-d result back to

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        """E.g. ``float32[4, 3] (torch)``: used in error messages."""
        kind = "torch" if self.is_torch else ("scalar" if self.scalar is not None else "numpy")
        return f"{self.dtype}{list(self.shape)} ({kind})"

    def finish(self, result: Any) -> Any:
        """Convert the backend's result back to the type the user passed."""
        if self.scalar is None or result is None:
            return result
        if self.scalar is np.generic:  # a NumPy scalar stays a NumPy scalar
            return result.reshape(()).copy()[()]
        return self.scalar(result.reshape(-1)[0].item())


def _torch_dtype_name(t: Any) -> str:
    return str(t.dtype).rpartition(".")[2]


def as_buffer(x: Any, call: str) -> Buffer:
    """Normalize ``x`` for collective ``call``; raise a clear error if it cannot be sent."""
    if type(x) is np.ndarray or isinstance(x, np.ndarray):
        name = _NUMPY_NAMES.get(x.dtype)
        if name is None:
            raise _bad_dtype(call, str(x.dtype))
        flags = x.flags
        if not flags.c_contiguous:
            raise UnsupportedArgumentError(
                f"phalanx.{call}: the array is not C-contiguous (strides {x.strides}). "
                "Pass `np.ascontiguousarray(x)` instead."
            )
        return Buffer(x, name, x.shape, flags.writeable, False)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        name = _torch_dtype_name(x)
        if name not in DTYPE_CODES:
            raise _bad_dtype(call, name)
        if x.layout != torch.strided:
            raise UnsupportedArgumentError(
                f"phalanx.{call}: {x.layout} tensors are not supported; pass `x.to_dense()`."
            )
        if not x.is_contiguous():
            raise UnsupportedArgumentError(
                f"phalanx.{call}: the tensor is not contiguous (shape {tuple(x.shape)}, strides "
                f"{x.stride()}). Pass `x.contiguous()` instead (and copy the result back if "
                "you need it in place)."
            )
        return Buffer(x.detach(), name, tuple(x.shape), True, True)
    if isinstance(x, (bool, int, float)):
        array = np.array(x)  # bool -> bool, int -> int64, float -> float64
        if array.dtype.name not in DTYPE_CODES:
            raise UnsupportedArgumentError(
                f"phalanx.{call}: the integer {x!r} does not fit in int64; pass a float or a NumPy array."
            )
        return Buffer(array, array.dtype.name, (), True, False, type(x))
    if isinstance(x, np.generic):
        array = np.array(x)
        if array.dtype.name not in DTYPE_CODES:
            raise _bad_dtype(call, array.dtype.name)
        return Buffer(array, array.dtype.name, (), True, False, np.generic)
    raise UnsupportedArgumentError(
        f"phalanx.{call}: cannot send an object of type {type(x).__module__}.{type(x).__qualname__}. "
        "Pass a NumPy array, a torch tensor or a Python/NumPy scalar (e.g. `np.asarray(x)`); "
        "for arbitrary picklable objects see phalanx.broadcast_object / allgather_object."
    )


def _bad_dtype(call: str, name: str) -> UnsupportedArgumentError:
    return UnsupportedArgumentError(
        f"phalanx.{call}: dtype {name} is not supported. Supported: {', '.join(DTYPE_CODES)}. "
        "Cast first, e.g. `x.astype(np.float32)` or `x.float()`."
    )
