"""Lifecycle, topology and build flags of ``hvd``: ``init``, ``size``, ``rank``, ``cross_rank``, ...

``hvd.init()`` is ``phalanx.init()`` (the backend the launcher started: mpi under
``phalanx run``/mpiexec, gloo/nccl under ``phalanx run --backend``/torchrun, a
world of one alone) plus Horovod's cross communicator: the ranks that share this
rank's local rank, one per node, ordered by rank (``cross_rank``/``cross_size``).
The flags tell what phalanx can use here (``*_built``) and what this job runs on
(``*_enabled``).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from typing import Any

import phalanx

from ..._epochs import Epoch
from ..._errors import InvalidArgumentError
from ..._world import World, current_or_none
from .._errors import HorovodNotInitializedError, HorovodUnsupportedError
from ._process_sets import ProcessSet, add_process_set, forget_all, register_global
from ._resync import majority_retries

__all__ = [
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init",
    "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size",
]

_cross: dict[str, Any] = {}  # "rank", "size", "homogeneous": computed by init()
_on_shutdown: list[Any] = []  # callbacks of the other hvd modules (pending handles, join state)


def init(comm: Sequence[int] | Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Start Horovod (phalanx) on every rank; calling it again does nothing.

    Arguments:
        comm: None (every rank), or the list of all ranks. A subset of ranks or an mpi4py
            communicator is not supported (HorovodUnsupportedError): use process sets.
        process_sets: None, ``"dynamic"`` (nothing to do: phalanx always allows
            ``hvd.add_process_set`` later), or a list of :class:`ProcessSet` to register now,
            in the same order on every rank.

    Raises HorovodUnsupportedError for ``comm`` other than all ranks, and phalanx's init
    errors (BackendUnavailableError, RendezvousError, ...).
    """
    first = not phalanx.initialized()
    phalanx.init()
    _world("init").set_retry_mismatch(majority_retries)  # a rank's extra collective fails alone (_resync)
    n = phalanx.size()
    if comm is not None and (not hasattr(comm, "__iter__") or sorted(comm) != list(range(n))):
        raise HorovodUnsupportedError(
            f"hvd.init(comm={comm!r}): phalanx runs Horovod on every rank of the job; pass comm=None "
            "and restrict collectives with process sets (hvd.ProcessSet, process_set=...).")
    if first or not _cross:
        _topology(n)
        register_global(n)
    if process_sets is not None and not isinstance(process_sets, str):
        for ps in process_sets:
            add_process_set(ps)
    elif isinstance(process_sets, str) and process_sets.lower() != "dynamic":
        raise InvalidArgumentError(f"hvd.init(process_sets={process_sets!r}): pass a list of ProcessSet, "
                                   "'dynamic' or None.")


def _topology(n: int) -> None:
    """One allgather of every rank's (local rank, local size): the cross communicator."""
    import numpy as np

    me = phalanx.rank()
    table = np.asarray(phalanx.allgather(np.array([phalanx.local_rank(), phalanx.local_size()],
                                                  dtype=np.int64))).reshape(n, 2)
    peers = [r for r in range(n) if table[r, 0] == table[me, 0]]
    _cross.update(rank=peers.index(me), size=len(peers), homogeneous=bool(len(set(table[:, 1].tolist())) == 1))


def _reformed(epoch: Epoch) -> None:
    """After ``phalanx.reform()`` (hvd.elastic.run's reset in place): what ``hvd.init`` sets up, again
    for the new world, in ``hvd.init``'s order (a replacement's own ``hvd.init`` makes the same calls).
    Registered at import, so it runs before the optimizers made since (each follows on its own, after)."""
    if not _cross:  # hvd.init() was never called in this process: nothing of Horovod's to rebind
        return
    _world("init").set_retry_mismatch(majority_retries)
    forget_all()
    _cross.clear()
    _topology(phalanx.size())
    register_global(phalanx.size())


def followed() -> bool:
    """Whether Horovod's state follows re-formed worlds: ``hvd.init()`` set it up in this process."""
    return bool(_cross)


phalanx.on_reform(_reformed)


def shutdown() -> None:
    """Stop Horovod (phalanx) on this rank: pending handles and process sets are dropped."""
    for hook in _on_shutdown:
        hook()
    forget_all()
    _cross.clear()
    phalanx.shutdown()


def is_initialized() -> bool:
    """True between ``hvd.init()`` and ``hvd.shutdown()``."""
    return phalanx.initialized()


def _world(what: str) -> World:
    world = current_or_none()
    if world is None:
        raise HorovodNotInitializedError(what)
    return world


def size() -> int:
    """The number of Horovod processes (ValueError-derived HorovodNotInitializedError before init)."""
    return _world("size").size


def rank() -> int:
    """This process's Horovod rank, in ``range(size())``."""
    return _world("rank").rank


def local_size() -> int:
    """The number of processes on this node."""
    return _world("local_size").backend.local_size


def local_rank() -> int:
    """This process's rank among the processes on its node."""
    return _world("local_rank").backend.local_rank


def _cross_value(what: str) -> int:
    world = _world(what)
    if not _cross:  # phalanx.init() without hvd.init(): only one node can be told without asking
        if world.backend.local_size != world.size:
            raise HorovodNotInitializedError(what)
        return 0 if what == "cross_rank" else 1
    return int(_cross["rank" if what == "cross_rank" else "size"])


def cross_size() -> int:
    """The number of processes that share this process's local rank: one per node that has it."""
    return _cross_value("cross_size")


def cross_rank() -> int:
    """This process's rank among those with its local rank (its node's index, on uniform nodes)."""
    return _cross_value("cross_rank")


def is_homogeneous() -> bool:
    """True when every node runs the same number of processes."""
    world = _world("is_homogeneous")
    return bool(_cross.get("homogeneous", world.backend.local_size == world.size))


def _backend_name() -> str | None:
    world = current_or_none()
    return None if world is None else world.backend.name


def mpi_built() -> bool:
    """True when phalanx can run on MPI here (mpi4py is installed)."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """True when this job runs on MPI."""
    return _backend_name() == "mpi"


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` (other threads may use MPI too).

    Raises HorovodUnsupportedError when this job does not run on MPI (Horovod raises too).
    """
    if not mpi_enabled():
        raise HorovodUnsupportedError("hvd.mpi_threads_supported(): this job does not run on MPI "
                                      "(hvd.mpi_enabled() is False); launch with `phalanx run --backend mpi`.")
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def _torch() -> Any:
    return sys.modules.get("torch") or importlib.import_module("torch")


def gloo_built() -> bool:
    """True when phalanx can run on gloo here (torch.distributed with gloo)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_gloo_available())


def gloo_enabled() -> bool:
    """True when this job runs on gloo."""
    return _backend_name() == "gloo"


def nccl_built() -> int:
    """NCCL's version code (e.g. 22105 for 2.21.5) when phalanx can run on NCCL here, else 0."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available() and _torch().cuda.is_available()):
        return 0
    major, minor, patch = _torch().cuda.nccl.version()[:3]
    return int(major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else major * 1000 + minor * 100 + patch)


def cuda_built() -> bool:
    """True when the installed torch is a CUDA build (phalanx moves CUDA tensors then)."""
    return _torch().version.cuda is not None


def rocm_built() -> bool:
    """True when the installed torch is a ROCm build."""
    return getattr(_torch().version, "hip", None) is not None


def ddl_built() -> bool:
    """False: phalanx has no IBM DDL backend."""
    return False


def ccl_built() -> bool:
    """False: phalanx has no oneCCL backend."""
    return False
