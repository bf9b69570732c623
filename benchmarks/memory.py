"""Per-rank training-state memory and step time: replicated, ``shard="optimizer"``, ``shard="gradients"``,
and torch's ``ZeroRedundancyOptimizer`` over DDP (gloo).

::

    python benchmarks/memory.py --ranks 1,2,4 --backends mpi,gloo --json benchmarks/results/memory.json

The model is an MLP 256 → 4096 → 4096 → 4096 → 4096 → 10 (3 hidden layers of
width 4096, 51.4M float32 parameters) trained with Adam (lr 1e-4) on batches
of 8, one thread per rank. One world (``phalanx run -n N --backend B``) per
(backend, N, variant), fresh processes each. In every rank:

1. build the model and synchronize it (rank 0's parameters everywhere);
2. start a thread that samples the resident set (``/proc/self/statm``)
   every millisecond, and take the resident set at that moment as the base;
3. wrap the optimizer (copies made when wrapping count), run 3 training
   steps (zero_grad, forward, cross-entropy, backward, step);
4. training-state memory = the highest sample minus the base: parameters
   are excluded; gradients, optimizer state, buckets and transients count;
5. then ``--steps`` more steps, timed: the step time is their median.

Before the base is taken each rank makes a throwaway torch optimizer (torch.optim's first
use imports ~70 MiB of code, not training state). By default every rank runs with glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB (``--malloc fixed``), so memory freed by a step
leaves the resident set instead of lingering in the heap; ``--malloc default`` measures
with glibc's dynamic threshold.

A figure is the maximum over ranks (memory) or the slowest rank's median
(time). Each rank also counts its optimizer-state bytes (the tensors in its
optimizer's state), compared with the formula 8Ψ/N for Adam (Ψ parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

VARIANTS = ("replicated", "optimizer", "gradients", "torch-zero")
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 2 ** 20


def rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


class Sampler(threading.Thread):
    """The highest resident set seen, sampled every millisecond until stopped."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = rss()
        self.running = True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def reset(self) -> None:
        """Start a new peak from the resident set now."""
        self.peak = rss()

    def stop(self) -> int:
        self.running = False
        self.join()
        return max(self.peak, rss())


def model(torch: Any, width: int, layers: int) -> Any:
    nn = torch.nn
    torch.manual_seed(0)
    blocks: list[Any] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def worker(args: argparse.Namespace) -> None:
    import torch

    import phalanx
    import phalanx.torch as pt

    torch.set_num_threads(1)
    phalanx.init()
    net = model(torch, args.width, args.layers)
    with torch.no_grad():
        phalanx.synchronize(net)
    params = sum(p.numel() for p in net.parameters())
    g = torch.Generator().manual_seed(phalanx.rank())
    x, y = torch.randn(8, 256, generator=g), torch.randint(0, 10, (8,), generator=g)
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # torch.optim's first use imports ~70 MiB of code
    import gc

    gc.collect()
    sampler = Sampler()
    base = rss()
    sampler.start()
    forward = net
    if args.variant == "torch-zero":
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer

        forward = torch.nn.parallel.DistributedDataParallel(net)
        opt = ZeroRedundancyOptimizer(forward.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
        assert dist.is_initialized()
    else:
        shard = None if args.variant == "replicated" else args.variant
        opt = pt.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=1e-4), shard=shard)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(forward(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    peak = sampler.stop()
    inner = opt.optim if args.variant == "torch-zero" else opt.optimizer
    local = [v.to_local() if hasattr(v, "to_local") else v for s in inner.state.values() for v in s.values()]
    state = sum(v.numel() * v.element_size() for v in local  # a sharded entry: this rank's elements
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    row = {"rank": phalanx.rank(), "state_memory": peak - base, "base": base, "optimizer_state_bytes": state,
           "step_s": statistics.median(times), "params": params}
    rows = phalanx.allgather_object(row, allow_pickle=True)
    if phalanx.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    phalanx.shutdown()


def run_world(args: argparse.Namespace, backend: str, n: int, variant: str) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        inner = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--out", out,
                 "--steps", str(args.steps), "--width", str(args.width), "--layers", str(args.layers)]
        cmd = [sys.executable, "-m", "phalanx", "run", "-n", str(n), "--backend", backend, *inner]
        env = dict(os.environ)
        if args.malloc == "fixed":  # glibc: no dynamic mmap threshold, so the resident set follows live memory
            env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                              env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"{backend} n={n} {variant}: failed\n{proc.stdout[-3000:]}", file=sys.stderr)
            return None
        with open(out) as f:
            rows = json.load(f)
    psi = rows[0]["params"]
    return {"backend": backend, "ranks": n, "variant": variant, "params": psi, "malloc": args.malloc,
            "state_mib": max(r["state_memory"] for r in rows) / MIB,
            "optimizer_state_mib": max(r["optimizer_state_bytes"] for r in rows) / MIB,
            "optimizer_state_formula_mib": 8 * psi / (1 if variant == "replicated" else n) / MIB,
            "step_ms": max(r["step_s"] for r in rows) * 1e3, "rows": rows}


def table(results: list[dict[str, Any]]) -> str:
    base = {(r["backend"], r["ranks"]): r for r in results if r["variant"] == "replicated"}
    lines = ["| backend | N | variant | state MiB/rank | × replicated | optimizer state MiB (8Ψ/N) | step ms | "
             "× replicated |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        ref = base.get((r["backend"], r["ranks"]))
        mem = f"{r['state_mib'] / ref['state_mib']:.2f}" if ref else "–"
        t = f"{r['step_ms'] / ref['step_ms']:.2f}" if ref else "–"
        lines.append(f"| {r['backend']} | {r['ranks']} | {r['variant']} | {r['state_mib']:.0f} | {mem} | "
                     f"{r['optimizer_state_mib']:.1f} ({r['optimizer_state_formula_mib']:.1f}) | "
                     f"{r['step_ms']:.0f} | {t} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, default="replicated")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default="1,2,4", help="world sizes, comma-separated (default 1,2,4)")
    parser.add_argument("--backends", default="mpi,gloo", help="backends, comma-separated (default mpi,gloo)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="variants, comma-separated")
    parser.add_argument("--steps", type=int, default=7, help="timed steps after the 3 measured ones")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--malloc", choices=("fixed", "default"), default="fixed",
                        help="fixed (default): MALLOC_MMAP_THRESHOLD_=1 MiB in every rank, so freed blocks leave "
                             "the resident set; default: glibc's dynamic threshold (freed memory may stay resident)")
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = []
    for backend in args.backends.split(","):
        for n in (int(v) for v in args.ranks.split(",")):
            for variant in args.variants.split(","):
                if variant == "torch-zero" and (backend != "gloo" or n == 1):
                    continue  # torch's ZeroRedundancyOptimizer needs torch.distributed (gloo), and peers
                result = run_world(args, backend, n, variant)
                if result is not None:
                    results.append(result)
                    print(f"{backend} n={n} {variant}: {result['state_mib']:.0f} MiB, "
                          f"{result['step_ms']:.0f} ms/step", flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": shlex.join([sys.executable, *sys.argv]), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
