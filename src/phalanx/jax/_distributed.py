"""``jax.distributed`` configured from phalanx's own launch: no coordinator address by hand.

::

    phalanx.jax.initialize_distributed()     # before any other JAX call
    mesh = phalanx.jax.process_mesh()        # one axis, "ranks": a device per process
    # ... jax.shard_map(step, mesh=mesh, ...) with jax.lax.pmean(grads, "ranks")

Rank 0 picks a free port on its host and sends ``host:port`` to every rank
through phalanx (one broadcast); every rank then calls
``jax.distributed.initialize(coordinator_address, num_processes=size(),
process_id=rank())`` with XLA's CPU collectives set to gloo on CPUs (one GPU per
process, ``local_rank()``, on GPUs: NCCL). The world phalanx launched
(``phalanx run``, ``mpiexec``, Slurm) decides who is who.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from typing import Any

import jax
import numpy as np

import phalanx

from .._errors import InvalidArgumentError, UsageError

__all__ = ["initialize_distributed", "process_mesh"]

_AXIS = "ranks"
_ADDRESS_BYTES = 256


def initialize_distributed(cpu_collectives: str = "gloo", timeout: int = 300) -> None:
    """Start ``jax.distributed`` across phalanx's ranks, so ``jax.lax.psum`` runs on XLA's collectives.

    Arguments:
        cpu_collectives: XLA's CPU collectives, ``"gloo"`` (default) or ``"mpi"``
            (sets ``jax_cpu_collectives_implementation``; ignored on GPUs, where
            XLA uses NCCL).
        timeout: seconds ``jax.distributed.initialize`` waits for every process.

    Call it once, after ``phalanx.init()`` (called here if needed) and before any
    other JAX computation (JAX's own rule). A world of one rank does nothing.
    Collective: every rank must call it. Raises UsageError when JAX's backends
    are already started, InvalidArgumentError for a bad argument, and what
    ``jax.distributed.initialize`` raises.
    """
    if cpu_collectives not in ("gloo", "mpi"):
        raise InvalidArgumentError(
            f"phalanx.jax.initialize_distributed(cpu_collectives={cpu_collectives!r}): XLA's CPU collectives "
            "are 'gloo' or 'mpi'; pass one of them (or leave the default, 'gloo').")
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
        raise InvalidArgumentError(
            f"phalanx.jax.initialize_distributed(timeout={timeout!r}): give the seconds to wait for every "
            "process as a positive int (e.g. timeout=300).")
    if not phalanx.initialized():
        phalanx.init()
    size, rank = phalanx.size(), phalanx.rank()
    if size == 1:
        return
    address = np.zeros(_ADDRESS_BYTES, np.uint8)
    if rank == 0:
        host = _coordinator_host()
        text = f"{host}:{_free_port(host)}".encode()
        address[:len(text)] = np.frombuffer(text, np.uint8)
    address = phalanx.broadcast(address, root=0)
    coordinator = bytes(address).rstrip(b"\0").decode()
    gpus = _uses_gpus()
    try:
        if not gpus:
            jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=size, process_id=rank,
            local_device_ids=[phalanx.local_rank()] if gpus else None, initialization_timeout=timeout)
    except RuntimeError as exc:
        if "before" in str(exc) or "already" in str(exc):
            raise UsageError(
                "phalanx.jax.initialize_distributed: JAX's backends were already started (a JAX array was "
                "made first). Call it at the top of the script, before any other JAX call.") from exc
        raise


def process_mesh() -> Any:
    """A ``jax.sharding.Mesh`` over every process's first local device, one axis named ``"ranks"``.

    After :func:`initialize_distributed`; inside ``jax.shard_map(..., mesh=process_mesh())``,
    ``jax.lax.pmean(x, "ranks")`` averages over the processes.
    """
    per_process: dict[int, Any] = {}
    for d in jax.devices():
        per_process.setdefault(d.process_index, d)
    devices = [per_process[p] for p in sorted(per_process)]
    return jax.sharding.Mesh(np.array(devices), (_AXIS,))


def _uses_gpus() -> bool:
    """Whether JAX will run on GPUs, decided before its backends start (``JAX_PLATFORMS``, else a CUDA/ROCm plugin)."""
    names = [n.strip().lower() for n in os.environ.get("JAX_PLATFORMS", "").split(",") if n.strip()]
    if names:
        return any(n != "cpu" for n in names)
    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin"))


def _coordinator_host() -> str:
    if phalanx.local_size() == phalanx.size():  # every rank on this host
        return "127.0.0.1"
    return os.environ.get("MASTER_ADDR") or socket.gethostname()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host != socket.gethostname() else "", 0))
        return int(s.getsockname()[1])
