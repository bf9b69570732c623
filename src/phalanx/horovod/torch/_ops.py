"""Horovod's collectives: ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``reducescatter``,
their grouped and in-place (``_``) variants, ``barrier``, and the op constants.

Horovod's semantics: ``allreduce`` averages by default (``op=None``), returns a new
tensor (the ``_`` variants write the input), and is differentiable; ``allgather``
concatenates on dim 0 (first dimensions may differ); ``broadcast``'s ``root_rank``
is a global rank; every function takes ``name=`` and ``process_set=``. Collectives
match by call order on every rank (as in MPI); a ``name`` is checked to be the same
on every rank. Failures are phalanx's (a mismatch or timeout instead of a stall),
raised as HorovodInternalError subclasses.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _impl, _negotiate
from ._autograd import (
    HorovodAllgather,
    HorovodAllreduce,
    HorovodAlltoall,
    HorovodBroadcast,
    HorovodGroupedAllreduce,
    HorovodReducescatter,
)
from ._errmap import horovod_errors
from ._impl import Adasum, Average, Max, Min, Product, Sum
from ._process_sets import ProcessSet, global_process_set, set_group

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "Sum", "allgather", "allreduce", "allreduce_", "alltoall",
    "barrier", "broadcast", "broadcast_", "grouped_allgather", "grouped_allreduce", "grouped_allreduce_",
    "grouped_reducescatter", "reducescatter",
]


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad and torch.is_grad_enabled()


@horovod_errors
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, compression: Any = None,
              op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Average (or ``op``) ``tensor`` over the process set; returns a new tensor (differentiable).

    Arguments: ``tensor`` (same shape and dtype on every rank; not modified), ``average``
    (deprecated: True → Average, False → Sum), ``name`` (checked to match on every rank),
    ``compression`` (``hvd.Compression.none``/``fp16``: compress before, decompress after),
    ``op`` (Average when None, Sum, Adasum, Min, Max, Product), ``prescale_factor``/
    ``postscale_factor`` (multiply before/after), ``process_set``.

    Returns the reduced tensor. Raises InvalidArgumentError (unknown op, op with average),
    DuplicateNameError, HorovodMismatchError (ranks differ in shape, dtype, op or name),
    HorovodTimeoutError, HorovodRankFailedError, HorovodUnsupportedError (Adasum on a
    number of ranks that is not a power of two).
    """
    _impl.check_tensor("allreduce", tensor)
    op = _impl.resolve_op("allreduce", op, average)
    step = _impl.name_step("allreduce", name)
    ctx = None
    if compression is not None:
        tensor, ctx = compression.compress(tensor)
    if _differentiable(tensor):
        out = HorovodAllreduce.apply(tensor, op, prescale_factor, postscale_factor, process_set, step)
    else:
        out = _impl.allreduce_into(tensor.detach().clone(memory_format=torch.contiguous_format), op,
                                   prescale_factor, postscale_factor, process_set, step, "allreduce")
    return out if compression is None else compression.decompress(out, ctx)


@horovod_errors
def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce` of a contiguous ``tensor``; returns ``tensor`` (not differentiable).

    Arguments and errors as :func:`allreduce` (no ``compression``).
    """
    _impl.check_tensor("allreduce_", tensor)
    op = _impl.resolve_op("allreduce_", op, average)
    step = _impl.name_step("allreduce_", name)
    with torch.no_grad():
        return _impl.allreduce_into(tensor, op, prescale_factor, postscale_factor, process_set, step, "allreduce_")


@horovod_errors
def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = None, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allreduce` of every tensor of ``tensors`` in one fused reduction per dtype; a list of new
    tensors (differentiable). Ranks must pass the same shapes in the same order (checked).

    Arguments and errors as :func:`allreduce`, ``name`` being the group's base name.
    """
    for t in tensors:
        _impl.check_tensor("grouped_allreduce", t)
    op = _impl.resolve_op("grouped_allreduce", op, average)
    _impl.name_step("grouped_allreduce", name)
    pairs = [compression.compress(t) for t in tensors] if compression is not None else None
    inputs = [p[0] for p in pairs] if pairs is not None else list(tensors)
    if any(_differentiable(t) for t in inputs):
        outs = list(HorovodGroupedAllreduce.apply(op, prescale_factor, postscale_factor, process_set, name, *inputs))
    else:
        outs = _impl.grouped_allreduce_into([t.detach().clone(memory_format=torch.contiguous_format) for t in inputs],
                                            op, prescale_factor, postscale_factor, process_set, name,
                                            "grouped_allreduce")
    if pairs is None:
        return outs
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs, strict=True)]


@horovod_errors
def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`; returns ``tensors``."""
    for t in tensors:
        _impl.check_tensor("grouped_allreduce_", t)
    op = _impl.resolve_op("grouped_allreduce_", op, average)
    _impl.name_step("grouped_allreduce_", name)
    with torch.no_grad():
        return _impl.grouped_allreduce_into(list(tensors), op, prescale_factor, postscale_factor, process_set, name,
                                            "grouped_allreduce_")


@horovod_errors
def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every set rank's ``tensor`` concatenated on dim 0, in rank order (differentiable).

    First dimensions may differ between ranks; the other dimensions and the dtype may not
    (HorovodMismatchError). Returns a new tensor. Raises DuplicateNameError,
    HorovodMismatchError, HorovodTimeoutError, HorovodRankFailedError, HorovodJoinedError.
    """
    _impl.check_tensor("allgather", tensor)
    step = _impl.name_step("allgather", name)
    if _differentiable(tensor):
        return HorovodAllgather.apply(tensor, process_set, step)
    return _impl.allgather(tensor, process_set, step)


@horovod_errors
def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allgather` of each tensor of ``tensors``, in order; a list of new tensors."""
    _impl.name_step("grouped_allgather", name)
    return [allgather.__wrapped__(t, None, process_set) for t in tensors]  # type: ignore[attr-defined]


@horovod_errors
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Global rank ``root_rank``'s ``tensor`` on every set rank, as a new tensor (differentiable).

    Raises InvalidArgumentError (a root outside the set), DuplicateNameError,
    HorovodMismatchError, HorovodTimeoutError, HorovodRankFailedError, HorovodJoinedError.
    """
    _impl.check_tensor("broadcast", tensor)
    step = _impl.name_step("broadcast", name)
    if _differentiable(tensor):
        return HorovodBroadcast.apply(tensor, root_rank, process_set, step)
    return _impl.broadcast_into(tensor.detach().clone(memory_format=torch.contiguous_format), root_rank,
                                process_set, step)


@horovod_errors
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`broadcast` of a contiguous ``tensor``; returns ``tensor``."""
    _impl.check_tensor("broadcast_", tensor)
    step = _impl.name_step("broadcast_", name)
    with torch.no_grad():
        return _impl.broadcast_into(tensor, root_rank, process_set, step, "broadcast_")


@horovod_errors
def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows of ``tensor`` (dim 0, in order) to set rank ``j``; differentiable.

    Arguments: ``splits`` (a list or int tensor of ``size()`` row counts, summing to at
    most ``tensor.shape[0]``; None: equal parts). Returns, as Horovod 0.28 does, the
    received rows concatenated in rank order when ``splits`` is None, else a tuple
    ``(output, received_splits)`` (an int32 tensor, or ``splits``' dtype). Raises
    InvalidArgumentError (bad splits), HorovodMismatchError, HorovodTimeoutError,
    HorovodRankFailedError, HorovodJoinedError.
    """
    _impl.check_tensor("alltoall", tensor)
    step = _impl.name_step("alltoall", name)
    if _differentiable(tensor):
        output, received = HorovodAlltoall.apply(tensor, splits, process_set, step)
    else:
        output, received = _impl.alltoall(tensor, splits, process_set, step)
    return output if splits is None else (output, received)


@horovod_errors
def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = None, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` (Average or Sum) and return this set rank's share of dim 0 (differentiable).

    Every rank passes the same shape; rank ``r`` gets rows ``[off_r, off_r + c_r)`` where the
    first ``dim0 % size`` ranks get ``dim0 // size + 1`` rows and the others one fewer (as
    Horovod). Raises InvalidArgumentError (an op other than Average/Sum, a scalar),
    HorovodMismatchError, HorovodTimeoutError, HorovodRankFailedError, HorovodJoinedError.
    """
    _impl.check_tensor("reducescatter", tensor)
    step = _impl.name_step("reducescatter", name)
    ctx = None
    if compression is not None:
        tensor, ctx = compression.compress(tensor)
    if _differentiable(tensor):
        out = HorovodReducescatter.apply(tensor, op, prescale_factor, postscale_factor, process_set, step)
    else:
        out = _impl.reducescatter(tensor, op, prescale_factor, postscale_factor, process_set, step)
    return out if compression is None else compression.decompress(out, ctx)


@horovod_errors
def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None, compression: Any = None,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` of each tensor of ``tensors``, in order; a list of new tensors."""
    _impl.name_step("grouped_reducescatter", name)
    return [reducescatter.__wrapped__(t, None, compression, op, process_set,  # type: ignore[attr-defined]
                                      prescale_factor, postscale_factor) for t in tensors]


@horovod_errors
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the process set has called ``barrier``, bounded by phalanx's timeout.

    Like Horovod's, the barrier is an operation matched by its position among this rank's
    barriers: operations other ranks have not submitted yet do not block it, and the
    operations every rank has submitted run meanwhile."""
    _impl.guard_join("barrier", process_set)
    set_group(process_set, "barrier")
    _negotiate.wait(_negotiate.submit("barrier", None, process_set, lambda: None), "barrier")
