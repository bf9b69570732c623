"""The non-blocking collectives of sharded training, for the MPI and torch.distributed backends.

::

    request = backend.ireduce_scatter(flat, "sum")   # flat: 1-D, size*k elements (may be overwritten); result: this rank's k
    request = backend.iallgather_into(chunk, out)    # chunk: 1-D, k; out: 1-D, size*k, rank r's at r*k

The gradient engine posts them bucket by bucket (``torch/_shard_reducer.py``,
``torch/_shard_plan.py``), so they are requests like ``iallreduce``'s,
posted in the same order on every rank and waited with a deadline. Each
backend class mixes in its own half here (its data-method module is at its
size limit); both use only that backend's own buffer helpers.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .._arrays import cast_like
from . import _halfsum
from ._mpilib import MPIRequest

__all__ = ["MPIShardOps", "TorchShardOps"]


class MPIShardOps:
    """``ireduce_scatter``/``iallgather_into`` for :class:`~phalanx.comm._mpi.MPIBackend`."""

    def ireduce_scatter(self: Any, x: Any, op: str) -> MPIRequest:
        """Post a reduce-scatter of 1-D ``x`` (``size * k`` elements); the result is this rank's ``k``.
        Half precision is summed in float32 (MPI has no 16-bit sum) and narrowed back; from
        ``_halfsum.MIN_BYTES`` a sum or mean moves the 16-bit words, as ``iallreduce`` does."""
        if _halfsum.eligible(x, op, self.size):
            return self._ireduce_scatter_16(x, op)
        if isinstance(x, np.ndarray) or x.is_cuda or x.element_size() < 4:
            work = self._reduction_work(x, inplace=True)[0]  # a send buffer; x is not written
        else:  # a CPU tensor goes to MPI as itself (DLPack): .numpy() would pin its storage's size, and
            work = x  # the engine releases a bucket's memory between steps
        k = work.shape[0] // self.size
        recv = np.empty(k, work.dtype) if isinstance(work, np.ndarray) else work.new_empty(k)
        req = self.comm.Ireduce_scatter_block(work, recv, self._mpi_op(work, op))

        def complete(keep: Any = work) -> Any:  # the send buffer lives until the request completes
            if op == "avg":
                recv.__itruediv__(self.size)
            return cast_like(x, recv)

        return MPIRequest(req, complete, self.MPI.Exception)

    def _ireduce_scatter_16(self: Any, x: Any, op: str) -> MPIRequest:
        """16-bit ``x``: an ``Ialltoall`` of its raw words gives this rank every rank's chunk, added up
        in float32 and rounded to 16 bits once (the first phase of ``_halfsum.HalfSum``)."""
        recv = np.empty_like(x) if isinstance(x, np.ndarray) else x.new_empty(x.shape[0])
        req = self.comm.Ialltoall(_words(x), _words(recv))

        def complete(keep: Any = x) -> Any:
            parts = recv.reshape(self.size, -1)
            total = parts[0].astype(np.float32) if isinstance(recv, np.ndarray) else parts[0].float()
            for r in range(1, self.size):
                total += parts[r]
            if op == "avg":
                total /= self.size
            return cast_like(x, total)

        return MPIRequest(req, complete, self.MPI.Exception)

    def iallgather_into(self: Any, x: Any, out: Any) -> MPIRequest:
        """Post an all-gather of 1-D ``x`` into 1-D ``out`` (rank ``r``'s at ``[r*k, (r+1)*k)``)."""
        send = self._as_send(x)
        host = out.cpu() if self._staged(out) else out  # a CUDA output staged on the host
        req = self.comm.Iallgather(send, self._as_mpi(host))

        def complete(keep: Any = send) -> Any:
            if host is not out:
                out.copy_(host)
            return out

        return MPIRequest(req, complete, self.MPI.Exception)


class TorchShardOps:
    """``ireduce_scatter``/``iallgather_into`` for :class:`~phalanx.comm._torch.TorchBackend` (gloo, nccl)."""

    def ireduce_scatter(self: Any, x: Any, op: str) -> Any:
        """Post a reduce-scatter of 1-D ``x`` (``size * k`` elements); the result is this rank's ``k``.

        On gloo, an allreduce of ``x`` in place, of which this rank keeps its chunk: gloo's own
        reduce-scatter took 1.5x an allreduce of the same buffer (64 MiB, 2 ranks: 64 vs 43 ms), and
        an all-to-all with a local sum, as fast in a training step, needs a second buffer as large
        as ``x`` (the 51.4M-parameter MLP at 4 ranks: 291 vs 229 MiB per rank). So ``x``'s contents
        are undefined afterwards on gloo (the engine releases the bucket anyway)."""
        if not self._nccl:
            t, _ = self._work(x, True, op)
            k = t.shape[0] // self.size
            lo = self.rank * k

            def keep() -> Any:
                chunk = t[lo:lo + k].clone()
                self._scale(chunk, op)
                return self._user(x, chunk)

            return self._request(lambda: self._all_reduce(t, op), keep)
        send = self._send(x, op)
        k = send.shape[0] // self.size
        out = self._torch.empty(k, dtype=send.dtype, device=self.device)

        def complete() -> Any:
            self._scale(out, op)
            return self._user(x, out)

        return self._request(lambda: self._reduce_scatter(out, send, self._ops[op], async_op=True), complete)

    def iallgather_into(self: Any, x: Any, out: Any) -> Any:
        """Post an all-gather of 1-D ``x`` into 1-D ``out`` (rank ``r``'s at ``[r*k, (r+1)*k)``).

        On gloo, one broadcast from each rank into its part of ``out``: gloo's all-gather took 4x
        as long (64 MiB over 2 ranks: 77 vs 15 ms; 4 ranks: 112 vs 37 ms)."""
        send = self._send(x)
        target = out if out.device == self.device else self._torch.empty_like(out, device=self.device)

        def complete() -> Any:
            if target is not out:
                out.copy_(target)
            return out

        if self._nccl:
            return self._request(lambda: self._all_gather(self._bits(target), self._bits(send), async_op=True),
                                 complete)
        k = send.shape[0]
        target[self.rank * k:(self.rank + 1) * k].copy_(send)
        parts = [self._bits(target[r * k:(r + 1) * k]) for r in range(self.size)]
        return self._request(lambda: _Works([self._dist.broadcast(part, r, async_op=True)
                                             for r, part in enumerate(parts)]), complete)


def _words(a: Any) -> np.ndarray:
    """The raw 16-bit words of a 16-bit float array or CPU tensor, as MPI sees them (no conversion)."""
    if isinstance(a, np.ndarray):
        return a.view(np.int16)
    return a.view(sys.modules["torch"].int16)  # a tensor (DLPack): .numpy() would pin its storage's size


class _Works:
    """Several torch ``Work`` objects waited as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True
