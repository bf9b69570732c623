"""The launcher behind ``phalanx run``, ``phalanx demo`` and :func:`phalanx.testing.run_world`.

::

    code = launch(Launch(n=4, backend="gloo", target=["train.py", "--lr", "0.1"]))

Every rank runs ``python -m phalanx.cli._worker <target>``, which reports an
uncaught exception to the launcher through a file in a fresh job directory
(``PHALANX_JOB_DIR``). MPI jobs are started by ``mpiexec`` (:mod:`._mpiexec`);
gloo and nccl jobs are spawned and supervised here (:mod:`._spawn`). Either
way the job ends within seconds of the first failure, with a report naming
the rank that failed first, and a Ctrl-C or SIGTERM to the launcher stops
every rank (exit status 130 or 143).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from types import FrameType

from .._errors import LaunchError
from ._procs import signal_name

__all__ = ["GRACE", "Launch", "LaunchError", "Signals", "launch", "stop_grace", "worker_command"]

GRACE = 3.0  # seconds between SIGTERM and SIGKILL when stopping ranks after a failure


def stop_grace() -> float:
    """Seconds between SIGTERM and SIGKILL when the *user* stops the job (Ctrl-C, SIGTERM).

    Long enough for a training loop that handles SIGTERM (``phalanx.train.fit``)
    to finish its step and write a checkpoint; a second Ctrl-C kills at once.
    ``PHALANX_STOP_GRACE`` changes it (torchrun waits 30 s, too).
    """
    try:
        return max(0.0, float(os.environ.get("PHALANX_STOP_GRACE", "30")))
    except ValueError:
        return 30.0


@dataclass
class Launch:
    """What to run: ``target`` is ``[script, *args]`` or ``["-m", module, *args]``."""

    n: int
    backend: str  # "mpi", "gloo" or "nccl"
    target: list[str]
    log_dir: str | None = None
    echo: bool = True  # with log_dir: also copy each rank's output to the console as "[r] line"
    timeout: float | None = None  # PHALANX_TIMEOUT for the ranks
    mpiexec: str | None = None
    mpi_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the ranks


def worker_command(target: list[str]) -> list[str]:
    return [sys.executable, "-m", "phalanx.cli._worker", *target]


class Signals:
    """While active, SIGINT/SIGTERM are recorded (``received``, ``count``) instead of killing the launcher."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.count = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():  # elsewhere Python forbids handlers
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum
        self.count += 1
        if self.count == 1:
            with contextlib.suppress(RuntimeError):  # a reentrant write to stderr: skip the notice
                notice(f"{signal_name(signum)}: stopping every rank (a rank that handles it, like "
                       f"phalanx.train.fit, gets up to {stop_grace():g} s to finish its step and write a "
                       "checkpoint; press Ctrl-C again to kill them now).")

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or 0)


def _rank_env(job: Launch, job_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(job.env)
    env.update(PHALANX_BACKEND=job.backend, PHALANX_JOB_DIR=job_dir, PYTHONUNBUFFERED="1")
    if job.timeout is not None:
        env["PHALANX_TIMEOUT"] = repr(float(job.timeout))
    if "OMP_NUM_THREADS" not in env:
        # n processes each using every core run slower than one process; torchrun does the same.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // job.n))
    return env


def launch(job: Launch) -> int:
    """Run the job to the end; print a failure report when it fails. Returns the exit status."""
    if job.n < 1:
        raise LaunchError(f"phalanx run: -n must be at least 1, got {job.n}")
    if not job.target or job.target[0] == "-m" and len(job.target) < 2:
        raise LaunchError("phalanx run: give a script (`phalanx run -n 2 train.py`) or a module (`-m pkg.mod`)")
    if job.backend not in ("mpi", "gloo", "nccl"):
        raise LaunchError(f"phalanx run: unknown backend {job.backend!r}; use mpi, gloo or nccl")
    if job.log_dir is not None:
        job.log_dir = os.path.abspath(job.log_dir)
        os.makedirs(job.log_dir, exist_ok=True)
    job_dir = tempfile.mkdtemp(prefix="phalanx-job-")
    env = _rank_env(job, job_dir)
    try:
        with Signals() as signals:
            if job.backend == "mpi":
                from ._mpiexec import run_mpi as run
            else:
                from ._spawn import run_spawn as run
            code = run(job, env, job_dir, signals)
        if signals.received:
            notice(f"stopped every rank after {signal_name(signals.received)} (exit status {code}).")
        return code
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


def notice(message: str) -> None:
    """A one-line launcher notice on stderr."""
    sys.stderr.write(f"phalanx run: {message}\n")
    sys.stderr.flush()
