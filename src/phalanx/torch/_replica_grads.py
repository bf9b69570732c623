"""The gradient reduction over in-process replicas (and across processes), and the replicas' structure checks.

::

    world = reduce_replica_gradients(modules, "avg", across_processes=True, checked_world=None)

Per dtype, each replica's gradients are flattened into one buffer (plus one
presence slot per parameter), the buffers are reduced on replica 0's device
(NCCL among distinct GPUs of this process), across processes if asked, and
copied back. :class:`phalanx.torch.Replicas` calls this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.cuda import nccl

from .. import _world
from .._agreement import agree, first_difference
from .._collectives import allreduce
from .._errors import CollectiveMismatchError
from .._gradients import check_gradient_op, pack_gradients, unpack_gradients
from ._common import GradientOp, verify_same_structure

__all__ = ["check_same_structure", "describe", "dtype_groups", "reduce_replica_gradients", "tensors"]

Entry = tuple[str, tuple[int, ...], str]  # (name, shape, dtype)


def reduce_replica_gradients(modules: Sequence[torch.nn.Module], op: GradientOp, *, across_processes: bool,
                             checked_world: Any) -> Any:
    """Reduce the gradients of ``modules`` in place (the mean or sum over replicas, and processes).

    ``checked_world``: the world in which the ranks were already found to hold
    the same replicas (None: check now if reducing across processes). Returns
    the world checked, to pass next time.
    """
    call = "torch.Replicas.allreduce_gradients"
    check_gradient_op(call, op, over="replicas")
    per_replica = [[p for p in m.parameters() if p.requires_grad] for m in modules]
    check_same_structure(call, "trainable parameter",
                         [describe(m.named_parameters(), trainable=True) for m in modules])
    world = _world.current_or_none() if across_processes else None
    if world is not None and world.size == 1:
        world = None
    if world is not None and checked_world is not world:
        _check_processes(world, call, len(modules), describe(modules[0].named_parameters(), trainable=True))
        checked_world = world
    if len(modules) == 1 and world is None:
        return checked_world
    with torch.no_grad():
        for positions in dtype_groups(per_replica[0]):
            _reduce_group(call, op, [[params[j] for j in positions] for params in per_replica], world is not None)
    return checked_world


def _check_processes(world: Any, call: str, k: int, entries: list[Entry]) -> None:
    """Once per world: every rank holds the same number of replicas of the same model."""
    counts = agree(world, call, k)
    if counts is not None:
        raise CollectiveMismatchError(
            f"phalanx.{call}: the processes hold different numbers of replicas (this rank, "
            f"{world.rank}, holds {k}; the ranks hold between {min(counts)} and {max(counts)}), so the "
            "mean over processes would weight replicas unequally; nothing was reduced. Make the same "
            "number of replicas on every rank, e.g. `phalanx.torch.replicate(model, 2)` everywhere.")
    verify_same_structure(call, [f"{name} {dtype}{list(shape)}" for name, shape, dtype in entries])


def _reduce_group(call: str, op: GradientOp, params: list[list[torch.Tensor]], across: bool) -> None:
    """Reduce one dtype's gradients: ``params[i]`` are replica i's parameters of that dtype."""
    dtype = params[0][0].dtype
    flats, missing = [], False
    for members in params:
        flat, absent = pack_gradients(torch, call, members, dtype)
        flats.append(flat)
        missing = missing or absent
    for members, flat in zip(params, _reduce_flat(op, flats, across), strict=True):
        unpack_gradients(torch, flat, members, missing)


def _reduce_flat(op: GradientOp, flats: list[torch.Tensor], across: bool) -> list[torch.Tensor]:
    """The reduced buffer, on each replica's device."""
    k = len(flats)
    if k > 1 and _nccl_usable(flats):
        if across:
            nccl.reduce(flats, root=0)
            if op == "avg":
                flats[0].div_(k)
            result = allreduce(flats[0], op=op)
            if result is not flats[0]:
                flats[0].copy_(result)
            nccl.broadcast(flats, root=0)
        else:
            nccl.all_reduce(flats)
            if op == "avg":
                for flat in flats:
                    flat.div_(k)
        return flats
    home = flats[0].device
    total = flats[0]
    for flat in flats[1:]:
        # non_blocking only towards a GPU: an asynchronous copy into host memory may be read early.
        total.add_(flat.to(home, non_blocking=home.type == "cuda"))
    if op == "avg" and k > 1:
        total.div_(k)
    if across:
        result = allreduce(total, op=op)
        if result is not total:
            total.copy_(result)
    return [total if flat.device == home else total.to(flat.device, non_blocking=flat.is_cuda) for flat in flats]


def _nccl_usable(flats: list[torch.Tensor]) -> bool:
    """NCCL reduces in place among buffers on distinct GPUs of this process."""
    if not all(f.is_cuda for f in flats) or not hasattr(torch._C, "_nccl_all_reduce"):
        return False
    return nccl.is_available(flats)


# -- structure checks ----------------------------------------------------------------------------

def tensors(module: torch.nn.Module, buffers: bool) -> list[tuple[str, torch.Tensor]]:
    """``module``'s parameters (and buffers), each labelled ``"parameter <name>"``/``"buffer <name>"``."""
    items: list[tuple[str, torch.Tensor]] = [(f"parameter {name}", p) for name, p in module.named_parameters()]
    if buffers:
        items += [(f"buffer {name}", b) for name, b in module.named_buffers()]
    return items


def describe(items: Any, trainable: bool = False) -> list[Entry]:
    """(name, shape, dtype) of each named tensor (only those with ``requires_grad`` if ``trainable``)."""
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in items if not trainable or t.requires_grad]


def check_same_structure(call: str, what: str, described: list[list[Entry]]) -> None:
    """Every replica has replica 0's list of (shape, dtype); else an error naming the first difference."""
    reference = described[0]
    for i, entries in enumerate(described[1:], start=1):
        counts = (len(reference), len(entries))

        def show(r: int, entry: Entry | None, counts: tuple[int, int] = counts) -> str:
            return _show(entry, counts[r])

        found = first_difference([reference, entries], show, compare=lambda e: e[1:], who="replica",
                                 labels=[0, i])
        if found is None:
            continue
        raise CollectiveMismatchError(
            f"phalanx.{call}: replica {i} no longer has the same {what}s as replica 0 "
            f"({len(entries)} against {len(reference)}), so they cannot be matched up; nothing was changed. "
            f"The first difference is {what} #{found[0]}:\n{found[2]}\n"
            "Change every replica the same way (e.g. freeze a parameter on all of them), or make new "
            "replicas with phalanx.torch.replicate(model, devices).")


def _show(entry: Entry | None, count: int) -> str:
    if entry is None:
        return f"none (it has only {count})"
    name, shape, dtype = entry
    return f"{name}: {dtype}{list(shape)}"


def dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Positions of ``tensors`` grouped by dtype, groups in order of first appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for j, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(j)
    return list(groups.values())
