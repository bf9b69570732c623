"""``launch(job)``: run a job to its end, behind ``phalanx run``, ``phalanx demo`` and ``phalanx.testing``.

::

    code = launch(Launch(n=4, backend="gloo", target=["train.py", "--lr", "0.1"]))

Every rank runs ``python -m phalanx.launch._worker <target>``, which reports an
uncaught exception to the launcher through a file in a fresh job directory
(``PHALANX_JOB_DIR``). MPI jobs are started by ``mpiexec`` (:mod:`._mpiexec`);
gloo and nccl jobs are spawned and supervised here (:mod:`._spawn`). Either
way the job ends within seconds of the first failure, with a report naming
the rank that failed first, and a Ctrl-C or SIGTERM to the launcher stops
every rank (exit status 130 or 143).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from .._errors import LaunchError
from ._elastic import check_elastic, run_elastic
from ._from_one_host import torch_runner
from ._job import Launch, Signals, notice, rank_env
from ._mpiexec import run_mpi
from ._on_each_host import check_nodes
from ._procs import signal_name

__all__ = ["launch"]

BACKENDS = ("mpi", "gloo", "nccl")


def _check(job: Launch) -> None:
    if job.n < 1:
        raise LaunchError(f"phalanx run -n {job.n}: a job needs at least one rank; use -n 1 or more.")
    if not job.target or job.target[0] == "-m" and len(job.target) < 2:
        raise LaunchError(f"phalanx run: got target {job.target!r}; give a script (`phalanx run -n 2 train.py`) "
                          "or a module (`phalanx run -n 2 -m pkg.train`).")
    if job.backend not in BACKENDS:
        raise LaunchError(f"phalanx run --backend {job.backend!r}: unknown backend; use mpi, gloo or nccl.")
    job.resolve_settings()
    check_nodes(job)


def launch(job: Launch) -> int:
    """Run ``job`` to its end and return its exit status (0 when every rank succeeded).

    Starts the ranks (``mpiexec`` for ``"mpi"``, spawned processes for ``"gloo"``/``"nccl"``),
    supervises them and, when the job fails, prints a report naming the rank that failed first
    with its traceback. The first failure stops every rank within seconds; so does a rank that
    has not reached ``phalanx.init`` within ``job.start_timeout`` while others have; a Ctrl-C or
    SIGTERM to this process stops every rank (exit status 130 or 143). With ``job.max_restarts``, a
    failed job is started again on the hosts still reachable (:func:`._elastic.run_elastic`).

    Raises :class:`~phalanx.LaunchError` when the job cannot start (bad arguments or settings,
    no ``mpiexec``, ...).
    """
    _check(job)
    check_elastic(job)
    if job.log_dir is not None:
        job.log_dir = os.path.abspath(job.log_dir)
        os.makedirs(job.log_dir, exist_ok=True)
    with Signals(job.stop_grace or 0.0) as signals:
        return run_elastic(job, signals, _attempt)  # one attempt, or more with job.max_restarts


def _attempt(job: Launch, signals: Signals) -> int:
    """Run ``job`` once, in a fresh job directory; its exit status."""
    job_dir = tempfile.mkdtemp(prefix="phalanx-job-")
    env = rank_env(job, job_dir)
    try:
        run = run_mpi if job.backend == "mpi" else torch_runner(job)
        code = run(job, env, job_dir, signals)
        if signals.received:
            notice(f"stopped every rank after {signal_name(signals.received)} (exit status {code}).")
        return code
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
