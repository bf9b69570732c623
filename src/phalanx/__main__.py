"""``python -m phalanx ...`` is the ``phalanx`` command."""

import sys

from phalanx.cli import main

if __name__ == "__main__":
    sys.exit(main())
