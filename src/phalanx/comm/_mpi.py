"""The ``mpi`` backend: mpi4py over any MPI (MPICH, Open MPI, Intel MPI, ...).

Design notes (why, not what):

* phalanx works on its own duplicate of ``COMM_WORLD``, so a user's own MPI
  traffic can never be matched with phalanx's collectives.
* The per-call agreement is a non-blocking ``MAX`` allreduce of
  ``[sig, -sig]`` (two int64s): equal signatures everywhere iff the result is
  ``[sig, -sig]`` on every rank. It is polled, so it doubles as the timeout
  for "has every rank reached this call".
* The data phase is bounded too: every data method posts MPI's non-blocking
  collective and polls it with the same deadline (:func:`._wait.poll`:
  ``Test`` in a loop that yields the core every 64 tests). A
  peer that passed the agreement and then stopped answering (a cut link, a
  dead host) is a ``CollectiveTimeoutError`` naming the call, not a hang in
  a blocking ``MPI_Allreduce`` that no timeout can interrupt; the world is
  then broken and the rank ends with ``MPI_Abort``. A blocking call below
  some size would not be safe: a peer can vanish between the agreement and
  the data phase of any call, and in a loop of small calls that gap is half
  the time. Measured (``benchmarks/README.md``, "Bounded data phase"): with
  a core per rank the non-blocking call plus the poll costs nothing
  measurable against the blocking call; with more ranks than
  cores the poll must yield from its first tests (:mod:`._wait`). The
  requests and buffers of a data phase that timed out are kept
  (``_abandoned``): MPI may write into them until the process ends.
* An MPI error raised by a data phase (the transport saw a peer's
  connection close) is ``PeerLost``, so it reaches users as
  ``RankFailedError`` naming the call.
* MPI has no bfloat16 and float16 reductions are not portable, so half
  precision is reduced in float32 (exact for min/max, and one rounding at the
  end for sum/prod/avg) and moved as raw 16-bit words.
* CUDA tensors go straight to MPI when it is GPU-aware, otherwise through a
  host copy (``gpu_aware_mpi=False`` forces the copy). Loading the library and
  asking it about GPUs is in :mod:`._mpilib`.
"""

from __future__ import annotations

import array
import contextlib
import copy
import weakref
from typing import Any

import numpy as np

from .._arrays import NATIVE_NUMPY_DTYPES, cast_like
from .._errors import RendezvousError
from . import _halfsum, _ring
from ._base import PeerLost, WaitTimeout
from ._mpi_buffers import MPIBuffers, is_torch
from ._mpilib import (
    DIAG_TAG,
    MPIRequest,
    abort_job,
    check_launcher_agrees,
    detect_gpu_aware,
    diagnose,
    group_comms,
    import_mpi,
    lost_peer_on_mpi_error,
    mpi_available,
    preconnect,
)
from ._shard_ops import MPIShardOps
from ._staging import back_to_device, to_host
from ._wait import poll

__all__ = ["MPIBackend", "detect_gpu_aware", "mpi_available"]

REVOKED: list[Any] = []
"""Revoked communicators (a re-formed world's, :meth:`MPIBackend.revoke`), kept until the process ends:
freed, Open MPI 5.0.11 reuses their context id while a request on them is still pending (a bucket's
allreduce that the revocation did not end), and the next epoch's collectives then match the old ones:
``tests/program_lost_in_flight.py`` saw a poll of a pending allreduce never fail, and the new world's
``MPI_Comm_dup`` hang on every rank. One set per re-formed world."""


class MPIBackend(MPIBuffers, MPIShardOps):
    """Backend over mpi4py; see the module docstring."""

    name = "mpi"

    def __init__(self, *, gpu_aware_mpi: bool | None = None, base: Any = None) -> None:
        """``base``: the communicator to work on (duplicates of it): ``COMM_WORLD`` by default, an
        epoch's where the world re-forms (:mod:`._ulfm`)."""
        MPI = import_mpi()
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        self.MPI = MPI
        if base is None:
            check_launcher_agrees(MPI.COMM_WORLD.Get_size())
            base = MPI.COMM_WORLD
        try:
            comm, diag = base.Dup(), base.Dup()
            node = comm.Split_type(MPI.COMM_TYPE_SHARED)
            self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
            node.Free()
            if self.local_size < comm.Get_size():  # across hosts, a diagnosis must never open a connection
                preconnect(diag, DIAG_TAG)
            rings = _ring.rings_for(MPI, comm, self.local_size)  # rings: large buffers across hosts
        except MPI.Exception as exc:  # a peer of a re-formed world was lost while it formed (phalanx.reform)
            raise RendezvousError(f"phalanx.init: the world's communicators could not be made ({exc})") from None
        self.gpu_aware = detect_gpu_aware(MPI) if gpu_aware_mpi is None else bool(gpu_aware_mpi)
        self._ops = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
        self._bool_ops = {"min": MPI.LAND, "max": MPI.LOR}
        self._max = MPI.MAX
        self._in_place = MPI.IN_PLACE
        self._abandoned: list[tuple[Any, tuple[Any, ...]]] = []  # timed-out data phases (module notes)
        self._groups: list[weakref.ref[MPIBackend]] = []  # subgroup()'s backends: revoke() revokes them too
        self._revoked = False
        self._bind(comm, diag, rings)

    def _bind(self, comm: Any, diag: Any, ring: _ring.Rings | None) -> None:
        """Work on ``comm`` (the world's own duplicate, or a group's), diagnose on ``diag``."""
        self.comm, self._diag, self._ring = comm, diag, ring
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._chk, self._chk_out = array.array("q", [0, 0]), array.array("q", [0, 0])
        # A persistent collective (MPI-4) skips argument parsing on every call.
        try:
            self._agreement: Any = comm.Allreduce_init(self._chk, self._chk_out, self.MPI.MAX)
        except (NotImplementedError, self.MPI.Exception, AttributeError):
            self._agreement = None

    def subgroup(self, ranks: tuple[int, ...], serial: int, timeout: float,
                 members_only: bool = False) -> MPIBackend | None:
        """The backend of group ``ranks`` (world ranks) on a member, None elsewhere: communicators of
        the members only, this backend's options and op tables (see :meth:`Backend.subgroup`; only
        the members take part either way)."""
        if self.rank not in ranks:
            return None
        comm, diag = group_comms(self.MPI, self.comm, self._diag, ranks)
        try:  # among the members only, like group_comms
            ring = _ring.Rings(self.MPI, comm.Dup()) if self._ring is not None and len(ranks) > 1 else None
        except self.MPI.Exception as exc:
            raise PeerLost(str(exc)) from exc
        sub = copy.copy(self)  # shares _abandoned: MPI may write into those until the process ends
        sub._bind(comm, diag, ring)
        sub._groups = []
        self._groups.append(weakref.ref(sub))
        return sub

    def __repr__(self) -> str:
        return f"<phalanx mpi backend rank {self.rank}/{self.size}>"

    # -- agreement ------------------------------------------------------------
    def agree(self, signature: int, timeout: float) -> bool:
        # array.array, not NumPy: item access is several times cheaper, and this is the hot path.
        chk, out = self._chk, self._chk_out
        chk[0] = signature
        chk[1] = -signature
        req = self._agreement
        try:
            if req is None:
                req = self.comm.Iallreduce(chk, out, self._max)
            else:
                req.Start()
            if not req.Test():
                poll(req.Test, timeout)
        except self.MPI.Exception as exc:  # a peer lost (ULFM), as in every data phase
            raise PeerLost(str(exc)) from exc
        return out[0] == signature and out[1] == -signature

    @lost_peer_on_mpi_error
    def iagree(self, signature: int) -> MPIRequest:
        chk = np.array([signature, -signature], np.int64)
        out = np.empty(2, np.int64)
        req = self.comm.Iallreduce(chk, out, self.MPI.MAX)
        return MPIRequest(req, lambda: bool(out[0] == chk[0] and out[1] == chk[1]), self.MPI.Exception)

    @lost_peer_on_mpi_error
    def allgather_bytes(self, payload: bytes, timeout: float) -> list[bytes]:
        sizes = np.empty(self.size, np.int64)
        poll(self.comm.Iallgather(np.array([len(payload)], np.int64), sizes).Test, timeout)
        recv = np.empty(int(sizes.sum()), np.uint8)
        send = np.frombuffer(payload, np.uint8)
        poll(self.comm.Iallgatherv(send, (recv, sizes)).Test, timeout)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        return [recv[offsets[i]:offsets[i + 1]].tobytes() for i in range(self.size)]

    @lost_peer_on_mpi_error
    def broadcast_bytes(self, payload: bytes | None, root: int, timeout: float) -> bytes:
        size = np.array([len(payload) if self.rank == root and payload is not None else 0], np.int64)
        poll(self.comm.Ibcast(size, root).Test, timeout)
        buf = np.frombuffer(payload or b"", np.uint8).copy() if self.rank == root else np.empty(int(size[0]), np.uint8)
        poll(self.comm.Ibcast(buf, root).Test, timeout)
        return buf.tobytes()

    def diagnose(self, call: str, call_index: int, grace: float) -> tuple[list[int], dict[int, str]]:
        """Tell every peer where this rank is stuck; listen for their reports for ``grace`` s."""
        missing, elsewhere, sends = diagnose(self.MPI, self._diag, call, call_index, grace)
        self._pending_diag = sends  # keep the send buffers alive; the world is unusable now anyway
        return missing, elsewhere

    # -- data -----------------------------------------------------------------
    def _finish(self, req: Any, timeout: float, *buffers: Any) -> None:
        """Complete a data phase within ``timeout`` s (WaitTimeout otherwise; module notes). Its callers are
        :func:`lost_peer_on_mpi_error`'s: an MPI error, in the post or here, is PeerLost."""
        if not req.Test():
            self._wait(req, timeout, *buffers)

    def _wait(self, req: Any, timeout: float, *buffers: Any) -> None:
        try:
            poll(_ring.advancing(self._ring, req.Test), timeout, patient=False)
        except WaitTimeout:
            self._abandoned.append((req, buffers))  # MPI may still write into them: keep them alive
            raise

    def allreduce(self, x: Any, op: str, inplace: bool, timeout: float) -> Any:
        if (inplace and type(x) is np.ndarray and x.dtype in NATIVE_NUMPY_DTYPES
                and (self._ring is None or not _ring.eligible(x, op))):
            try:  # the hot path, without the wrapper's call
                req = self.comm.Iallreduce(self._in_place, x, self._ops[op])
                if not req.Test():
                    self._wait(req, timeout, x)
            except self.MPI.Exception as exc:
                raise PeerLost(str(exc)) from exc
            if op == "avg":
                x /= self.size
            return x
        return self._allreduce(x, op, inplace, timeout)

    @lost_peer_on_mpi_error
    def _allreduce(self, x: Any, op: str, inplace: bool, timeout: float) -> Any:
        if self._ring is not None and _ring.eligible(x, op):
            return self.iallreduce(x, op, inplace).wait(timeout)
        if _halfsum.eligible(x, op, self.size):  # 16-bit floats travel as 16 bits
            return _halfsum.HalfSum(self.comm, self.size, x, op, inplace).wait(timeout)
        work, finish = self._reduction_work(x, inplace)
        self._finish(self.comm.Iallreduce(self._in_place, work, self._mpi_op(work, op)), timeout, work)
        if op == "avg":
            work /= self.size
        return finish(work)

    @lost_peer_on_mpi_error
    def iallreduce(self, x: Any, op: str, inplace: bool) -> Any:
        if self._ring is not None and _ring.eligible(x, op):
            return self._ring.start(x, op, inplace)
        if _halfsum.eligible(x, op, self.size):
            return _halfsum.HalfSum(self.comm, self.size, x, op, inplace)
        work, finish = self._reduction_work(x, inplace)
        req = self.comm.Iallreduce(self.MPI.IN_PLACE, work, self._mpi_op(work, op))

        def complete() -> Any:
            if op == "avg":
                work.__itruediv__(self.size)
            return finish(work)

        return MPIRequest(req, complete, self.MPI.Exception)

    def _bcast_buffer(self, x: Any, inplace: bool) -> tuple[Any, Any]:
        """(user-typed result, its MPI view) for a broadcast into ``x``."""
        if isinstance(x, np.ndarray) and not inplace:
            x = x.copy()
        if self._staged(x):
            host = to_host(x)
            return host, self._as_mpi(host)
        return x, self._as_mpi(x)

    @lost_peer_on_mpi_error
    def broadcast(self, x: Any, root: int, inplace: bool, timeout: float) -> Any:
        out, view = self._bcast_buffer(x, inplace)
        self._finish(self.comm.Ibcast(view, root), timeout, view)
        return self._copy_back(x, out)

    @lost_peer_on_mpi_error
    def ibroadcast(self, x: Any, root: int, inplace: bool) -> MPIRequest:
        out, view = self._bcast_buffer(x, inplace)
        req = self.comm.Ibcast(view, root)
        return MPIRequest(req, lambda: self._copy_back(x, out), self.MPI.Exception)

    @lost_peer_on_mpi_error
    def isend(self, x: Any, dst: int, tag: int) -> MPIRequest:
        view = self._as_mpi(self._host_in(x))

        def sent(keep: Any = view) -> Any:  # the send buffer lives until the request completes
            return x

        return MPIRequest(self.comm.Isend(view, dest=dst, tag=tag), sent, self.MPI.Exception)

    @lost_peer_on_mpi_error
    def irecv(self, x: Any, src: int, tag: int) -> MPIRequest:
        out, view = self._bcast_buffer(x, True)
        return MPIRequest(self.comm.Irecv(view, source=src, tag=tag), lambda: self._copy_back(x, out),
                          self.MPI.Exception)

    def _copy_back(self, x: Any, out: Any) -> Any:
        if out is not x and is_torch(x) and x.is_cuda:
            return back_to_device(out, x) if not out.is_cuda else x.copy_(out)
        return out

    @lost_peer_on_mpi_error
    def reduce(self, x: Any, op: str, root: int, inplace: bool, timeout: float) -> Any:
        if self.rank != root:
            work = self._reduction_work(x, inplace=True)[0]  # a send buffer; x is not written
            self._finish(self.comm.Ireduce(work, None, self._mpi_op(work, op), root), timeout, work)
            return x
        work, finish = self._reduction_work(x, inplace)
        self._finish(self.comm.Ireduce(self._in_place, work, self._mpi_op(work, op), root), timeout, work)
        if op == "avg":
            work /= self.size
        return finish(work)

    def _as_send(self, x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return x
        return self._as_mpi(self._host_in(x))

    @lost_peer_on_mpi_error
    def allgather(self, x: Any, timeout: float) -> Any:
        out, view = self._new_like(x, (self.size, *x.shape))
        send = self._as_send(x)
        self._finish(self.comm.Iallgather(send, view), timeout, send, view)
        return self._device_out(x, out)

    @lost_peer_on_mpi_error
    def gather(self, x: Any, root: int, timeout: float) -> Any:
        send = self._as_send(x)
        if self.rank != root:
            self._finish(self.comm.Igather(send, None, root), timeout, send)
            return None
        out, view = self._new_like(x, (self.size, *x.shape))
        self._finish(self.comm.Igather(send, view, root), timeout, send, view)
        return self._device_out(x, out)

    @lost_peer_on_mpi_error
    def reduce_scatter(self, x: Any, op: str, timeout: float) -> Any:
        shape = (x.shape[0] // self.size, *x.shape[1:])
        work = self._reduction_work(x, inplace=True)[0]  # a send buffer; x is not written
        recv = np.empty(shape, work.dtype) if isinstance(work, np.ndarray) else work.new_empty(shape)
        self._finish(self.comm.Ireduce_scatter_block(work, recv, self._mpi_op(work, op)), timeout, work, recv)
        if op == "avg":
            recv /= self.size
        return cast_like(x, recv)

    @lost_peer_on_mpi_error
    def alltoall(self, x: Any, timeout: float) -> Any:
        out, view = self._new_like(x, tuple(x.shape))
        send = self._as_send(x)
        self._finish(self.comm.Ialltoall(send, view), timeout, send, view)
        return self._device_out(x, out)

    @lost_peer_on_mpi_error
    def barrier(self, timeout: float) -> None:
        poll(_ring.advancing(self._ring, self.comm.Ibarrier().Test), timeout)

    # -- lifecycle --------------------------------------------------------------
    def shutdown(self) -> None:
        if self._agreement is not None:
            with contextlib.suppress(Exception):
                self._agreement.Free()
        if self._revoked:  # never freed: see REVOKED
            REVOKED.append((self.comm, self._diag, self._ring))
            return
        if self._ring is not None:
            self._ring.free()
        for comm in (self.comm, self._diag):
            try:
                comm.Free()
            except Exception:  # noqa: BLE001 - freeing after a failure may itself fail
                pass

    def revoke(self) -> None:
        """Revoke this backend's communicators (ULFM's ``MPI_Comm_revoke``): the peers' pending and next
        calls on them fail at once with ``MPI_ERR_REVOKED``; a duplicate is not revoked with its parent, nor a
        group's communicators with the world's: those of :meth:`subgroup` are revoked here too (a member waiting
        in a group's call on a rank that is re-forming the world stops waiting at once)."""
        self._revoked = True
        comms = [self.comm, self._diag, *([self._ring.comm] if self._ring is not None else [])]
        for comm in comms:
            with contextlib.suppress(Exception):  # revoked by a peer already, or no ULFM: nothing to do
                comm.Revoke()
        for ref in self._groups:
            group = ref()
            if group is not None:
                group.revoke()

    def abort(self, code: int) -> None:
        """End the job with ``MPI_Abort(code)``, then this process (:func:`._mpilib.abort_job`)."""
        abort_job(self.MPI, code)
