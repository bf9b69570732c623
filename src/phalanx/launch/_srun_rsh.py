"""An ssh-style command over Slurm's ``srun``: ``python -m phalanx.launch._srun_rsh HOST WORDS...``.

Inside a Slurm allocation of several nodes, ``phalanx run --backend gloo``
(or nccl) starts its per-host launchers on the allocation's nodes the way
``--hosts`` does through ssh, with this as the ``--rsh``: it runs WORDS
(joined by spaces and run by ``sh -c``, as ssh does) as a one-task job step
on node HOST::

    srun --nodes 1 --ntasks 1 --nodelist HOST --overlap --input all sh -c 'WORDS'

``--overlap`` lets the step share the node with the other steps of the job,
and ``--input all`` hands this process's stdin to the task (the per-host
launcher reads its job and secret there, and stops its ranks when it closes).
Extra ``srun`` options come from ``PHALANX_SRUN_ARGS`` (e.g.
``--cpus-per-task=32`` where Slurm confines a step to the CPUs it asked for).
"""

from __future__ import annotations

import os
import shlex
import sys


def srun_argv(host: str, words: list[str], extra: str = "") -> list[str]:
    """The ``srun`` command that runs ``words`` on ``host`` as one task (``extra``: more srun options)."""
    return ["srun", "--nodes", "1", "--ntasks", "1", "--nodelist", host, "--overlap", "--input", "all",
            *shlex.split(extra), "sh", "-c", " ".join(words)]


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m phalanx.launch._srun_rsh HOST COMMAND...")
    argv_ = srun_argv(argv[0], argv[1:], os.environ.get("PHALANX_SRUN_ARGS", ""))
    try:
        os.execvp(argv_[0], argv_)
    except OSError as exc:
        sys.exit(f"phalanx: cannot run srun to start a command on node {argv[0]} ({exc.strerror or exc}); "
                 "is this a Slurm allocation with srun on PATH? Or give the hosts with --hosts and --rsh.")


if __name__ == "__main__":
    main(sys.argv[1:])
