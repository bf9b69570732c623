"""A rank's keeper: the process MPICH's mpiexec starts, which runs the rank as its child.

Hydra kills every rank with SIGKILL the moment one of them dies *by a signal*, even under
``-disable-auto-cleanup`` (which spares them only when a rank exits with a status): its
proxy sends SIGUSR1 and then SIGKILL to each rank's process group within a millisecond.
A launcher that is a few milliseconds late (a loaded machine) then sees every rank end at
the same instant and cannot tell which one failed: a SIGKILL from the out-of-memory killer
and Hydra's clean-up look alike.

So where the launcher stops the ranks itself (:func:`._mpi_flavor.hydra_args`), each rank
forks at start. The child is the rank (its pid is the one in ``pid-rank<r>``; it holds the
PMI connection and runs the user's code). The parent, a small copy of the interpreter that
imported nothing heavy, only waits: when the child ends, it writes ``status-rank<r>``
(the exact wait status, negative for a signal, and when it came) and exits with the status
a shell would show (``128 + N`` for signal N). Hydra sees an exit status, not a signal, so
it leaves the other ranks to the launcher, which names the rank that ended first.

The keeper also knows the MPICH shared-memory files (``/dev/shm/mpich_shm_*``) its rank maps
(listed in the rank's ``ready-rank<r>`` marker once ``MPI_Init`` made them); when the rank ends abnormally (never reaching ``MPI_Finalize``,
which unlinks them), it unlinks those, so a failed job leaves nothing behind in ``/dev/shm``
and other jobs' segments are never touched.

Under ``mpiexec.gforker`` (every rank here: :func:`._mpi_flavor.single_host_forker`) the keeper
is what makes the forker usable: the forker reports a rank killed by a signal as exit status 0
and interrupts the others, and it signals every rank after any abnormal end; with keepers it
sees no signal, and its own reach only the keepers, which ignore them. The forker also copies its ranks' output
to its own one byte per ``write``, so lines of different ranks could splice: the launcher
passes its own pipes (``STDIO_ENV``) and each rank writes to them directly, whole lines as it
writes them; rank 0 reads the launcher's stdin, as under Hydra.
"""

from __future__ import annotations

import os
import signal
import time

from .._files import write_atomically
from ._procs import child_setup

__all__ = ["ENV", "STDIO_ENV", "keep", "remove_segments"]

SHM_PREFIX = "/dev/shm/mpich_shm_"  # MPICH's shared-memory segments: unlinked at MPI_Finalize only
ENV = "PHALANX_RANK_KEEPER"  # set by the launcher where it stops the ranks itself (single-host MPICH)
STDIO_ENV = "PHALANX_RANK_STDIO"  # "IN,OUT,ERR": the launcher's descriptors, passed through mpiexec.gforker
# What reaches the keeper through the rank's process group (Hydra's SIGUSR1 failure notice, its
# SIGINT/SIGTERM forwarding): the child gets the same signal and decides; the keeper outlives it.
_IGNORED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
            signal.SIGPIPE, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)


def keep(job_dir: str, rank: int) -> None:
    """Fork; return in the child (the rank). The parent waits for it and exits with its status."""
    _adopt_stdio(rank)
    die_with_keeper = child_setup()
    child = os.fork()
    if child == 0:
        if die_with_keeper is not None:  # a keeper killed alone must not leave an orphaned rank
            die_with_keeper()
        return
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    pmi_fd = os.environ.get("PMI_FD", "")
    if pmi_fd.isdigit():  # the child's connection to Hydra: it must close when the child ends
        try:
            os.close(int(pmi_fd))
        except OSError:
            pass
    for fd in (0, 1, 2):  # the child writes to Hydra's pipes; the keeper has nothing to say
        try:
            os.close(fd)
        except OSError:
            pass
    raw = _wait(child)
    status = -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
    if status != 0:
        remove_segments(job_dir, rank)
    try:
        with write_atomically(os.path.join(job_dir, f"status-rank{rank}"), "w", durable=False) as f:
            f.write(f"{status} {time.time():.6f}\n")
    except OSError:
        pass  # the report falls back on what the launcher saw
    os._exit(128 - status if status < 0 else status)


def _adopt_stdio(rank: int) -> None:
    """Write to the launcher's pipes (and rank 0 read its stdin) instead of the forker's."""
    fds = [int(fd) for fd in os.environ.pop(STDIO_ENV, "").split(",") if fd.isdigit()]
    if len(fds) != 3:
        return
    for fd, target in zip(fds, (0, 1, 2), strict=True):  # the launcher numbers them past 2
        try:
            if target or rank == 0:
                os.dup2(fd, target)
            os.close(fd)
        except OSError:
            pass  # not passed on after all: the forker's pipe stays


def _wait(child: int) -> int:
    while True:
        try:
            _, raw = os.waitpid(child, 0)
            return raw
        except ChildProcessError:  # cannot happen for our own child; leave with a failure rather than spin
            os._exit(1)
        except InterruptedError:
            continue


def remove_segments(job_dir: str, rank: int) -> None:
    """Unlink the MPICH shared-memory files rank ``rank`` mapped (listed in its ``ready-rank<r>``
    marker): it ended abnormally, never reaching MPI_Finalize, which would have. Memory the job's
    other ranks still map stays theirs until they end; other jobs' files are never named there."""
    try:
        with open(os.path.join(job_dir, f"ready-rank{rank}")) as f:
            paths = f.read().split("\n")
    except OSError:  # the rank never formed the world: MPI_Init may not have mapped anything yet
        return
    for path in paths:
        if path.startswith(SHM_PREFIX) and "/" not in path[len(SHM_PREFIX):]:
            try:
                os.unlink(path)
            except OSError:
                pass  # another rank's keeper was first
