"""The mpi backend's buffers: a user's array or tensor as the memory MPI reads and writes, and back.

::

    work, finish = backend._reduction_work(x, inplace)   # x's own memory where it can be, else a copy
    out, view = backend._new_like(x, shape)               # an output like x, and its MPI view

A mixin of :class:`~phalanx.comm._mpi.MPIBackend` (its data methods are in ``_mpi.py``), as
``_torch_buffers.py`` is of the torch backend: one rule for where a buffer lives and in which dtype it
is reduced. Half precision is reduced in float32 and moved as raw 16-bit words; CUDA memory goes
straight to a GPU-aware MPI, else through pinned host memory (``_staging.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .._arrays import NATIVE_NUMPY_DTYPES
from ._staging import back_to_device, pinned_empty, to_host

__all__ = ["MPIBuffers", "is_torch"]

_F16 = np.dtype(np.float16)
_BOOL = np.dtype(np.bool_)


def _torch() -> Any:
    return sys.modules["torch"]


def is_torch(x: Any) -> bool:
    return not isinstance(x, np.ndarray)


def _identity(w: Any) -> Any:
    return w


class MPIBuffers:
    """Buffer conversions of the mpi backend (reads its ``gpu_aware``, ``_ops`` and ``_bool_ops``)."""

    gpu_aware: bool
    _ops: dict[str, Any]
    _bool_ops: dict[str, Any]

    def _mpi_op(self, x: Any, op: str) -> Any:
        dtype = x.dtype
        if dtype is _BOOL or (dtype == _BOOL if isinstance(x, np.ndarray) else str(dtype) == "torch.bool"):
            return self._bool_ops[op]
        return self._ops[op]

    def _as_mpi(self, x: Any) -> Any:
        """A zero-copy MPI-ready view of a NumPy array or CPU/GPU-aware tensor (bit view for halves)."""
        if isinstance(x, np.ndarray):
            return x
        torch = _torch()
        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        if x.is_cuda:
            torch.cuda.current_stream(x.device).synchronize()
            return x
        return x.numpy()

    def _staged(self, x: Any) -> bool:
        return is_torch(x) and x.is_cuda and not self.gpu_aware

    def _reduction_work(self, x: Any, inplace: bool) -> tuple[Any, Callable[[Any], Any]]:
        """(buffer MPI reduces in place, finish(buffer) -> user result).

        The buffer is ``x``'s own memory where possible; half precision is
        widened to float32 and CUDA memory staged on the host when MPI is not
        GPU-aware. Also a valid send buffer (finish is then not called).
        """
        if inplace and type(x) is np.ndarray and x.dtype in NATIVE_NUMPY_DTYPES:
            return x, _identity  # the common case first
        if isinstance(x, np.ndarray):
            if x.dtype == _F16:
                if not inplace:
                    return x.astype(np.float32), lambda w: w.astype(np.float16)

                def narrow(w: Any) -> Any:
                    np.copyto(x, w, casting="unsafe")
                    return x

                return x.astype(np.float32), narrow
            return (x if inplace else x.copy()), _identity
        torch = _torch()
        half = x.dtype in (torch.float16, torch.bfloat16)
        if not half and not x.is_cuda:
            return x.numpy(), lambda w: x
        if not half and self.gpu_aware:  # device memory straight to a GPU-aware MPI
            torch.cuda.current_stream(x.device).synchronize()
            return x, _identity
        pinned = to_host(x, torch.float32 if half else None) if x.is_cuda else x.float()  # _staging
        host = pinned.numpy()

        def write_back(w: Any) -> Any:
            if x.is_cuda:  # from the pinned tensor itself: the allocator keeps it until the copy is done
                return back_to_device(pinned, x)
            x.copy_(torch.from_numpy(w))
            return x

        return host, write_back

    def _new_like(self, x: Any, shape: tuple[int, ...]) -> tuple[Any, Any]:
        """(user-typed output of ``shape`` like ``x``, its MPI view)."""
        if isinstance(x, np.ndarray):
            out = np.empty(shape, x.dtype)
            return out, out
        torch = _torch()
        out = pinned_empty(shape, x.dtype) if self._staged(x) else torch.empty(shape, dtype=x.dtype, device=x.device)
        return out, self._as_mpi(out)

    def _host_in(self, x: Any) -> Any:
        """Staged input: a host copy of a CUDA tensor when MPI is not GPU-aware."""
        return to_host(x) if self._staged(x) else x

    def _device_out(self, like: Any, out: Any) -> Any:
        return out.to(like.device, non_blocking=True) if is_torch(like) and like.is_cuda and not out.is_cuda \
            else out
