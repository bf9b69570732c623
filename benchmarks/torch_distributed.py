"""What the ``"phalanx"`` torch.distributed backend costs per call: a 4-byte ``dist.all_reduce`` through it
against ``phalanx.allreduce`` on the same tensor, in the same world, at 2 ranks on mpi and on gloo (where
torch's own gloo group, which phalanx made, is timed too).

::

    python benchmarks/torch_distributed.py --json benchmarks/results/torch_distributed.json

Per world: ``--rounds`` rounds; in each, every variant makes ``--calls``
calls back to back (the order rotates per round) and its time per call is
the slowest rank's mean. A figure is the median over rounds, and the best
round (2 ranks busy-polling on 2 shared cores make single rounds noisy). The step-time
comparisons (DDP on the benchmark MLP, FSDP2 on the 134M GPT) are rows of
``benchmarks/train_step.py`` (``mpi/DDP``) and ``benchmarks/gpt.py``
(``fsdp2-mpi``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

VARIANTS = ("phalanx.allreduce", "dist.all_reduce on 'phalanx'", "dist.all_reduce on torch's gloo",
            "the process group's allreduce, called directly")


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import phalanx
    import phalanx.torch as pt

    torch.set_num_threads(1)
    phalanx.init()
    native = phalanx.backend()._group if phalanx.backend().name == "gloo" else None  # phalanx's gloo group
    pt.init_process_group()
    t = torch.ones(1, dtype=torch.float32)  # 4 bytes

    group, opts = dist.group.WORLD, dist.AllreduceOptions()
    calls = {
        VARIANTS[0]: lambda: phalanx.allreduce(t),
        VARIANTS[1]: lambda: dist.all_reduce(t),
        VARIANTS[3]: lambda: group.allreduce([t], opts),  # without torch's dist.* wrapper
    }
    if native is not None:
        calls[VARIANTS[2]] = lambda: dist.all_reduce(t, group=native)
    names = list(calls)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            fn = calls[name]
            for _ in range(50):
                fn()
            phalanx.barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            mine = (time.perf_counter() - start) / args.calls
            per_round[name].append(float(np.max(phalanx.allgather(np.array(mine)))))
    if phalanx.rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"backend": phalanx.backend().name, "ranks": phalanx.size(),
                       "us_per_call": {k: statistics.median(v) * 1e6 for k, v in per_round.items()},
                       "us_per_call_best": {k: min(v) * 1e6 for k, v in per_round.items()},
                       "rounds_us": {k: [x * 1e6 for x in v] for k, v in per_round.items()}}, f)
    phalanx.shutdown()


def run_world(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "phalanx", "run", "-n", str(args.ranks), "--backend", backend,
               os.path.abspath(__file__), "--worker", "--out", out,
               "--rounds", str(args.rounds), "--calls", str(args.calls)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"{backend}: failed\n{proc.stdout[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--backends", default="mpi,gloo")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = [run_world(args, b) for b in args.backends.split(",")]
    print("| world | statistic | phalanx.allreduce µs | the group's allreduce, direct µs | "
          "dist.all_reduce on 'phalanx' µs | added µs | dist.all_reduce on torch's gloo µs |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        for stat, key in (("median of rounds", "us_per_call"), ("best round", "us_per_call_best")):
            us = r[key]
            gloo = f"{us[VARIANTS[2]]:.1f}" if VARIANTS[2] in us else "–"
            print(f"| {r['backend']}, {r['ranks']} ranks | {stat} | {us[VARIANTS[0]]:.1f} | {us[VARIANTS[3]]:.1f} | "
                  f"{us[VARIANTS[1]]:.1f} | {us[VARIANTS[1]] - us[VARIANTS[0]]:.1f} | {gloo} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
