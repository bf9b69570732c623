"""Horovod's asynchronous collectives: the ``_async``/``_async_`` variants return an int handle;
``poll(handle)`` says whether it is done, ``synchronize(handle)`` returns its result.

An asynchronous call only queues its operation; operations are matched between ranks
by name, as in Horovod (unnamed ones by this rank's count of such calls), and run
once every rank of the process set has submitted them, in an order all ranks agree
on, whoever waits (``synchronize``, ``barrier``) negotiating it: see
``_negotiate``. A ``name`` stays taken until its operation has run: a second
operation with that name meanwhile raises DuplicateNameError (a ValueError, as in
Horovod). ``synchronize`` of an unknown handle returns None, as in Horovod.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from ..._errors import InvalidArgumentError
from . import _impl, _negotiate
from ._basics import _on_shutdown
from ._errmap import horovod_errors
from ._process_sets import ProcessSet, global_process_set, set_group

__all__ = [
    "allgather_async", "allreduce_async", "allreduce_async_", "alltoall_async", "broadcast_async",
    "broadcast_async_", "grouped_allgather_async", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter_async", "poll", "reducescatter_async", "sparse_allreduce_async", "synchronize",
]


_pending: dict[int, _negotiate.Entry] = {}
_ids = itertools.count(1)


def _drop_all() -> None:
    _pending.clear()
    _impl.names_in_flight.clear()


_on_shutdown.append(_drop_all)


def _submit(call: str, name: Any, ps: ProcessSet, run: Callable[[], Any]) -> int:
    handle = next(_ids)
    _pending[handle] = _negotiate.submit(call, name, ps, run)
    return handle


def _allreduce_async(call: str, out: torch.Tensor, average: Any, name: Any, op: Any, pre: float, post: float,
                     ps: ProcessSet) -> int:
    _impl.check_tensor(call, out)
    op = _impl.resolve_op(call, op, average)
    step = _impl.name_step(call, name)
    set_group(ps, call)  # a process set this rank is not in: refused now, on this rank
    return _submit("allreduce", name, ps, lambda: _impl.allreduce_into(out, op, pre, post, ps, step, call))


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
    return _submit("grouped_allreduce", name, process_set, lambda: _impl.grouped_allreduce_into(
        outs, op, prescale_factor, postscale_factor, process_set, name, "grouped_allreduce_async"))


@horovod_errors
def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`grouped_allreduce_async`; synchronize returns ``tensors``."""
    op = _impl.resolve_op("grouped_allreduce_async_", op, average)
    _impl.name_step("grouped_allreduce_async_", name)
    return _submit("grouped_allreduce", name, process_set, lambda: _impl.grouped_allreduce_into(
        list(tensors), op, prescale_factor, postscale_factor, process_set, name, "grouped_allreduce_async_"))


@horovod_errors
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """:func:`hvd.allgather` as a handle (completed before it returns)."""
    _impl.check_tensor("allgather_async", tensor)
    step = _impl.name_step("allgather_async", name)
    return _submit("allgather", name, process_set, lambda: _impl.allgather(tensor, process_set, step))


@horovod_errors
def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """:func:`hvd.grouped_allgather` as a handle (completed before it returns)."""
    _impl.name_step("grouped_allgather_async", name)
    return _submit("grouped_allgather", name, process_set,
                   lambda: [_impl.allgather(t, process_set, None) for t in tensors])


def _broadcast_async(call: str, out: torch.Tensor, root_rank: int, name: Any, ps: ProcessSet) -> int:
    step = _impl.name_step(call, name)
    if not isinstance(root_rank, int) or isinstance(root_rank, bool):
        raise InvalidArgumentError(f"hvd.{call}(root_rank={root_rank!r}): pass the global rank of the sender.")
    if ps is not global_process_set:
        ps.set_rank_of(root_rank, call)
    set_group(ps, call)
    return _submit("broadcast", name, ps, lambda: _impl.broadcast_into(out, root_rank, ps, step, call))


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
    step = _impl.name_step("alltoall_async", name)
    return _submit("alltoall", name, process_set, lambda: _impl.alltoall(tensor, splits, process_set, step))


@horovod_errors
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = _impl.Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """:func:`hvd.reducescatter` as a handle (completed before it returns)."""
    _impl.check_tensor("reducescatter_async", tensor)
    step = _impl.name_step("reducescatter_async", name)
    return _submit("reducescatter", name, process_set, lambda: _impl.reducescatter(
        tensor, op, prescale_factor, postscale_factor, process_set, step))


@horovod_errors
def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None, op: int = _impl.Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """:func:`hvd.grouped_reducescatter` as a handle (completed before it returns)."""
    _impl.name_step("grouped_reducescatter_async", name)
    return _submit("grouped_reducescatter", name, process_set, lambda: [_impl.reducescatter(
        t, op, prescale_factor, postscale_factor, process_set, None) for t in tensors])


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start the reduction of the sparse COO ``tensor`` (Average or Sum) as two allgathers (indices
    ``<name>.indices`` and values ``<name>.values``), as Horovod does; returns a function that waits
    and returns the reduced sparse tensor (duplicate indices summed when coalesced)."""
    t = tensor
    indices = allgather_async(t._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(t._values(), name=f"{name}.values", process_set=process_set)

    def handle() -> torch.Tensor:
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op == _impl.Average:
            gathered_values = gathered_values / process_set.size()
        if gathered_indices.dim() == 0 or gathered_values.dim() == 0:
            return t.new().resize_as_(t)
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values, t.size())

    return handle


@horovod_errors
def poll(handle: int) -> bool:
    """True once the operation of ``handle`` has run (``synchronize`` then returns at once); never blocks
    and never communicates: an operation runs once every rank has submitted it and some rank waits
    (``synchronize``, ``barrier``, a blocking collective).

    Raises InvalidArgumentError for a handle that is not pending.
    """
    entry = _pending.get(handle)
    if entry is None:
        raise InvalidArgumentError(f"hvd.poll({handle!r}): no pending operation has this handle (already "
                                   "synchronized, or not returned by an hvd *_async call).")
    return entry.done


@horovod_errors
def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` (bounded by phalanx's timeout) and return its result.

    Meanwhile this rank negotiates with the others which named operations every rank has
    submitted, and runs those (see ``docs/horovod.md``). Returns None for an unknown handle
    (as Horovod). Raises the operation's errors (HorovodMismatchError, HorovodTimeoutError,
    HorovodRankFailedError, ...).
    """
    entry = _pending.get(handle)
    if entry is None:
        return None
    try:
        _negotiate.wait(entry, "synchronize")
    finally:
        if entry.done or entry not in _negotiate.queued(entry.ps):
            _pending.pop(handle, None)
    _impl.names_in_flight.discard(entry.name)
    if entry.error is not None:
        raise entry.error
    return entry.result
