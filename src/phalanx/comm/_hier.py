"""Hierarchical allreduce for ``gloo`` when a job has several ranks on some of several hosts.

Three stages, each a gloo collective on a process group of its own:

1. ``reduce`` within the host to its leader (the host's lowest rank), over
   loopback/the host's own stack: no byte crosses the link;
2. ``all_reduce`` among the leaders, one per host: the only stage whose bytes
   cross the link, ``2 (H-1)/H S`` per leader for H hosts and S bytes,
   instead of the flat ring's ``2 (N-1)/N S`` on each of the ring's links
   that cross a host boundary;
3. ``broadcast`` from the leader within the host.

Why it is built as it is:

* gloo matches the collectives of one process group by the order they are
  posted, and a stage may only be posted once the one before it has
  finished. So each stage has its own group (a host's reduce and broadcast
  groups have the same members but separate sequences), and a request posts
  a stage only after every earlier request has posted it (:meth:`Hierarchy.advance`):
  every rank posts each group's collectives in the order of its calls, however
  its requests are tested or waited.
* A request looks like a torch ``Work`` (``is_completed()``, ``wait(timeout)``),
  so the backend bounds it with the same wait as a flat collective: ``wait``
  blocks on whichever posted stage holds it up, with what is left of the
  deadline, and raises torch's own error (a lost peer, a timeout) or
  :class:`WaitTimeout` when the deadline passes between stages.
* Every rank makes every group at init, in the same order (``new_group`` is
  collective over the world), after one vote that every rank resolved the
  setting the same way (a rank that makes groups the others do not would wait
  for them until the group's backstop).
* Progress is driven by the calls that test or wait any request (the
  gradient bucket engine tests its requests from its hooks), not by a thread.
* A large buffer goes in chunks (``CHUNK_BYTES``), each a request: while one
  chunk crosses the link, the next is reduced within the host (the chunk
  sizes tried: ``benchmarks/README.md``, "Figures behind design choices").
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .._errors import InvalidSettingError, RendezvousError
from .._settings import settings
from ._base import PeerLost, WaitTimeout
from ._torchsetup import translate

__all__ = ["Hierarchy", "build_hierarchy", "host_layout"]

CHUNK_BYTES = 1 << 20  # a larger allreduce is pipelined in chunks of this size (measured: benchmarks/README.md)
# PHALANX_HIERARCHICAL unset/auto: off for now. It wins wherever measured (benchmarks/README.md), but under
# a partition the ranks behind the cut were stopped by the launcher before raising their own timeout
# (tests/test_host_failures.py, gloo); on once that is understood.
AUTO = False


def host_layout(hosts: list[str]) -> list[tuple[int, ...]]:
    """The ranks of each host (``hosts[r]`` is rank r's host), hosts in order of their lowest rank."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    return [tuple(ranks) for ranks in by_host.values()]


def build_hierarchy(backend: Any, hosts: list[str], timeout: float) -> Hierarchy | None:
    """The hierarchy of a gloo world whose rank ``r`` runs on ``hosts[r]``, or None for flat allreduce.

    Collective over the world (every rank calls it once, right after the process group is made).
    None unless the backend is gloo, there are several hosts, some host has several ranks and
    ``phalanx.settings.hierarchical`` (``PHALANX_HIERARCHICAL``) is not off.
    Raises InvalidSettingError when the ranks resolved the setting differently, RendezvousError
    when the groups cannot be made (a peer failed during set-up).
    """
    layout = host_layout(hosts)
    if backend.name != "gloo" or len(layout) < 2 or max(map(len, layout)) < 2:
        return None
    wanted = AUTO if settings.hierarchical is None else bool(settings.hierarchical)
    try:
        if not _vote(backend, wanted, timeout):
            raise InvalidSettingError(
                f"phalanx.init: rank {backend.rank} resolved PHALANX_HIERARCHICAL (phalanx.settings."
                f"hierarchical={settings.hierarchical!r}) to {'on' if wanted else 'off'}, but other ranks "
                "did not; set the same value on every rank (or leave it unset everywhere).")
        return Hierarchy(backend, layout, timeout) if wanted else None
    except (WaitTimeout, PeerLost, RuntimeError) as exc:
        raise RendezvousError(
            f"phalanx.init: rank {backend.rank} of {backend.size} could not set up the hierarchical "
            f"allreduce's process groups ({exc}). A peer failed during set-up (its own error is in its "
            "output); PHALANX_HIERARCHICAL=0 turns the hierarchy off.") from exc


def _vote(backend: Any, wanted: bool, timeout: float) -> bool:
    """True when every rank ``wanted`` the same (one bounded allreduce of the world)."""
    torch, dist = backend._torch, backend._dist
    votes = torch.tensor([int(wanted), -int(wanted)], dtype=torch.int64)
    backend._wait(dist.all_reduce(votes, dist.ReduceOp.MAX, async_op=True), timeout)
    return int(votes[0]) == -int(votes[1])


class Hierarchy:
    """The world's groups for hierarchical allreduce, and the requests in flight through them.

    Attributes: ``hosts`` (the ranks of each host, world ranks), ``leaders`` (the lowest rank of
    each host), ``local`` (this rank's host's ranks), ``leader`` (whether this rank is its host's),
    ``calls`` (hierarchical allreduces started on this rank: how tests see the path taken).
    Made by :func:`build_hierarchy`; arguments: the world's gloo backend, the host layout
    (:func:`host_layout`) and the backend's timeout (the groups' backstop).
    """

    def __init__(self, backend: Any, layout: list[tuple[int, ...]], timeout: float) -> None:
        dist = backend._dist
        self._owner = weakref.ref(backend)  # the world's backend (a group's copy is another object)
        backstop = {"timeout": timedelta(seconds=timeout + max(30.0, timeout))}
        rank = backend.rank
        self.hosts = layout
        self.leaders = tuple(ranks[0] for ranks in layout)
        self.local = next(ranks for ranks in layout if rank in ranks)
        self.leader = rank == self.local[0]
        self.calls = 0
        reduce_group = bcast_group = None
        for ranks in layout:  # every rank makes every group, in the same order
            if len(ranks) > 1:
                made = dist.new_group(list(ranks), **backstop), dist.new_group(list(ranks), **backstop)
                if ranks == self.local:
                    reduce_group, bcast_group = made
        leader_group = dist.new_group(list(self.leaders), **backstop)
        root = self.local[0]
        stages: list[Callable[[Any, Any], Any]] = []
        if reduce_group is not None:
            stages.append(lambda t, op: dist.reduce(t, root, op, group=reduce_group, async_op=True))
        if self.leader:
            stages.append(lambda t, op: dist.all_reduce(t, op, group=leader_group, async_op=True))
        if bcast_group is not None:
            stages.append(lambda t, op: dist.broadcast(t, root, group=bcast_group, async_op=True))
        self._stages = stages
        self._queue: deque[_HierWork] = deque()  # requests with stages left to post, in call order
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"<phalanx hierarchy hosts={[len(h) for h in self.hosts]} leaders={list(self.leaders)}>"

    def serves(self, backend: Any) -> bool:
        """Whether ``backend`` is the world this hierarchy was made for (not a sub-group's copy)."""
        return self._owner() is backend

    def all_reduce(self, t: Any, op: Any) -> Any:
        """Start reducing tensor ``t`` in place with torch ReduceOp ``op``; returns a Work-like request.

        A large contiguous ``t`` goes in chunks of about ``CHUNK_BYTES``, each a request of its own,
        so that one chunk's reduction within the host overlaps another's across hosts.
        """
        self.calls += 1
        step = max(1, CHUNK_BYTES // max(1, t.element_size()))
        if t.numel() <= step * 3 // 2 or not t.is_contiguous():
            return self._start(t, op)
        flat = t.view(-1)
        return _Chunks([self._start(flat[i:i + step], op) for i in range(0, flat.numel(), step)])

    def _start(self, t: Any, op: Any) -> _HierWork:
        work = _HierWork(self, t, op)
        with self._lock:
            work.post_next()
            self._queue.append(work)
        return work

    def advance(self) -> None:
        """Post every stage that may be posted: its previous stage finished, every earlier request
        has posted it. A stage that failed ends its request (the error is raised by its wait)."""
        with self._lock:
            allowed = len(self._stages)
            for work in list(self._queue):
                while work.posted < allowed and work.error is None and work.current_done():
                    work.post_next()
                if work.posted == len(self._stages) or work.error is not None:
                    self._queue.remove(work)
                    continue
                allowed = work.posted

    def blocker(self, work: _HierWork) -> Any:
        """The posted, unfinished stage that holds ``work`` up (its own, or an earlier request's)."""
        with self._lock:
            if work in self._queue:
                for earlier in self._queue:
                    if earlier is work or not earlier.current_done():
                        return earlier.current
            return work.current


class _HierWork:
    """One hierarchical allreduce in flight, with the interface of a torch ``Work``."""

    __slots__ = ("_hier", "_t", "_op", "posted", "current", "error")

    def __init__(self, hier: Hierarchy, t: Any, op: Any) -> None:
        self._hier, self._t, self._op = hier, t, op
        self.posted = 0
        self.current: Any = None
        self.error: RuntimeError | None = None

    def post_next(self) -> None:
        try:
            self.current = self._hier._stages[self.posted](self._t, self._op)
        except RuntimeError as exc:  # a failure to post: raised by wait()
            self.error = exc
        self.posted += 1

    def current_done(self) -> bool:
        """Whether the last posted stage finished; a failed one is recorded in ``error``."""
        if self.error is not None:
            return True
        if not self.current.is_completed():
            return False
        try:
            self.current.wait()
        except RuntimeError as exc:
            self.error = exc
        return True

    def _finished(self) -> bool:
        return self.error is not None or (self.posted == len(self._hier._stages) and self.current_done())

    def is_completed(self) -> bool:
        self._hier.advance()
        return self._finished()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until every stage finished, within ``timeout``; torch's error or WaitTimeout if not."""
        seconds = timeout.total_seconds() if timeout is not None else None
        deadline = None if seconds is None else time.monotonic() + seconds
        while True:
            self._hier.advance()
            if self._finished():
                if self.error is not None:
                    raise self.error
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left < 0.002:  # torch reads a timeout under 1 ms as none at all
                raise WaitTimeout(seconds)
            stage = self._hier.blocker(self)
            try:
                stage.wait() if left is None else stage.wait(timedelta(seconds=left))
            except RuntimeError as exc:
                if translate(exc) is None:
                    raise
                self.error = exc
                raise


class _Chunks:
    """The requests of one allreduce's chunks, as one Work-like request."""

    __slots__ = ("_works",)

    def __init__(self, works: list[_HierWork]) -> None:
        self._works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until every chunk finished, within ``timeout`` in all."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for work in self._works:
            left = None if deadline is None else timedelta(seconds=max(0.0, deadline - time.monotonic()))
            work.wait(left)
        return True
