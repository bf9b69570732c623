"""The collectives users call: validate, agree across ranks, then hand to the backend.

Semantics (the same on every backend):

* Arguments: NumPy arrays, torch tensors (CPU or CUDA) and Python/NumPy
  scalars. Results are returned; a mutable buffer is also updated in place
  (use the return value: read-only arrays and scalars get new ones).
* ``op``: ``"sum"`` (default), ``"prod"``, ``"min"``, ``"max"``, ``"avg"``.
  ``avg`` needs a floating dtype; ``bool`` takes ``min`` (and) / ``max`` (or).
* ``allgather``/``gather`` stack the ranks' buffers on a new first axis;
  ``gather`` returns ``None`` off the root. ``reduce`` leaves non-root ranks
  their input. ``reduce_scatter``/``alltoall`` split the first axis into
  ``size()`` equal chunks. ``counts=`` gives ``reduce_scatter`` and
  ``allgather`` shards of unequal size, ``out=`` a preallocated result
  (:mod:`phalanx._shards`).
* ``group=``: every collective can run on a group of ranks made by
  :func:`phalanx.new_group` (see :mod:`phalanx._groups`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _trace
from ._arrays import FLOAT_DTYPES, Buffer, as_buffer
from ._errors import InvalidArgumentError, UnsupportedArgumentError
from ._groups import Group, world_for
from ._shards import CountedBuffer, check_counts, check_out, concatenated, padded, unpadded, write_out
from ._world import World, current
from .comm._base import OPS, Op

__all__ = [
    "allgather", "allreduce", "alltoall", "barrier", "broadcast", "gather", "reduce", "reduce_scatter",
]


def _check_op(call: str, op: Any, buf: Buffer) -> str:
    if op not in OPS:
        raise InvalidArgumentError(
            f"phalanx.{call}(op={op!r}): unknown op; use one of {', '.join(map(repr, OPS))} "
            "(e.g. op='avg' for the mean).")
    if op == "avg" and buf.dtype not in FLOAT_DTYPES:
        raise UnsupportedArgumentError(
            f"phalanx.{call}(op='avg') on {buf.dtype} data: an integer average would be truncated. "
            "Use op='sum' and divide, or cast to a float dtype first."
        )
    if buf.dtype == "bool" and op not in ("min", "max"):
        raise UnsupportedArgumentError(
            f"phalanx.{call}(op={op!r}) on bool data: use op='min' (logical and) or op='max' "
            "(logical or), or cast to an integer dtype to count."
        )
    return op


def _check_root(call: str, root: Any, world: World) -> int:
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < world.size:
        raise InvalidArgumentError(
            f"phalanx.{call}(root={root!r}): not a rank of this {'group' if hasattr(world, 'group') else 'world'}"
            f"; pass an int in "
            f"0..{world.size - 1} (e.g. root=0), the same on every rank."
        )
    return root


def _check_step(call: str, step: Any) -> int | None:
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise InvalidArgumentError(
            f"phalanx.{call}(step={step!r}): the step label must be an int (e.g. the loop's step "
            "counter) or None.")
    return step


def _check_chunks(call: str, buf: Buffer, world: World) -> None:
    if not buf.shape or buf.shape[0] % world.size:
        raise UnsupportedArgumentError(
            f"phalanx.{call}: the first axis ({buf.shape[0] if buf.shape else 'a scalar has none'}) "
            f"must split into {world.size} equal chunks, one per rank; got shape {list(buf.shape)}."
        )


def _run(world: World, call: str, fn: Any, *args: Any) -> Any:
    with world.guard(call):
        result = fn(*args, world.timeout)
    if _trace.ON:
        _trace.end(world)
    return result


def allreduce(x: Any, op: Op = "sum", *, step: int | None = None, group: Group | None = None) -> Any:
    """Reduce ``x`` over all ranks with ``op``; every rank gets the result (and ``x`` in place).

    >>> phalanx.allreduce(np.array([rank, 1.0]))   # on 3 ranks: array([3., 3.])
    >>> phalanx.allreduce(loss, op="avg")          # a float stays a float

    Arguments:
        x: a NumPy array, torch tensor (CPU or CUDA) or Python/NumPy scalar, the same
            shape and dtype on every rank. Arrays and tensors are updated in place
            (a read-only array gets a new one); scalars come back as new scalars.
        op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"avg"`` (floats only; on
            bool, ``"min"`` is logical and, ``"max"`` logical or).
        step: an optional int label (e.g. the training step), the same on every rank.

    ``group``: a :class:`Group` from :func:`new_group` runs the call among its members
    only (ranks and roots are group ranks); None (default) is the whole world; a rank
    outside the group gets NotInGroupError.

    Returns the reduced value, of ``x``'s type. Raises InvalidArgumentError (unknown
    op), UnsupportedArgumentError (a type or dtype that cannot be sent),
    CollectiveMismatchError (ranks passed different shapes, dtypes, ops or steps:
    raised on every rank before anything is sent), CollectiveTimeoutError (a rank
    never came, within the timeout), RankFailedError (a peer died or shut down).
    """
    world = current("allreduce") if group is None else world_for(group, "allreduce")
    buf = as_buffer(x, "allreduce")
    if op != "sum" or buf.dtype == "bool":  # the common case skips the op checks
        _check_op("allreduce", op, buf)
    if step is not None:
        _check_step("allreduce", step)
    world.enter("allreduce", buf, op, -1, step)
    with world.guard("allreduce"):
        result = world.backend.allreduce(buf.data, op, buf.inplace, world.timeout)
    if _trace.ON:
        _trace.end(world)
    return result if buf.scalar is None else buf.finish(result)


def broadcast(x: Any, root: int = 0, *, step: int | None = None, group: Group | None = None) -> Any:
    """Every rank gets ``root``'s ``x``: arrays and tensors are overwritten in place.

    Arguments: ``x`` (a NumPy array, tensor or scalar, the same shape and dtype on
    every rank), ``root`` (the sending rank, the same on every rank), ``step`` (an
    optional int label, the same on every rank).

    ``group``: a :class:`Group` from :func:`new_group` runs the call among its members
    only (ranks and roots are group ranks); None (default) is the whole world; a rank
    outside the group gets NotInGroupError.

    Returns root's value, of ``x``'s type. Raises InvalidArgumentError (a root that
    is not a rank), CollectiveMismatchError (ranks disagree on shape, dtype, root or
    step), CollectiveTimeoutError, RankFailedError.
    """
    world = world_for(group, "broadcast")
    buf = as_buffer(x, "broadcast")
    _check_root("broadcast", root, world)
    world.enter("broadcast", buf, None, root, _check_step("broadcast", step))
    return buf.finish(_run(world, "broadcast", world.backend.broadcast, buf.data, root, buf.inplace))


def reduce(x: Any, op: Op = "sum", root: int = 0, *, step: int | None = None, group: Group | None = None) -> Any:
    """Reduce ``x`` onto ``root`` with ``op``; other ranks get their own ``x`` back unchanged.

    Arguments: ``x`` (array, tensor or scalar, alike on every rank), ``op``
    (``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"avg"``), ``root`` (the receiving
    rank), ``step`` (an optional int label, the same on every rank).

    ``group``: a :class:`Group` from :func:`new_group` runs the call among its members
    only (ranks and roots are group ranks); None (default) is the whole world; a rank
    outside the group gets NotInGroupError.

    Returns the reduction on ``root``, ``x`` elsewhere. Raises InvalidArgumentError
    (unknown op, a root that is not a rank), UnsupportedArgumentError (a type or
    dtype that cannot be sent), CollectiveMismatchError (ranks passed different
    shapes, dtypes, ops, roots or steps), CollectiveTimeoutError, RankFailedError.
    """
    world = world_for(group, "reduce")
    buf = as_buffer(x, "reduce")
    _check_op("reduce", op, buf)
    _check_root("reduce", root, world)
    world.enter("reduce", buf, op, root, _check_step("reduce", step))
    return buf.finish(_run(world, "reduce", world.backend.reduce, buf.data, op, root, buf.inplace))


def allgather(x: Any, *, counts: Any = None, out: Any = None, step: int | None = None,
              group: Group | None = None) -> Any:
    """Every rank's ``x`` in rank order: stacked on a new first axis, or concatenated with ``counts``.

    >>> phalanx.allgather(np.array([rank]))                     # on 3 ranks: [[0], [1], [2]]
    >>> phalanx.allgather(np.full(rank, rank), counts=[0, 1, 2])  # [1, 2, 2]

    Arguments: ``x`` (array, tensor or scalar, the same shape and dtype on every
    rank; not modified), ``step`` (an optional int label, the same on every rank).

    ``counts``: None (default) stacks: the result has shape ``(size(), *x.shape)``. A
    sequence of non-negative ints, one per rank and the same on every rank, gathers
    shards of unequal size (like MPI's Allgatherv): rank ``i``'s ``x`` has
    ``counts[i]`` rows (``x.shape[0] == counts[rank]``; the other axes alike on every
    rank) and the result is their concatenation along the first axis, shape
    ``(sum(counts), *x.shape[1:])``.

    ``out``: an array or tensor of the result's shape, dtype and kind (and device) to
    write the result into; it is returned. Not for JAX arrays (immutable).

    ``group``: a :class:`Group` from :func:`new_group` runs the call among its members
    only (ranks and roots are group ranks); None (default) is the whole world; a rank
    outside the group gets NotInGroupError.

    Returns a new array or tensor like ``x`` (``out`` when given). Raises
    InvalidArgumentError (bad ``counts`` or ``out``), UnsupportedArgumentError,
    CollectiveMismatchError (ranks disagree on shapes, dtypes, counts or steps),
    CollectiveTimeoutError, RankFailedError.
    """
    world = world_for(group, "allgather")
    buf = as_buffer(x, "allgather")
    _check_step("allgather", step)
    if counts is None:
        if out is not None:
            check_out("allgather", out, buf, (world.size, *buf.shape))
        world.enter("allgather", buf, None, -1, step)
        result = _run(world, "allgather", world.backend.allgather, buf.data)
        return write_out(out, result) if out is not None else buf.back(result)
    sizes = check_counts("allgather", counts, buf, world.size, None)
    if buf.shape[0] != sizes[world.rank]:
        raise InvalidArgumentError(
            f"phalanx.allgather(counts={list(sizes)}): x has {buf.shape[0]} rows (shape {list(buf.shape)}) "
            f"but counts[{world.rank}] is {sizes[world.rank]} on rank {world.rank}; each rank's x must have "
            "counts[rank] rows along the first axis.")
    shape = (sum(sizes), *buf.shape[1:])
    if out is not None:
        check_out("allgather", out, buf, shape)
    world.enter("allgather", CountedBuffer(buf, sizes, shape), None, -1, step)
    width = max(sizes)
    if width == 0:  # nothing to move: every shard is empty
        result = buf.data.copy() if isinstance(buf.data, np.ndarray) else buf.data.clone()
    else:
        stacked = _run(world, "allgather", world.backend.allgather, padded(buf.data, sizes, width, False))
        result = concatenated(stacked, sizes)
    return write_out(out, result) if out is not None else buf.back(result)


def gather(x: Any, root: int = 0, *, step: int | None = None, group: Group | None = None) -> Any:
    """Every rank's ``x`` stacked on a new first axis, on ``root`` only; other ranks get ``None``.

    Arguments: ``x`` (array, tensor or scalar, alike on every rank), ``root`` (the
    receiving rank), ``step`` (an optional int label, the same on every rank).

    ``group``: a :class:`Group` from :func:`new_group` runs the call among its members
    only (ranks and roots are group ranks); None (default) is the whole world; a rank
    outside the group gets NotInGroupError.

    Returns the ``(size(), *x.shape)`` stack on ``root``, else None. Raises
    InvalidArgumentError (a root that is not a rank), UnsupportedArgumentError,
    CollectiveMismatchError, CollectiveTimeoutError, RankFailedError.
    """
    world = world_for(group, "gather")
    buf = as_buffer(x, "gather")
    _check_root("gather", root, world)
    world.enter("gather", buf, None, root, _check_step("gather", step))
    return buf.back(_run(world, "gather", world.backend.gather, buf.data, root))


def reduce_scatter(x: Any, op: Op = "sum", *, counts: Any = None, out: Any = None, step: int | None = None,
                   group: Group | None = None) -> Any:
    """Reduce ``x`` with ``op`` and give each rank its own rows of the result's first axis.

    >>> phalanx.reduce_scatter(np.ones(6))                   # on 3 ranks: [3., 3.] each
    >>> phalanx.reduce_scatter(np.ones(5), counts=[3, 0, 2])  # rank 0: 3 rows, rank 1: 0, rank 2: 2

    Arguments: ``x`` (array or tensor, alike on every rank; not modified), ``op``
    (``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"avg"``), ``step`` (an optional int
    label, the same on every rank).

    ``counts``: None (default) splits the first axis into ``size()`` equal chunks of
    ``k`` rows and rank ``i`` gets chunk ``i``. A sequence of non-negative ints, one
    per rank, summing to ``x.shape[0]`` and the same on every rank, gives rank ``i``
    rows ``sum(counts[:i])`` to ``sum(counts[:i+1])`` of the reduction (shards of
    unequal size; a count may be 0).

    ``out``: an array or tensor of the result's shape, dtype and kind (and device) to
    write the result into; it is returned. Not for JAX arrays (immutable).

    ``group``: a :class:`Group` from :func:`new_group` runs the call among its members
    only (ranks and roots are group ranks); None (default) is the whole world; a rank
    outside the group gets NotInGroupError.

    Returns a new array or tensor of this rank's rows (``out`` when given). Raises
    InvalidArgumentError (unknown op, bad ``counts`` or ``out``),
    UnsupportedArgumentError (a type or dtype that cannot be sent, or without
    ``counts`` a first axis that does not split into ``size()`` equal chunks),
    CollectiveMismatchError (ranks passed different shapes, dtypes, ops, counts or
    steps), CollectiveTimeoutError, RankFailedError.
    """
    world = world_for(group, "reduce_scatter")
    buf = as_buffer(x, "reduce_scatter")
    _check_op("reduce_scatter", op, buf)
    _check_step("reduce_scatter", step)
    if counts is None:
        _check_chunks("reduce_scatter", buf, world)
        if out is not None:
            check_out("reduce_scatter", out, buf, (buf.shape[0] // world.size, *buf.shape[1:]))
        world.enter("reduce_scatter", buf, op, -1, step)
        result = _run(world, "reduce_scatter", world.backend.reduce_scatter, buf.data, op)
        return write_out(out, result) if out is not None else buf.back(result)
    sizes = check_counts("reduce_scatter", counts, buf, world.size, buf.shape[0] if buf.shape else None)
    mine = sizes[world.rank]
    if out is not None:
        check_out("reduce_scatter", out, buf, (mine, *buf.shape[1:]))
    world.enter("reduce_scatter", CountedBuffer(buf, sizes, buf.shape), op, -1, step)
    width = max(sizes)
    if width == 0:  # nothing to reduce: every shard is empty
        result = buf.data.copy() if isinstance(buf.data, np.ndarray) else buf.data.clone()
    else:
        data = buf.data if all(c == width for c in sizes) else padded(buf.data, sizes, width, True)
        result = unpadded(_run(world, "reduce_scatter", world.backend.reduce_scatter, data, op), mine)
    return write_out(out, result) if out is not None else buf.back(result)


def alltoall(x: Any, *, step: int | None = None, group: Group | None = None) -> Any:
    """Send chunk ``j`` of ``x``'s first axis to rank ``j``; the result's chunk ``j`` came from rank ``j``.

    Arguments: ``x`` (array or tensor whose first axis splits into ``size()`` equal
    chunks, alike on every rank; not modified), ``step`` (an optional int label).

    ``group``: a :class:`Group` from :func:`new_group` runs the call among its members
    only (ranks and roots are group ranks); None (default) is the whole world; a rank
    outside the group gets NotInGroupError.

    Returns a new array or tensor of ``x``'s shape. Raises UnsupportedArgumentError
    (chunks do not split), CollectiveMismatchError, CollectiveTimeoutError,
    RankFailedError.
    """
    world = world_for(group, "alltoall")
    buf = as_buffer(x, "alltoall")
    _check_chunks("alltoall", buf, world)
    world.enter("alltoall", buf, None, -1, _check_step("alltoall", step))
    return buf.back(_run(world, "alltoall", world.backend.alltoall, buf.data))


def barrier(*, step: int | None = None, group: Group | None = None) -> None:
    """Wait until every rank has called ``barrier()``, bounded by the timeout.

    ``step``: an optional int label, the same on every rank.

    ``group``: a :class:`Group` from :func:`new_group` runs the call among its members
    only (ranks and roots are group ranks); None (default) is the whole world; a rank
    outside the group gets NotInGroupError.

    Raises
    CollectiveMismatchError (a rank is in another collective or step),
    CollectiveTimeoutError (naming the ranks that never came), RankFailedError.
    """
    world = world_for(group, "barrier")
    world.enter("barrier", None, None, -1, _check_step("barrier", step))
    _run(world, "barrier", world.backend.barrier)
