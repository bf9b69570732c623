"""Which backend ``phalanx run`` uses when none is given."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from .._errors import LaunchError
from ._mpi_flavor import find_mpiexec

__all__ = ["default_backend"]


def default_backend(mpiexec: str | None = None) -> str:
    """``"mpi"`` when mpi4py and an mpiexec are installed (or ``mpiexec`` is given), else ``"nccl"``
    when torch sees GPUs, else ``"gloo"``.

    Raises :class:`~phalanx.LaunchError` when neither MPI nor PyTorch is installed.
    """
    if mpiexec or importlib.util.find_spec("mpi4py") is not None and find_mpiexec() is not None:
        return "mpi"  # an explicit --mpiexec means MPI, even a wrong one (run_mpi then says so)
    if importlib.util.find_spec("torch") is None:
        raise LaunchError(
            "phalanx run: no backend to run on: install MPI (`pip install 'phalanx[mpich]'`) or PyTorch "
            "(`pip install torch`, for gloo and nccl)."
        )
    return "nccl" if _has_gpus() else "gloo"


def _has_gpus() -> bool:
    """Ask torch in a subprocess (importing torch costs seconds; skip it when no GPU driver is present)."""
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")):
        return False
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip() or 0) > 0
    except (OSError, ValueError, subprocess.SubprocessError):
        return False
