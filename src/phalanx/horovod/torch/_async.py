"""Horovod's asynchronous collectives: the ``_async``/``_async_`` variants return an int handle;
``poll(handle)`` says whether it is done, ``synchronize(handle)`` returns its result.

``allreduce_async``/``allreduce_async_`` and ``broadcast_async``/``broadcast_async_`` run on
phalanx's non-blocking calls (``iallreduce``/``ibroadcast``: the transfer overlaps
the caller's work); the other asynchronous calls (allgather, alltoall,
reducescatter, grouped) complete before they return their handle, which Horovod's
contract allows. A ``name`` stays taken until its handle is synchronized: a second
operation with that name meanwhile raises DuplicateNameError (a ValueError, as in
Horovod). ``synchronize`` of an unknown handle returns None, as in Horovod.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

import phalanx

from ..._errors import InvalidArgumentError
from . import _impl, _join
from ._basics import _on_shutdown
from ._errmap import horovod_errors
from ._process_sets import ProcessSet, global_process_set, set_group, set_size

__all__ = [
    "allgather_async", "allreduce_async", "allreduce_async_", "alltoall_async", "broadcast_async",
    "broadcast_async_", "grouped_allgather_async", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter_async", "poll", "reducescatter_async", "synchronize",
]


class _Pending:
    """One asynchronous operation: a phalanx Handle (or a result already there) and how to finish it."""

    __slots__ = ("handle", "result", "finish", "redo", "name")

    def __init__(self, handle: Any, result: Any, finish: Callable[[], Any] | None,
                 redo: Callable[[], Any] | None, name: Any) -> None:
        self.handle, self.result, self.finish, self.redo, self.name = handle, result, finish, redo, name


_pending: dict[int, _Pending] = {}
_ids = itertools.count(1)


def _drop_all() -> None:
    _pending.clear()
    _impl.names_in_flight.clear()


_on_shutdown.append(_drop_all)


def _register(entry: _Pending) -> int:
    handle = next(_ids)
    _pending[handle] = entry
    if entry.name is not None:
        _impl.names_in_flight.add(entry.name)
    return handle


def _done(result: Any, name: Any) -> int:
    return _register(_Pending(None, result, None, None, name))


def _allreduce_async(call: str, out: torch.Tensor, average: Any, name: Any, op: Any, pre: float, post: float,
                     ps: ProcessSet) -> int:
    _impl.check_tensor(call, out)
    op = _impl.resolve_op(call, op, average)
    step = _impl.name_step(call, name)
    if op == _impl.Adasum or (ps is global_process_set and _join.in_join_mode()):
        return _done(_impl.allreduce_into(out, op, pre, post, ps, step, call), name)
    _impl.scale(out, pre)
    integer_average = op == _impl.Average and not out.is_floating_point()
    phalanx_op: phalanx.Op = "avg" if op == _impl.Average and not integer_average else \
        ("sum" if op == _impl.Average else _impl._PHALANX_OPS[op])
    handle = phalanx.iallreduce(out, phalanx_op, step=step, group=set_group(ps, call))

    def finish() -> torch.Tensor:
        if integer_average:
            out.floor_divide_(set_size(ps))
        return _impl.scale(out, post)

    def redo() -> torch.Tensor:  # the handle met a rank's hvd.join(): reduce through the join exchange
        _join.reduce_with_joined(out.view(-1), phalanx_op, call)
        return finish()

    return _register(_Pending(handle, None, finish, redo, name))


@horovod_errors
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start :func:`hvd.allreduce` of ``tensor`` (not modified); ``synchronize(handle)`` returns the result."""
    _impl.check_tensor("allreduce_async", tensor)
    return _allreduce_async("allreduce_async", tensor.detach().clone(memory_format=torch.contiguous_format),
                            average, name, op, prescale_factor, postscale_factor, process_set)


@horovod_errors
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce of ``tensor`` (do not touch it before ``synchronize``); returns a handle."""
    return _allreduce_async("allreduce_async_", tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set)


@horovod_errors
def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """:func:`hvd.grouped_allreduce` as a handle (completed before it returns); synchronize gives the list."""
    op = _impl.resolve_op("grouped_allreduce_async", op, average)
    _impl.name_step("grouped_allreduce_async", name)
    outs = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return _done(_impl.grouped_allreduce_into(outs, op, prescale_factor, postscale_factor, process_set, name,
                                              "grouped_allreduce_async"), name)


@horovod_errors
def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`grouped_allreduce_async`; synchronize returns ``tensors``."""
    op = _impl.resolve_op("grouped_allreduce_async_", op, average)
    _impl.name_step("grouped_allreduce_async_", name)
    return _done(_impl.grouped_allreduce_into(list(tensors), op, prescale_factor, postscale_factor, process_set,
                                              name, "grouped_allreduce_async_"), name)


@horovod_errors
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """:func:`hvd.allgather` as a handle (completed before it returns)."""
    _impl.check_tensor("allgather_async", tensor)
    return _done(_impl.allgather(tensor, process_set, _impl.name_step("allgather_async", name)), name)


@horovod_errors
def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """:func:`hvd.grouped_allgather` as a handle (completed before it returns)."""
    _impl.name_step("grouped_allgather_async", name)
    return _done([_impl.allgather(t, process_set, None) for t in tensors], name)


def _broadcast_async(call: str, out: torch.Tensor, root_rank: int, name: Any, ps: ProcessSet) -> int:
    step = _impl.name_step(call, name)
    if ps is global_process_set and _join.in_join_mode():
        return _done(_impl.broadcast_into(out, root_rank, ps, step, call), name)
    if not isinstance(root_rank, int) or isinstance(root_rank, bool):
        raise InvalidArgumentError(f"hvd.{call}(root_rank={root_rank!r}): pass the global rank of the sender.")
    root = ps.set_rank_of(root_rank, call) if ps is not global_process_set else root_rank
    handle = phalanx.ibroadcast(out, root, step=step, group=set_group(ps, call))
    return _register(_Pending(handle, None, lambda: out, None, name))


@horovod_errors
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start :func:`hvd.broadcast` from global rank ``root_rank`` (``tensor`` not modified); a handle."""
    _impl.check_tensor("broadcast_async", tensor)
    return _broadcast_async("broadcast_async", tensor.detach().clone(memory_format=torch.contiguous_format),
                            root_rank, name, process_set)


@horovod_errors
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place broadcast into ``tensor`` from global rank ``root_rank``; a handle."""
    _impl.check_tensor("broadcast_async_", tensor)
    return _broadcast_async("broadcast_async_", tensor, root_rank, name, process_set)


@horovod_errors
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """:func:`hvd.alltoall` as a handle (completed before it returns); synchronize gives
    ``(output, received_splits)``, as Horovod's does."""
    _impl.check_tensor("alltoall_async", tensor)
    return _done(_impl.alltoall(tensor, splits, process_set, _impl.name_step("alltoall_async", name)), name)


@horovod_errors
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = _impl.Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """:func:`hvd.reducescatter` as a handle (completed before it returns)."""
    _impl.check_tensor("reducescatter_async", tensor)
    step = _impl.name_step("reducescatter_async", name)
    return _done(_impl.reducescatter(tensor, op, prescale_factor, postscale_factor, process_set, step), name)


@horovod_errors
def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None, op: int = _impl.Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """:func:`hvd.grouped_reducescatter` as a handle (completed before it returns)."""
    _impl.name_step("grouped_reducescatter_async", name)
    return _done([_impl.reducescatter(t, op, prescale_factor, postscale_factor, process_set, None)
                  for t in tensors], name)


@horovod_errors
def poll(handle: int) -> bool:
    """True once the operation of ``handle`` is done (``synchronize`` then returns at once); never blocks.

    Raises InvalidArgumentError for a handle that is not pending, and the operation's errors.
    """
    entry = _pending.get(handle)
    if entry is None:
        raise InvalidArgumentError(f"hvd.poll({handle!r}): no pending operation has this handle (already "
                                   "synchronized, or not returned by an hvd *_async call).")
    if entry.handle is None:
        return True
    try:
        return bool(entry.handle.test())
    except phalanx.CollectiveMismatchError as exc:
        if entry.redo is None or not _join.is_join_mismatch(exc):
            raise
        return False  # synchronize() redoes it through the join exchange


@horovod_errors
def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` (bounded by phalanx's timeout) and return its result.

    Returns None for an unknown handle (as Horovod). Raises the operation's errors
    (HorovodMismatchError, HorovodTimeoutError, HorovodRankFailedError, ...).
    """
    entry = _pending.pop(handle, None)
    if entry is None:
        return None
    _impl.names_in_flight.discard(entry.name)
    if entry.handle is None:
        return entry.result
    try:
        entry.handle.wait()
    except phalanx.CollectiveMismatchError as exc:
        if entry.redo is None or not _join.is_join_mismatch(exc):
            raise
        return entry.redo()
    return entry.finish() if entry.finish is not None else None
