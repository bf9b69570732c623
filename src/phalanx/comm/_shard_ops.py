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

import datetime
import sys
import time
from typing import Any

import numpy as np

from .._arrays import cast_like
from . import _halfsum
from ._mpilib import MPIRequest, lost_peer_on_mpi_error

__all__ = ["MPIShardOps", "TorchShardOps"]


class MPIShardOps:
    """``ireduce_scatter``/``iallgather_into`` for :class:`~phalanx.comm._mpi.MPIBackend`."""

    gathers_by_broadcast = True
    """Sharded training gathers parameters by broadcasting each rank's part in place
    (``ShardPlan.gather``): no copy in or out of a gather buffer (``benchmarks/README.md``, "Figures
    behind design choices")."""

    @lost_peer_on_mpi_error
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

    @lost_peer_on_mpi_error
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

    @lost_peer_on_mpi_error
    def iallgather_into(self: Any, x: Any, out: Any) -> MPIRequest:
        """Post an all-gather of 1-D ``x`` into 1-D ``out`` (rank ``r``'s at ``[r*k, (r+1)*k)``)."""
        host = out.cpu() if self._staged(out) else out  # a CUDA output staged on the host
        if _plain_cpu(x) and _plain_cpu(host):
            send: Any = _raw(self.MPI, x)
            req = self.comm.Iallgather(send, _raw(self.MPI, host))
        else:
            send = self._as_send(x)
            req = self.comm.Iallgather(send, self._as_mpi(host))

        def complete(keep: Any = (send, host)) -> Any:
            if host is not out:
                out.copy_(host)
            return out

        return MPIRequest(req, complete, self.MPI.Exception)


class TorchShardOps:
    """``ireduce_scatter``/``iallgather_into`` for :class:`~phalanx.comm._torch.TorchBackend` (gloo, nccl)."""

    @property
    def gathers_by_broadcast(self: Any) -> bool:
        """Whether sharded training gathers parameters by broadcasting each rank's part in place
        (``ShardPlan.gather``): on gloo, whose broadcast into the destination is faster than its
        all-gather, which also needs a copy in and out (``benchmarks/README.md``, "Figures behind
        design choices")."""
        return not self._nccl

    def ireduce_scatter(self: Any, x: Any, op: str) -> Any:
        """Post a reduce-scatter of 1-D ``x`` (``size * k`` elements); the result is this rank's ``k``.

        On gloo, a sum or mean of 32- or 64-bit floats is a pairwise exchange: in step ``s`` each rank
        sends rank ``r+s`` its chunk of ``x`` and adds the chunk received from rank ``r-s`` (each rank
        moves ``(size-1)*k`` elements, half an allreduce's bytes), faster than gloo's own reduce-scatter
        and than an allreduce (``benchmarks/README.md``, "Figures behind design choices"). Other
        dtypes and ops, and worlds of a group, are an
        allreduce of ``x`` in place of which this rank keeps its chunk. So ``x``'s contents are
        undefined afterwards on gloo (the engine releases the bucket anyway)."""
        if not self._nccl:
            t, _ = self._work(x, True, op)
            k = t.shape[0] // self.size
            lo = self.rank * k
            if self.size > 1 and op in ("sum", "avg") and t.dtype in (self._torch.float32, self._torch.float64) \
                    and (self._owns_group or self._group is None) and t.device.type == "cpu":  # the world's
                self._pair_tag = tag = (getattr(self, "_pair_tag", 0) + 1) % (1 << 30)
                out = t.new_empty(k)

                def summed() -> Any:
                    self._scale(out, op)
                    return self._user(x, out)

                return self._request(lambda: _Pairwise(self._dist, t.view(self.size, k), out, self.rank, tag),
                                     summed)

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

        On gloo, one broadcast from each rank into its part of ``out``: gloo's all-gather takes
        several times as long (``benchmarks/README.md``, "Figures behind design choices")."""
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


def _plain_cpu(t: Any) -> bool:
    return not isinstance(t, np.ndarray) and not t.is_cuda and t.is_contiguous()


def _raw(MPI: Any, t: Any) -> list[Any]:
    """A CPU tensor's memory as MPI bytes, leaving its storage resizable (``numpy()`` marks it not
    resizable for good, and sharded parameters free and regather their storage). The caller keeps
    ``t`` alive until the request completes."""
    return [MPI.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size()), MPI.BYTE]


def _words(a: Any) -> np.ndarray:
    """The raw 16-bit words of a 16-bit float array or CPU tensor, as MPI sees them (no conversion)."""
    if isinstance(a, np.ndarray):
        return a.view(np.int16)
    return a.view(sys.modules["torch"].int16)  # a tensor (DLPack): .numpy() would pin its storage's size


class _Pairwise:
    """A reduce-scatter as pairwise exchanges, waited as one torch ``Work``: step ``s`` (1 to size-1)
    sends chunk ``r+s`` of ``parts`` to rank ``r+s`` and receives rank ``r-s``'s chunk ``r``, which is
    added into ``out``. One step is in flight at a time (one extra chunk-sized buffer from 3 ranks);
    :meth:`is_completed` and :meth:`wait` move to the next step."""

    def __init__(self, dist: Any, parts: Any, out: Any, rank: int, tag: int) -> None:
        self.dist, self.parts, self.out, self.rank, self.tag = dist, parts, out, rank, tag
        self.size = parts.shape[0]
        self.spare: Any = None
        self.step = 0
        self.works: list[Any] = []
        self._post()

    def _post(self) -> None:
        self.step += 1
        s, r, n = self.step, self.rank, self.size
        if s == 1:
            into = self.out
        else:
            into = self.spare = self.out.new_empty(self.out.shape[0]) if self.spare is None else self.spare
        self.works = [self.dist.isend(self.parts[(r + s) % n], (r + s) % n, tag=self.tag),
                      self.dist.irecv(into, (r - s) % n, tag=self.tag)]

    def _advance(self) -> None:
        """The current step's exchange is complete: add what it received; post the next step."""
        self.works = []
        self.out.add_(self.parts[self.rank] if self.step == 1 else self.spare)
        if self.step < self.size - 1:
            self._post()
        else:
            self.parts = self.spare = None

    def is_completed(self) -> bool:
        while self.works and all(w.is_completed() for w in self.works):
            try:
                for w in self.works:
                    w.wait()
            except RuntimeError:
                return True  # failed: wait() raises it
            self._advance()
        return not self.works

    def wait(self, timeout: Any = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while self.works:
            for w in self.works:
                if deadline is None:
                    w.wait()
                else:
                    w.wait(datetime.timedelta(seconds=max(1e-3, deadline - time.monotonic())))  # 0: forever
            self._advance()
        return True


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
