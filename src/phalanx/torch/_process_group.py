"""The ``"phalanx"`` torch.distributed backend: a ``ProcessGroup`` whose every call is a phalanx collective.

torch's libraries (DDP, FSDP2, DTensor, ``torch.distributed.checkpoint``,
``ZeroRedundancyOptimizer``, ``torch.distributed.nn``) talk to a
``ProcessGroup``; this one hands each of its operations to phalanx's own
collectives (:mod:`phalanx._collectives`), so they run on whatever phalanx's
world runs on (mpi, gloo, the local world of one) and keep its guarantees:
the per-call agreement (a different shape, dtype, op or root on one rank is
a ``CollectiveMismatchError`` on every rank, before data moves), the bounded
wait (``CollectiveTimeoutError`` naming the missing rank) and the job-ending
abort hook. Nothing is copied from the world: each call resolves its world
through :class:`Binding`, which follows a re-formed world (``phalanx._reconfigure``).

Every operation runs when it is called, in the caller's thread, and returns a
completed ``Work`` (``async_op=True`` included: ``wait()`` and ``get_future()``
return at once), so the order of operations is the order of the calls on
every rank. What torch's pickling path, DDP's buckets and FSDP2's flat buffers
send are plain tensors: nothing here copies them except where torch's list
form must be laid out as one buffer (the list all-gather, reduce-scatter and
all-to-all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.futures import Future

from .. import _collectives as coll
from .. import _p2p as p2p
from .._errors import UnsupportedArgumentError
from .._groups import Group
from ..comm._base import Op
from ._binding import Binding

__all__ = ["Binding", "PhalanxProcessGroup"]

NAME = "phalanx"
_KINDS: Any = dist.ReduceOp.RedOpType  # what a ReduceOp is (SUM, AVG, ...): not in torch's stubs
_Work: Any = dist._Work  # torch's stubs do not say it can be subclassed


_OPS: dict[int, Op] = {int(_KINDS.SUM): "sum", int(_KINDS.PRODUCT): "prod", int(_KINDS.MIN): "min",
                       int(_KINDS.MAX): "max", int(_KINDS.AVG): "avg"}
_BITWISE = {int(_KINDS.BAND): "min", int(_KINDS.BOR): "max"}  # on bool: logical and, or


def _op(call: str, op: Any, tensor: Any) -> Op:
    """phalanx's name of torch's ``op``; bitwise and/or on bool are min/max, the rest is refused."""
    kind = int(getattr(op, "op", op))  # options hold a ReduceOp; its kind is a RedOpType
    name = _OPS.get(kind)
    if name is not None:
        return name
    if tensor is not None and tensor.dtype == torch.bool and kind in _BITWISE:
        return cast(Op, _BITWISE[kind])
    raise UnsupportedArgumentError(
        f"torch.distributed.{call}(op={getattr(op, 'op', op)}) on the 'phalanx' backend: supported ops are SUM, "
        "PRODUCT, MIN, MAX and AVG (BAND/BOR on bool tensors); PREMUL_SUM and bitwise ops on integers are not. "
        "Reduce with SUM and scale, or cast.")


class _Done(_Work):
    """A completed Work: ``wait()`` returns at once, ``get_future()`` holds ``result`` (torch's convention:
    the output tensors). The future is made only when asked for (DDP's hooks ask; most callers do not)."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        """True: the operation ran when it was called."""
        return True

    def is_completed(self) -> bool:
        """True."""
        return True

    def is_success(self) -> bool:
        """True (a failure raised when the operation was called)."""
        return True

    def exception(self) -> None:
        """None."""
        return None

    def result(self) -> Any:
        """The output tensors."""
        return self._result

    def get_future(self) -> Any:
        """A completed torch Future holding the output tensors."""
        fut: Future[Any] = Future()
        fut.set_result(self._result)
        return fut




class _Pending(_Done):
    """A Work of a point-to-point message, completed by ``wait()`` (torch's ``isend``/``irecv`` return it;
    ``send``/``recv`` wait at once). ``exception()`` and ``result()`` are the completed Work's."""

    def __init__(self, message: Any, result: Any) -> None:
        super().__init__(result)
        self._message = message
        self._complete = False

    def wait(self, timeout: Any = None) -> bool:
        """Complete the message (within phalanx's timeout); True."""
        self._message.wait()
        self._complete = True
        return True

    def is_completed(self) -> bool:
        """Whether ``wait()`` has completed it."""
        return self._complete

    def is_success(self) -> bool:
        """Whether ``wait()`` has completed it."""
        return self._complete

    def get_future(self) -> Any:
        """A torch Future of the tensors, completed by waiting for the message first."""
        self.wait()
        fut: Future[Any] = Future()
        fut.set_result(self._result)
        return fut


def _one(call: str, tensors: Sequence[Any]) -> Any:
    if len(tensors) != 1:
        raise UnsupportedArgumentError(
            f"torch.distributed.{call} on the 'phalanx' backend: one tensor per process, got {len(tensors)} "
            "(the multi-device list form of old torch is not supported); pass one tensor.")
    return tensors[0]


_ProcessGroup: Any = dist.ProcessGroup  # torch's stubs type the C++ methods' parameters; these take torch's


class PhalanxProcessGroup(_ProcessGroup):
    """torch's ProcessGroup over phalanx: made by ``init_process_group("phalanx")`` or ``new_group``.

    Arguments: ``rank`` and ``size`` (this rank and the group's size, as torch
    numbers them), ``binding`` (the :class:`Binding` it runs on).
    """

    def __init__(self, rank: int, size: int, binding: Binding) -> None:
        super().__init__(rank, size)
        self.binding = binding
        self._name = ""
        self._desc = ""

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``"phalanx"``."""
        return NAME

    def _set_group_name(self, name: str) -> None:
        """torch names each group it makes (DeviceMesh and functional collectives find it by name)."""
        super()._set_group_name(name)
        self._name = name

    @property
    def group_name(self) -> str:
        """The name torch gave this group."""
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        super()._set_group_desc(desc)
        self._desc = desc

    @property
    def group_desc(self) -> str:
        """torch's description of this group (``"default_pg"``, a mesh dimension, ...)."""
        return self._desc

    # -- reductions ---------------------------------------------------------------
    def allreduce(self, tensors: list[Any], opts: Any) -> Any:
        """``dist.all_reduce``: every rank gets the reduction, in place."""
        t = tensors[0] if len(tensors) == 1 else _one("all_reduce", tensors)
        coll.allreduce(t, _op("all_reduce", opts.reduceOp, t), group=self.binding.group)
        return _Done(tensors)

    def allreduce_coalesced(self, tensors: list[Any], opts: Any) -> Any:
        """``dist.all_reduce_coalesced``: each tensor reduced, in order."""
        for t in tensors:
            coll.allreduce(t, _op("all_reduce_coalesced", opts.reduceOp, t), group=self.binding.group)
        return _Done(tensors)

    def reduce(self, tensors: list[Any], opts: Any) -> Any:
        """``dist.reduce``: the reduction on the root, others unchanged."""
        t = _one("reduce", tensors)
        coll.reduce(t, _op("reduce", opts.reduceOp, t), opts.rootRank, group=self.binding.group)
        return _Done(tensors)

    def broadcast(self, tensors: list[Any], opts: Any) -> Any:
        """``dist.broadcast``: the root's tensor everywhere, in place."""
        t = _one("broadcast", tensors)
        coll.broadcast(t, opts.rootRank, group=self.binding.group)
        return _Done(tensors)

    # -- all-gathers ----------------------------------------------------------------
    def allgather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any) -> Any:
        """``dist.all_gather`` (list form): output ``i`` gets rank ``i``'s input."""
        out, t = _one("all_gather", outputs), _one("all_gather", inputs)
        stacked = coll.allgather(t, group=self.binding.group)
        for dst, row in zip(out, stacked, strict=True):
            dst.copy_(row.view_as(dst))
        return _Done(outputs)

    def _allgather_base(self, output: Any, input: Any, opts: Any) -> Any:  # noqa: A002 - torch's name
        """``dist.all_gather_into_tensor``: the ranks' inputs concatenated into ``output``."""
        _gather_into(output, input, self.binding.group)
        return _Done(output)

    def allgather_into_tensor_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any) -> Any:
        """Several ``all_gather_into_tensor`` in one call (FSDP2 and DTensor coalesce them)."""
        for o, t in zip(outputs, inputs, strict=True):
            _gather_into(o, t, self.binding.group)
        return _Done(outputs)

    def allgather_coalesced(self, outputs: list[list[Any]], inputs: list[Any], opts: Any) -> Any:
        """``dist.all_gather_coalesced``: one list all-gather per input."""
        for out, t in zip(outputs, inputs, strict=True):
            stacked = coll.allgather(t, group=self.binding.group)
            for dst, row in zip(out, stacked, strict=True):
                dst.copy_(row.view_as(dst))
        return _Done(outputs)

    # -- reduce-scatters ------------------------------------------------------------
    def reduce_scatter(self, outputs: list[Any], inputs: list[list[Any]], opts: Any) -> Any:
        """``dist.reduce_scatter`` (list form): this rank gets the reduction of every rank's input ``rank``."""
        out, parts = _one("reduce_scatter", outputs), _one("reduce_scatter", inputs)
        flat = torch.stack([p.reshape(out.shape) for p in parts])
        coll.reduce_scatter(flat, _op("reduce_scatter", opts.reduceOp, out), out=out.view(1, *out.shape),
                            group=self.binding.group)
        return _Done(outputs)

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any) -> Any:  # noqa: A002 - torch's name
        """``dist.reduce_scatter_tensor``: this rank's chunk of the reduction into ``output``."""
        _scatter_into(output, input, opts.reduceOp, self.binding.group)
        return _Done(output)

    def reduce_scatter_tensor_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any) -> Any:
        """Several ``reduce_scatter_tensor`` in one call."""
        for o, t in zip(outputs, inputs, strict=True):
            _scatter_into(o, t, opts.reduceOp, self.binding.group)
        return _Done(outputs)

    # -- gather, scatter, all-to-all --------------------------------------------------
    def gather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any) -> Any:
        """``dist.gather``: the root's output ``i`` gets rank ``i``'s input."""
        t = _one("gather", inputs)
        stacked = coll.gather(t, opts.rootRank, group=self.binding.group)
        if stacked is not None:
            for dst, row in zip(_one("gather", outputs), stacked, strict=True):
                dst.copy_(row.view_as(dst))
        return _Done(outputs)

    def scatter(self, outputs: list[Any], inputs: list[list[Any]], opts: Any) -> Any:
        """``dist.scatter``: rank ``i`` gets the root's input ``i`` (sent as one broadcast of the stack)."""
        out = _one("scatter", outputs)
        size = self.size()
        if inputs:
            parts = _one("scatter", inputs)
            stack = torch.stack([p.reshape(out.shape) for p in parts])
        else:
            stack = out.new_empty((size, *out.shape))
        coll.broadcast(stack, opts.rootRank, group=self.binding.group)
        out.copy_(stack[self.rank()])
        return _Done(outputs)

    def alltoall(self, outputs: list[Any], inputs: list[Any], opts: Any) -> Any:
        """``dist.all_to_all`` (list form): output ``j`` gets rank ``j``'s input ``rank``."""
        stack = torch.stack([t.reshape(outputs[0].shape) for t in inputs])
        got = coll.alltoall(stack, group=self.binding.group)
        for dst, row in zip(outputs, got, strict=True):
            dst.copy_(row.view_as(dst))
        return _Done(outputs)

    def alltoall_base(self, output: Any, input: Any, output_split_sizes: list[int],  # noqa: A002
                      input_split_sizes: list[int], opts: Any) -> Any:
        """``dist.all_to_all_single``: equal chunks, or ``*_split_sizes`` rows per rank."""
        _all_to_all(output, input, output_split_sizes, input_split_sizes, self.size(), self.binding.group)
        return _Done(output)

    # torch's newer names for the same operations (2.10 and later call these)
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # -- point to point -------------------------------------------------------------
    def send(self, tensors: list[Any], dst: int, tag: int) -> Any:
        """``dist.send``/``isend``: posted now, completed by the Work's ``wait()``."""
        return _Pending(p2p.isend(_one("send", tensors), dst, tag=tag, group=self.binding.group), tensors)

    def recv(self, tensors: list[Any], src: int, tag: int) -> Any:
        """``dist.recv``/``irecv``: the header checked and the data received by the Work's ``wait()``."""
        return _Pending(p2p.irecv(_one("recv", tensors), src, tag=tag, group=self.binding.group), tensors)

    def recv_anysource(self, tensors: list[Any], tag: int) -> Any:
        """Refused: a receive names its sender here."""
        raise UnsupportedArgumentError(
            "torch.distributed.recv(src=None) on the 'phalanx' backend: a receive from any rank is not "
            "supported; pass src=, the sending rank.")

    def barrier(self, opts: Any) -> Any:
        """``dist.barrier``: every rank arrives, bounded by phalanx's timeout."""
        coll.barrier(group=self.binding.group)
        return _Done(None)


def _gather_into(output: Any, input: Any, group: Group | None) -> None:  # noqa: A002
    n = output.numel() // max(input.numel(), 1)
    rows = output.view(n, *input.shape) if output.is_contiguous() else None
    if rows is not None and input.numel():
        coll.allgather(input, out=rows, group=group)
    else:
        output.copy_(coll.allgather(input, group=group).reshape(output.shape))


def _scatter_into(output: Any, input: Any, op: Any, group: Group | None) -> None:  # noqa: A002
    n = input.numel() // max(output.numel(), 1)
    name = _op("reduce_scatter_tensor", op, output)
    flat = input.reshape(n, output.numel())
    if output.is_contiguous():
        coll.reduce_scatter(flat, name, out=output.view(1, -1), group=group)
    else:
        output.copy_(coll.reduce_scatter(flat, name, group=group).view_as(output))


def _all_to_all(output: Any, input: Any, out_splits: list[int], in_splits: list[int], size: int,  # noqa: A002
                group: Group | None) -> None:
    if not out_splits and not in_splits:
        got = coll.alltoall(input.reshape(size, -1), group=group)
        output.copy_(got.view_as(output))
        return
    rows = input.shape[0] if input.dim() else 0
    in_splits = list(in_splits) or [rows // size] * size
    out_splits = list(out_splits) or [output.shape[0] // size] * size
    width = max(max(in_splits), max(out_splits), 0)
    tail = tuple(input.shape[1:])
    if width == 0:
        return
    padded = input.new_zeros((size, width, *tail))
    start = 0
    for j, n in enumerate(in_splits):
        padded[j, :n] = input[start:start + n]
        start += n
    got = coll.alltoall(padded, group=group)
    start = 0
    for j, n in enumerate(out_splits):
        output[start:start + n] = got[j, :n]
        start += n
