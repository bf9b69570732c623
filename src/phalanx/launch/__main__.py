"""``python -m phalanx.launch JOB_JSON``: run one job described as JSON (the fields of :class:`Launch`).

What :func:`phalanx.testing.run_world` starts, so that the test helper depends
on this package and not on the command line. Exit status: the job's, or 2
when it cannot start (the reason on stderr).
"""

from __future__ import annotations

import json
import sys

from .._errors import LaunchError
from ._job import Launch
from ._launch import launch


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m phalanx.launch JOB_JSON (the fields of phalanx.launch.Launch)\n")
        return 2
    try:
        return launch(Launch(**json.loads(argv[0])))
    except LaunchError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
