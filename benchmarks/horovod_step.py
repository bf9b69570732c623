"""What the Horovod API costs per training step over phalanx's own, on the benchmark MLP.

::

    flock /tmp/phalanx-tests.lock phalanx run -n 2 --backend mpi benchmarks/horovod_step.py \\
        --json benchmarks/results/horovod-step-mpich-2.json
    flock /tmp/phalanx-tests.lock phalanx run -n 2 --backend gloo benchmarks/horovod_step.py \\
        --json benchmarks/results/horovod-step-gloo-2.json

Two variants of the same step (``zero_grad``, forward, cross-entropy,
backward, reduction, SGD step) on the MLP of ``train_step.py`` (512→1024→4×1024→10,
4.73M parameters, batch 64 per rank, one thread per rank), each built as its
user writes it:

* ``phalanx``: ``phalanx.torch.DistributedOptimizer(SGD(...))``;
* ``hvd``: ``hvd.DistributedOptimizer(SGD(...), named_parameters=model.named_parameters())``
  after ``hvd.broadcast_parameters`` and ``hvd.broadcast_optimizer_state``, with
  ``import phalanx.horovod.torch as hvd``.

Every round builds both afresh (set-up not timed), runs ``--warmup`` steps of
each, then alternates blocks of ``--steps`` steps between them (``--blocks``
pairs; which goes first alternates too), both models alive side by side, so
that drift on a shared machine hits both alike. A block's figure is the
slowest rank's mean step time; a variant's figure is the median over all its
blocks, and the ratio is also the median of the per-pair ratios (paired).
Both variants start from the same weights and see the same batches, so their
models must end equal: the JSON records whether they did.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from train_step_worker import batch, build_model, settle_allocator  # beside this script (sys.path[0])

import phalanx
import phalanx.horovod.torch as hvd
import phalanx.torch as pt

VARIANTS = ("phalanx", "hvd")


def make(variant: str, width: int) -> tuple[Any, Any]:
    """(model, optimizer) of ``variant``, as a user of that API builds them."""
    model = build_model("mlp", width)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    if variant == "phalanx":
        return model, pt.DistributedOptimizer(sgd)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    return model, hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())


def time_steps(step: Callable[[], None], steps: int) -> float:
    """The slowest rank's mean seconds per step over ``steps`` steps."""
    phalanx.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return float(phalanx.allreduce((time.perf_counter() - start) / steps, op="max"))


def one_round(args: argparse.Namespace, x: Any, y: Any) -> tuple[list[dict[str, float]], bool]:
    """Build both variants, then alternate blocks of ``--steps`` steps between them (``--blocks`` pairs).

    Returns the seconds per step of each pair of blocks by variant, and whether the two models
    ended equal (same weights, same batches, same number of steps).
    """
    built = {variant: make(variant, args.mlp_width) for variant in VARIANTS}
    steps = {}
    for variant, (model, opt) in built.items():
        def step(model: Any = model, opt: Any = opt) -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        steps[variant] = step
        for _ in range(args.warmup):
            step()
    pairs = []
    for block in range(args.blocks):
        order = VARIANTS if block % 2 == 0 else VARIANTS[::-1]
        pairs.append({variant: time_steps(steps[variant], args.steps) for variant in order})
    with torch.no_grad():
        equal = all(torch.equal(a, b) for a, b in zip(built["phalanx"][0].parameters(),
                                                       built["hvd"][0].parameters(), strict=True))
    for _, opt in built.values():
        if hasattr(opt, "close"):
            opt.close()
    return pairs, bool(phalanx.allreduce(int(equal), op="min"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each builds both variants afresh")
    parser.add_argument("--blocks", type=int, default=12, help="pairs of blocks per round")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank")
    parser.add_argument("--mlp-width", type=int, default=1024, help="MLP hidden size (1024: 4.73M parameters)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settle_allocator()
    hvd.init()
    x, y = batch("mlp", args.batch, seed=hvd.rank())
    rounds: list[dict[str, float]] = []
    equal = []
    for _ in range(args.rounds):
        pairs, same = one_round(args, x, y)
        rounds += pairs
        equal.append(same)
    if hvd.rank() != 0:
        return
    medians = {v: statistics.median(r[v] for r in rounds) * 1e3 for v in VARIANTS}
    paired = statistics.median(r["hvd"] / r["phalanx"] for r in rounds)
    backend = phalanx.backend().name
    print(f"{hvd.size()} ranks, {backend}, MLP width {args.mlp_width}, batch {args.batch}/rank, "
          f"median of {args.rounds} rounds x {args.blocks} pairs of blocks x {args.steps} steps:")
    for v in VARIANTS:
        print(f"  {v:8s} {medians[v]:7.2f} ms/step")
    print(f"  hvd / phalanx: {medians['hvd'] / medians['phalanx']:.3f} of the medians, {paired:.3f} paired per block pair "
          f"({medians['hvd'] - medians['phalanx']:+.2f} ms/step); models equal in every round: {all(equal)}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"ranks": hvd.size(), "backend": backend, "blocks_s": rounds, "models_equal": equal,
                       "median_ms": medians, "ratio_of_medians": medians["hvd"] / medians["phalanx"],
                       "ratio_paired_median": paired, "load_average": list(os.getloadavg()),
                       "versions": {"torch": torch.__version__, "phalanx": phalanx.__version__},
                       "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
