"""torch's creator of ``"phalanx"`` process groups: a group torch makes, bound to phalanx's world.

``torch.distributed`` calls :func:`create` (through :mod:`phalanx._torch_plugin`)
for its default group and for each ``new_group``/``DeviceMesh`` dimension, on
the members only: a group of some ranks becomes this rank's group of a
partition of the world (:func:`phalanx._groups.split_group`), which every
rank must reach, as the groups of a mesh dimension or of
``new_subgroups`` do. A ``new_group`` of some ranks whose other ranks make no
group is a ``CollectiveTimeoutError`` naming them. It joins (or starts) phalanx's world and returns a
:class:`~phalanx.torch._process_group.PhalanxProcessGroup` whose
:class:`~phalanx.torch._process_group.Binding` names what it runs on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .._errors import UsageError
from .._groups import split_group
from .._world import current, current_or_none, init
from ..comm._detect import detect_backend

__all__ = ["create"]

_CALL = "torch.distributed.init_process_group('phalanx')"


def create(opts: Any, backend_options: Any) -> Any:
    """torch's creator: a PhalanxProcessGroup for the group torch is making (``opts``: its ranks)."""
    from ._process_group import Binding, PhalanxProcessGroup

    if current_or_none() is None:
        _join_world()
    world = current(_CALL)
    ranks = sorted(opts.global_ranks_in_group or range(opts.group_size))
    if ranks == list(range(world.size)):
        if opts.group_size != world.size or opts.group_rank != world.rank:
            raise UsageError(
                f"{_CALL}: torch numbers this process rank {opts.group_rank} of {opts.group_size}, phalanx's "
                f"world rank {world.rank} of {world.size}. Let phalanx pick them: call "
                "phalanx.torch.init_process_group(), or pass no rank/world_size under phalanx run.")
        return PhalanxProcessGroup(world.rank, world.size, Binding(None, world.rank, world.size))
    # a new_group or a DeviceMesh dimension: torch asks its members only, and the groups of one
    # dimension partition the world, so each rank names its own group of the partition
    group = split_group(ranks)
    return PhalanxProcessGroup(ranks.index(world.rank), group.size, Binding(group))


def _join_world() -> None:
    """phalanx's world for a torch group made before ``phalanx.init``: init it now.

    On gloo/nccl, torch's env:// rendezvous has just made rank 0 serve a store on
    ``MASTER_PORT``, the port phalanx's own rendezvous would serve: phalanx's
    ranks then meet in that store as clients, as under torchrun's agent.
    """
    if detect_backend() == "mpi" or "TORCHELASTIC_USE_AGENT_STORE" in os.environ:
        init()
        return
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    try:
        init()
    finally:
        del os.environ["TORCHELASTIC_USE_AGENT_STORE"]


def over_the_world(name: str, timeout: float | None, torch_init: Callable[..., Any]) -> Any:
    """torch's default process group as backend ``name`` ("phalanx") over phalanx's world (made first
    when none exists); torch's ``torch_init`` (its own ``init_process_group``) makes it. What
    ``phalanx.torch.init_process_group()`` and torch's ``init_process_group("phalanx")`` inside a
    world both do. On gloo/nccl, phalanx's own group stops being torch's default first (it stays
    registered, and phalanx keeps using it). Returns the group (the same one on a second call)."""
    import torch.distributed as dist

    if current_or_none() is None:
        init()
    world = current("phalanx.torch.init_process_group")
    if dist.is_initialized():
        group = dist.group.WORLD
        if group is not None and group.name() == name:
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
    torch_init(name, store=store, rank=world.rank, world_size=world.size, timeout=timedelta(seconds=max(seconds, 1.0)))
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
