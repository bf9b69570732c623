"""Which job environment a process runs under, told from its environment variables alone.

``phalanx info`` shows it, so that a user can see what phalanx will find: Ray Train
(a worker of ``TorchTrainer``, which made the process group), a Kubeflow ``PyTorchJob``
pod, an ``MPIJob`` launcher or worker pod, another Kubernetes pod, a Slurm job, torchrun,
``phalanx run``, or none of these. The signals are the variables each one sets:

* Ray: ``RAY_RAYLET_PID`` in every process a raylet starts (with ``RANK``/``WORLD_SIZE`` in a
  Ray Train worker), ``RAY_ADDRESS`` in a driver that joins a cluster.
* Kubernetes: ``KUBERNETES_SERVICE_HOST`` in every pod; the training operator's ``PET_NNODES``
  (or ``MASTER_ADDR`` + ``RANK``) in a ``PyTorchJob`` pod; the MPI operator's ``K_MPI_JOB_ROLE``.
* Slurm: ``SLURM_JOB_ID``; torchrun: ``TORCHELASTIC_RUN_ID``; ``phalanx run``: ``PHALANX_JOB_DIR``
  or ``PHALANX_BACKEND``.

The first match in that order wins: inside a Ray worker on Kubernetes, Ray is what formed the
world. ``docs/kubernetes.md`` describes each.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["describe_environment"]


def _rank(env: Mapping[str, str]) -> str:
    rank, size = env.get("RANK", ""), env.get("WORLD_SIZE", "")
    return f" (rank {rank} of {size})" if rank and size else ""


def describe_environment(env: Mapping[str, str] | None = None) -> str:
    """One line naming the job environment of ``env`` (default: this process's), e.g.
    ``"Kubeflow PyTorchJob pod (rank 1 of 3, master train-master-0:23456)"``; ``"none detected
    (...)"`` when no launcher or cluster left its variables."""
    env = os.environ if env is None else env
    if env.get("RAY_RAYLET_PID"):
        if env.get("RANK") and env.get("WORLD_SIZE"):
            return f"Ray Train worker{_rank(env)}: phalanx.init() uses the process group Ray made"
        return "a Ray worker process (not a Ray Train worker: no RANK/WORLD_SIZE)"
    if env.get("RAY_ADDRESS"):
        return f"a Ray driver (RAY_ADDRESS={env['RAY_ADDRESS']}): phalanx runs in the TorchTrainer's workers"
    role = env.get("K_MPI_JOB_ROLE", "")
    if role:
        where = env.get("HYDRA_HOST_FILE") or env.get("OMPI_MCA_orte_default_hostfile") or \
            env.get("I_MPI_HYDRA_HOST_FILE") or "/etc/mpi/hostfile"
        if role == "launcher":
            return f"Kubeflow MPIJob launcher pod (host file {where}): start the ranks with " \
                   f"`phalanx run --hostfile {where}` or mpirun"
        return f"Kubeflow MPIJob {role} pod"
    if env.get("KUBERNETES_SERVICE_HOST"):
        if env.get("PET_NNODES") or (env.get("MASTER_ADDR") and env.get("RANK")):
            master = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
            secret = "" if env.get("PHALANX_SECRET") else "; PHALANX_SECRET is not set (docs/kubernetes.md)"
            inner = _rank(env)[2:-1]
            return f"Kubeflow PyTorchJob pod ({inner + ', ' if inner else ''}master {master}{secret})"
        return "a Kubernetes pod (no training operator's variables)"
    if env.get("SLURM_JOB_ID"):
        tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or "?"
        step = f", task {env['SLURM_PROCID']}" if env.get("SLURM_PROCID") else ""
        return f"Slurm job {env['SLURM_JOB_ID']} ({tasks} tasks{step})"
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun{_rank(env)}"
    if env.get("PHALANX_JOB_DIR") or env.get("PHALANX_BACKEND"):
        backend = env.get("PHALANX_BACKEND", "")
        return f"phalanx run{' --backend ' + backend if backend else ''}"
    return "none detected (not under Ray, Kubernetes, Slurm, torchrun or phalanx run)"
