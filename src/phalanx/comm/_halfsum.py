"""A sum of 16-bit floats over MPI that sends 16 bits (MPI has no bfloat16 and no 16-bit float sum).

MPI can only add float16/bfloat16 after widening them to float32, which
doubles the bytes on the wire. For large buffers phalanx instead runs the
reduction itself in two non-blocking phases, moving raw 16-bit words:

1. reduce-scatter: an ``Ialltoall`` gives rank ``r`` everyone's chunk ``r``
   (``ceil(n / size)`` elements), which it adds up in float32 (and divides,
   for ``avg``), then rounds to 16 bits once;
2. an ``Iallgather`` of the summed chunks gives every rank the whole result.

Each rank sends and receives ``2 (size-1)/size`` times the buffer's 16-bit
bytes, as a ring allreduce of 16-bit data would, half of the float32 path;
the result equals the float32 path's (the sum in float32, rounded once) up to
the order of the additions. Small buffers keep the float32 path: two phases
cost more latency than the bytes save (``MIN_BYTES``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._mpilib import lost_peer_on_mpi_error
from ._wait import poll

__all__ = ["MIN_BYTES", "HalfSum", "eligible"]

MIN_BYTES = 64 * 1024  # 16-bit buffers from this size travel as 16 bits
_F16 = np.dtype(np.float16)


def eligible(x: Any, op: str, size: int) -> bool:
    """Whether ``x`` (a host buffer) is a 16-bit float buffer worth the 16-bit transport for ``op``."""
    if op not in ("sum", "avg") or size == 1:
        return False
    if isinstance(x, np.ndarray):
        return x.dtype == _F16 and x.nbytes >= MIN_BYTES and x.flags.c_contiguous
    torch = sys.modules.get("torch")
    return (torch is not None and isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16)
            and not x.is_cuda and x.numel() * 2 >= MIN_BYTES and x.is_contiguous())


class HalfSum:
    """The two-phase request (module docstring); ``test()``/``wait(timeout)`` like the backend's requests."""

    __slots__ = ("_comm", "_size", "_op", "_x", "_flat", "_out", "_recv", "_mine", "_n", "_c", "_req",
                 "_phase", "_result", "_torch")

    @lost_peer_on_mpi_error
    def __init__(self, comm: Any, size: int, x: Any, op: str, inplace: bool) -> None:
        self._comm, self._size, self._op = comm, size, op
        self._torch = not isinstance(x, np.ndarray)
        self._x = x if inplace else (x.clone() if self._torch else x.copy())
        flat = self._x.reshape(-1)
        self._n = n = flat.shape[0]
        self._c = c = -(-n // size)
        if n == size * c:  # the common case: gather straight into the buffer
            padded = flat
        else:
            padded = self._zeros(size * c)
            padded[:n] = flat
        self._flat, self._out = flat, padded
        self._recv = self._zeros(size * c)
        self._mine: Any = None
        self._req = comm.Ialltoall(self._words(padded), self._words(self._recv))
        self._phase = 1
        self._result: Any = None

    def _zeros(self, count: int) -> Any:
        if self._torch:
            return sys.modules["torch"].zeros(count, dtype=self._x.dtype)
        return np.zeros(count, self._x.dtype)

    def _words(self, a: Any) -> np.ndarray:
        """The raw 16-bit words of ``a``, as MPI sees them (no conversion)."""
        if self._torch:
            return a.view(sys.modules["torch"].int16).numpy()
        return a.view(np.int16)

    def _reduce_mine(self) -> Any:
        """This rank's chunk: every rank's part added up in float32 (rank by rank, no big temporary)."""
        size, c = self._size, self._c
        parts = self._recv.reshape(size, c)
        if self._torch:
            total = parts[0].float()
            for r in range(1, size):
                total.add_(parts[r])
        else:
            total = parts[0].astype(np.float32)
            for r in range(1, size):
                total += parts[r]
        if self._op == "avg":
            total /= size
        return total.to(self._x.dtype) if self._torch else total.astype(_F16)

    @lost_peer_on_mpi_error
    def test(self) -> bool:
        if self._phase == 1 and self._req.Test():
            self._mine = self._reduce_mine()  # kept alive until the gather completes
            self._req = self._comm.Iallgather(self._words(self._mine), self._words(self._out))
            self._phase = 2
        if self._phase == 2 and self._req.Test():
            if self._out is not self._flat:
                self._flat[:] = self._out[:self._n]
            self._result, self._phase = self._x, 3
            self._out = self._recv = self._flat = self._mine = None
        return self._phase == 3

    def wait(self, timeout: float) -> Any:
        if self._phase != 3:
            poll(self.test, timeout, patient=False)
        return self._result
