"""The mpi ring allreduce in two levels, for worlds whose hosts hold several ranks.

A flat ring over ``N`` ranks makes each host's link carry ``2 (N-1)/N`` times
the buffer (the rank whose right neighbour is on the next host sends that
much), however many of those ranks share the host. In two levels:

1. **within the host**: a ring allreduce over the host's ranks (shared memory);
2. **across hosts**: a ring allreduce of the host sums among one leader per host
   (local rank 0), ``2 (H-1)/H`` times the buffer on each link for ``H`` hosts;
3. **within the host**: the leader broadcasts the result (``MPI_Ibcast``, posted in the order the
   allreduces started, as MPI requires, even when a later one reaches it first).

On 2 hosts × 2 ranks that is 1× the buffer per link instead of 1.5×
(``benchmarks/README.md``, "Across hosts"). Each level is a :class:`Ring` on a
communicator of its own (the same tag, so one request's messages never meet
another's); ``avg`` sums within the host and, among the leaders, sums and
divides by the world's size in float32, as the flat ring does (on one host the
host's ring divides). A state machine like :class:`Ring`: :meth:`_advance` moves
it on, :class:`Rings` advances every live one whenever any is tested.

Used in place of the flat ring where the ring is on, the world spans hosts and
some host holds more than one rank, unless ``phalanx.settings.hierarchical``
(``PHALANX_HIERARCHICAL``) is False; True uses it on one host too.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._base import PeerLost
from ._wait import Stepped

__all__ = ["HierRing", "Levels"]



class Levels:
    """The communicators of the two levels: ``node`` (this host's ranks) and ``leaders`` (local rank 0 of
    every host; None on other ranks), each wrapped as a ``Rings`` for its :class:`Ring` steps."""

    def __init__(self, rings_type: Any, MPI: Any, node: Any, leaders: Any, hosts: int) -> None:
        self.hosts = hosts  # how many hosts (leaders) the world has
        self.node = rings_type(MPI, node)
        self.leaders = rings_type(MPI, leaders) if leaders is not None else None
        self.leader = node.Get_rank() == 0
        self.started = 0  # two-level allreduces started, and broadcasts posted: MPI matches non-blocking
        self.posted = 0   # collectives by the order they are posted, so they are posted in start order
        self.broken: BaseException | None = None  # the first failure: later allreduces raise it at once

    def free(self) -> None:
        for rings in (self.node, self.leaders):
            if rings is not None:
                try:
                    rings.comm.Free()
                except Exception:  # noqa: BLE001 - freeing after a failure may itself fail
                    pass


def _raw(x: Any) -> np.ndarray:
    """The bytes of a contiguous buffer as a NumPy uint8 view (for the broadcast)."""
    if isinstance(x, np.ndarray):
        return x.reshape(-1).view(np.uint8)
    return x.reshape(-1).view(sys.modules["torch"].uint8).numpy()


class HierRing(Stepped):
    """The two-level allreduce of ``x`` (module docstring); ``test()``/``wait(timeout)`` like :class:`Ring`.

    ``avg`` sums within hosts and averages among the leaders (that ring divides by the world's size in
    float32, as the flat ring does; on one host, the host's ring does). A failure (PeerLost) is kept and
    raised again by every later ``test``; it also marks the :class:`Levels` broken, so that later
    allreduces, whose broadcasts would wait for this one's, fail at once instead of timing out.
    """

    def __init__(self, rings: Any, levels: Levels, ring_type: Any, x: Any, op: str, inplace: bool,
                 tag: int, world_size: int) -> None:
        self._rings, self._levels, self._ring_type, self._tag = rings, levels, ring_type, tag
        self._MPI, self._size = rings.MPI, world_size
        torch_like = not isinstance(x, np.ndarray)
        self._result = x if inplace else (x.clone() if torch_like else x.copy())
        node_ring = levels.node.comm.Get_size() > 1
        leaders_ring = levels.leaders is not None and levels.hosts > 1
        # avg: the host's ring sums where the leaders' ring follows (the same on every rank of a host), and
        # the last ring divides by the world's size
        self._ops = ("sum" if op == "avg" and levels.hosts > 1 else op, op)
        self._levels_run = (node_ring, leaders_ring)
        self._stage, self._current, self._done = 0, None, False
        self._error: PeerLost | None = None
        self._seq = levels.started
        levels.started += 1
        if levels.broken is not None:
            raise PeerLost(f"an earlier two-level allreduce failed: {levels.broken}")
        try:
            self._begin(0)
        except (self._MPI.Exception, PeerLost) as exc:
            raise self._fail(exc) from exc

    def _fail(self, exc: BaseException) -> PeerLost:
        error = exc if isinstance(exc, PeerLost) else PeerLost(str(exc))
        self._error, self._current = error, None
        if self._levels.broken is None:
            self._levels.broken = error
        return error

    def _begin(self, stage: int) -> None:
        """Start ``stage`` (0 within the host, 1 among the leaders, 2 the broadcast), skipping empty ones."""
        levels = self._levels
        self._current = None
        while stage < 3:
            self._stage = stage
            if stage < 2 and self._levels_run[stage]:
                rings = levels.node if stage == 0 else levels.leaders
                self._current = self._ring_type(rings, self._result, self._ops[stage], True, self._tag, self._size)
                return
            if stage == 2:
                if levels.posted != self._seq:  # an older one has not posted its broadcast yet
                    return
                levels.posted += 1
                if self._levels_run[0]:
                    self._current = levels.node.comm.Ibcast(_raw(self._result), root=0)
                    return
            stage += 1
        self._done = True

    def _advance(self) -> bool:
        """Move on as far as the messages allow; True once done (PeerLost on an MPI error, then on every
        later call)."""
        if self._error is not None:
            raise self._error
        try:
            while not self._done:
                current = self._current
                if current is None:  # waiting for its turn to post the broadcast
                    self._begin(2)
                    if self._current is None and not self._done:
                        return False
                    continue
                finished = current._advance() if self._stage < 2 else current.Test()
                if not finished:
                    return False
                self._begin(self._stage + 1)
        except (self._MPI.Exception, PeerLost) as exc:
            raise self._fail(exc) from exc
        return True

    def test(self) -> bool:
        """Whether the allreduce is done (advancing every live ring of the backend first)."""
        if self._error is not None:
            raise self._error
        if not self._done:
            self._rings.advance()
        return self._done
