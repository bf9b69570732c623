"""What the torch wrappers share: their option checks, the wrap-time structure check and direct backend calls.

::

    verify_same_structure("torch.DataParallel", ["fc.weight float32[10, 5]", ...])  # once, at wrap time
    request = backend_call(world, "torch.DataParallel", world.backend.iallreduce, flat, "sum", True)

The wrappers check the structure of what they reduce *once*, when they are
made (DESIGN.md, "Failure design"), and then talk to the backend directly in
the hot path, without the per-call agreement: every rank reduces the same
buckets in the same order by construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from .._agreement import agree, first_difference
from .._errors import CollectiveMismatchError, InvalidArgumentError
from .._gradients import check_gradient_op
from .._groups import world_for
from .._world import World
from ..comm import GradientOp
from ._powersgd import PowerSGD, is_powersgd

__all__ = ["Compression", "GradientOp", "backend_call", "verify_same_structure"]

Compression = Literal["bf16", "fp16", "powersgd"] | PowerSGD
"""How gradients travel: 16-bit (``"bf16"``/``"fp16"``), low-rank (``"powersgd"`` or a :class:`PowerSGD`),
or in full precision (``None`` where a signature allows it)."""


def verify_same_structure(call: str, entries: list[str], what: str = "parameter", group: Any = None,
                          fix: str | None = None) -> None:
    """Raise the same CollectiveMismatchError on every rank unless every rank passed ``entries``
    (``fix``: what the error tells the user to do; default: build the same model on every rank).

    One small allreduce of a hash (:func:`phalanx._agreement.agree`); the
    descriptions are exchanged only when the hashes differ, to name the first
    differing entry. ``group``: among its members only.
    """
    world = world_for(group, call)
    if world.size == 1:
        return
    lists = agree(world, call, entries)
    if lists is None:
        return
    found = first_difference(lists, lambda r, e: e if e is not None else f"(none: it has only {len(lists[r])})")
    first, lines = (found[0], found[2]) if found is not None else (0, "")
    raise CollectiveMismatchError(
        f"phalanx.{call}: the ranks wrap different {what}s ({', '.join(str(len(x)) for x in lists)} "
        f"on ranks 0..{world.size - 1}), so their gradients cannot be reduced together; nothing was "
        f"sent. The first difference is {what} #{first}:\n{lines}\n"
        + (fix or "Every rank must build the same model (same layers, shapes, dtypes and requires_grad "
           "flags, in the same order) before wrapping it, e.g. from the same config on every rank."))


def backend_call(world: World, call: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the world's backend, with its internal failures as phalanx errors.

    Pending non-blocking collectives are posted first: MPI matches
    collectives by the order they are posted, on every rank.
    """
    world.ready(call)
    with world.guard(call):
        return fn(*args)


_WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_options(call: str, op: Any, bucket_cap_mb: Any, compression: Any) -> None:
    """Raise InvalidArgumentError naming ``call`` for an op, bucket size or compression it cannot use."""
    check_gradient_op(call, op)
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise InvalidArgumentError(f"phalanx.{call}(bucket_cap_mb={bucket_cap_mb!r}): give the bucket size "
                                   "in MB as a positive number (default 25).")
    if compression is not None and not is_powersgd(compression) and compression not in _WIRE:
        raise InvalidArgumentError(f"phalanx.{call}(compression={compression!r}): use None (full precision), "
                                   "'bf16', 'fp16', 'powersgd' or phalanx.torch.PowerSGD(rank=...).")


def wire_dtype(compression: Any) -> torch.dtype | None:
    """The dtype a ``"bf16"``/``"fp16"`` compression sends gradients in; None for the others."""
    return _WIRE.get(compression) if isinstance(compression, str) else None
