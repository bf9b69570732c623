"""Sparse gradients in ``DistributedOptimizer``: reduced sparse, as Horovod does (``sparse_as_dense=False``).

A parameter whose gradient arrives sparse (``nn.Embedding(..., sparse=True)``) has
it reduced by :func:`~phalanx.horovod.torch.sparse_allreduce_async`: an allgather of
every rank's indices and one of its values, summed where indices repeat (divided by
the set's size for Average); ``p.grad`` is then that sparse tensor. Which parameters
have sparse gradients shows only in backward, so the first step finds them: a hook
registered before the dense engine's takes each such gradient aside (the engine
then reduces zeros in its place, that once) and ``synchronize`` reduces it sparse,
then rebuilds the engine without those parameters (collective, as every rank finds
the same ones); from then on their gradients stay out of the engine, accumulating
sparse over ``backward_passes_per_step`` passes. ``sparse_as_dense=True`` leaves every
gradient to the engine (densified), as before.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from ._async import sparse_allreduce_async
from ._process_sets import global_process_set

__all__: list[str] = []


def install(opt: Any) -> None:
    """Hook every parameter of ``opt`` (before its engine is made) to take sparse gradients aside."""
    opt._hvd_sparse = set()  # ids of the parameters known to have sparse gradients (out of the engine)
    opt._hvd_aside = {}  # id -> (param, sparse gradient) taken aside before they left the engine
    if opt.sparse_as_dense:
        return
    ref = weakref.ref(opt)
    opt._hvd_sparse_hooks = [p.register_post_accumulate_grad_hook(functools.partial(_on_grad, ref))
                             for group in opt.param_groups for p in group["params"] if p.requires_grad]


def _on_grad(ref: weakref.ref[Any], p: torch.Tensor) -> None:
    opt = ref()
    if opt is None or id(p) in opt._hvd_sparse or p.grad is None:
        return
    grad = p.grad
    if not grad.is_sparse and id(p) not in opt._hvd_aside:
        return
    held = opt._hvd_aside.get(id(p))
    # a later pass accumulated into the zeros below: keep the layout of what was taken aside
    part = grad if grad.is_sparse else grad.to_sparse(held[1].sparse_dim())
    opt._hvd_aside[id(p)] = (p, part if held is None else (held[1] + part).coalesce())
    p.grad = torch.zeros_like(p)  # the engine still holds this parameter for this first step


def reduce(opt: Any) -> bool:
    """After the engine's reduction: reduce the sparse gradients sparse (``p.grad`` becomes the result);
    returns True when parameters were found sparse for the first time (then rebuild the engine)."""
    ps = opt.process_set if opt.process_set is not None else global_process_set
    names = opt._parameter_names
    found = [p for p, _ in opt._hvd_aside.values()]
    grads = {id(p): g for p, g in opt._hvd_aside.values()}
    opt._hvd_aside = {}
    todo = found + [p for group in opt.param_groups for p in group["params"]
                    if id(p) in opt._hvd_sparse and p.grad is not None]
    handles = [(p, sparse_allreduce_async(grads.get(id(p), p.grad), f"sparse.{names[p]}", opt.op, ps))
               for p in todo]
    for p, handle in handles:
        p.grad = handle()
    opt._hvd_sparse.update(id(p) for p in found)
    return bool(found)
