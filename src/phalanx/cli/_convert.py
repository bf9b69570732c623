"""``phalanx convert``: a checkpoint from phalanx's sharded format to torch's DCP, or back, in one process.

::

    phalanx convert --to dcp ckpt/step-1000 dcp/step-1000      # save_sharded's directory -> DCP
    phalanx convert --from dcp dcp/step-1000 ckpt/step-1000    # DCP -> a directory load_sharded loads at any N

No launcher and no world: it runs as one plain process (torch is imported
only when the command runs). What it writes is described by
``phalanx.torch.convert_checkpoint``, which it calls.
"""

from __future__ import annotations

import argparse
import sys
import warnings

__all__ = ["main"]

FORMATS = ("dcp", "phalanx")


def main(argv: list[str]) -> int:
    """``phalanx convert`` with ``argv`` (the arguments after ``convert``); return the exit status."""
    parser = argparse.ArgumentParser(
        prog="phalanx convert", description=__doc__.splitlines()[0],
        epilog="--to dcp and --from phalanx are the same conversion, as are --to phalanx and --from dcp.")
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=FORMATS, help="the format to write")
    direction.add_argument("--from", dest="source", choices=FORMATS, help="the format SRC is in")
    parser.add_argument("src", metavar="SRC", help="the checkpoint directory to read")
    parser.add_argument("dst", metavar="DST", help="the directory to write (replaced as a whole)")
    args = parser.parse_args(argv)
    to = args.to or ("phalanx" if args.source == "dcp" else "dcp")
    from .._errors import PhalanxError

    try:
        from phalanx.torch import convert_checkpoint
    except ImportError as exc:
        sys.stderr.write(f"phalanx convert: needs torch ({exc}); `pip install torch`.\n")
        return 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            written = convert_checkpoint(args.src, args.dst, to=to)
        except PhalanxError as exc:
            sys.stderr.write(f"phalanx convert: {exc}\n")
            return 1
    for warning in caught:
        sys.stderr.write(f"phalanx convert: {warning.message}\n")
    print(f"phalanx convert: wrote {written} ({to}) from {args.src} ({'dcp' if to == 'phalanx' else 'phalanx'})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
