"""The ``"phalanx"`` torch.distributed backend's registration, light enough to run at ``import torch``.

torch loads the ``torch.backends`` entry points of installed packages at the end
of ``import torch`` (``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off);
phalanx's (``pyproject.toml``) is :func:`autoload`, so a script written for
torchrun needs only ``init_process_group("phalanx")``. Registering imports
nothing of phalanx's torch adapter: the creator does, when a group is made
(:mod:`phalanx.torch._pg_create`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["autoload", "register"]

NAME = "phalanx"


def register() -> None:
    """Register the ``"phalanx"`` backend with torch.distributed (once; later calls do nothing)."""
    import torch.distributed as dist

    if not dist.is_available() or hasattr(dist.Backend, NAME.upper()):
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def autoload() -> None:
    """torch's autoload hook: :func:`register`, never failing torch's own import."""
    try:
        register()
    except Exception:  # noqa: BLE001 - nothing of phalanx may break `import torch`
        pass


def _create(opts: Any, backend_options: Any) -> Any:
    from .torch._pg_create import create

    return create(opts, backend_options)
