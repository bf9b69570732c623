"""What the ``gloo``/``nccl`` backends hold of ``torch.distributed``: requests, groups, teardown.

* :class:`TorchRequest`: a ``Work`` in flight plus what turns its buffers into
  the user's result (the backends' non-blocking calls).
* :func:`group_dist`: the process group of a ``phalanx.new_group`` (every rank
  of the world makes it, members or not, in the same order) and, on a member,
  ``torch.distributed`` as the group's backend calls it (:class:`GroupDist`:
  every collective on the group, roots translated to the world ranks torch
  expects). :meth:`TorchBackend.subgroup` runs its data methods over it.
* :func:`end_group`: destroy a process group in a thread given up after a few
  seconds: after a failure, destroying can block on a peer that is gone, and
  leaving must not.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._base import PeerLost, WaitTimeout
from ._torchsetup import translate

__all__ = ["GroupDist", "TorchRequest", "WaitedWork", "end_group", "group_dist"]

_TEARDOWN_S = 2.0  # destroying a process group may block on a peer that is gone: then give up


class TorchRequest:
    """A ``Work`` in flight plus what turns its buffers into the user's result.

    ``wait(work, timeout)`` is the backend's bounded wait (WaitTimeout or PeerLost);
    ``error`` is a failure to post, raised by :meth:`wait` like any other.
    """

    __slots__ = ("_wait", "_work", "_finish", "_done", "_result", "_error")

    def __init__(self, wait: Callable[[Any, float], None], work: Any, finish: Callable[[], Any],
                 error: Exception | None = None) -> None:
        self._wait, self._work, self._finish, self._error = wait, work, finish, error
        self._done = False
        self._result: Any = None

    def test(self) -> bool:
        if self._done or self._error is not None:
            return True
        if not self._work.is_completed():
            return False
        try:
            self.wait(1.0)
        except (WaitTimeout, PeerLost) as exc:  # kept for wait(), where the front end expects it
            self._error = exc
        return True

    def wait(self, timeout: float) -> Any:
        if not self._done:
            if self._error is not None:
                raise self._error
            self._wait(self._work, timeout)
            self._result = self._finish()
            self._done = True
            self._work, self._finish = None, _released  # drop buffer references
        return self._result


def _released() -> None:
    return None


class WaitedWork:
    """A gloo point-to-point ``Work`` waited in a thread of its own, so that it can be polled.

    gloo completes a send or receive only inside ``wait()`` (``is_completed()``
    stays False until then), and a send completes only once its receive is
    posted; a rank polling several messages (phalanx._p2p) must see each one
    complete without blocking on any. The thread's wait is bounded by the
    group's own timeout; :meth:`wait` by its caller's.
    """

    __slots__ = ("_work", "_thread", "_error")

    def __init__(self, work: Any) -> None:
        self._work = work
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="phalanx-p2p", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._work.wait()
        except BaseException as exc:  # noqa: BLE001 - raised again by wait()
            self._error = exc

    def is_completed(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._thread.join(None if timeout is None else timeout.total_seconds())
        if self._thread.is_alive():
            raise WaitTimeout(timeout.total_seconds() if timeout is not None else 0.0)
        if self._error is not None:
            raise self._error
        return True


class GroupDist:
    """``torch.distributed`` as a group's backend calls it: every collective on ``group``, roots translated.

    torch takes the roots of ``broadcast``/``reduce``/``gather`` as world ranks even
    with ``group=``; the backend's code passes group ranks.
    """

    all_gather_single = reduce_scatter_single = None  # so the backend picks the methods below

    def __init__(self, dist: Any, group: Any, ranks: tuple[int, ...]) -> None:
        self._dist, self.group, self._ranks = dist, group, ranks
        self.ReduceOp = dist.ReduceOp
        self._gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._scatter_from = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def __getattr__(self, name: str) -> Any:  # anything else (is_initialized, ...) as it is
        return getattr(self._dist, name)

    def all_reduce(self, t: Any, op: Any = None, async_op: bool = False) -> Any:
        op = self._dist.ReduceOp.SUM if op is None else op
        return self._dist.all_reduce(t, op, group=self.group, async_op=async_op)

    def broadcast(self, t: Any, src: int, async_op: bool = False) -> Any:
        return self._dist.broadcast(t, self._ranks[src], group=self.group, async_op=async_op)

    def reduce(self, t: Any, dst: int, op: Any, async_op: bool = False) -> Any:
        return self._dist.reduce(t, self._ranks[dst], op, group=self.group, async_op=async_op)

    def gather(self, t: Any, parts: Any, dst: int, async_op: bool = False) -> Any:
        return self._dist.gather(t, parts, self._ranks[dst], group=self.group, async_op=async_op)

    def all_to_all_single(self, out: Any, send: Any, async_op: bool = False) -> Any:
        return self._dist.all_to_all_single(out, send, group=self.group, async_op=async_op)

    def all_gather_into_tensor(self, out: Any, send: Any, async_op: bool = False) -> Any:
        return self._gather_into(out, send, group=self.group, async_op=async_op)

    def reduce_scatter_tensor(self, out: Any, send: Any, op: Any, async_op: bool = False) -> Any:
        return self._scatter_from(out, send, op, group=self.group, async_op=async_op)

    def isend(self, t: Any, dst: int, tag: int = 0) -> Any:
        return self._dist.isend(t, self._ranks[dst], group=self.group, tag=tag)

    def irecv(self, t: Any, src: int, tag: int = 0) -> Any:
        return self._dist.irecv(t, self._ranks[src], group=self.group, tag=tag)


def group_dist(dist: Any, ranks: tuple[int, ...], rank: int, timeout: float,
               device: Any = None, backend: str | None = None, members_only: bool = False) -> GroupDist | None:
    """Make the process group of world ranks ``ranks`` (on every rank of the world, in the same
    order: torch numbers the groups in order); on a member, the group's view of ``dist``, else None.

    ``device``: the nccl backend's GPU (bound to the group where torch allows it). ``backend``:
    the group's torch backend (None: the default group's; phalanx's own names "gloo"/"nccl",
    since torch's default may be the "phalanx" backend by then). ``members_only``: only the
    members call this (torch's ``use_local_synchronization``: the group is named by its ranks,
    not by a count every rank keeps), None at once elsewhere.
    """
    if members_only and rank not in ranks:
        return None
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout + max(30.0, timeout))}
    if backend is not None:
        kwargs["backend"] = backend
    if members_only:
        kwargs["use_local_synchronization"] = True
    if isinstance(dist, GroupDist):  # the world's own view (phalanx made the group): torch.distributed itself
        dist = dist._dist
    if device is not None and "device_id" in inspect.signature(dist.new_group).parameters:
        kwargs["device_id"] = device
    try:
        group = dist.new_group(list(ranks), **kwargs)
    except RuntimeError as exc:
        failure = translate(exc)
        if failure is None:
            raise
        raise failure from exc
    return GroupDist(dist, group, ranks) if rank in ranks else None


def end_group(dist: Any, group: Any = None, release: list[Any] | None = None, *, lost_peer: bool = False) -> None:
    """Destroy process ``group`` (None: the default one), given up after a few seconds (module notes).

    ``release``: the caller's last references to the group (and what holds it), emptied in the
    teardown thread: a gloo group's destructor joins its threads, which after a lost peer can wait
    out gloo's own timeout, so it must not run in the caller's thread. ``lost_peer``: a peer is
    known gone (a world re-forming in place): wait only for the group to be unregistered, not for
    its destructor, which would wait out gloo's timeout (the process goes on, the thread ends later).
    """
    destroyed, freed = threading.Event(), threading.Event()
    ending = _groups_ending(dist, group)
    target = [group]  # no name of this frame or the thread's may hold the group (see _free_here)
    del group

    def destroy() -> None:
        with contextlib.suppress(Exception):  # destroying after a failure may itself fail
            dist.destroy_process_group(target.pop())
        destroyed.set()
        if release:
            release.clear()  # the group's destructor, if these were its last references, runs here
        _free_here(ending, freed)

    thread = threading.Thread(target=destroy, name="phalanx-teardown", daemon=True)
    thread.start()
    if lost_peer:
        destroyed.wait(_TEARDOWN_S)
    else:
        freed.wait(_TEARDOWN_S)


def _groups_ending(dist: Any, group: Any) -> list[Any]:
    """The process groups that ``destroy_process_group(group)`` ends: ``group``, or (None) every one."""
    if group is not None:
        return [group]
    c10d = getattr(dist, "distributed_c10d", None)
    world = getattr(c10d, "_world", None)
    pgs = list(getattr(world, "pg_map", {}) or {})
    default = getattr(getattr(dist, "group", None), "WORLD", None)
    return pgs or ([default] if default is not None else [])


_OWN_REFS = 3  # while ``_free_here`` filters: its list, the comprehension's name, getrefcount's argument


def _free_here(pgs: list[Any], freed: threading.Event) -> None:
    """Free the ended groups ``pgs`` in this (teardown) thread, whoever else still refers to them.

    A gloo group's destructor joins its threads, which after a lost peer wait out gloo's own timeout.
    When a reference cycle holds a group, the cyclic collector frees it wherever it next runs: in the
    training thread, inside an unrelated collective, which then stalls past the world's timeout (a
    rank re-forming in place missed its check-in so). So the groups are held here, the collector is run
    here, and each group is let go here once nothing else refers to it; a group still referred to is
    held for as long as the process lives (this thread is a daemon: nothing is joined at exit).
    ``freed`` is set after the first pass (the groups nothing else held have ended).
    """
    wait = 0.05
    while pgs:
        gc.collect()
        pgs[:] = [pg for pg in pgs if sys.getrefcount(pg) > _OWN_REFS]  # the rest end here
        freed.set()
        if pgs:
            time.sleep(wait)
            wait = min(wait * 2, 30.0)
    freed.set()
