"""Before a job is torn down: let the reader of this process's output pipes take what is in them.

A rank that fails writes its traceback and its failure record to stderr and then
ends the job (``MPI_Abort``). Under Hydra that output goes through a pipe to the
rank's proxy, which forwards it to ``mpiexec`` and the launcher; the abort goes
to the same proxy by another way (PMI), and a proxy that handles the abort first
tears the job down with the output still in the pipe: the launcher then never
learns which rank failed, or why. :func:`await_readers` waits, bounded, until the
pipes are empty (``FIONREAD``), which takes a few milliseconds where the reader is
alive; output to a terminal or a file is not waited for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import struct
import sys
import termios
import time
from collections.abc import Iterable

__all__ = ["await_readers", "also_wait_for"]

LIMIT_S = 2.0  # a reader that is gone or stopped must not hold a failing rank longer than this
_ALSO: set[int] = set()  # more descriptors waited for by default (also_wait_for)


def also_wait_for(fd: int) -> None:
    """Wait for ``fd`` too in :func:`await_readers` by default (the job channel: stderr as it was
    before ``--log-dir`` redirected it, ``phalanx._failure.keep_job_channel``)."""
    _ALSO.add(fd)


def await_readers(fds: Iterable[int] | None = None, limit: float = LIMIT_S) -> None:
    """Flush ``sys.stdout``/``sys.stderr``, then wait until no pipe among ``fds`` (default: 1, 2 and
    those of :func:`also_wait_for`) holds unread bytes, for at most ``limit`` seconds."""
    fds = (1, 2, *_ALSO) if fds is None else fds
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or replaced stream must not stop an abort
            stream.flush()
    pipes = [fd for fd in fds if _is_pipe(fd)]
    deadline = time.monotonic() + limit
    while any(_unread(fd) for fd in pipes) and time.monotonic() < deadline:
        time.sleep(0.005)


def _is_pipe(fd: int) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False


def _unread(fd: int) -> int:
    """Bytes written to pipe ``fd`` that its reader has not taken yet (0 if that cannot be told)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])
    except OSError:
        return 0
