"""The transports under phalanx's collectives: the :class:`Backend` protocol every one implements.

``phalanx.backend()`` returns the running one (``local``, ``mpi``, ``gloo`` or
``nccl``). The implementations live in private modules and import their heavy
dependency (mpi4py, torch) only when a world is made with them.
"""

from __future__ import annotations

from ._base import OPS, Backend, GradientOp, Op, Request
from ._detect import BACKENDS, BackendName, detect_backend

__all__ = ["BACKENDS", "OPS", "Backend", "BackendName", "GradientOp", "Op", "Request", "detect_backend"]
