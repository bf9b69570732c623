"""What ``phalanx.train.fit`` costs per step over a hand-written loop doing the same training.

::

    phalanx run -n 2 --backend mpi benchmarks/fit_overhead.py
    phalanx run -n 2 --backend gloo benchmarks/fit_overhead.py --json benchmarks/results/fit-overhead-gloo-2.json

Both train the benchmark MLP of ``train_step.py`` (4.7M parameters, batch 64
per rank, SGD, one thread per rank) with a ``DistributedOptimizer`` on the
same in-memory data. The hand loop slices tensors and steps; ``fit`` adds its
global-batch sampler and DataLoader, the per-step agreement (one small
allgather: failure flags, stop request, loss sums), metrics and logging.
Rounds alternate the two; a figure is the median over rounds of the slowest
rank's mean step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import phalanx
import phalanx.torch as pt
import phalanx.train as ptrain


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(512, 1024), torch.nn.ReLU()]
    for _ in range(4):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10))


def slowest(seconds: float) -> float:
    return float(phalanx.allreduce(seconds, op="max"))


def hand_loop(data: Any, steps: int, batch: int) -> float:
    model = mlp()
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = data.tensors
    rank, size = phalanx.rank(), phalanx.size()
    g = batch * size
    step = lambda s: (x[s * g + rank * batch:s * g + (rank + 1) * batch],  # noqa: E731
                      y[s * g + rank * batch:s * g + (rank + 1) * batch])
    for s in range(3):  # warm-up
        xb, yb = step(s)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    phalanx.barrier()
    start = time.perf_counter()
    for s in range(steps):
        xb, yb = step(s)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        loss.item()  # a loop that logs its loss reads it, too
    elapsed = time.perf_counter() - start
    opt.close()
    return slowest(elapsed / steps)


def with_fit(data: Any, steps: int, batch: int) -> float:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ptrain.fit(model, torch.nn.functional.cross_entropy, opt, data, batch_size=batch, steps=3,
               progress=False, shuffle=False)  # warm-up
    phalanx.barrier()
    history = ptrain.fit(model, torch.nn.functional.cross_entropy, opt, data, batch_size=batch,
                         steps=steps, progress=False, shuffle=False, log_every=10)
    return slowest(history.summary["time_s"] / steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    torch.set_num_threads(1)
    phalanx.init()
    n = args.batch * phalanx.size() * (args.steps + 3)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 512, generator=g), torch.randint(0, 10, (n,), generator=g))
    times: dict[str, list[float]] = {"hand loop": [], "fit": []}
    for r in range(args.rounds):
        order = [("hand loop", hand_loop), ("fit", with_fit)]
        for name, run in order if r % 2 == 0 else order[::-1]:
            times[name].append(run(data, args.steps, args.batch))
    if phalanx.rank() != 0:
        return
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{phalanx.size()} ranks, {phalanx.backend().name}, median of {args.rounds} rounds x {args.steps} steps:")
    for k, v in medians.items():
        print(f"  {k:10s} {v:7.2f} ms/step")
    print(f"  fit / hand loop: {medians['fit'] / medians['hand loop']:.3f} "
          f"(+{medians['fit'] - medians['hand loop']:.2f} ms/step)")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"ranks": phalanx.size(), "backend": phalanx.backend().name, "rounds_s": times,
                       "median_ms": medians, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
