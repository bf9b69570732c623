"""Which backend a process was started for, read from its environment."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Mapping
from typing import Literal

__all__ = ["BACKENDS", "BackendName", "detect_backend"]

BackendName = Literal["auto", "local", "mpi", "gloo", "nccl"]
BackendName.__doc__ = """The names :func:`phalanx.init` accepts as ``backend``: a ``typing.Literal`` of strings.

* ``"auto"`` (the default): what the launcher started, read from the environment:
  ``PHALANX_BACKEND`` (set by ``phalanx run --backend``) if set; ``"mpi"`` under
  mpiexec or srun; ``"nccl"`` under torchrun when CUDA is available, else ``"gloo"``;
  ``"local"`` for a script started alone.
* ``"local"``: a world of one process, no communication library.
* ``"mpi"``: MPI through mpi4py (start the ranks with ``phalanx run`` or ``mpiexec``).
* ``"gloo"``: torch.distributed's CPU backend (``phalanx run --backend gloo`` or torchrun).
* ``"nccl"``: torch.distributed's GPU backend, one CUDA device per rank.

``phalanx.backend().name`` is the resolved name, never ``"auto"``. Any other string
raises :class:`phalanx.InvalidArgumentError`. Example::

    backend: phalanx.BackendName = "gloo"
    phalanx.init(backend)
"""
BACKENDS = ("local", "mpi", "gloo", "nccl")

# Variables an MPI launcher sets in every rank it starts.
_MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_RANK",
             "MV2_COMM_WORLD_SIZE", "I_MPI_HYDRA_TOPOLIB")


def detect_backend(env: Mapping[str, str] | None = None) -> str:
    """``phalanx run`` → its ``--backend``; mpiexec/srun → mpi; torchrun → gloo/nccl; alone → local."""
    env = os.environ if env is None else env
    chosen = env.get("PHALANX_BACKEND", "").strip()
    if chosen:
        return chosen
    if any(name in env for name in _MPI_VARS):
        # A DataLoader worker (forkserver/spawn) re-imports the script with its rank's MPI
        # variables, but a child process can never join the MPI job: it is a world of one.
        if env is os.environ and multiprocessing.parent_process() is not None:
            return "local"
        return "mpi"
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in env:
        return "mpi"
    if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return "torch"  # gloo or nccl: decided once torch is imported
    return "local"
