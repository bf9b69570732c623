"""``phalanx run``: its arguments, turned into a :class:`phalanx.launch.Launch` and run.

The options (phalanx's and horovodrun's) are parsed in :mod:`phalanx.launch._options`.
"""

from __future__ import annotations

import os

from ..launch import launch
from ..launch._horovodrun import describe_job, strip_python
from ..launch._options import add_run_options, job_from_args, run_parser, split_target

__all__ = ["add_run_options", "job_from_args", "main", "split_target"]


def main(argv: list[str]) -> int:
    options, target = split_target(argv)
    parser = run_parser()
    args = parser.parse_args(options)
    target = strip_python(target)
    if not target:
        parser.error("give a script (phalanx run -n 2 train.py) or a module (phalanx run -n 2 -m pkg.train)")
    if target[0] != "-m" and not os.path.isfile(target[0]):
        parser.error(f"no such script: {target[0]}")
    if target[0] == "-m" and len(target) < 2:
        parser.error("-m needs a module name")
    job = job_from_args(args, target)
    if args.verbose:
        describe_job(job)
    return launch(job)
