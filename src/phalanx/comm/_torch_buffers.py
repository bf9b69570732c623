"""The torch backend's buffers: a user's array or tensor as the tensor gloo/nccl work on, and back.

::

    t, finish = backend._work(x, inplace, op)   # x's own memory where it can be, else a staged copy
    send = backend._send(x, op)                 # a send buffer on the transport's device
    out, finish = backend._output(x, send, shape)

A mixin of :class:`~phalanx.comm._torch.TorchBackend` (its data methods are in
``_torch.py``, the sharded ones in ``_shard_ops.py``): one rule for where a
buffer lives and in which dtype it is reduced, used by every data method.
CUDA tensors on gloo go through pinned host memory (``_staging.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ._staging import back_to_device, pinned_empty, stages_cuda, to_host

__all__ = ["TorchBuffers"]


class TorchBuffers:
    """Buffer conversions of the torch backend (reads its ``_torch``, ``device``, ``_nccl``, ``size``)."""

    _torch: Any
    device: Any
    _nccl: bool
    size: int

    def _tensor(self, a: Any) -> Any:
        """A torch view of a NumPy array (zero-copy), or the tensor itself."""
        if not isinstance(a, np.ndarray):
            return a
        if a.dtype.name == "bfloat16":  # ml_dtypes (JAX): NumPy's bfloat16 is not torch's, so via bits
            return self._tensor(a.view(np.int16)).view(self._torch.bfloat16)
        if a.flags.writeable:
            return self._torch.from_numpy(a)
        with warnings.catch_warnings():  # only ever a send buffer: nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            return self._torch.from_numpy(a)

    def _reduce_dtype(self, t: Any, op: str | None) -> Any:
        """The dtype the transport reduces ``t`` in (``_torch.py``'s module docstring)."""
        torch = self._torch
        if op is None:
            return t.dtype
        if t.dtype == torch.int16:
            return torch.int32
        if op == "avg" and not self._nccl and t.dtype in (torch.float16, torch.bfloat16):
            return torch.float32
        return t.dtype

    def _work(self, x: Any, inplace: bool, op: str | None = None) -> tuple[Any, Callable[[Any], Any]]:
        """(tensor the transport works on in place, finish(tensor) -> the user's result).

        ``x``'s own memory where it can be; else a copy on the transport's
        device in the reduction dtype, which ``finish`` writes back into ``x``.
        """
        if not inplace:
            x = x.copy() if isinstance(x, np.ndarray) else x.clone()
        src = self._tensor(x)
        dtype = self._reduce_dtype(src, op)
        if src.device == self.device and dtype == src.dtype:
            return src, lambda t: x
        host = src.is_cuda and self.device.type == "cpu"  # gloo: through pinned memory (_staging)
        if host and dtype == src.dtype and not stages_cuda(self):  # PHALANX_GLOO_CUDA=direct
            return src, lambda t: x
        staged = to_host(src, dtype) if host else src.to(device=self.device, dtype=dtype)

        def write_back(t: Any) -> Any:
            if host:
                back_to_device(t, src)
            else:
                src.copy_(t)
            return x

        return staged, write_back

    def _send(self, x: Any, op: str | None = None) -> Any:
        """``x`` as a send buffer on the transport's device (a view when possible; never written)."""
        src = self._tensor(x)
        dtype = self._reduce_dtype(src, op)
        if src.is_cuda and self.device.type == "cpu":
            return to_host(src, dtype)
        return src.to(device=self.device, dtype=dtype)

    def _output(self, x: Any, send: Any, shape: tuple[int, ...]) -> tuple[Any, Callable[[], Any]]:
        """(tensor the transport writes a new result into, finish() -> the user's result)."""
        if isinstance(x, np.ndarray) and not self._nccl:
            arr = np.empty(shape, x.dtype)
            return self._tensor(arr), lambda: arr
        if self.device.type == "cpu" and x.is_cuda:
            out = pinned_empty(shape, send.dtype)
        else:
            out = self._torch.empty(shape, dtype=send.dtype, device=self.device)
        return out, lambda: self._user(x, out)

    def _user(self, like: Any, t: Any) -> Any:
        """A new result ``t`` as ``like``'s kind, dtype and device."""
        if not isinstance(like, np.ndarray):
            return t.to(device=like.device, dtype=like.dtype, non_blocking=like.is_cuda and t.is_pinned())
        if t.device.type == "cpu" and like.dtype.name != "bfloat16":
            return t.numpy().astype(like.dtype, copy=False)
        out = np.empty(tuple(t.shape), like.dtype)
        self._tensor(out).copy_(t)
        return out

    def _bits(self, t: Any) -> Any:
        """Neither transport has int16; moves only copy bytes, so send its bits as float16."""
        return t.view(self._torch.float16) if t.dtype == self._torch.int16 else t

    def _scale(self, t: Any, op: str) -> None:
        if op == "avg" and not self._nccl:
            t.div_(self.size)
