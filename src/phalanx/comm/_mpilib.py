"""Loading MPI for the ``mpi`` backend, what phalanx asks the library before using it, the
request object of its non-blocking calls, the communicators of a group and the diagnosis of a timeout.

mpi4py is imported only here and only when a backend is made (``import phalanx``
stays light); a missing or broken MPI is a :class:`BackendUnavailableError`
that names what to install.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

from .._drain import await_readers
from .._errors import BackendUnavailableError
from ._base import PeerLost, WaitTimeout
from ._wait import poll

__all__ = ["DIAG_TAG", "MPIRequest", "abort_job", "check_launcher_agrees", "detect_gpu_aware", "diagnose",
           "group_comms", "import_mpi", "mpi_available"]

DIAG_TAG = 31_337  # the diagnosis's messages (and preconnect's) on the diagnosis communicator
_GROUP_TAG = 7_713  # MPI_Comm_create_group's tag (calls are ordered by the world-wide agreement anyway)


def lost_peer_on_mpi_error(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, with an mpi4py ``MPI.Exception`` it raises (a lost peer or a revoked communicator, under
    ULFM: posting an operation fails too, not only its test or wait) raised as PeerLost, which the
    world turns into RankFailedError naming the call."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if type(exc).__module__ == "mpi4py.MPI":
                raise PeerLost(str(exc)) from exc
            raise
    return wrapper


def mpi_available() -> bool:
    """True when mpi4py imports (without initializing MPI)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def import_mpi() -> Any:
    """mpi4py's ``MPI`` module; BackendUnavailableError naming what to install when it cannot load."""
    try:
        import mpi4py
    except ImportError as exc:
        raise BackendUnavailableError(
            "phalanx backend 'mpi' needs mpi4py. Install `pip install 'phalanx[mpich]'` "
            "(mpi4py with MPICH from PyPI), or `pip install 'phalanx[mpi]'` to build mpi4py "
            "against your cluster's own MPI (load its module first)."
        ) from exc
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:
        raise BackendUnavailableError(
            f"phalanx backend 'mpi': mpi4py {mpi4py.__version__} is installed but its MPI library "
            f"could not be loaded ({exc}). Install an MPI (`pip install mpich`) or load your "
            "cluster's MPI module."
        ) from exc
    return MPI


def detect_gpu_aware(MPI: Any) -> bool:
    """Ask the (initialized) MPI library whether it accepts CUDA device memory.

    mpi4py loads libmpi privately, so the query functions are looked up
    through mpi4py's own extension module. MPICH aborts the process if its
    query runs before ``MPI_Init``: call this only after initialization.
    """
    try:
        lib = ctypes.CDLL(MPI.__file__)
    except OSError:
        return False
    query = getattr(lib, "MPIX_Query_cuda_support", None)  # Open MPI
    if query is not None:
        query.restype = ctypes.c_int
        return bool(query())
    gpu_query = getattr(lib, "MPIX_GPU_query_support", None)  # MPICH >= 4
    if gpu_query is not None:
        ok = ctypes.c_int(0)
        if gpu_query(ctypes.c_int(0), ctypes.byref(ok)) == 0:  # MPIX_GPU_SUPPORT_CUDA == 0
            return bool(ok.value)
    return False


def check_launcher_agrees(size: int) -> None:
    """A world of one under an mpiexec that started several ranks means two different MPIs."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        launched = os.environ.get(name, "")
        if launched.isdigit() and int(launched) > 1 and size == 1:
            raise BackendUnavailableError(
                f"phalanx backend 'mpi': the launcher started {launched} ranks ({name}) but MPI sees "
                "a world of 1: mpiexec and the MPI library mpi4py loaded belong to different MPI "
                "implementations (e.g. Open MPI's mpiexec with MPICH's libmpi). Use the mpiexec "
                "that matches mpi4py (`phalanx run` picks it), or rebuild mpi4py against your MPI."
            )


def abort_job(MPI: Any, code: int) -> None:
    """End the job with ``MPI_Abort(code)``, then this process (without ``MPI_Finalize``).

    MPICH's ``MPI_Abort`` returns once it has told its launcher, which then kills
    the ranks; a launcher that cannot be reached (a cut link) never does, and
    mpi4py's ``MPI_Finalize`` at exit would wait for the lost peers forever.
    """
    await_readers()  # the failure's output reaches the launcher before the job is torn down
    setter = getattr(MPI, "_set_abort_status", None)
    if setter is not None:
        setter(code)  # should anything still run Python's exit: mpi4py aborts instead of finalizing
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def preconnect(comm: Any, tag: int) -> None:
    """Open every pair's connection now, with one byte each way on ``comm``, while the network is known good.

    MPI connects a pair of ranks on their first message. A rank whose first message to a peer goes out
    behind a partition (the diagnosis of a timed-out call tells every peer where it is stuck) is ended
    by Open MPI's TCP transport at once (exit 14, no error the program can catch), before phalanx can
    raise; over a connection that exists, the same message just waits in the socket buffer.
    """
    import numpy as np

    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return
    token, inbox = np.zeros(1, np.uint8), np.empty(size, np.uint8)
    peers = [r for r in range(size) if r != rank]
    reqs = [comm.Irecv(inbox[r:r + 1], source=r, tag=tag) for r in peers]
    reqs += [comm.Isend(token, dest=r, tag=tag) for r in peers]
    type(reqs[0]).Waitall(reqs)


def group_comms(MPI: Any, comm: Any, diag: Any, ranks: tuple[int, ...]) -> tuple[Any, Any]:
    """The communicators of group ``ranks`` made from ``comm`` and ``diag`` (``MPI_Comm_create_group``).

    Blocking, among the members only (they have just agreed on it, world-wide); an MPI
    error is PeerLost.
    """
    try:
        members = comm.Get_group().Incl(list(ranks))
        made = comm.Create_group(members, _GROUP_TAG), diag.Create_group(members, _GROUP_TAG + 1)
        members.Free()
    except MPI.Exception as exc:
        raise PeerLost(str(exc)) from exc
    return made


def diagnose(MPI: Any, diag: Any, call: str, call_index: int,
             grace: float) -> tuple[list[int], dict[int, str], list[Any]]:
    """Tell every peer on ``diag`` where this rank is stuck; listen for their reports for ``grace`` s.

    Returns (ranks that never reported, {rank: the call it is in instead}, the sends, whose buffers
    must be kept alive).
    """
    rank, size = diag.Get_rank(), diag.Get_size()
    me = json.dumps({"call": call, "index": call_index}).encode()
    sends = [diag.Isend(me, dest=r, tag=DIAG_TAG) for r in range(size) if r != rank]
    reports: dict[int, dict[str, Any]] = {}
    status = MPI.Status()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and len(reports) < size - 1:
        if diag.Iprobe(source=MPI.ANY_SOURCE, tag=DIAG_TAG, status=status):
            src = status.Get_source()
            buf = bytearray(status.Get_count(MPI.BYTE))
            diag.Recv(buf, source=src, tag=DIAG_TAG)
            reports[src] = json.loads(bytes(buf))
        else:
            time.sleep(0.005)
    missing = [r for r in range(size) if r != rank and r not in reports]
    elsewhere = {r: f"{rep['call']} (call #{rep['index']})" for r, rep in reports.items()
                 if rep["call"] != call or rep["index"] != call_index}
    return missing, elsewhere, sends


_ABANDONED: list[Any] = []  # requests whose wait timed out (MPIRequest.wait)


class MPIRequest:
    """An MPI request plus what turns its buffers into the user's result (an MPI error is PeerLost)."""

    __slots__ = ("_req", "_finish", "_done", "_result", "_errors")

    def __init__(self, req: Any, finish: Callable[[], Any], errors: type[Exception]) -> None:
        self._req = req
        self._finish = finish
        self._done = False
        self._result: Any = None
        self._errors = errors  # mpi4py's MPI.Exception

    def test(self) -> bool:
        try:
            if not self._done and self._req.Test():
                self._complete()
        except self._errors as exc:
            raise PeerLost(str(exc)) from exc
        return self._done

    def wait(self, timeout: float) -> Any:
        if not self._done:
            try:
                poll(self._req.Test, timeout, patient=False)
            except self._errors as exc:
                raise PeerLost(str(exc)) from exc
            except WaitTimeout:
                _ABANDONED.append(self)  # MPI may write into its buffers until the process ends
                raise
            self._complete()
        return self._result

    def _complete(self) -> None:
        self._result = self._finish()
        self._done = True
        self._finish = None  # type: ignore[assignment]  # drop buffer references
