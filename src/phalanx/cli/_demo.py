"""``phalanx demo``: train on scikit-learn's digits with 1 process, then with N, and compare.

::

    phalanx demo                          # 1 process, then 2 on the default backend
    phalanx demo -n 3 --backend gloo      # global batch 63 = 3 x 21 (64 rounded to a multiple of 3)
    phalanx demo --smoke                  # the collectives smoke test (phalanx.cli._smoke) instead
    phalanx demo --framework jax          # the same with JAX: an equinox MLP, optax, a jitted step

Both runs start :mod:`phalanx.examples.digits` (``examples/digits.py`` in a
clone; with ``--framework jax``, :mod:`phalanx.examples.jax_digits`) through the launcher with the same global batch, seed and epochs; rank
0's progress shows live. The exit status is 0 only when the two test
accuracies agree to the printed digits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import tempfile
from typing import Any

from ..launch import Launch, default_backend, launch

__all__ = ["main"]

SCRIPT = "phalanx.examples.digits"
SCRIPTS = {"torch": SCRIPT, "jax": "phalanx.examples.jax_digits"}
NEEDS = {"torch": (("torch", "torch"), ("scikit-learn", "sklearn")),
         "jax": (("jax", "jax"), ("optax", "optax"), ("equinox", "equinox"), ("scikit-learn", "sklearn"))}
INSTALL = {"torch": "pip install 'phalanx[train,examples]'", "jax": "pip install 'phalanx[jax,examples]'"}
MODELS = {"torch": "a 64-128-128-10 network", "jax": "a 64-128-128-10 equinox MLP (optax, a jitted step)"}
BATCH = 64  # the global batch, rounded to a multiple of the number of processes


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx demo",
        description="Train a small network on scikit-learn's bundled handwritten digits (no download) on "
                    "1 process, then data-parallel on N processes with the same global batch, and check "
                    "that both reach the same test accuracy. The training script is "
                    f"`python -m {SCRIPT}` (examples/digits.py in the repository).",
    )
    parser.add_argument("-n", "--np", dest="n", type=int, default=2, metavar="N",
                        help="number of processes to compare with 1 (default 2)")
    parser.add_argument("--backend", choices=("mpi", "gloo", "nccl"),
                        help="default: what `phalanx run` would choose")
    parser.add_argument("--epochs", type=int, default=20, help="training epochs (default 20)")
    parser.add_argument("--batch-size", type=int, metavar="B",
                        help=f"global batch, a multiple of N (default: {BATCH} rounded to a multiple of N)")
    parser.add_argument("--framework", choices=tuple(SCRIPTS), default="torch",
                        help="the training script's framework (default torch; jax: an equinox MLP with "
                             "optax, phalanx.jax.DistributedOptimizer inside a jitted step)")
    parser.add_argument("--smoke", action="store_true",
                        help="instead: N ranks only check allreduce, broadcast and allgather")
    return parser


def _plural(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def _train(n: int, backend: str, options: list[str], out: str,
           script: str = SCRIPT) -> tuple[int, dict[str, Any] | None]:
    """Run the script on ``n`` processes; (exit status, rank 0's results or None)."""
    command = f"phalanx run -n {n} --backend {backend} -m {script} {shlex.join(options)}"
    print(f"\n--- {_plural(n)}: {command}", flush=True)
    code = launch(Launch(n=n, backend=backend, target=["-m", script, *options, "--json", out], timeout=120.0))
    if code != 0 or not os.path.isfile(out):
        return code or 1, None
    with open(out) as f:
        return 0, json.load(f)


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.smoke:
        backend = args.backend or default_backend()
        return launch(Launch(n=args.n, backend=backend, target=["-m", "phalanx.cli._smoke"], timeout=60.0))

    n = args.n
    if n < 2:
        parser.error(f"-n {n}: give at least 2 processes (the demo compares them with 1)")
    if args.epochs < 1:
        parser.error(f"--epochs {args.epochs}: give at least 1")
    batch = args.batch_size if args.batch_size is not None else n * max(1, round(BATCH / n))
    if batch < n or batch % n:
        parser.error(f"--batch-size {batch} does not split evenly over {n} processes; use a multiple of {n}")
    missing = [name for name, module in NEEDS[args.framework] if importlib.util.find_spec(module) is None]
    if missing:
        sys.stderr.write(f"phalanx demo: the training demo needs {' and '.join(missing)}: "
                         f"{INSTALL[args.framework]} (or run `phalanx demo --smoke`).\n")
        return 2
    backend = args.backend or default_backend()

    print(f"phalanx demo: {MODELS[args.framework]} learns scikit-learn's handwritten digits (bundled, no "
          f"download), first on 1 process, then on {n} ({backend}), with the same global batch of {batch} "
          f"images per step. Progress is rank 0's.", flush=True)
    options = ["--epochs", str(args.epochs), "--batch-size", str(batch)]
    with tempfile.TemporaryDirectory(prefix="phalanx-demo-") as tmp:
        script = SCRIPTS[args.framework]
        code, one = _train(1, backend, options, os.path.join(tmp, "1.json"), script)
        if one is None:
            sys.stderr.write(f"phalanx demo: the 1-process run failed (exit status {code}).\n")
            return code
        code, many = _train(n, backend, options, os.path.join(tmp, f"{n}.json"), script)
        if many is None:
            sys.stderr.write(f"phalanx demo: the {n}-process run failed (exit status {code}).\n")
            return code

    a1, an = f"{one['accuracy']:.4f}", f"{many['accuracy']:.4f}"
    label = f"{n} processes:"
    print(f"\n{'1 process:':<{len(label)}} test accuracy {a1} (global batch {batch}, {args.epochs} epochs, "
          f"trained in {one['seconds']:.1f} s)")
    print(f"{label} test accuracy {an} (global batch {batch} = {n} x {batch // n}, {backend}, "
          f"trained in {many['seconds']:.1f} s)")
    if a1 != an:
        print(f"Different accuracy: {n} processes reached {an} and 1 process {a1} on the same global batch. "
              "Please report this with the output of `phalanx info`.", flush=True)
        return 1
    print(f"Same accuracy: data-parallel training on {n} processes matches 1 process on the same global "
          "batch.")
    if round(many["seconds"], 1) > round(one["seconds"], 1):
        print(f"({n} processes trained slower: this network is so small that exchanging its gradients "
              "costs more than the computation they share.)")
    sys.stdout.flush()
    return 0
