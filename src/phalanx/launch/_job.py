"""What a job is (:class:`Launch`), the settings it reads, and what every launcher shares.

Both launchers (:mod:`._spawn` for gloo/nccl, :mod:`._mpiexec` for MPI) start
``python -m phalanx.launch._worker <target>`` on every rank with the
environment :func:`rank_env` builds, and stop the job the same way: ranks get
SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import sys
import threading
from dataclasses import dataclass, field
from types import FrameType

from .._errors import LaunchError
from .._net import is_local_address
from .._settings import env_seconds
from ._hostlist import Host, as_hosts
from ._procs import signal_name

__all__ = ["GRACE", "Launch", "Signals", "all_local", "notice", "rank_env", "seconds_from_env",
           "worker_command"]

GRACE = 3.0  # seconds between SIGTERM and SIGKILL when stopping ranks after a failure
DEFAULT_STOP_GRACE = 30.0  # after a user's Ctrl-C/SIGTERM (torchrun waits 30 s, too)
DEFAULT_START_TIMEOUT = 600.0  # every rank must have reached phalanx.init by then
WORKER = "phalanx.launch._worker"

# mpiexec options that place ranks on other hosts, and batch systems whose allocation Hydra and
# Open MPI use on their own: with either, the ranks may not all run here.
_PLACEMENT = re.compile(r"(?:^|\s)-{1,2}(?:hosts?|H|f|hostfile|machinefile|rankfile|default-hostfile)(?:[\s=]|$)")
_BATCH_SYSTEMS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "PE_HOSTFILE", "COBALT_JOBID", "FLUX_JOB_ID")


def seconds_from_env(name: str, default: float, *, zero_ok: bool = False) -> float:
    """``$name`` as seconds (``default`` when unset or empty); a bad value is a :class:`LaunchError`."""
    return env_seconds(name, default, zero_ok=zero_ok, call="phalanx run: ", error=LaunchError)


@dataclass
class Launch:
    """One job: ``n`` ranks of ``target`` (``[script, *args]`` or ``["-m", module, *args]``) on ``backend``.

    ``stop_grace`` (``PHALANX_STOP_GRACE``) and ``start_timeout`` (``PHALANX_START_TIMEOUT``) are
    read from the environment when left ``None``; :func:`~phalanx.launch.launch` validates both.
    """

    n: int
    backend: str  # "mpi", "gloo" or "nccl"
    target: list[str]
    log_dir: str | None = None
    echo: bool = True  # with log_dir: also copy each rank's output to the console as "[r] line"
    timeout: float | None = None  # PHALANX_TIMEOUT for the ranks
    mpiexec: str | None = None
    mpi_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the ranks
    stop_grace: float | None = None  # after a user's Ctrl-C/SIGTERM, before SIGKILL
    start_timeout: float | None = None  # every rank must reach phalanx.init within it (only when all_local)
    nnodes: int = 1  # gloo/nccl: hosts of the job, one launcher each (._on_each_host, torchrun's convention)
    node_rank: int = 0  # this launcher's host among them (its ranks: node_rank * n + 0..n-1)
    master: str | None = None  # HOST[:PORT] where rank 0 serves the rendezvous (default port 29500)
    iface: str | None = None  # network interface for the ranks (PHALANX_IFACE; default: the route to master)
    secret_file: str | None = None  # file holding the job's secret (default: $PHALANX_SECRET)
    max_restarts: int = 0  # a failed job is started again up to this many times (._elastic)
    # slots given a replacement in place (._epochs): they count against max_restarts with whole restarts
    replaced: list[int] = field(default_factory=list)
    min_ranks: int | None = None  # a restart on fewer ranks than this is refused (default 1)
    hosts: list[Host] | None = None  # ranks on these hosts (--hosts/--hostfile; ._hostlist); None: all here
    rsh: str | None = None  # the command that starts a process on another host (default: ssh)
    oversubscribe: bool = False  # more ranks than the hosts' slots

    def __post_init__(self) -> None:
        self.hosts = as_hosts(self.hosts)  # "h0:2,h1:2" or [name, slots] pairs (JSON) become Host entries

    def resolve_settings(self) -> None:
        """Fill ``stop_grace`` and ``start_timeout`` from the environment (LaunchError when malformed)."""
        if self.stop_grace is None:
            self.stop_grace = seconds_from_env("PHALANX_STOP_GRACE", DEFAULT_STOP_GRACE, zero_ok=True)
        if self.start_timeout is None:
            self.start_timeout = seconds_from_env("PHALANX_START_TIMEOUT", DEFAULT_START_TIMEOUT)
        if not self.start_timeout > 0:
            raise LaunchError(f"phalanx run --start-timeout {self.start_timeout:g}: give a positive number "
                              "of seconds, e.g. --start-timeout 60.")


ONE_HOST = "PHALANX_ONE_HOST"  # set by `phalanx run --backend mpi` when every rank runs on its host


def all_local(job: Launch) -> bool:
    """True when every rank runs on this host (spawned ranks always do; MPI unless told otherwise)."""
    if job.backend != "mpi":
        return True
    if job.hosts and any(not is_local_address(h.name) for h in job.hosts):
        return False
    return not _PLACEMENT.search(" ".join(job.mpi_args)) and not any(v in os.environ for v in _BATCH_SYSTEMS)


def worker_command(target: list[str]) -> list[str]:
    """The command every rank runs: the worker bootstrap around ``target``."""
    return [sys.executable, "-m", WORKER, *target]


def rank_env(job: Launch, job_dir: str) -> dict[str, str]:
    """The environment shared by every rank of ``job`` (the launchers add each rank's identity)."""
    env = dict(os.environ)
    env.update(job.env)
    env.update(PHALANX_BACKEND=job.backend, PHALANX_JOB_DIR=job_dir, PYTHONUNBUFFERED="1")
    if job.timeout is not None:
        env["PHALANX_TIMEOUT"] = repr(float(job.timeout))
    if not env.get("PHALANX_SECRET", "").strip():  # guards even a one-host rendezvous from other local users
        env["PHALANX_SECRET"] = secrets.token_hex(32)
    if "OMP_NUM_THREADS" not in env:
        # n processes each using every core run slower than one process; torchrun does the same.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // job.n))
    return env


class Signals:
    """While active, SIGINT/SIGTERM are recorded (``received``, ``count``) instead of killing the launcher."""

    def __init__(self, stop_grace: float = DEFAULT_STOP_GRACE) -> None:
        self.received: int | None = None
        self.count = 0
        self.stop_grace = stop_grace
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
                       f"phalanx.train.fit, gets up to {self.stop_grace:g} s to finish its step and write a "
                       "checkpoint; press Ctrl-C again to kill them now).")

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or 0)


def notice(message: str) -> None:
    """A one-line launcher notice on stderr."""
    sys.stderr.write(f"phalanx run: {message}\n")
    sys.stderr.flush()
