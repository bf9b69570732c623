"""The ``"phalanx"`` torch.distributed backend's registration, light enough to run at ``import torch``.

torch loads the ``torch.backends`` entry points of installed packages at the end
of ``import torch`` (``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off);
phalanx's (``pyproject.toml``) is :func:`autoload`, so a script written for
torchrun needs only ``init_process_group("phalanx")``. Registering imports
nothing of phalanx's torch adapter: the creator does, when a group is made
(:mod:`phalanx.torch._pg_create`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["autoload", "register", "torch_init_process_group"]

NAME = "phalanx"
_TORCH_INIT: Callable[..., Any] | None = None  # torch's own init_process_group, once wrapped


def register() -> None:
    """Register the ``"phalanx"`` backend with torch.distributed (once; later calls do nothing)."""
    import torch.distributed as dist

    if not dist.is_available() or hasattr(dist.Backend, NAME.upper()):
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    from torch.distributed import distributed_c10d as c10d

    global _TORCH_INIT
    _TORCH_INIT = c10d.init_process_group
    c10d.init_process_group = dist.init_process_group = _handing_over(_TORCH_INIT)


def torch_init_process_group() -> Callable[..., Any]:
    """torch's own ``init_process_group``, as it was before :func:`register` wrapped it."""
    if _TORCH_INIT is not None:
        return _TORCH_INIT
    import torch.distributed as dist

    return dist.init_process_group


def _handing_over(init: Callable[..., Any]) -> Callable[..., Any]:
    """torch's ``init_process_group``, which also takes ``"phalanx"`` inside a world ``phalanx.init()`` made.

    There the group is made over that world (its ranks, its store), as
    ``phalanx.torch.init_process_group()`` makes it (:func:`phalanx.torch._pg_create.over_the_world`),
    whatever launched the script: a world of one in plain ``python`` has no torchrun variables for
    torch's env:// rendezvous, and on gloo/nccl phalanx's own process group is torch's default,
    which torch refuses to make twice before any backend is asked (``ValueError: trying to
    initialize the default process group twice!``); it is
    handed over. Every other call is torch's own, unchanged.
    """

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        name = args[0] if args else kwargs.get("backend")
        if name is not None and str(name).lower() == NAME and _in_a_world():
            from .torch._pg_create import over_the_world

            timeout = kwargs.get("timeout")
            over_the_world(NAME, None if timeout is None else timeout.total_seconds(), init)
            return None
        return init(*args, **kwargs)

    return init_process_group


def _in_a_world() -> bool:
    """Whether a phalanx world exists and torch's default group is free or that world's own."""
    import torch.distributed as dist

    world_module = sys.modules.get("phalanx._world")
    world = None if world_module is None else world_module.current_or_none()
    if world is None:
        return False
    return not dist.is_initialized() or getattr(world.backend, "own_group", None) is dist.group.WORLD


def autoload() -> None:
    """torch's autoload hook: :func:`register`, never failing torch's own import."""
    try:
        register()
    except Exception:  # noqa: BLE001 - nothing of phalanx may break `import torch`
        pass


def _create(opts: Any, backend_options: Any) -> Any:
    from .torch._pg_create import create

    return create(opts, backend_options)
