"""``phalanx.torch.init_process_group``: the ``"phalanx"`` backend as torch's default process group.

The backend is registered at ``import torch`` (:mod:`phalanx._torch_plugin`)
and again here; torch's creator, and the making of the default group over a
world (:func:`~phalanx.torch._pg_create.over_the_world`, which torch's own
``init_process_group("phalanx")`` reaches too), are :mod:`phalanx.torch._pg_create`.
"""

from __future__ import annotations

from typing import Any

from .._torch_plugin import NAME, register, torch_init_process_group
from ._pg_create import over_the_world

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
    register()
    return over_the_world(NAME, timeout, torch_init_process_group())
