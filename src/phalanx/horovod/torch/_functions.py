"""Horovod's state broadcasts: ``broadcast_parameters``, ``broadcast_optimizer_state``,
``broadcast_object``, ``allgather_object``.

::

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    epoch = hvd.broadcast_object(epoch, root_rank=0)

Tensors move through :func:`phalanx.synchronize` (one structure agreement, then
fused buffers), objects through ``phalanx.broadcast_object``/``allgather_object``
(pickle). ``root_rank`` is a rank of the whole job, as in Horovod, also with a
``process_set``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

import phalanx

from ..._errors import InvalidArgumentError

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def group_of(process_set: Any) -> Any:
    """The phalanx group of a Horovod ``process_set`` (None: the whole job)."""
    if process_set is None:
        return None
    from . import _process_sets

    if process_set is getattr(_process_sets, "global_process_set", None):
        return None
    for attr in ("group", "_group"):
        group = getattr(process_set, attr, None)
        if group is not None:
            return group
    return None


def group_root(call: str, root_rank: Any, process_set: Any) -> int:
    """Horovod's ``root_rank`` (a rank of the job) as the root phalanx's collectives take (a group rank)."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise InvalidArgumentError(f"phalanx.horovod.torch.{call}(root_rank={root_rank!r}): give the rank "
                                   "(an int) whose values every rank receives, e.g. root_rank=0.")
    group = group_of(process_set)
    if group is None:
        return root_rank
    ranks = list(group.ranks)
    if root_rank not in ranks:
        raise InvalidArgumentError(f"phalanx.horovod.torch.{call}(root_rank={root_rank}): rank {root_rank} is "
                                   f"not in the process set (ranks {ranks}); give one of its ranks.")
    return ranks.index(root_rank)


def _pairs(call: str, params: Any) -> list[tuple[Any, torch.Tensor]]:
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise InvalidArgumentError(
            f"phalanx.horovod.torch.{call}(params={type(params).__name__}): invalid params of type "
            f"{type(params).__name__}; pass model.state_dict(), list(model.named_parameters()) or "
            "list(model.parameters()).")
    pairs = []
    for entry in items:
        if len(entry) != 2:
            raise InvalidArgumentError(f"phalanx.horovod.torch.{call}: an entry of params is a tuple of "
                                       f"{len(entry)} items; give (name, tensor) pairs.")
        name, p = entry
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise InvalidArgumentError(f"phalanx.horovod.torch.{call}: params entry {name!r} is a "
                                       f"{type(p).__name__}, not a tensor; pass tensors only (a state_dict "
                                       "or named_parameters()).")
        pairs.append((name, p))
    return pairs


def broadcast_parameters(params: Any, root_rank: int, process_set: Any = None) -> None:
    """Overwrite every rank's tensors in ``params``, in place, with ``root_rank``'s.

    Arguments:
        params: ``model.state_dict()`` (a dict: taken in sorted key order), or a list of
            ``(name, tensor)`` pairs or of tensors (``model.named_parameters()``,
            ``model.parameters()``). ``None`` values are skipped.
        root_rank: the rank (of the job) whose values every rank receives.
        process_set: only its ranks take part (default: every rank).

    Collective over the process set. Raises InvalidArgumentError (params of another kind, a
    non-tensor value, a root outside the process set), CollectiveMismatchError (the ranks
    passed different names, shapes or dtypes: on every rank, before any data moves),
    CollectiveTimeoutError/RankFailedError (a rank never came or died).
    """
    call = "broadcast_parameters"
    root = group_root(call, root_rank, process_set)
    tensors = [p for _, p in _pairs(call, params)]
    with torch.no_grad():
        phalanx.synchronize(tensors, root=root, group=group_of(process_set))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: Any = None) -> None:
    """Overwrite every rank's optimizer state and hyperparameters (lr, momentum, ...) with ``root_rank``'s.

    An optimizer whose state is still empty (no step taken) first gets one, as Horovod
    makes it: every trainable parameter gets a zero gradient and the optimizer takes one
    local step with it (no reduction). Unlike Horovod, the parameters keep their values
    (that step's weight decay is undone), so only the state is created.

    Arguments:
        optimizer: a torch optimizer, plain or from ``hvd.DistributedOptimizer``.
        root_rank: the rank (of the job) whose state every rank receives.
        process_set: only its ranks take part (default: every rank).

    Collective over the process set. Raises InvalidArgumentError (``torch.optim.LBFGS``,
    whose state Horovod cannot broadcast either: use ``broadcast_object(opt.state_dict())``),
    CollectiveMismatchError (the ranks' states differ in structure), CollectiveTimeoutError,
    RankFailedError.
    """
    call = "broadcast_optimizer_state"
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InvalidArgumentError(
            f"phalanx.horovod.torch.{call}(optimizer=LBFGS): cannot broadcast torch.optim.LBFGS state; "
            "use `opt.load_state_dict(hvd.broadcast_object(opt.state_dict(), root_rank))` instead.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(f"phalanx.horovod.torch.{call}(optimizer={type(optimizer).__name__}): "
                                   "pass a torch optimizer.")
    root = group_root(call, root_rank, process_set)
    if len(optimizer.state) == 0:
        _create_state(optimizer)
    with torch.no_grad():
        phalanx.synchronize(optimizer, root=root, group=group_of(process_set))
    scalars: dict[tuple[Any, str], Any] = {(g, k): v for g, group in enumerate(optimizer.param_groups)
               for k, v in group.items() if k != "params"}
    scalars.update({(p_key, name): v for p_key, state in _states(optimizer)
                    for name, v in state.items() if not isinstance(v, torch.Tensor)})
    received = phalanx.broadcast_object(scalars, root=root, allow_pickle=True, group=group_of(process_set))
    states = dict(_states(optimizer))
    for (where, name), value in received.items():
        if isinstance(where, int) and where < len(optimizer.param_groups):
            optimizer.param_groups[where][name] = value
        elif where in states:
            states[where][name] = value


def _states(optimizer: torch.optim.Optimizer) -> list[tuple[str, dict[str, Any]]]:
    """Each parameter's state dict, keyed by its position ("g.k") in the param groups."""
    return [(f"{g}.{k}", optimizer.state[p]) for g, group in enumerate(optimizer.param_groups)
            for k, p in enumerate(group["params"]) if p in optimizer.state]


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """One local step on zero gradients, as Horovod does, keeping the parameters' values."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for p in params:
        grad = torch.zeros_like(p)
        p.grad = grad.to_sparse() if sparse else grad
    local_step = getattr(optimizer, "_hvd_local_step", None)  # hvd.DistributedOptimizer: no reduction
    if local_step is not None:
        local_step()
    else:
        optimizer.step()
    with torch.no_grad():
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """``root_rank``'s ``obj`` (any picklable object) on every rank; returns it.

    Arguments:
        obj: only ``root_rank``'s is sent; the others may pass anything (e.g. None).
        root_rank: the rank (of the job) that sends.
        name: accepted for Horovod's signature (phalanx orders calls itself).
        process_set: only its ranks take part (default: every rank).

    Collective over the process set. Raises InvalidArgumentError (a root outside the process
    set), CollectiveTimeoutError, RankFailedError.
    """
    root = group_root("broadcast_object", root_rank, process_set)
    return phalanx.broadcast_object(obj, root=root, allow_pickle=True, group=group_of(process_set))


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every rank's ``obj`` (any picklable object), as a list in rank order.

    Arguments:
        obj: this rank's object (sizes may differ between ranks).
        name: accepted for Horovod's signature.
        process_set: only its ranks take part; the list has one entry per member.

    Collective over the process set. Raises CollectiveTimeoutError, RankFailedError.
    """
    return phalanx.allgather_object(obj, allow_pickle=True, group=group_of(process_set))
