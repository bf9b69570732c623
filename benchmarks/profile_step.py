"""Where the gradient engine's time goes in one training step: the engine's methods timed inside the step.

::

    phalanx run -n 2 --backend mpi benchmarks/profile_step.py --steps 30 --rounds 3
    phalanx run -n 2 --backend gloo benchmarks/profile_step.py --variants none,dopt

The benchmark MLP of ``train_step.py`` (batch 64 per rank, SGD, one thread
per rank). Per round, each variant runs 3 warm-up steps and ``--steps`` timed
steps: ``none`` (the step without communication), ``dopt``
(``DistributedOptimizer``), ``dopt-timed`` (the same with the engine's
methods wrapped in timers: ms per step in each, inclusive), ``raw`` (one
allreduce of a buffer of the gradients' size, through the backend, alone),
and the plain step followed by: a 1-value allreduce (``sync``: what making
the ranks wait for each other costs), the gradients' allreduce
(``allreduce``: no copy), both with the gradients first copied into the
buffer scaled (``copy-allreduce``). ``dopt-copy``, ``dopt-noprogress``,
``dopt-1bucket``: the engine with a method swapped or one bucket, for A/B in
one world. Prints the median over rounds of the slowest rank's ms per step,
and each ``dopt-*`` variant's per-round ratio to ``dopt``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict
from typing import Any

from train_step_worker import batch, build_model, settle_allocator

TIMED = ("_ready", "_adopt", "_launch", "_progress", "_complete", "_finish")


def _timed_engine(totals: dict[str, float]) -> list[tuple[str, Any]]:
    """Wrap the engine's methods with timers adding into ``totals``; return the originals."""
    from phalanx.torch import _bucket

    cls = _bucket.GradientBuckets
    originals = []
    for name in TIMED:
        fn = getattr(cls, name, None)
        if fn is None:
            continue
        originals.append((name, fn))

        def wrapped(*a: Any, _fn: Any = fn, _name: str = name, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_name] += time.perf_counter() - t

        setattr(cls, name, functools.wraps(fn)(wrapped))
    return originals


def _old_adopt(self: Any, i: int, p: Any) -> None:
    """The engine's _adopt before the 1/N scaling moved into it (a plain copy; the launch scales)."""
    view = self.views[i]
    view.copy_(p.grad)
    p.grad = view


PATCHES: dict[str, dict[str, Any]] = {"dopt-copy": {"_adopt": _old_adopt},
                                      "dopt-noprogress": {"_progress": lambda self: None}}


def _patch(kind: str) -> list[tuple[str, Any]]:
    """Swap in the methods variant ``kind`` replaces (an earlier engine, for A/B in one world)."""
    from phalanx.torch import _bucket

    cls = _bucket.GradientBuckets
    originals = []
    for name, fn in PATCHES.get(kind, {}).items():
        originals.append((name, getattr(cls, name)))
        setattr(cls, name, fn)
    return originals


def _step(kind: str, x: Any, y: Any) -> tuple[Any, Any]:
    import torch

    import phalanx.torch as pt

    model = build_model("mlp", 1024)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if kind == "dopt-1bucket":  # every gradient in one bucket, launched when backward ends
        from phalanx.torch import _bucket

        first, _bucket.FIRST_BUCKET_MB = _bucket.FIRST_BUCKET_MB, 1e4
        opt = pt.DistributedOptimizer(opt, bucket_cap_mb=1e4)
        _bucket.FIRST_BUCKET_MB = first
    elif kind.startswith("dopt"):
        opt = pt.DistributedOptimizer(opt)
    loss_fn = torch.nn.functional.cross_entropy

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step, model


def _reduce_after(kind: str, plain: Any, model: Any) -> Any:
    """The plain step, then (by ``kind``) a 1-value allreduce ("sync"), an allreduce of a flat buffer of
    the gradients' size ("allreduce"), or the gradients copied into it scaled first ("copy-allreduce")."""
    import torch

    from phalanx._groups import world_for

    params = list(model.parameters())
    flat = torch.zeros(1 if kind == "sync" else sum(p.numel() for p in params))
    views = [] if kind == "sync" else [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in params]),
                                                                  params, strict=True)]
    backend = world_for(None, "profile_step").backend

    def step() -> None:
        if plain is not None:
            plain()
        if kind == "copy-allreduce":
            for v, p in zip(views, params, strict=True):
                torch.mul(p.grad, 0.5, out=v)
        backend.iallreduce(flat, "sum", True).wait(60.0)

    return step


def main() -> int:
    import numpy as np
    import torch

    import phalanx

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="none,dopt,dopt-timed,raw")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settle_allocator()
    phalanx.init()
    x, y = batch("mlp", 64, seed=phalanx.rank())
    kinds = args.variants.split(",")
    times: dict[str, list[float]] = defaultdict(list)
    parts: dict[str, list[float]] = defaultdict(list)
    for r in range(args.rounds):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            totals: dict[str, float] = defaultdict(float)
            patched = _patch(kind)
            step, model = _step(kind, x, y)
            if kind in ("raw", "sync", "allreduce", "copy-allreduce"):
                step = _reduce_after(kind, None if kind == "raw" else step, model)
            for _ in range(3):
                step()
            originals = _timed_engine(totals) if kind == "dopt-timed" else []
            phalanx.barrier()
            t = time.perf_counter()
            for _ in range(args.steps):
                step()
            mine = (time.perf_counter() - t) / args.steps
            from phalanx.torch import _bucket
            for name, fn in originals + patched:
                setattr(_bucket.GradientBuckets, name, fn)
            times[kind].append(float(np.max(phalanx.allgather(np.array(mine)))))
            for name, total in totals.items():
                parts[name].append(float(np.max(phalanx.allgather(np.array(total / args.steps)))))
    if phalanx.rank() == 0:
        print(f"{phalanx.backend().name}, {phalanx.size()} ranks, ms per step (median of {args.rounds} rounds, "
              "slowest rank):")
        for kind, values in times.items():
            print(f"  {kind:12s} {1e3 * statistics.median(values):7.2f}   {[round(1e3 * v, 1) for v in values]}")
        base = times.get("dopt")
        for kind, values in times.items():
            if base and kind.startswith("dopt-") and len(values) == len(base):
                ratios = [v / b for v, b in zip(values, base, strict=True)]
                print(f"  {kind} / dopt, paired per round: median {statistics.median(ratios):.3f} "
                      f"{[round(r, 3) for r in ratios]}")
        for name, values in parts.items():
            print(f"  in {name:9s} {1e3 * statistics.median(values):7.2f}")
    phalanx.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
