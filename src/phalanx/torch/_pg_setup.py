"""Making ``"phalanx"`` process groups: torch's creator, and ``phalanx.torch.init_process_group``.

The backend is registered at ``import torch`` (:mod:`phalanx._torch_plugin`) and
again by :func:`init_process_group`. The creator joins (or starts) phalanx's
world and returns a :class:`~phalanx.torch._process_group.PhalanxProcessGroup`
bound to it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from .._errors import UnsupportedArgumentError, UsageError
from .._torch_plugin import NAME, register
from .._world import current, current_or_none, init
from ..comm._detect import detect_backend

__all__ = ["create", "init_process_group"]

_CALL = "torch.distributed.init_process_group('phalanx')"


def create(opts: Any, backend_options: Any) -> Any:
    """torch's creator: a PhalanxProcessGroup for the group torch is making (``opts``: its ranks)."""
    from ._process_group import Binding, PhalanxProcessGroup

    world = current_or_none()
    if world is None:
        world = _join_world(opts)
    ranks = list(opts.global_ranks_in_group or range(opts.group_size))
    if ranks != list(range(world.size)):
        raise UnsupportedArgumentError(
            f"torch.distributed.new_group(ranks={ranks}) on the 'phalanx' backend: only the whole world "
            f"({world.size} ranks) is supported as a torch process group here; use phalanx.new_group for "
            "groups, or one mesh dimension.")
    if opts.group_size != world.size or opts.group_rank != world.rank:
        raise UsageError(
            f"{_CALL}: torch numbers this process rank {opts.group_rank} of {opts.group_size}, phalanx's "
            f"world rank {world.rank} of {world.size}. Let phalanx pick them: call "
            "phalanx.torch.init_process_group(), or pass no rank/world_size under phalanx run.")
    return PhalanxProcessGroup(world.rank, world.size, Binding(None))


def _join_world(opts: Any) -> Any:
    """phalanx's world for a torch group made before ``phalanx.init``: init it now.

    On gloo/nccl, torch's env:// rendezvous has just made rank 0 serve a store on
    ``MASTER_PORT``, the port phalanx's own rendezvous would serve: phalanx's
    ranks then meet in that store as clients, as under torchrun's agent.
    """
    if detect_backend() == "mpi" or "TORCHELASTIC_USE_AGENT_STORE" in os.environ:
        return init()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    try:
        return init()
    finally:
        del os.environ["TORCHELASTIC_USE_AGENT_STORE"]


def init_process_group(*, timeout: float | None = None) -> Any:
    """Make torch.distributed's default process group the ``"phalanx"`` backend over phalanx's world.

    >>> phalanx.init("mpi")
    >>> phalanx.torch.init_process_group()      # then DDP, FSDP2, DCP, ... run over MPI
    >>> torch.distributed.all_reduce(t)         # a phalanx allreduce: checked and bounded

    It calls ``phalanx.init()`` first when no world exists. No network is
    used for torch's store: the store is process-local (``HashStore``), since
    every operation goes through phalanx's own transport.

    Arguments:
        timeout: torch's own timeout for the group, in seconds (None: phalanx's
            collective timeout). phalanx's timeout bounds every call either way.

    Returns torch's default process group. Raises UsageError (torch.distributed is
    already initialized with another backend, e.g. by hand), and what ``phalanx.init``
    raises.
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
    dist.init_process_group(NAME, store=dist.HashStore(), rank=world.rank, world_size=world.size,
                            timeout=timedelta(seconds=max(seconds, 1.0)))
    return dist.group.WORLD


def _owned_by(world: Any, group: Any) -> bool:
    """Whether torch's default group is phalanx's own (its gloo/nccl backend made it)."""
    backend = getattr(world, "backend", None)
    return bool(getattr(backend, "_owns_group", False)) and getattr(backend, "_group", None) is not None


def _release_default() -> None:
    """Stop counting phalanx's own gloo/nccl group as torch's default (it stays registered, so
    phalanx's backend keeps using it by name) so that the ``"phalanx"`` group can be the default."""
    from torch.distributed import distributed_c10d as c10d

    c10d._update_default_pg(None)
    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "0")
