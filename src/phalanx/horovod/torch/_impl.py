"""The ``hvd`` collectives without autograd: Horovod's semantics on phalanx's collectives.

Every function takes tensors it may write (``out``: a copy, or the user's tensor for
the in-place ``_`` variants) and returns the result. Translations:

* ``Average`` is phalanx's ``avg`` on floats, a sum then division rounded toward zero
  on integers (Horovod's); ``prescale_factor``/``postscale_factor`` multiply before/after (on
  integers, truncated back to the dtype).
* A ``name`` becomes the step label of phalanx's agreement, so ranks that call in a
  different order (phalanx matches collectives by order, Horovod by name) get a
  mismatch error instead of mixed data.
* ``allgather``/``alltoall`` with different first dimensions exchange the sizes
  first, then move padded data; ``reducescatter`` splits an uneven first dimension
  as Horovod does (the first ``dim0 % size`` ranks get one row more).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

import phalanx

from ..._errors import InvalidArgumentError, UnsupportedArgumentError
from .._errors import DuplicateNameError, HorovodMismatchError, HorovodUnsupportedError
from . import _join
from ._adasum import adasum_allreduce
from ._process_sets import ProcessSet, global_process_set, set_group, set_size

__all__ = ["Adasum", "Average", "Max", "Min", "Product", "Sum"]

# Horovod's op values (its C++ ReduceOp enum).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_PHALANX_OPS: dict[int, phalanx.Op] = {Sum: "sum", Min: "min", Max: "max", Product: "prod"}
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

names_in_flight: set[str] = set()  # names of asynchronous operations not yet synchronized


def resolve_op(call: str, op: Any, average: Any) -> int:
    """Horovod's ``op``/deprecated ``average`` rule: op None → Average; both given → error."""
    if average is not None:
        if op is not None:
            raise InvalidArgumentError(f"hvd.{call}: the op parameter supersedes average; pass only op=.")
        import warnings

        warnings.warn(f"hvd.{call}(average=...) is deprecated; use op=hvd.Average or op=hvd.Sum.",
                      DeprecationWarning, stacklevel=4)
        return Average if average else Sum
    if op is None:
        return Average
    if op not in _OP_NAMES:
        raise InvalidArgumentError(f"hvd.{call}(op={op!r}): unknown op; use hvd.Average, hvd.Sum, hvd.Adasum, "
                                   "hvd.Min, hvd.Max or hvd.Product.")
    return op


def check_tensor(call: str, tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedArgumentError(f"hvd.{call}: expected a torch.Tensor, got {type(tensor).__name__}; "
                                       "wrap values with torch.tensor(...).")


def name_step(call: str, name: Any) -> int | None:
    """The agreement's step label for ``name`` (None without a name); duplicate names in flight refused."""
    if name is None:
        return None
    if name in names_in_flight:
        raise DuplicateNameError(
            f"hvd.{call}(name={name!r}): an operation with this name is still in flight (not synchronized); "
            "synchronize it first or use a different name (Horovod refuses it too).")
    return zlib.crc32(str(name).encode()) + (1 << 40)  # never collides with a join exchange's label


def scale(out: torch.Tensor, factor: float) -> torch.Tensor:
    if factor != 1.0:
        if out.is_floating_point():
            out.mul_(factor)
        else:
            out.copy_((out.double() * factor).trunc().to(out.dtype))
    return out


def _reduce(out: torch.Tensor, op: phalanx.Op, step: int | None, ps: ProcessSet, call: str) -> torch.Tensor:
    """phalanx.allreduce of ``out`` in place; through the join exchange while ranks may be joined."""
    if ps is global_process_set:
        if _join.in_join_mode():
            _join.reduce_with_joined(out.view(-1), op, call)
            return out
        try:
            phalanx.allreduce(out, op, step=step)
        except phalanx.CollectiveMismatchError as exc:
            if not _join.is_join_mismatch(exc):
                raise
            _join.reduce_with_joined(out.view(-1), op, call)
        return out
    phalanx.allreduce(out, op, step=step, group=set_group(ps, call))
    return out


def guard_join(call: str, ps: ProcessSet) -> None:
    """Collectives other than allreduce: refused on every rank that makes them while ranks are joined."""
    if ps is global_process_set and _join.in_join_mode():
        _join.refuse_while_joined(call)


def allreduce_into(out: torch.Tensor, op: int, pre: float, post: float, ps: ProcessSet, step: int | None,
                   call: str) -> torch.Tensor:
    """Reduce ``out`` in place with Horovod ``op`` (pre/post scaling included) and return it."""
    scale(out, pre)
    if op == Adasum:
        guard_join(call, ps)
        adasum_allreduce(out, set_size(ps), set_group(ps, call))
    elif op == Average:
        if out.is_floating_point():
            _reduce(out, "avg", step, ps, call)
        else:
            _reduce(out, "sum", step, ps, call).div_(set_size(ps), rounding_mode="trunc")
    else:
        _reduce(out, _PHALANX_OPS[op], step, ps, call)
    return scale(out, post)


def mismatch_on_dims(call: str, dims: list[int], what: str) -> HorovodMismatchError:
    return HorovodMismatchError(f"hvd.{call}: {what}; first dimensions by rank of the process set: {dims}.")


def gather_dim0(x: torch.Tensor, ps: ProcessSet, step: int | None, call: str) -> list[int]:
    """Every set rank's first dimension (one small allgather)."""
    sizes = phalanx.allgather(torch.tensor([x.shape[0]], dtype=torch.int64), step=step, group=set_group(ps, call))
    return sizes.view(-1).tolist()


def allgather(tensor: torch.Tensor, ps: ProcessSet, step: int | None, call: str = "allgather") -> torch.Tensor:
    """Concatenate every set rank's tensor on dim 0 (first dimensions may differ)."""
    guard_join(call, ps)
    x = tensor.detach().contiguous()
    if x.dim() == 0:
        x = x.reshape(1)
    n = set_size(ps)
    if n == 1:
        return x.clone()
    counts = gather_dim0(x, ps, step, call)
    rest, top = tuple(x.shape[1:]), max(counts)
    group = set_group(ps, call)
    if top == 0:
        return x.new_empty((0, *rest))
    if min(counts) == top:
        return phalanx.allgather(x, group=group).reshape(n * top, *rest)
    padded = x.new_zeros((top, *rest))
    padded[: x.shape[0]] = x
    gathered = phalanx.allgather(padded, group=group)
    return torch.cat([gathered[i, : counts[i]] for i in range(n)])


def broadcast_into(out: torch.Tensor, root_rank: int, ps: ProcessSet, step: int | None,
                   call: str = "broadcast") -> torch.Tensor:
    """Overwrite ``out`` with global rank ``root_rank``'s tensor."""
    guard_join(call, ps)
    if not isinstance(root_rank, int) or isinstance(root_rank, bool):
        raise InvalidArgumentError(f"hvd.{call}(root_rank={root_rank!r}): pass the global rank of the sender, an int.")
    root = ps.set_rank_of(root_rank, call) if ps is not global_process_set else root_rank
    phalanx.broadcast(out, root=root, step=step, group=set_group(ps, call))
    return out


def _splits(call: str, splits: Any, dim0: int, n: int) -> list[int]:
    if splits is None:
        if dim0 % n:
            raise InvalidArgumentError(f"hvd.{call}: the first dimension ({dim0}) does not split into {n} equal "
                                       "parts; pass splits= (rows for each rank).")
        return [dim0 // n] * n
    values = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    if len(values) != n or any(not isinstance(v, int) or v < 0 for v in values) or sum(values) > dim0:
        raise InvalidArgumentError(f"hvd.{call}(splits={values}): pass {n} non-negative ints (rows for each rank) "
                                   f"whose sum is at most the first dimension ({dim0}).")
    return values


def alltoall(tensor: torch.Tensor, splits: Any, ps: ProcessSet, step: int | None,
             call: str = "alltoall") -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[j]`` rows to set rank ``j``; return (received rows, rows received from each rank)."""
    guard_join(call, ps)
    x = tensor.detach().contiguous()
    if x.dim() == 0:
        raise InvalidArgumentError(f"hvd.{call}: a scalar has no first dimension to split; pass a 1-d tensor.")
    n, rest = set_size(ps), tuple(x.shape[1:])
    sends = _splits(call, splits, x.shape[0], n)
    group = set_group(ps, call)
    split_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32
    if n == 1:
        return x[: sends[0]].clone(), torch.tensor(sends, dtype=split_dtype)
    matrix = phalanx.allgather(torch.tensor(sends, dtype=torch.int64), step=step, group=group).view(n, n)
    me = ps.rank() if ps is not global_process_set else phalanx.rank()
    received = matrix[:, me].tolist()
    top = int(matrix.max())
    counts = torch.tensor(received, dtype=split_dtype)
    if top == 0:
        return x.new_empty((0, *rest)), counts
    if int(matrix.min()) == top and sum(sends) == x.shape[0]:
        return phalanx.alltoall(x, group=group), counts
    padded = x.new_zeros((n * top, *rest))
    offset = 0
    for j, rows in enumerate(sends):
        padded[j * top: j * top + rows] = x[offset: offset + rows]
        offset += rows
    moved = phalanx.alltoall(padded, group=group)
    return torch.cat([moved[i * top: i * top + received[i]] for i in range(n)]), counts


def reducescatter(tensor: torch.Tensor, op: int, pre: float, post: float, ps: ProcessSet, step: int | None,
                  call: str = "reducescatter") -> torch.Tensor:
    """Reduce (Average or Sum) and give set rank ``r`` its share of dim 0 (the first ``dim0 % n`` get one more)."""
    guard_join(call, ps)
    if op not in (Average, Sum):  # a RuntimeError, as Horovod's
        raise HorovodUnsupportedError(f"hvd.{call}(op={_OP_NAMES.get(op, op)!r}): reducescatter supports "
                                      "hvd.Average and hvd.Sum (as in Horovod).")
    if tensor.dim() == 0:
        raise InvalidArgumentError(f"hvd.{call}: a scalar has no first dimension to scatter; pass a 1-d tensor.")
    x = scale(tensor.detach().clone(memory_format=torch.contiguous_format), pre)
    n, dim0, rest = set_size(ps), tensor.shape[0], tuple(tensor.shape[1:])
    group = set_group(ps, call)
    phalanx_op: phalanx.Op = "avg" if op == Average and x.is_floating_point() else "sum"
    if n == 1:
        out = x
    elif dim0 % n == 0:
        out = phalanx.reduce_scatter(x, phalanx_op, step=step, group=group)
    else:
        dims = gather_dim0(x, ps, step, call)
        if len(set(dims)) > 1:
            raise mismatch_on_dims(call, dims, "every rank must pass the same shape")
        base, extra = divmod(dim0, n)
        top = base + 1
        padded = x.new_zeros((n * top, *rest))
        offset = 0
        for r in range(n):
            rows = base + (r < extra)
            padded[r * top: r * top + rows] = x[offset: offset + rows]
            offset += rows
        me = phalanx.rank() if ps is global_process_set else ps.rank()
        assert me is not None  # set_group above refused a set that is not registered
        out = phalanx.reduce_scatter(padded, phalanx_op, group=group)[: base + (me < extra)].contiguous()
    if op == Average and not out.is_floating_point():
        out.div_(n, rounding_mode="trunc")
    return scale(out, post)


def grouped_allreduce_into(outs: list[torch.Tensor], op: int, pre: float, post: float, ps: ProcessSet,
                           name: Any, call: str) -> list[torch.Tensor]:
    """Reduce every tensor of ``outs`` in place: one fused phalanx allreduce per dtype (Adasum: per tensor).

    The step label carries a checksum of the shapes (and the name), so ranks that pass
    different shapes with the same total size get a mismatch error too.
    """
    if op == Adasum:
        for out in outs:
            allreduce_into(out, op, pre, post, ps, None, call)
        return outs
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for out in outs:
        by_dtype.setdefault(out.dtype, []).append(out)
    base = zlib.crc32(repr(([tuple(o.shape) for o in outs], name)).encode()) + (1 << 41)
    for members in by_dtype.values():
        flat = torch.cat([m.reshape(-1) for m in members]) if len(members) > 1 else members[0].reshape(-1).clone()
        allreduce_into(flat, op, pre, post, ps, base, call)
        offset = 0
        for m in members:
            m.copy_(flat[offset: offset + m.numel()].view_as(m))
            offset += m.numel()
    return outs
