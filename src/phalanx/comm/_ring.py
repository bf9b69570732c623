"""A ring allreduce over MPI point-to-point messages, for large buffers in worlds that span hosts.

Why: across hosts over TCP, MPICH's own ``MPI_Iallreduce`` picks a
recursive-halving schedule that keeps a slow link far less busy than gloo's
ring does (``benchmarks/README.md``, "Across hosts"). A ring moves the same ``2 (size-1)/size`` bytes per rank,
each rank only ever talking to its two neighbours, in ``2 (size-1)`` steps:
``size-1`` of reduce-scatter (receive a segment, add it to the local one, send
it on) and ``size-1`` of allgather (pass the finished segments round).

It is a state machine driven by :meth:`Ring.test`, like the backend's other
requests: each call checks the step's two messages and, when both are done,
reduces and posts the next step; ``wait`` polls with the call's deadline, so a
lost peer is a timeout, never a hang. Messages go on a communicator of their
own with a tag per request (every rank starts its requests in the same order).

16-bit floats travel as 16 bits and are added in float32, the partial sum
rounded to 16 bits at each hop (as gloo's and NCCL's rings do); ``avg``
divides each finished segment once, before the allgather.

Used when ``phalanx.settings.mpi_ring`` (``PHALANX_MPI_RING``) is on, or unset
and the world spans hosts (some rank has a different shared-memory node), for
host buffers of at least ``MIN_BYTES``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ._base import PeerLost
from ._hring import HierRing, Levels
from ._wait import Stepped

__all__ = ["MIN_BYTES", "Ring", "Rings", "advancing", "eligible", "rings_for"]

MIN_BYTES = 1 << 20
SEGMENT_BYTES = 1 << 20  # at most this much per message: a long buffer goes round as several rings
_UFUNCS = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _half_kind(x: Any) -> str | None:
    """"bf16"/"f16" for a 16-bit float buffer, else None."""
    if isinstance(x, np.ndarray):
        return "f16" if x.dtype == np.float16 else None
    torch = sys.modules["torch"]
    return {torch.bfloat16: "bf16", torch.float16: "f16"}.get(x.dtype)


def eligible(x: Any, op: str) -> bool:
    """Whether ``x`` is a contiguous host buffer of at least MIN_BYTES that the ring reduces with ``op``."""
    if isinstance(x, np.ndarray):
        dtype, nbytes, ok = x.dtype, x.nbytes, x.flags.c_contiguous
    else:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(x, torch.Tensor) or x.is_cuda or not x.is_contiguous():
            return False
        if x.dtype in (torch.bfloat16, torch.float16):
            return op in ("sum", "avg") and x.numel() * 2 >= MIN_BYTES
        if x.dtype not in (torch.float32, torch.float64):
            return False
        dtype, nbytes, ok = np.dtype(str(x.dtype).removeprefix("torch.")), x.numel() * x.element_size(), True
    if not ok or nbytes < MIN_BYTES:
        return False
    if dtype == np.float16:
        return op in ("sum", "avg")
    return dtype in _FLOATS and op in _UFUNCS


def rings_for(MPI: Any, comm: Any, local_size: int) -> Rings | None:
    """The :class:`Rings` of ``comm`` (on a duplicate of it), or None where the ring is not used.

    On when ``phalanx.settings.mpi_ring`` is True, or None (``PHALANX_MPI_RING`` unset) and the world spans
    hosts; every rank must agree (the most restrictive rank's choice wins), so this is collective. In two
    levels (:mod:`._hring`) where the world spans hosts and some host holds several ranks, unless
    ``phalanx.settings.hierarchical`` is False (True: on one host too).
    """
    from .._settings import settings

    size = comm.Get_size()
    wanted = settings.mpi_ring if settings.mpi_ring is not None else local_size < size
    if size == 1 or not comm.allreduce(int(bool(wanted)), op=MPI.MIN):
        return None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    hosts = comm.allreduce(int(node.Get_rank() == 0))
    shared = comm.allreduce(node.Get_size(), op=MPI.MAX) > 1
    two_levels = settings.hierarchical if settings.hierarchical is not None else (hosts > 1 and shared)
    if not comm.allreduce(int(bool(two_levels)), op=MPI.MIN):
        node.Free()
        return Rings(MPI, comm.Dup())
    leaders = comm.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, comm.Get_rank())
    return Rings(MPI, comm.Dup(), Levels(Rings, MPI, node, None if leaders == MPI.COMM_NULL else leaders, hosts))


def advancing(rings: Rings | None, test: Callable[[], bool]) -> Callable[[], bool]:
    """``test``, moving ``rings``' live rings on too where there are any (a rank waiting on another request
    must not stall its ring peers)."""
    return test if rings is None or not rings.live else rings.advancing(test)


class Rings:
    """The rings of one communicator: each started with a tag of its own, every live one advanced, oldest
    first, whenever any is tested or waited on (or the backend waits on another request), so ranks may wait
    on their rings in different orders, as MPI allows for its own non-blocking collectives."""

    def __init__(self, MPI: Any, comm: Any, levels: Levels | None = None) -> None:
        self.MPI, self.comm, self.levels = MPI, comm, levels
        self.live: list[Ring | HierRing] = []
        self._count = 0

    def start(self, x: Any, op: str, inplace: bool) -> Ring | HierRing:
        """Post the first step of the ring allreduce of ``x`` with ``op`` (in two levels where the backend
        has them); returns its request."""
        self._count += 1
        tag = self._count % 32_000
        if self.levels is not None:
            ring: Ring | HierRing = HierRing(self, self.levels, Ring, x, op, inplace, tag, self.comm.Get_size())
        else:
            ring = Ring(self, x, op, inplace, tag)
        self.live.append(ring)
        return ring

    def free(self) -> None:
        """Free the communicators (the backend's shutdown)."""
        if self.levels is not None:
            self.levels.free()
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001 - freeing after a failure may itself fail
            pass

    def advance(self) -> None:
        """Move every live ring on as far as its messages allow (PeerLost on an MPI error)."""
        for ring in list(self.live):
            if ring._advance():
                self.live.remove(ring)

    def advancing(self, test: Callable[[], bool]) -> Callable[[], bool]:
        """``test`` that also advances the live rings (for the backend's waits on other requests)."""
        def both() -> bool:
            self.advance()
            return test()
        return both


class Ring(Stepped):
    """The ring allreduce of ``x`` (module docstring); ``test()``/``wait(timeout)`` like MPIRequest."""

    __slots__ = ("_rings", "_comm", "_MPI", "_rank", "_size", "_op", "_tag", "_result", "_all", "_words",
                 "_half", "_bounds", "_recv", "_reqs", "_step", "_done", "_block", "_per_block", "_divisor")

    def __init__(self, rings: Rings, x: Any, op: str, inplace: bool, tag: int, divisor: int | None = None) -> None:
        self._rings, self._comm, self._MPI, self._op, self._tag = rings, rings.comm, rings.MPI, op, tag
        comm = self._comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._divisor = divisor or self._size  # what ``avg`` divides by (two levels: the whole world's size)
        torch_like = not isinstance(x, np.ndarray)
        self._result = x if inplace else (x.clone() if torch_like else x.copy())
        self._half = _half_kind(self._result)
        flat = self._result.reshape(-1)
        if self._half is not None:  # raw words: MPI moves them, this module does the arithmetic
            flat = flat.view(sys.modules["torch"].int16) if torch_like else flat.view(np.int16)
        self._all = flat.numpy() if torch_like else flat
        n, size = self._all.shape[0], self._size
        self._per_block = max(size, size * (SEGMENT_BYTES // self._all.itemsize))
        self._recv = np.empty(-(-min(n, self._per_block) // size), self._all.dtype)
        self._block, self._done = 0, False
        try:
            self._start_block()
        except self._MPI.Exception as exc:
            raise PeerLost(str(exc)) from exc

    def _start_block(self) -> None:
        n, size = self._all.shape[0], self._size
        start = self._block * self._per_block
        self._words = self._all[start:min(n, start + self._per_block)]
        count = self._words.shape[0]
        self._bounds = [count * i // size for i in range(size + 1)]
        self._step = 0
        self._post()

    def _segment(self, i: int) -> np.ndarray:
        return self._words[self._bounds[i]:self._bounds[i + 1]]

    def _indices(self) -> tuple[int, int]:
        """(segment sent, segment received) in the current step."""
        r, n, s = self._rank, self._size, self._step
        if s < n - 1:
            return (r - s) % n, (r - s - 1) % n
        t = s - (n - 1)
        return (r - t + 1) % n, (r - t) % n

    def _post(self) -> None:
        send, recv = self._indices()
        n = self._size
        left, right = (self._rank - 1) % n, (self._rank + 1) % n
        into = self._recv[:len(self._segment(recv))] if self._step < n - 1 else self._segment(recv)
        self._reqs = [self._comm.Irecv(into, source=left, tag=self._tag),
                      self._comm.Isend(self._segment(send), dest=right, tag=self._tag)]

    def _reduce(self, i: int) -> None:
        """Segment ``i`` op= the received one; the last reduce-scatter step also averages (``avg``)."""
        mine, got = self._segment(i), self._recv[:len(self._segment(i))]
        last = self._step == self._size - 2
        if self._half is None:
            _UFUNCS[self._op](mine, got, out=mine)
            if last and self._op == "avg":
                mine /= self._divisor
            return
        torch = sys.modules.get("torch")
        if torch is not None:  # vectorised 16-bit conversions (NumPy's float16 ones are not)
            dtype = torch.bfloat16 if self._half == "bf16" else torch.float16
            a, b = torch.from_numpy(mine).view(dtype), torch.from_numpy(got).view(dtype)
            if last and self._op == "avg":
                a.copy_(a.float().add_(b.float()).div_(self._divisor))
            else:
                a.add_(b)  # in float32, rounded to 16 bits once
            return
        total = _widen(mine, self._half) + _widen(got, self._half)
        if last and self._op == "avg":
            total /= self._divisor
        mine[:] = _narrow(total, self._half)

    def _advance(self) -> bool:
        """Reduce and post as far as the messages allow; True once done."""
        try:
            while not self._done:
                if not self._MPI.Request.Testall(self._reqs):
                    return False
                if self._step < self._size - 1:
                    self._reduce(self._indices()[1])
                self._step += 1
                if self._step < 2 * (self._size - 1):
                    self._post()
                elif (self._block + 1) * self._per_block < self._all.shape[0]:
                    self._block += 1
                    self._start_block()
                else:
                    self._done, self._reqs, self._recv = True, [], None  # type: ignore[assignment]
        except self._MPI.Exception as exc:
            raise PeerLost(str(exc)) from exc
        return True

    def test(self) -> bool:
        """Whether the allreduce is done (advancing every live ring of its communicator first)."""
        if not self._done:
            self._rings.advance()
        return self._done


def _widen(words: np.ndarray, kind: str) -> np.ndarray:
    """16-bit words (int16) as float32 values."""
    if kind == "f16":
        return words.view(np.float16).astype(np.float32)
    return (words.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _narrow(values: np.ndarray, kind: str) -> np.ndarray:
    """float32 values as 16-bit words (int16), rounded to nearest even."""
    if kind == "f16":
        return values.astype(np.float16).view(np.int16)
    bits = values.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    rounded[np.isnan(values)] = 0x7FC0
    return rounded.view(np.int16)
