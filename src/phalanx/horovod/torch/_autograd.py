"""Autograd through ``hvd`` collectives, with Horovod's backward rules.

* allreduce: the gradient is allreduced with the same op and scale factors;
* allgather: the gradient is averaged over the set, and each rank takes its rows;
* broadcast: the gradient is averaged over the set, kept on the root, zero elsewhere;
* alltoall: the gradient goes back with an alltoall of the received splits;
* reducescatter: the gradient is allgathered (divided by the set size for Average),
  times the scale factors;
* grouped_allreduce: each tensor's gradient as for allreduce.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _impl
from ._process_sets import ProcessSet, set_size

__all__: list[str] = []


class HorovodAllreduce(torch.autograd.Function):
    """allreduce as an autograd function (forward: out of place)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, pre: float, post: float, ps: ProcessSet,
                step: int | None) -> torch.Tensor:
        ctx.args = (op, pre, post, ps)
        return _impl.allreduce_into(tensor.detach().clone(), op, pre, post, ps, step, "allreduce")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        out = _impl.allreduce_into(grad.detach().clone(memory_format=torch.contiguous_format), op, pre, post, ps,
                                   None, "allreduce")
        return out, None, None, None, None, None


class HorovodGroupedAllreduce(torch.autograd.Function):
    """grouped_allreduce as an autograd function."""

    @staticmethod
    def forward(ctx: Any, op: int, pre: float, post: float, ps: ProcessSet, name: Any,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, ps)
        outs = [t.detach().clone() for t in tensors]
        return tuple(_impl.grouped_allreduce_into(outs, op, pre, post, ps, name, "grouped_allreduce"))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        outs = [g.detach().clone(memory_format=torch.contiguous_format) for g in grads]
        return (None, None, None, None, None,
                *_impl.grouped_allreduce_into(outs, op, pre, post, ps, None, "grouped_allreduce"))


class HorovodAllgather(torch.autograd.Function):
    """allgather as an autograd function."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, ps: ProcessSet, step: int | None) -> torch.Tensor:
        ctx.rows, ctx.ps = (tensor.shape[0] if tensor.dim() else 1), ps
        return _impl.allgather(tensor, ps, step)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ps = ctx.ps
        reduced = _impl.allreduce_into(grad.detach().clone(memory_format=torch.contiguous_format), _impl.Average,
                                       1.0, 1.0, ps, None, "allgather")
        counts = _impl.gather_dim0(torch.empty(ctx.rows), ps, None, "allgather")
        me = ps.rank() if ps.process_set_id else _impl.phalanx.rank()
        return reduced.narrow(0, sum(counts[:me]), ctx.rows), None, None


class HorovodBroadcast(torch.autograd.Function):
    """broadcast as an autograd function."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, ps: ProcessSet, step: int | None) -> torch.Tensor:
        ctx.root, ctx.ps = root_rank, ps
        return _impl.broadcast_into(tensor.detach().clone(), root_rank, ps, step)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = _impl.allreduce_into(grad.detach().clone(memory_format=torch.contiguous_format), _impl.Average,
                                       1.0, 1.0, ctx.ps, None, "broadcast")
        if _impl.phalanx.rank() != ctx.root:
            reduced.zero_()
        return reduced, None, None, None


class HorovodAlltoall(torch.autograd.Function):
    """alltoall as an autograd function (returns the output and the received splits)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, ps: ProcessSet,
                step: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = _impl.alltoall(tensor, splits, ps, step)
        ctx.received, ctx.ps = received, ps
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> tuple[Any, ...]:
        back, _ = _impl.alltoall(grad.contiguous(), ctx.received, ctx.ps, None)
        return back, None, None, None


class HorovodReducescatter(torch.autograd.Function):
    """reducescatter as an autograd function."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, pre: float, post: float, ps: ProcessSet,
                step: int | None) -> torch.Tensor:
        ctx.args = (op, pre * post, ps)
        return _impl.reducescatter(tensor, op, pre, post, ps, step)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, factor, ps = ctx.args
        gathered = _impl.allgather(grad, ps, None, "reducescatter")
        if op == _impl.Sum:  # Horovod's convention: Sum scales the gathered gradient by the set size
            factor *= set_size(ps)
        return gathered * factor if factor != 1.0 else gathered, None, None, None, None, None
