"""``phalanx run``: argument parsing and the default backend."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys

from ._launch import Launch, LaunchError, launch

__all__ = ["add_run_options", "default_backend", "main", "split_target"]

USAGE = "phalanx run -n N [options] script.py [args...]\n       phalanx run -n N [options] -m module [args...]"

# Launcher options that take a value: everything before the script (or -m) belongs to phalanx.
_VALUED = {"-n", "--np", "--backend", "--log-dir", "--timeout", "--mpiexec", "--mpi-args"}


def split_target(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(launcher options, target)``: the target starts at the script or ``-m`` and keeps every
    later argument untouched (argparse's REMAINDER would still grab ``-m mod --flag``)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if arg == "-m":
            return argv[:i], argv[i:]
        if arg.startswith("-m") and not arg.startswith("--"):  # -mpkg.mod, like python
            return argv[:i], ["-m", arg[2:], *argv[i + 1:]]
        if not arg.startswith("-") or arg == "-":
            return argv[:i], argv[i:]
        i += 2 if arg in _VALUED else 1
    return argv, []


def add_run_options(parser: argparse.ArgumentParser, *, n_default: int | None = None) -> None:
    parser.add_argument("-n", "--np", dest="n", type=int, required=n_default is None, default=n_default,
                        metavar="N", help="number of processes (ranks) on this machine"
                        + (f" (default {n_default})" if n_default else ""))
    parser.add_argument("--backend", choices=("mpi", "gloo", "nccl"),
                        help="default: mpi when mpi4py and an mpiexec are installed, else nccl when "
                             "torch sees GPUs, else gloo")
    parser.add_argument("--log-dir", metavar="DIR",
                        help="write each rank's stdout+stderr to DIR/rank.<r>.log (echoed to the console "
                             "as '[r] line'). With mpi the ranks write the files themselves, so on several "
                             "nodes DIR must be on a shared file system.")
    parser.add_argument("--no-echo", dest="echo", action="store_false",
                        help="with --log-dir: do not echo the ranks' output to the console")
    parser.add_argument("--timeout", type=float, metavar="S",
                        help="seconds a collective may wait for the other ranks (sets PHALANX_TIMEOUT)")
    parser.add_argument("--mpiexec", metavar="PATH", help="the mpiexec to use (default: the one beside "
                        "this Python, e.g. from `pip install mpich`, then PATH)")
    parser.add_argument("--mpi-args", default="", metavar="'ARGS'",
                        help="extra mpiexec arguments, one quoted string, e.g. --mpi-args='--bind-to core'")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx run", usage=USAGE,
        description="Start N ranks of a script and supervise them: the first failure stops every rank "
                    "and is reported with its traceback; Ctrl-C stops everything (exit 130). Each rank "
                    "gets PHALANX_BACKEND, so `phalanx.init()` needs no arguments. Unless "
                    "OMP_NUM_THREADS is set, each rank gets cpu_count // N threads.",
    )
    add_run_options(parser)
    return parser


def default_backend(mpiexec: str | None = None) -> str:
    """What ``phalanx run`` uses without ``--backend`` (see DESIGN: mpi, else nccl with GPUs, else gloo)."""
    from ._mpiexec import find_mpiexec

    if mpiexec or importlib.util.find_spec("mpi4py") is not None and find_mpiexec() is not None:
        return "mpi"  # an explicit --mpiexec means MPI, even a wrong one (run_mpi then says so)
    if importlib.util.find_spec("torch") is None:
        raise LaunchError(
            "phalanx run: no backend to run on: install MPI (`pip install 'phalanx[mpich]'`) or PyTorch "
            "(`pip install torch`, for gloo and nccl)."
        )
    return "nccl" if _has_gpus() else "gloo"


def _has_gpus() -> bool:
    """Ask torch in a subprocess (importing torch costs seconds; skip it when no GPU driver is present)."""
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")):
        return False
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip() or 0) > 0
    except (OSError, ValueError, subprocess.SubprocessError):
        return False


def job_from_args(args: argparse.Namespace, target: list[str]) -> Launch:
    if args.timeout is not None and not args.timeout > 0:
        raise LaunchError(f"phalanx run: --timeout must be a positive number of seconds, got {args.timeout}")
    try:
        mpi_args = shlex.split(args.mpi_args)
    except ValueError as exc:
        raise LaunchError(f"phalanx run: cannot split --mpi-args {args.mpi_args!r}: {exc}") from None
    backend = args.backend or default_backend(args.mpiexec)
    return Launch(n=args.n, backend=backend, target=target, log_dir=args.log_dir, echo=args.echo,
                  timeout=args.timeout, mpiexec=args.mpiexec, mpi_args=mpi_args)


def main(argv: list[str]) -> int:
    options, target = split_target(argv)
    parser = _parser()
    args = parser.parse_args(options)
    if not target:
        parser.error("give a script (phalanx run -n 2 train.py) or a module (phalanx run -n 2 -m pkg.train)")
    if target[0] != "-m" and not os.path.isfile(target[0]):
        parser.error(f"no such script: {target[0]}")
    if target[0] == "-m" and len(target) < 2:
        parser.error("-m needs a module name")
    return launch(job_from_args(args, target))
