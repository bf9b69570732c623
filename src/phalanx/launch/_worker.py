"""What every rank runs: ``python -m phalanx.launch._worker [-m module | script] args...``.

Runs the user's code as ``__main__`` (like ``python script.py`` /
``python -m module``, with ``sys.argv`` and ``sys.path[0]`` set the same way)
and makes an uncaught exception end the job instead of hanging it:

* the traceback goes to stderr and into ``$PHALANX_JOB_DIR/failure-rank<r>.json``
  (so ``phalanx run`` can name the rank that failed first); a rank whose code ends
  without an error leaves ``exit-rank<r>`` instead, so a rank that ends with
  neither (killed by a signal, ``os._exit``) is known to have failed;
* under MPI with more than one rank it calls ``MPI_Abort`` (a rank that just
  exits would leave its peers waiting in a collective, or in ``MPI_Finalize``);
  otherwise it exits with status 1 and the launcher stops the other ranks.

``KeyboardInterrupt`` exits 130; ``SystemExit`` passes through (a non-zero
status also aborts an MPI job, as ``python -m mpi4py`` does).

With ``PHALANX_LOG_DIR`` set (``phalanx run --backend mpi --log-dir DIR``) the
rank's stdout and stderr go to ``DIR/rank.<r>.log`` only; the launcher echoes
those files to its console.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import traceback
from typing import Any

from .._drain import await_readers
from .._epochs import JOINING_ENV, ulfm
from .._failure import (
    RAISED_STATUS,
    env_rank,
    keep_job_channel,
    on_launch_host,
    record_failure,
    send_job_file,
)
from . import _keeper as keeper
from ._job import ONE_HOST


def _mpi() -> Any:
    """mpi4py.MPI when the user's code initialized MPI with more than one rank, else None."""
    mpi = sys.modules.get("mpi4py.MPI")  # never import it here: that could initialize MPI
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
            return mpi
    except Exception:  # noqa: BLE001 - a broken MPI must not hide the user's error
        pass
    return None


def _abort_at_exit(status: int) -> None:
    """Make mpi4py call MPI_Abort(status) instead of MPI_Finalize at exit (what `-m mpi4py` does)."""
    mpi = _mpi()
    setter = getattr(mpi, "_set_abort_status", None)
    if setter is not None and status:
        setter(status)


def _redirect_output(log_dir: str, rank: int) -> None:
    fd = os.open(os.path.join(log_dir, f"rank.{rank}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)


def _leave_exit_marker() -> None:
    """``exit-rank<r>``: this rank's code ended without an error (a rank that ends without one failed)."""
    job_dir = os.environ.get("PHALANX_JOB_DIR")
    if job_dir:
        try:
            open(os.path.join(job_dir, f"exit-rank{env_rank()}"), "wb").close()
        except OSError:
            pass


def _leave_pid(job_dir: str, rank: int) -> None:
    try:
        with open(os.path.join(job_dir, f"pid-rank{rank}"), "w") as f:
            f.write(f"{os.getpid()} {socket.gethostname()}\n")
    except OSError:
        pass  # on another node the job directory does not exist: only the report loses detail


def run(argv: list[str]) -> None:
    """Run ``[-m module | script] args...`` as ``__main__``."""
    if not argv or argv[0] == "-m" and len(argv) < 2:
        raise SystemExit("usage: python -m phalanx.launch._worker [-m module | script] [args...]")
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _user_frames(exc: BaseException) -> BaseException:
    """Drop the leading frames of this bootstrap, runpy and phalanx.testing's rank runner
    (``phalanx.launch``): they are noise to the user."""
    ours = os.path.dirname(os.path.abspath(__file__))
    runner = {os.path.abspath(runpy.__file__ or ""), "<frozen runpy>"}
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and (
            tb.tb_frame.f_code.co_filename in runner
            or os.path.dirname(os.path.abspath(tb.tb_frame.f_code.co_filename)) == ours):
        tb = tb.tb_next
    return exc.with_traceback(tb)


def fail(exc: BaseException) -> None:
    """Report an uncaught exception and end this rank (and an MPI job) with :data:`RAISED_STATUS`."""
    rank = env_rank()
    exc = _user_frames(exc)
    try:  # the record first: on another host it travels through stderr, which an abort can cut short
        record_failure(type(exc), exc, exc.__traceback__, rank)
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    finally:
        mpi = _mpi()
        if mpi is not None:
            size = mpi.COMM_WORLD.Get_size()
            sys.stderr.write(f"phalanx: rank {rank}/{size} raised {type(exc).__name__}; aborting the MPI "
                             "job so the other ranks do not wait forever.\n")
        sys.stderr.flush()
        sys.stdout.flush()
        if mpi is not None:
            _abort_at_exit(RAISED_STATUS)  # MPICH's MPI_Abort returns: at exit abort again, never MPI_Finalize
            await_readers()  # the output above reaches the launcher before the abort tears the job down
            mpi.COMM_WORLD.Abort(RAISED_STATUS)
    # Exit normally (atexit handlers flush the user's files). Should exit hang, waiting for peers that
    # will never come, the launcher stops this rank: it has seen the failure record.
    if _skips_finalize():
        _exit_past_torch_teardown(RAISED_STATUS)
    sys.exit(RAISED_STATUS)


def _whole_lines() -> None:
    """Write the rank's output a line at a time: the launcher sets PYTHONUNBUFFERED (nothing is held
    back), under which ``print`` writes its text and its newline separately, so two ranks sharing the
    launcher's stdout could splice their lines together."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(write_through=False, line_buffering=True)  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):  # replaced or closed by the caller: leave it
            pass


# torchrun's variables from an MPI launcher's (Open MPI's first, then MPICH/Hydra's and PMIx's)
_FROM_MPI = {
    "RANK": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"),
    "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
    "LOCAL_RANK": ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
    "LOCAL_WORLD_SIZE": ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"),
}


def torchrun_variables(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """Under ``phalanx run --backend mpi``: the ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` a script written for torchrun reads (nanoGPT's ``int(os.environ["RANK"])``),
    from the MPI launcher's variables; those already set and those it cannot know are left out."""
    if env.get("PHALANX_BACKEND") != "mpi":
        return {}
    found = {}
    sources_of = dict(_FROM_MPI)
    if env.get(ONE_HOST) == "1":  # every rank on one host: the local rank is the rank
        sources_of["LOCAL_RANK"] += sources_of["RANK"]
        sources_of["LOCAL_WORLD_SIZE"] += sources_of["WORLD_SIZE"]
    for name, sources in sources_of.items():
        value = next((env[s] for s in sources if env.get(s, "").isdigit()), None)
        if value is not None and name not in env:
            found[name] = value
    return found


def main() -> None:
    if os.environ.get(JOINING_ENV) == "1" and ulfm():
        from .._epochs_ulfm import start_early

        start_early()  # a replacement spawned into a running MPI job: its survivors wait in MPI_Comm_spawn
    rank = env_rank()  # from the environment: needed before MPI is initialized
    os.environ.update(torchrun_variables(os.environ))
    if os.environ.pop(keeper.ENV, None) and os.environ.get("PHALANX_JOB_DIR"):
        keeper.keep(os.environ["PHALANX_JOB_DIR"], rank)  # from here on: the rank, a child of its keeper
    _whole_lines()
    if not on_launch_host():  # the launcher's job directory is on its host: its files go through stderr
        os.environ.pop("PHALANX_JOB_DIR", None)
        keep_job_channel()
        send_job_file(f"pid-rank{rank}", f"{os.getpid()} {socket.gethostname()}\n")
    log_dir = os.environ.get("PHALANX_LOG_DIR")
    if log_dir:
        _redirect_output(log_dir, rank)
    job_dir = os.environ.get("PHALANX_JOB_DIR")
    if job_dir:
        _leave_pid(job_dir, rank)
    try:
        run(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code == 0:
            _leave_exit_marker()
        if _skips_finalize():
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)  # what sys.exit("message") prints
            _exit_past_torch_teardown(code)
        _abort_at_exit(code)
        raise
    except KeyboardInterrupt as exc:
        traceback.print_exception(_user_frames(exc))
        if _skips_finalize():
            _exit_past_torch_teardown(130)
        _abort_at_exit(130)
        sys.exit(130)
    except BaseException as exc:  # noqa: BLE001 - every uncaught error must end the job
        fail(exc)
    _leave_exit_marker()
    if _skips_finalize():
        _exit_past_torch_teardown(0)


def _skips_finalize() -> bool:
    """Whether this rank ends past its library's teardown (:func:`_exit_past_torch_teardown`): gloo and
    nccl ranks, and the MPI ranks of a world that re-formed in place under ULFM: Open MPI 5.0.11's
    ``MPI_Finalize`` corrupts its heap (``ompi_dpm_dyn_finalize``) once a spawned replacement has died.
    Its exit marker is left first and ``phalanx.shutdown`` (an exit handler) agrees with the peers, so
    every rank has finished before any leaves; ``phalanx run`` then reads mpirun's complaint about a rank
    that did not finalize against those markers (:mod:`._mpi_in_place`)."""
    backend = os.environ.get("PHALANX_BACKEND")
    return backend in ("gloo", "nccl") or backend == "mpi" and ulfm()


def _exit_past_torch_teardown(code: int) -> None:
    """End a torch.distributed rank with status ``code`` without C++ static teardown.

    torch 2.13's Gloo teardown sometimes dies in ``terminate called without an
    active exception`` (SIGABRT) after the script has finished, even after
    ``destroy_process_group()`` (about 1 exit in 20, raw torch too; more often
    after a timeout, with a store call abandoned in a thread), which would turn
    a success into a failure and a failure's exit status 1 into a signal.
    Python's own exit work (atexit handlers: the user's files, loggers) runs
    first; only the C++ destructors are skipped. MPI ranks must finalize, and
    take this path only under ULFM (:func:`_skips_finalize`).
    """
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not turn success into failure
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
