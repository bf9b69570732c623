"""``phalanx demo``: a 2-rank smoke test of the collectives through the launcher."""

from __future__ import annotations

import argparse

from ._launch import Launch, launch
from ._run import default_backend

__all__ = ["main"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="phalanx demo",
        description="Start 2 ranks through `phalanx run` and check that they agree on allreduce, "
                    "broadcast and allgather. Exit status 0 means the installation works.",
    )
    parser.add_argument("-n", "--np", dest="n", type=int, default=2, metavar="N",
                        help="number of ranks (default 2)")
    parser.add_argument("--backend", choices=("mpi", "gloo", "nccl"),
                        help="default: what `phalanx run` would choose")
    args = parser.parse_args(argv)
    backend = args.backend or default_backend()
    return launch(Launch(n=args.n, backend=backend, target=["-m", "phalanx.cli._smoke"], timeout=60.0))
