"""Step time of data-parallel training: phalanx's gradient engine against torch DDP, in one run.

::

    phalanx run -n 2 --backend gloo benchmarks/train_step.py      # adds torch DDP (gloo)
    phalanx run -n 2 --backend mpi benchmarks/train_step.py
    ... train_step.py --json benchmarks/results/train-step-gloo-2.json

The model is an MLP 512 -> 1024 -> 4 x (1024 -> 1024) -> 10 (4.7M float32
parameters, 18.9 MB of gradients), SGD, batch 64 per rank, one thread per
rank. Every configuration trains its own copy of the model; configurations
are interleaved in rounds so drift hits them alike. A figure is the median
over rounds of the *slowest rank's* mean step time (forward, backward,
reduction, step). "local" is the same step with no communication at all:
the compute floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import phalanx
import phalanx.torch as pt


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(512, 1024), torch.nn.ReLU()]
    for _ in range(4):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10))


def configs(backend: str) -> dict[str, Callable[[], tuple[torch.nn.Module, Any]]]:
    def plain() -> tuple[torch.nn.Module, Any]:
        model = mlp()
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)

    def data_parallel(**kw: Any) -> Callable[[], tuple[torch.nn.Module, Any]]:
        def make() -> tuple[torch.nn.Module, Any]:
            model = pt.DataParallel(mlp(), **kw)
            return model, torch.optim.SGD(model.parameters(), lr=1e-3)
        return make

    def dist_opt(**kw: Any) -> Callable[[], tuple[torch.nn.Module, Any]]:
        def make() -> tuple[torch.nn.Module, Any]:
            model = mlp()
            return model, pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), **kw)
        return make

    def fused_helper() -> tuple[torch.nn.Module, Any]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        step = opt.step

        def reduce_then_step() -> None:
            phalanx.allreduce_gradients(model)
            step()

        opt.step = reduce_then_step  # type: ignore[method-assign]
        return model, opt

    found: dict[str, Callable[[], tuple[torch.nn.Module, Any]]] = {
        "local (no communication)": plain,
        "phalanx DataParallel": data_parallel(),
        "phalanx DataParallel, set_to_none=False": data_parallel(),
        "phalanx DistributedOptimizer": dist_opt(),
        "phalanx DataParallel, bf16": data_parallel(compression="bf16"),
        "phalanx DataParallel, fp16": data_parallel(compression="fp16"),
        "phalanx allreduce_gradients (blocking, fused)": fused_helper,
    }
    if backend == "gloo":
        def ddp() -> tuple[torch.nn.Module, Any]:
            model = torch.nn.parallel.DistributedDataParallel(mlp())
            return model, torch.optim.SGD(model.parameters(), lr=1e-3)

        def ddp_fp16() -> tuple[torch.nn.Module, Any]:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model = torch.nn.parallel.DistributedDataParallel(mlp())
            # (DDP's bf16 hook needs CUDA/NCCL; the fp16 one runs on gloo)
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            return model, torch.optim.SGD(model.parameters(), lr=1e-3)

        found["torch DDP (gloo)"] = ddp
        found["torch DDP (gloo), fp16 hook"] = ddp_fp16
    return found


def timed(model: torch.nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, steps: int,
          keep_grads: bool) -> float:
    loss_fn = torch.nn.functional.cross_entropy
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=not keep_grads)
        loss_fn(model(x), y).backward()
        opt.step()
    mine = (time.perf_counter() - start) / steps
    return float(phalanx.allreduce(mine, op="max"))  # the slowest rank sets the pace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration per round")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    phalanx.init()
    backend, n = phalanx.backend().name, phalanx.size()
    g = torch.Generator().manual_seed(phalanx.rank())
    x = torch.randn(args.batch, 512, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    runs = {name: make() for name, make in configs(backend).items()}
    for name, (model, opt) in runs.items():  # warm up: allocations, first-step copies
        timed(model, opt, x, y, 3, "set_to_none=False" in name)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, opt) in runs.items():
            times[name].append(timed(model, opt, x, y, args.steps, "set_to_none=False" in name))
    params = sum(p.numel() for p in mlp().parameters())
    floor = statistics.median(times["local (no communication)"])
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        rows.append({"config": name, "step_ms": round(median * 1e3, 2),
                     "vs_local": round(median / floor, 3), "rounds_ms": [round(v * 1e3, 2) for v in values]})
    if phalanx.rank() == 0:
        print(f"# {backend}, {n} ranks, MLP {params / 1e6:.2f}M params, batch {args.batch}/rank, "
              f"1 thread/rank, median of {args.rounds} rounds x {args.steps} steps (slowest rank)")
        for row in rows:
            print(f"{row['config']:<48} {row['step_ms']:>8.1f} ms  x{row['vs_local']:.2f} of local")
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump({"backend": backend, "ranks": n, "params": params, "batch_per_rank": args.batch,
                           "torch": torch.__version__, "rows": rows}, f, indent=1)
    phalanx.shutdown()


if __name__ == "__main__":
    main()
