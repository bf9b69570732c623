"""Hierarchical vs flat allreduce, gloo and mpi, on 2 simulated hosts × 2 ranks over a shaped link.

::

    flock /tmp/phalanx-tests.lock python benchmarks/hierarchical.py --rate 1gbit --rounds 5 \\
        --json benchmarks/results/hierarchical-2x2-1gbit.json

Every round starts, in an order rotating from round to round, one world per variant
from host 0 (``phalanx run --hosts h0:R,h1:R --rsh RSH``): ``gloo/hier``
(``PHALANX_HIERARCHICAL=1``), ``gloo/flat`` (``PHALANX_HIERARCHICAL=0``), ``mpi/two-levels``
(phalanx's ring in two levels, the default across hosts with several ranks each),
``mpi/flat-ring`` (``PHALANX_HIERARCHICAL=0``: one ring over every rank) and ``mpi/own``
(``PHALANX_MPI_RING=0``: MPICH's own ``MPI_Allreduce``; the default variants are the gloo
ones and ``mpi/own``). Each world times, per size, ``--warmup`` then
``--iters`` float32 ``phalanx.allreduce`` calls (a barrier before each); a figure is the
median over rounds of the slowest rank's median call. Bytes: what each host sent on its
link (``eth0`` transmit counter, headers included) per call, the busiest host's.
``--mlp-steps K``: also the benchmark MLP's training step (``DistributedOptimizer``, SGD,
batch 64 per rank), median of K steps, the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

WORKER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import phalanx

    phalanx.init()
    sizes, warmup, iters = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    if sys.argv[4]:  # the hierarchy's chunk size, for the variants that set it
        import phalanx.comm._hier as h
        h.CHUNK_BYTES = int(sys.argv[4])
    backend = phalanx.backend()
    ring = getattr(backend, "_ring", None)
    hier = getattr(backend, "hierarchy", None) or (ring.levels if ring is not None else None)
    local0 = int(os.environ.get("LOCAL_RANK", "0")) == 0

    def tx():
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())

    out = {"rank": phalanx.rank(), "hier": hier is not None, "sizes": {}}
    for size in sizes:
        x = np.ones(size // 4, np.float32)
        for _ in range(warmup):
            phalanx.allreduce(x)
        times = []
        phalanx.barrier()
        sent = tx()
        for _ in range(iters):
            phalanx.barrier()
            start = time.perf_counter()
            phalanx.allreduce(x)
            times.append(time.perf_counter() - start)
        phalanx.barrier()
        sent = tx() - sent
        out["sizes"][str(size)] = {"median_ms": 1e3 * float(np.median(times)),
                                   "tx_per_call": sent / iters if local0 else None}
    steps = int(sys.argv[5])
    if steps:  # the benchmark MLP (train_step_worker.py's, 4.73M parameters) under DistributedOptimizer
        import torch
        import phalanx.torch as pt

        torch.manual_seed(0)
        nn = torch.nn
        layers = [nn.Linear(512, 1024), nn.ReLU()] + [m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())]
        model = nn.Sequential(*layers, nn.Linear(1024, 10))
        opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        g = torch.Generator().manual_seed(phalanx.rank())
        x, y = torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)
        times = []
        for i in range(warmup + steps):
            phalanx.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - start)
        out["sizes"]["mlp"] = {"median_ms": 1e3 * float(np.median(times[warmup:])), "tx_per_call": None}
    sys.stdout.write("RESULT " + json.dumps(out) + "\\n")
    sys.stdout.flush()
""")

VARIANTS = {"gloo/hier": ("gloo", "1"), "gloo/flat": ("gloo", "0"), "mpi/own": ("mpi", ""),
            "mpi/two-levels": ("mpi", "1"), "mpi/flat-ring": ("mpi", "0")}
DEFAULT_VARIANTS = ["gloo/hier", "gloo/flat", "mpi/own"]
# gloo/hier@BYTES: the hierarchy with chunks of BYTES (0: one piece), e.g. gloo/hier@0, gloo/hier@4194304


def run_world(hosts, variant: str, spec: str, worker: Path, args: argparse.Namespace) -> dict:
    """One world of ``variant``; {size: {"ms": slowest rank's median, "tx": busiest host's bytes/call}}."""
    import os

    backend, hier = VARIANTS[variant.split("@")[0]]
    chunk = variant.split("@")[1] if "@" in variant else ""
    env = dict(os.environ, PHALANX_HIERARCHICAL=hier) if hier else dict(os.environ, PHALANX_MPI_RING="0")
    argv = [sys.executable, "-m", "phalanx", "run", "--hosts", spec, "--rsh", hosts.rsh, "--backend", backend,
            "--timeout", "60", str(worker), json.dumps(args.sizes), str(args.warmup), str(args.iters),
            str(1 << 62) if chunk == "0" else chunk, str(args.mlp_steps)]
    done = hosts.run(0, argv, capture_output=True, text=True, timeout=300, env=env)
    rows = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or len(rows) != args.hosts * args.ranks_per_host:
        raise RuntimeError(f"{variant}: rc {done.returncode}\n{done.stdout}\n{done.stderr[-2000:]}")
    assert all(r["hier"] == (hier == "1") for r in rows), rows  # the path asked for is the path that ran
    keys = [str(s) for s in args.sizes] + (["mlp"] if args.mlp_steps else [])
    return {k: {"ms": max(r["sizes"][k]["median_ms"] for r in rows),
                "tx": max(r["sizes"][k]["tx_per_call"] or 0 for r in rows)} for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4 << 20, 16 << 20], help="bytes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help=", ".join(VARIANTS))
    parser.add_argument("--mlp-steps", type=int, default=0, help="also time this many steps of the benchmark MLP")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from phalanx.testing import simulated_hosts

    spec = ",".join(f"h{i}:{args.ranks_per_host}" for i in range(args.hosts))
    raw: dict[str, list[dict]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory() as tmp, simulated_hosts(args.hosts, rate=args.rate) as hosts:
        worker = Path(tmp) / "worker.py"
        worker.write_text(WORKER)
        for r in range(args.rounds):
            order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
            for variant in order:
                raw[variant].append(run_world(hosts, variant, spec, worker, args))
                print(f"round {r} {variant}: {raw[variant][-1]}", file=sys.stderr, flush=True)
    summary = {v: {k: {"ms": statistics.median(w[k]["ms"] for w in worlds),
                       "ms_all": [round(w[k]["ms"], 2) for w in worlds],
                       "tx_mb": statistics.median(w[k]["tx"] for w in worlds) / 1e6}
                   for k in worlds[0]} for v, worlds in raw.items()}
    print(f"{args.hosts} hosts x {args.ranks_per_host} ranks, {args.rate}, medians of {args.rounds} rounds")
    base = "gloo/flat" if "gloo/flat" in summary else "mpi/flat-ring"
    print(f"| size | variant | ms (allreduce; MLP: step) | sent per host per call (MB) | vs {base} |")
    print("|---|---|---|---|---|")
    for k in summary[args.variants[0]]:
        flat = summary.get("gloo/flat", summary.get("mpi/flat-ring", {})).get(k, {}).get("ms")
        for v in args.variants:
            row = summary[v][k]
            ratio = f"{flat / row['ms']:.2f}x" if flat else ""
            name = "MLP step" if k == "mlp" else f"{int(k) >> 20} MB" if int(k) >= 1 << 20 else f"{int(k) >> 10} KB"
            print(f"| {name} | {v} | {row['ms']:.1f} | {row['tx_mb']:.2f} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "summary": summary,
                                         "rounds": raw}, indent=1))


if __name__ == "__main__":
    main()
