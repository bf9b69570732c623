"""What the collectives accept, normalized into one small record.

``as_buffer(x, call)`` takes a NumPy array, a torch tensor, a JAX array, or a
Python/NumPy scalar and returns a :class:`Buffer`: the contiguous array the
backend moves (the user's own memory when possible), its canonical dtype name,
its shape, whether it may be written in place, and how to turn the backend's
result back into what the user passed (a scalar stays a scalar, a JAX array
comes back as a new JAX array on the input's device). Nothing heavy is imported
here: torch and jax are recognized through ``sys.modules``, never imported.

JAX arrays are immutable, so they are never written: the backend reads a host
view (``np.asarray``: no copy for a CPU array) and returns a new array. A JAX
array on a GPU is staged through host memory (one copy each way). bfloat16
travels as float32 (MPI has no bfloat16; exact, one rounding at the end).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._errors import UnsupportedArgumentError

__all__ = ["DTYPE_CODES", "FLOAT_DTYPES", "NATIVE_NUMPY_DTYPES", "Buffer", "JaxResult",
           "UnsupportedArgumentError", "as_buffer", "cast_like", "is_jax_array", "jax_host_view"]


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
        # None, or how to convert the result back: a scalar type, np.generic, or a JaxResult.
        self.scalar = scalar

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        """E.g. ``float32[4, 3] (torch)``: used in error messages."""
        if type(self.scalar) is JaxResult:
            kind = "jax"
        else:
            kind = "torch" if self.is_torch else ("scalar" if self.scalar is not None else "numpy")
        return f"{self.dtype}{list(self.shape)} ({kind})"

    def back(self, result: Any) -> Any:
        """A new array result (allgather, gather, ...) as a JAX array when a JAX array was passed."""
        return self.scalar(result) if type(self.scalar) is JaxResult else result

    def finish(self, result: Any) -> Any:
        """Convert the backend's result back to the type the user passed."""
        if self.scalar is None or result is None:
            return result
        if type(self.scalar) is JaxResult:
            return self.scalar(result)
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
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        host = jax_host_view(x, call)
        name = host.dtype.name
        if name == "bfloat16":  # MPI has no bfloat16: widened (exactly), rounded back once at the end
            host = host.astype(np.float32)
        elif name not in DTYPE_CODES:
            raise _bad_dtype(call, name)
        return Buffer(host, name, host.shape, False, False, JaxResult(x))
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
        "Pass a NumPy array, a torch tensor, a JAX array or a Python/NumPy scalar (e.g. `np.asarray(x)`); "
        "for arbitrary picklable objects see phalanx.broadcast_object / allgather_object."
    )


def _bad_dtype(call: str, name: str) -> UnsupportedArgumentError:
    return UnsupportedArgumentError(
        f"phalanx.{call}: dtype {name} is not supported. Supported: {', '.join(DTYPE_CODES)}. "
        "Cast first, e.g. `x.astype(np.float32)` or `x.float()`."
    )


# -- JAX ----------------------------------------------------------------------------------------

def is_jax_array(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` (concrete or traced), without importing jax."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def jax_host_view(x: Any, call: str) -> np.ndarray:
    """A C-contiguous host array holding ``x``'s values: no copy for a CPU array, one for a GPU array.

    Raises UnsupportedArgumentError for a traced value (inside ``jax.jit``: use
    ``phalanx.jax``, whose functions call the collectives from inside jit) and
    for an array sharded over several devices.
    """
    jax = sys.modules["jax"]
    if isinstance(x, jax.core.Tracer):
        raise UnsupportedArgumentError(
            f"phalanx.{call}: got a traced JAX value (inside jax.jit, jax.grad or jax.vmap), which has "
            "no data yet. Inside jit use phalanx.jax.allreduce_gradients / phalanx.jax.allreduce (they "
            "call phalanx from the compiled step), or call phalanx.{call} outside the jitted function.")
    if len(x.sharding.device_set) > 1:
        raise UnsupportedArgumentError(
            f"phalanx.{call}: the JAX array is sharded over {len(x.sharding.device_set)} devices; "
            "phalanx moves one process's array. Pass a single-device array (e.g. "
            "`jax.device_put(x, jax.local_devices()[0])`).")
    return np.ascontiguousarray(np.asarray(x))


class JaxResult:
    """Turns a backend's host result into a new JAX array on the input's device."""

    __slots__ = ("device", "dtype")

    def __init__(self, like: Any) -> None:
        self.device = next(iter(like.sharding.device_set))
        self.dtype = like.dtype

    def __call__(self, result: Any) -> Any:
        if result is None:
            return None
        if result.dtype != self.dtype:  # a bfloat16 array reduced in float32
            result = result.astype(self.dtype)
        return sys.modules["jax"].device_put(result, self.device)


def cast_like(like: Any, result: Any) -> Any:
    """A reduction result (NumPy array or tensor, maybe float32) cast and moved to ``like``'s dtype and device."""
    if isinstance(like, np.ndarray):
        return result.astype(like.dtype, copy=False)
    torch = sys.modules["torch"]
    if isinstance(result, np.ndarray):
        result = torch.from_numpy(result)
    return result.to(device=like.device, dtype=like.dtype)
