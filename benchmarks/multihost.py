"""Training-step benchmark across simulated hosts: phalanx, torch DDP, mpi4py and the Horovod API over a shaped link.

::

    flock /tmp/phalanx-tests.lock python benchmarks/multihost.py --hosts 4 --ranks-per-host 1 --rate 1gbit \\
        --models mlp --rounds 5 --steps 10 --json benchmarks/results/multihost-4x1-1gbit.json \\
        --png benchmarks/multihost-4x1-1gbit.png
    python benchmarks/multihost.py --replot benchmarks/results/multihost-*.json   # the tables again

The driver builds ``--hosts`` simulated hosts (``phalanx.testing.simulated_hosts``:
network namespaces behind one switch, every link shaped both ways to
``--rate`` with ``tc tbf``) and, in every round, starts one after the other
(in an order rotating from round to round) the worlds of
``benchmarks/train_step_worker.py`` from host 0:

* ``single``: one process on host 0, no communication: ``T_1``;
* ``mpi`` and ``gloo``: ``phalanx run --backend B --hosts h0:R,h1:R,... --rsh RSH``, every
  non-solo variant of that backend, one after the other (order rotating too);
* one world per *solo* variant (torch DDP's PowerSGD hook, which aborts its process on
  gloo): its end is recorded as the result ``"failed: <reason>"`` and it is not started again.

Each variant: ``--warmup`` steps, then ``--steps`` timed steps (zero_grad, forward,
cross-entropy, backward, reduction, SGD step), one thread per rank, batch ``--batch`` per
rank. A figure is the median over rounds of the slowest rank's mean step time.
Efficiency = T_1 / T_N (weak scaling: N × samples/s of one process is the ideal);
×DDP = the step time of DDP's equivalent (plain for uncompressed variants, the fp16 hook
for bf16/fp16, the PowerSGD hook for PowerSGD) / the variant's; ×plain = the uncompressed
phalanx step on the same backend / the variant's. Bytes per step: what the busiest
host sent on its link per timed step (``eth0`` transmit counter, headers included).
A configuration whose ranks (and their network stack) outnumber the machine's cores
is marked CPU-bound: compute and the kernel's network work then share cores.

JSON (one per configuration): ``settings`` (hosts, ranks_per_host, rate, steps, rounds,
batch, ...), ``cpu_bound``, ``rounds`` (every world's raw per-rank numbers), and
``summary`` → model → ``{"params", "t1_ms", "rows": {variant: {"step_ms", "ranks",
"bytes_per_step", "status", ...}}}`` (``step_ms`` is null unless ``status`` is ``"ok"``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

from multihost_report import overview, plot, summarize, table  # beside this script (sys.path[0])
from train_step_worker import BY_KEY, MODELS, worker

__all__ = ["DEFAULT_VARIANTS", "drive", "main", "parse_rate"]

DEFAULT_VARIANTS = [
    "single", "mpi/none",
    "mpi/DistributedOptimizer", "mpi/DistributedOptimizer+bf16", "mpi/DistributedOptimizer+fp16",
    "mpi/DistributedOptimizer+powersgd", "mpi/hand", "mpi/hvd",
    "gloo/DistributedOptimizer", "gloo/DistributedOptimizer+bf16", "gloo/DistributedOptimizer+fp16",
    "gloo/DistributedOptimizer+powersgd", "gloo/hvd",
    "gloo/DDP", "gloo/DDP+fp16", "gloo/DDP+powersgd",
]
IFACE = "eth0"  # every simulated host's link
SOLO_TIMEOUT = 90.0  # seconds for a solo world (torch's PowerSGD hook on gloo aborts, or hangs, within seconds)
_REASON = re.compile(r"(error|mismatch|terminate|abort|signal|killed|exception|exit)", re.IGNORECASE)


def parse_rate(rate: str) -> float:
    """Bits per second of a ``tc`` rate such as ``"1gbit"``, ``"10gbit"``, ``"100mbit"`` (``"...bps"``: bytes)."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*$", rate, re.IGNORECASE)
    if not m:
        raise SystemExit(f"multihost.py: --rate {rate!r} is not a rate; pass e.g. 1gbit, 10gbit, 100mbit")
    scale = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    return float(m.group(1)) * scale * (8 if (m.group(3) or "").lower() == "bps" else 1)


# -- worlds -----------------------------------------------------------------------------------------

def jobs(variants: list[str]) -> list[tuple[str, str, list[str]]]:
    """The worlds one round starts: (name, world, variant keys); solo variants get a world each."""
    found = [("single", "single", ["single"])] if "single" in variants else []
    for world in ("mpi", "gloo"):
        keys = [k for k in variants if BY_KEY[k].world == world and not BY_KEY[k].solo]
        if keys:
            found.append((world, world, keys))
    found += [(k, BY_KEY[k].world, [k]) for k in variants if BY_KEY[k].solo]
    return found


def _command(args: argparse.Namespace, hosts: Any, world: str, keys: list[str], rnd: int, out: str) -> list[str]:
    inner = [os.path.abspath(__file__), "--worker", "--world", world, "--round", str(rnd), "--out", out,
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
             "--models", ",".join(args.models), "--variants", ",".join(keys),
             "--mlp-width", str(args.mlp_width), "--cnn-width", str(args.cnn_width)]
    if world == "single":
        return [sys.executable, *inner]
    hostlist = ",".join(f"{name}:{args.ranks_per_host}" for name in hosts.names)
    return [sys.executable, "-m", "phalanx", "run", "--backend", world, "--hosts", hostlist, "--rsh", hosts.rsh,
            *inner, "--count-iface", IFACE]


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PHALANX_", "OMPI_", "PMI", "MASTER_", "HYDRA_")) and k != "HOSTNAME"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _reason(output: str, status: int, timeout: float) -> str:
    """The likeliest cause of a world's end, from its launcher's output: the last line naming an error."""
    if status == 124:
        return f"hung: no result within {timeout:g} s (the world was killed)"
    every = [line.strip() for line in output.splitlines()]
    lines = [line for line in every if _REASON.search(line)]
    detail = lines[-1] if lines else f"exit status {status}, no output naming an error"
    for i, line in enumerate(every):  # a C++ abort (gloo's own check) says more than the launcher's summary
        if "terminate called" in line:
            what = next((w for w in every[i + 1:i + 4] if "what()" in w), "")
            detail = f"{line} {what}".strip()
            break
    return f"exit {status}: {detail[:400]}"


def run_world(args: argparse.Namespace, hosts: Any, job: tuple[str, str, list[str]], rnd: int,
              tmp: str) -> dict[str, Any]:
    """Start one world from host 0 and wait: rank 0's results, or ``{"failed": reason}`` after ``attempts``."""
    name, world, keys = job
    out = os.path.join(tmp, f"{name.replace('/', '_')}-{rnd}.json")
    cmd = _command(args, hosts, world, keys, rnd, out)
    solo = BY_KEY[keys[0]].solo
    attempts, timeout = (1, min(args.world_timeout, SOLO_TIMEOUT)) if solo else (2, args.world_timeout)
    reason = ""
    for attempt in range(1, attempts + 1):
        load, start = os.getloadavg()[0], time.monotonic()
        try:
            proc = hosts.run(0, cmd, env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             timeout=timeout, check=False)
            status, text = proc.returncode, proc.stdout.decode(errors="replace")
        except subprocess.TimeoutExpired as e:
            status, text = 124, (e.output or b"").decode(errors="replace")
        wall = time.monotonic() - start
        for i in range(len(hosts)):  # nothing of this world may outlive it (a rank on a far host, an orphan)
            hosts.kill(i)
        if os.path.exists(out):
            with open(out) as f:
                found = json.load(f)
            os.remove(out)
            found.update(wall_s=round(wall, 2), load_before=round(load, 2))
            if status != 0:
                found["exit_status"] = status
            return found
        reason = _reason(text, status, timeout)
        print(f"  {name} world, round {rnd + 1}, attempt {attempt}: {reason}\n{text[-3000:]}", file=sys.stderr,
              flush=True)
    return {"failed": reason, "wall_s": round(wall, 2), "load_before": round(load, 2)}


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """Build the hosts, run every round, and return the raw results plus their summary."""
    from phalanx.testing import simulated_hosts

    todo = jobs(args.variants)
    rounds: list[dict[str, Any]] = []
    started, load_before = time.time(), os.getloadavg()
    with simulated_hosts(args.hosts, rate=args.rate) as hosts, \
            tempfile.TemporaryDirectory(prefix="phalanx-multihost-") as tmp:
        for r in range(args.rounds):
            order = todo[r % len(todo):] + todo[:r % len(todo)]
            this: dict[str, Any] = {}
            for job in order:
                earlier = [rnd[job[0]] for rnd in rounds if "failed" in rnd.get(job[0], {})]
                if BY_KEY[job[2][0]].solo and earlier:  # a solo world that ended its process: once is enough
                    this[job[0]] = dict(earlier[0], skipped=True)
                    continue
                this[job[0]] = run_world(args, hosts, job, r, tmp)
            rounds.append(this)
            print(f"round {r + 1}/{args.rounds} done ({time.time() - started:.0f} s; "
                  + ", ".join(f"{n} {w['wall_s']:.1f} s" for n, w in this.items() if not w.get("skipped"))
                  + f"; load average {os.getloadavg()[0]:.1f})", flush=True)
    versions: dict[str, str] = {}
    for world in rounds[0].values():
        versions.update(world.get("versions", {}))
    record = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "cores": os.cpu_count(), "versions": versions,
        "settings": {"hosts": args.hosts, "ranks_per_host": args.ranks_per_host, "rate": args.rate,
                     "rate_bits": parse_rate(args.rate), "steps": args.steps, "rounds": args.rounds,
                     "warmup": args.warmup, "batch": args.batch, "models": args.models, "variants": args.variants,
                     "mlp_width": args.mlp_width, "cnn_width": args.cnn_width, "threads_per_rank": 1},
        "jobs": [list(j) for j in todo],
        "rounds": rounds,
    }
    ranks = args.hosts * args.ranks_per_host
    cores = os.cpu_count() or 1
    busy = parse_rate(args.rate) >= 5e9  # the kernel's TCP/veth/tbf work at 10 Gbit/s takes about a core
    record["cpu_bound"] = ranks > cores or busy
    record["cpu_bound_reason"] = (f"{ranks} ranks on {cores} cores" if ranks > cores else "") + \
        ("; " if ranks > cores and busy else "") + (f"the network stack at {args.rate}" if busy else "")
    record["summary"] = summarize(record)
    return record


# -- command line -----------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2, help="simulated hosts (default 2)")
    p.add_argument("--ranks-per-host", type=int, default=1, help="ranks on each host (default 1)")
    p.add_argument("--rate", default="1gbit", help="every link's rate, both ways (tc tbf; default 1gbit)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; every figure is a median over them")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant before timing (>= 2)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--models", default="mlp", help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated variant keys (default: the multi-host set): " + ", ".join(BY_KEY))
    p.add_argument("--mlp-width", type=int, default=1024, help="MLP hidden size (1024: 4.73M parameters)")
    p.add_argument("--cnn-width", type=int, default=16, help="first channel count of the CNN and resnet_tiny")
    p.add_argument("--world-timeout", type=float, default=300, help="seconds one world may take")
    p.add_argument("--json", dest="json_path", help="write all raw numbers and the summary here")
    p.add_argument("--png", dest="png_path", help="write the chart here")
    p.add_argument("--replot", nargs="+", metavar="JSON", help="no run: the tables (and chart) of earlier runs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--world", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--count-iface", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    args = _parser().parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.variants = [k for k in args.variants.split(",") if k]
    bad = [m for m in args.models if m not in MODELS] + [k for k in args.variants if k not in BY_KEY]
    if bad:
        raise SystemExit(f"multihost.py: unknown model or variant {', '.join(bad)}; models: {', '.join(MODELS)}; "
                         f"variants: {', '.join(BY_KEY)}")
    if args.worker:
        args.fresh_allocator = False
        return worker(args)
    if args.replot:
        records = []
        for path in args.replot:
            with open(path) as f:
                records.append(json.load(f))
    else:
        if args.rounds < 1 or args.steps < 1 or args.warmup < 2 or args.hosts < 1 or args.ranks_per_host < 1 \
                or args.hosts * args.ranks_per_host < 2:
            raise SystemExit("multihost.py: --rounds and --steps must be >= 1, --warmup >= 2 (DDP's PowerSGD "
                             "compresses from its 2nd step), and hosts × ranks per host >= 2")
        parse_rate(args.rate)
        records = [drive(args)]
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(records[0], f, indent=1)
            print(f"results written to {args.json_path}")
    for record in records:
        print(table(record))
    if len(records) > 1:
        print(overview(records))
    if args.png_path:
        plot(records, args.png_path)
        print(f"chart written to {args.png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
