"""Refusing parameters that torch's ``DistributedDataParallel`` already reduces.

A model wrapped in DDP (``ray.train.torch.prepare_model`` does it by default) averages its
gradients itself, in backward; a phalanx wrapper over the same parameters would average the
average again. Neither can see the other's hooks (DDP's reducer registers its hooks in C++),
so the check looks for live DDP modules: one pass over the garbage collector's objects,
made only where a DDP can exist at all (``torch.distributed`` initialized, more than one
rank), once per wrapper (tens of milliseconds on a large program).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

from .._errors import UsageError

__all__ = ["refuse_ddp"]


def refuse_ddp(call: str, params: Sequence[Any]) -> None:
    """Raise UsageError when a live ``DistributedDataParallel`` module holds any of ``params``."""
    import torch.distributed as dist

    if not params or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    from torch.nn.parallel import DistributedDataParallel

    kinds, todo = set(), [DistributedDataParallel]
    while todo:  # DDP and its subclasses: compared by type, as a weak proxy's isinstance may raise
        kind = todo.pop()
        kinds.add(kind)
        todo.extend(kind.__subclasses__())
    objects = gc.get_objects()
    if not any(map(kinds.__contains__, map(type, objects))):  # the common case, scanned in C
        return
    mine = {id(p) for p in params}
    for obj in (o for o in objects if type(o) in kinds):
        if any(id(p) in mine for p in obj.module.parameters()):
            raise UsageError(
                f"phalanx.{call}: these parameters belong to a torch DistributedDataParallel model "
                f"({type(obj.module).__name__} inside DDP), which already averages their gradients in "
                f"backward; phalanx.{call} would average them a second time. Drop one of the two: keep "
                f"phalanx.{call} and do not wrap the model in DDP (under Ray Train: "
                "`ray.train.torch.prepare_model(model, parallel_strategy=None)`, which still moves the "
                "model to the worker's device), or keep the DDP model and its plain torch optimizer.")
