"""The ``phalanx`` command (also ``python -m phalanx``).

::

    phalanx run -n 4 train.py --lr 0.1      # 4 ranks; the first failure stops all and is reported
    phalanx run -n 2 --backend gloo -m pkg.train
    phalanx info [--json]                   # versions, backends, GPUs, MPI, settings
    phalanx demo                            # train on digits with 1 and 2 processes, compare
    phalanx bench ...                       # benchmarks
    phalanx convert --to dcp SRC DST        # a save_sharded checkpoint to torch's DCP (--from dcp: back)

Each command imports what it needs when it runs, so ``import phalanx.cli``
stays as light as ``import phalanx``.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]

_COMMANDS = {
    "run": "start N ranks of a script and supervise them",
    "info": "show versions, backends, GPUs and MPI",
    "demo": "train a small network on 1 and 2 processes and compare (--smoke: collectives only)",
    "bench": "benchmark collectives against raw mpi4py/torch.distributed",
    "convert": "convert a checkpoint between phalanx's sharded format and torch's DCP (--to dcp, --from dcp)",
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx", description="Data-parallel training over MPI, Gloo and NCCL.",
        epilog="`phalanx COMMAND -h` shows a command's options.",
    )
    parser.add_argument("--version", action="store_true", help="print the phalanx version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in _COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``phalanx`` script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _top_parser()
    if not argv or argv[0] not in _COMMANDS:
        args = parser.parse_args(argv)  # -h, --version, or an error naming the commands
        if args.version:
            from phalanx import __version__

            print(f"phalanx {__version__}")
            return 0
        parser.print_help()
        return 2
    command, rest = argv[0], argv[1:]
    from .._errors import LaunchError

    try:
        if command == "run":
            from ._run import main as run_main

            return run_main(rest)
        if command == "info":
            from ._info import main as info_main

            return info_main(rest)
        if command == "demo":
            from ._demo import main as demo_main

            return demo_main(rest)
        if command == "convert":
            from ._convert import main as convert_main

            return convert_main(rest)
        from ._bench import main as bench_main

        return bench_main(rest)
    except LaunchError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `phalanx info | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141

