"""What happens when a rank fails: a record for the launcher, and ending the job.

An uncaught exception on one MPI rank would otherwise deadlock the job
(the failing rank waits in ``MPI_Finalize`` while its peers wait for it), so
after :func:`phalanx.init` on MPI an uncaught exception prints the traceback
and calls ``MPI_Abort``, as ``python -m mpi4py`` does. Under ``phalanx run``
every failing rank also leaves a small JSON record in the job directory, so
the launcher can name the *first* failing rank and show its traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import time
import traceback
from types import TracebackType
from typing import Any

from ._drain import also_wait_for
from ._files import write_atomically

__all__ = ["JOB_FILE_MARK", "RAISED_STATUS", "env_rank", "install_abort_hook", "keep_job_channel", "mark_rank",
           "marker_rank", "on_launch_host", "record_failure", "send_job_file"]

JOB_DIR_ENV = "PHALANX_JOB_DIR"
LAUNCH_HOST_ENV = "PHALANX_LAUNCH_HOST"  # set by `phalanx run` when ranks may run on other hosts
JOB_FILE_MARK = "@phalanx-job-file "  # a job-directory file on stderr, from a rank on another host
RAISED_STATUS = 1  # the exit status of a rank that raised; phalanx run's MPI report returns it too
_channel = 2  # the fd that carries them: stderr, as it was before --log-dir redirected it


def on_launch_host() -> bool:
    """False on a rank that runs on another host than its ``phalanx run`` (``$PHALANX_LAUNCH_HOST``):
    the launcher's job directory is not there, so the rank reports through its stderr instead."""
    host = os.environ.get(LAUNCH_HOST_ENV)
    return not host or host == socket.gethostname()


# Set by the launchers phalanx supports (phalanx run/torchrun, Open MPI, Hydra, PMIx, Slurm).
_RANK_VARS = ("PHALANX_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


def env_rank() -> int:
    """This process's rank as its launcher set it in the environment (0 when none did).

    Read from the environment because it is needed before (or without) a formed world:
    before MPI is initialized, and by a rank whose world never formed.
    """
    for name in _RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def record_failure(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None,
                   rank: int | None = None) -> None:
    """Write ``failure-rank<r>.json`` into ``$PHALANX_JOB_DIR`` (atomically), if set; on another host
    than the launcher's, one ``RECORD_MARK`` line of JSON on stderr, which mpiexec carries to it."""
    job_dir = os.environ.get(JOB_DIR_ENV)
    remote = not on_launch_host()
    if not job_dir and not remote:
        return
    rank = env_rank() if rank is None else rank
    message, trace = str(exc), "".join(traceback.format_exception(exc_type, exc, tb))
    if remote:  # one line through mpiexec's stderr: kept short
        message, trace = message[:1000], trace[-2000:]
    record = {"rank": rank, "time": time.time(), "type": exc_type.__name__, "message": message,
              "traceback": trace, "host": socket.gethostname()}
    if remote:
        send_job_file(f"failure-rank{rank}.json", json.dumps(record))
        return
    assert job_dir is not None
    # Whole or absent: the launcher reads it while this rank may still be killed. Not fsynced:
    # it only has to outlive this process, not the machine.
    with contextlib.suppress(OSError):  # the report is a courtesy; never mask the real failure
        with write_atomically(os.path.join(job_dir, f"failure-rank{rank}.json"), "w", durable=False) as f:
            json.dump(record, f)


def keep_job_channel() -> None:
    """Keep this rank's stderr, as it is now, for :func:`send_job_file` (before --log-dir redirects it)."""
    global _channel
    with contextlib.suppress(OSError):
        _channel = os.dup(2)
        also_wait_for(_channel)  # a failure record sent through it is read before an abort


def send_job_file(name: str, text: str) -> None:
    """Send the launcher's job-directory file ``name`` with ``text`` from a rank on another host:
    one ``JOB_FILE_MARK`` line, one write (short enough not to interleave with other ranks' output).
    The launcher reads it from mpiexec's stderr, keeps it off the console and writes the file."""
    line = (JOB_FILE_MARK + json.dumps({"name": name, "text": text}) + "\n").encode(errors="replace")
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
        os.write(_channel, line)


def mark_rank(kind: str, rank: int | None = None, tag: str = "", *, any_host: bool = False) -> None:
    """Leave an empty ``<kind>-rank<r><tag>`` file in ``$PHALANX_JOB_DIR`` (if set) for the launcher.

    ``kind``: ``"init"`` when ``phalanx.init`` starts, ``"ready"`` when the world is formed
    (``phalanx run --start-timeout`` names the ranks that have neither). Under ULFM
    (:mod:`phalanx._epochs_ulfm`) the first survivor marks a lost rank's slot ``"dropped"`` (no
    replacement takes it) or ``"replaced"`` (``tag`` ``-e<epoch>``: one marker per replacement spawned).
    ``any_host``: write it on another host than the launcher's too (where the directory exists there).
    The launcher reads the markers with :func:`marker_rank`.
    """
    job_dir = os.environ.get(JOB_DIR_ENV)
    if not job_dir or not (any_host or on_launch_host()):
        return
    rank = env_rank() if rank is None else rank
    with contextlib.suppress(OSError):  # on another host the job directory may not exist
        with open(os.path.join(job_dir, f"{kind}-rank{rank}{tag}"), "w") as f:
            if kind == "ready":  # MPICH's shared memory, made by MPI_Init: the launcher removes it should
                f.write(_mpich_segments())  # this rank end abnormally, before MPI_Finalize would


def marker_rank(name: str, kind: str, *, tagged: bool = False) -> int | None:
    """The rank of a job-directory file ``name`` that is a ``kind`` marker (``<kind>-rank<r>``, as
    :func:`mark_rank` writes it; ``tagged``: with or without a ``-<tag>`` after it), else None."""
    prefix = f"{kind}-rank"
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):].split("-")[0] if tagged else name[len(prefix):]
    return int(rest) if rest.isdigit() else None


def _mpich_segments() -> str:
    """The names of the MPICH shared-memory files this process maps, one a line ("" if none)."""
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        return "".join(f"{line.split(None, 5)[5].rstrip()}\n" for line in maps
                       if "/dev/shm/mpich_shm_" in line and not line.rstrip().endswith("(deleted)"))
    return ""


def install_abort_hook(world: Any) -> None:
    """On an uncaught exception: print it, record it, then end the job (``backend.abort``).

    Called by ``phalanx.init`` once the world is formed; also leaves this rank's ``ready``
    marker for the launcher (:func:`mark_rank`).

    On MPI that is ``MPI_Abort`` (otherwise the job deadlocks); on gloo/nccl
    it exits at once, so peers see the closed connection within a second
    instead of waiting out the process group's own timeout. Also at exit: a
    world broken by a timeout has collectives in flight that can never
    complete, and ``MPI_Finalize`` could wait for them forever, so the MPI
    job is aborted instead.
    """
    backend = world.backend
    # In a world with epochs the launcher knows each process by its slot (RANK as it started it), not by
    # its rank in the current epoch.
    slot = env_rank() if os.environ.get("PHALANX_ELASTIC") else None
    mark_rank("ready", backend.rank if slot is None else slot)
    if backend.size <= 1 or getattr(sys.excepthook, "_phalanx", False):
        return
    previous = sys.excepthook

    def at_exit() -> None:
        live = world
        while live.superseded is not None:  # phalanx.reform replaced it by a new epoch's world
            live = live.superseded
        if live.broken is not None and live.backend.name == "mpi":
            sys.stderr.write(f"phalanx: rank {live.backend.rank} ends the MPI job: the world was left "
                             f"unusable ({live.broken}), so MPI cannot finalize cleanly.\n")
            sys.stderr.flush()
            live.backend.abort(1)

    atexit.register(at_exit)

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            record_failure(exc_type, exc, tb, backend.rank if slot is None else slot)
            previous(exc_type, exc, tb)
            sys.stderr.write(
                f"phalanx: rank {backend.rank}/{backend.size} raised {exc_type.__name__}; "
                "ending the job so the other ranks do not wait forever.\n"
            )
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            code = 130 if issubclass(exc_type, KeyboardInterrupt) else RAISED_STATUS
            backend.abort(code)

    hook._phalanx = True  # type: ignore[attr-defined]
    sys.excepthook = hook
