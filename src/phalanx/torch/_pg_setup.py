"""``phalanx.torch.init_process_group``: the ``"phalanx"`` backend as torch's default process group.

The backend is registered at ``import torch`` (:mod:`phalanx._torch_plugin`)
and again here; torch's creator is :mod:`phalanx.torch._pg_create`.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from .._errors import UsageError
from .._torch_plugin import NAME, register, torch_init_process_group
from .._world import current, current_or_none, init

__all__ = ["init_process_group"]


def init_process_group(*, timeout: float | None = None) -> Any:
    """Make torch.distributed's default process group the ``"phalanx"`` backend over phalanx's world.

    >>> phalanx.init("mpi")
    >>> phalanx.torch.init_process_group()      # then DDP, FSDP2, DCP, ... run over MPI
    >>> torch.distributed.all_reduce(t)         # a phalanx allreduce: checked and bounded

    It calls ``phalanx.init()`` first when no world exists. Nothing new
    listens for torch's store: on gloo/nccl worlds it is phalanx's own
    rendezvous store (where gloo groups torch makes later meet), elsewhere a
    process-local one (``HashStore``), since every operation goes through
    phalanx's own transport.

    Arguments:
        timeout: torch's own timeout for the group, in seconds (None: phalanx's
            collective timeout). phalanx's timeout bounds every call either way.

    Returns:
        torch's default process group (the same one on a second call).

    Raises:
        UsageError: torch.distributed is already initialized with another backend
            (by the script or its launcher); and what ``phalanx.init`` raises.
    """
    import torch.distributed as dist

    register()
    if current_or_none() is None:
        init()
    world = current("phalanx.torch.init_process_group")
    if dist.is_initialized():
        group = dist.group.WORLD
        if group is not None and group.name() == NAME:
            return group
        if not _owned_by(world, group):
            raise UsageError(
                f"phalanx.torch.init_process_group(): torch.distributed is already initialized with backend "
                f"{dist.get_backend()!r} (by this script or its launcher). Call dist.destroy_process_group() "
                "first, or keep that backend.")
        _release_default()
    seconds = timeout if timeout is not None else world.timeout
    # torch makes its new groups' stores from the default group's: phalanx's own rendezvous store where it
    # has one (gloo, nccl: a gloo group made later meets there), else a process-local one (mpi, local)
    store = getattr(world.backend, "torch_store", None)
    store = dist.HashStore() if store is None else dist.PrefixStore("phalanx-pg/", store)
    torch_init_process_group()(NAME, store=store, rank=world.rank, world_size=world.size,
                               timeout=timedelta(seconds=max(seconds, 1.0)))
    return dist.group.WORLD


def _owned_by(world: Any, group: Any) -> bool:
    """Whether torch's default group is phalanx's own (its gloo/nccl backend made it)."""
    return group is not None and getattr(world.backend, "own_group", None) is group


def _release_default() -> None:
    """Stop counting phalanx's own gloo/nccl group as torch's default (it stays registered, so
    phalanx's backend keeps using it by name) so that the ``"phalanx"`` group can be the default."""
    from torch.distributed import distributed_c10d as c10d

    c10d._update_default_pg(None)
    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "0")
