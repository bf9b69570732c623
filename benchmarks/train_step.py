"""Training-step benchmark: phalanx's gradient engine against torch DDP and a hand-written mpi4py loop.

::

    python benchmarks/train_step.py --ranks 2 --rounds 7 --steps 15 \\
        --json benchmarks/results/train-step-2.json --png benchmarks/train_step.png   # ~4 min on 2 cores
    python benchmarks/train_step.py --replot benchmarks/results/train-step-2.json --png out.png

One invocation is a *driver*: in every round it starts, one after the other
(in an order that rotates from round to round), three short worlds with the
phalanx launcher and collects what their rank 0 writes:

* a 1-process run (no communication): ``T_1``, the baseline of weak scaling;
* an mpi world of ``--ranks`` ranks (``phalanx run --backend mpi``): phalanx
  ``DistributedOptimizer`` and ``DataParallel``, each with compression off and
  ``bf16``, a hand-written loop (backward, one fused ``mpi4py`` ``Allreduce``
  of all gradients flattened into one buffer, step), and the same step with no
  communication at all (what running N ranks on the machine costs by itself);
* a gloo world of ``--ranks`` ranks: the same four phalanx variants, torch
  ``DistributedDataParallel`` and DDP with the body of its ``bf16_compress_hook``.

Each world times all its variants on both models (an MLP 512→1024→4×1024→10,
4.73M parameters, and a small CNN on 3×32×32 images), one after the other in
an order that also rotates per round: per variant ``--warmup`` steps, then
``--steps`` timed steps (zero_grad, forward, cross-entropy, backward,
reduction, SGD step). One thread per rank (``torch.set_num_threads(1)``), so
N ranks use N cores, and every process first puts glibc's malloc in its
steady state (:func:`settle_allocator`). A figure is the median over rounds of the *slowest
rank's* mean step time; samples/s = ranks × batch / step time; weak-scaling
efficiency = samples/s at N ranks / (N × samples/s of the 1-process run);
×DDP = samples/s / samples/s of torch DDP (gloo), compression off.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from train_step_worker import (  # beside this script (sys.path[0]): the rank program, variants and models
    BY_KEY,
    DDP,
    MODELS,
    VARIANTS,
    WORLDS,
    Variant,
    build_model,
    make_step,
    settle_allocator,
    worker,
)

__all__ = ["BY_KEY", "VARIANTS", "WORLDS", "Variant", "build_model", "main", "make_step", "plot", "settle_allocator",
           "summarize", "table"]


# -- the driver --------------------------------------------------------------------------------------

def _world_command(world: str, args: argparse.Namespace, round_index: int, out: str) -> list[str]:
    inner = [os.path.abspath(__file__), "--worker", "--world", world, "--round", str(round_index),
             "--out", out, "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
             "--models", ",".join(args.models), "--variants", ",".join(args.variants),
             "--mlp-width", str(args.mlp_width), "--cnn-width", str(args.cnn_width)]
    if args.fresh_allocator:
        inner.append("--fresh-allocator")
    if world == "single":
        return [sys.executable, *inner]
    return [sys.executable, "-m", "phalanx", "run", "-n", str(args.ranks), "--backend", world, *inner]


def _run_world(world: str, args: argparse.Namespace, round_index: int, tmp: str) -> dict[str, Any]:
    out = os.path.join(tmp, f"{world}-{round_index}.json")
    cmd = _world_command(world, args, round_index, out)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PHALANX_BACKEND", None)
    for attempt in (1, 2):
        load = os.getloadavg()[0]  # other work on the machine: a high figure marks a noisy world
        start = time.monotonic()
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=args.world_timeout, check=False)
        wall = time.monotonic() - start
        if os.path.exists(out):
            with open(out) as f:
                found = json.load(f)
            os.remove(out)
            found["wall_s"] = round(wall, 2)
            found["load_before"] = round(load, 2)
            if proc.returncode != 0:
                found["exit_status"] = proc.returncode  # results were written; the exit itself failed
            return found
        text = proc.stdout.decode(errors="replace")
        print(f"  {world} world, round {round_index + 1}, attempt {attempt}: exit {proc.returncode}, no "
              f"results\n{text[-4000:]}", file=sys.stderr, flush=True)
    raise SystemExit(f"train_step.py: the {world} world failed twice ({shlex.join(cmd)})")


def _available_worlds() -> set[str]:
    from phalanx.testing import available_backends

    return {"single"} | (set(available_backends()) & {"mpi", "gloo"})


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "platform": platform.platform(),
                            "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"] = models[0] if models else platform.processor()
    except OSError:
        info["cpu"] = platform.processor()
    try:
        with open("/proc/meminfo") as f:
            info["memory"] = f.readline().split(":", 1)[1].strip()
    except OSError:
        pass
    return info


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """Run every round and return the raw results plus their summary."""
    available = _available_worlds()
    skipped = sorted({BY_KEY[k].world for k in args.variants} - available)
    if skipped:
        print(f"train_step.py: no {', '.join(skipped)} here: those variants are left out", file=sys.stderr)
    args.variants = [k for k in args.variants if BY_KEY[k].world in available]
    worlds = [w for w in WORLDS if any(BY_KEY[k].world == w for k in args.variants)]
    rounds: list[dict[str, Any]] = []
    started = time.time()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="phalanx-train-step-") as tmp:
        for r in range(args.rounds):
            order = worlds[r % len(worlds):] + worlds[:r % len(worlds)]
            this: dict[str, Any] = {}
            for world in order:
                this[world] = _run_world(world, args, r, tmp)
            rounds.append(this)
            done = time.time() - started
            print(f"round {r + 1}/{args.rounds} done ({done:.0f} s; worlds "
                  + ", ".join(f"{w} {this[w]['wall_s']:.1f} s" for w in order)
                  + f"; load average {os.getloadavg()[0]:.1f})", flush=True)
    versions: dict[str, str] = {}
    for world in rounds[0].values():
        versions.update(world["versions"])
    record = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "machine": _machine(), "versions": versions,
        "settings": {"ranks": args.ranks, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                     "batch_per_rank": args.batch, "models": args.models, "variants": args.variants,
                     "mlp_width": args.mlp_width, "cnn_width": args.cnn_width, "threads_per_rank": 1,
                     "settled_allocator": not args.fresh_allocator},
        "rounds": rounds,
    }
    record["summary"] = summarize(record)
    return record


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """Per model and variant: per-round slowest-rank step times, their median, samples/s, efficiency, ×DDP."""
    settings = record["settings"]
    n, per_rank = settings["ranks"], settings["batch_per_rank"]
    summary: dict[str, Any] = {}
    for model_name in settings["models"]:
        params = sum(p.numel() for p in build_model(
            model_name, settings["mlp_width" if model_name == "mlp" else "cnn_width"]).parameters())
        rows: dict[str, Any] = {}
        for key in settings["variants"]:
            variant = BY_KEY[key]
            samples = [rnd[variant.world]["results"][f"{model_name}:{key}"] for rnd in record["rounds"]]
            slowest = [max(s["rank_s"]) for s in samples]
            ranks = 1 if variant.world == "single" else n
            step = statistics.median(slowest)
            rows[key] = {"label": variant.label, "ranks": ranks, "step_ms": step * 1e3,
                         "rounds_ms": [v * 1e3 for v in slowest],
                         "samples_per_s": ranks * per_rank / step,
                         "notes": sorted({note for s in samples for note in s["notes"]}),
                         "replicas_agree": all(s["replicas_agree"] for s in samples)}
        base = rows.get("single")
        ddp = rows.get(DDP)
        for row in rows.values():
            if base is not None:
                row["efficiency"] = row["samples_per_s"] / (row["ranks"] * base["samples_per_s"])
            if ddp is not None:
                row["x_ddp"] = row["samples_per_s"] / ddp["samples_per_s"]
                paired = [d / v for d, v in zip(ddp["rounds_ms"], row["rounds_ms"], strict=True)]
                row["x_ddp_per_round_median"] = statistics.median(paired)
        summary[model_name] = {"params": params, "rows": rows}
    return summary


def table(record: dict[str, Any]) -> str:
    """The summary as a Markdown table (one block per model)."""
    s = record["settings"]
    lines = []
    for model_name, block in record["summary"].items():
        lines.append(f"\n{MODELS[model_name]} ({block['params'] / 1e6:.2f}M parameters), batch "
                     f"{s['batch_per_rank']}/rank, {s['ranks']} ranks, median of {s['rounds']} rounds × "
                     f"{s['steps']} steps\n")
        lines.append("| variant | step ms | samples/s | efficiency | ×DDP |")
        lines.append("|---|---:|---:|---:|---:|")
        for row in block["rows"].values():
            label = row["label"].replace("N ranks", f"{s['ranks']} ranks")
            if any("ignored" in note for note in row["notes"]):
                label += " (compression ignored on mpi)"
            eff = f"{row['efficiency']:.2f}" if "efficiency" in row else "—"
            ratio = f"{row['x_ddp']:.2f}" if "x_ddp" in row else "—"
            lines.append(f"| {label} | {row['step_ms']:.1f} | {row['samples_per_s']:.0f} | {eff} | {ratio} |")
    return "\n".join(lines)


def plot(record: dict[str, Any], path: str) -> None:
    """A PNG: samples/s per variant, one panel per model, torch DDP (gloo) and N × T_1 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, s = record["summary"], record["settings"]
    fig, axes = plt.subplots(1, len(summary), figsize=(7.5 * len(summary), 0.42 * len(s["variants"]) + 1.8),
                             squeeze=False)
    colors = {"single": "#999999", "mpi": "#1f77b4", "gloo": "#ff7f0e"}
    for ax, (model_name, block) in zip(axes[0], summary.items(), strict=True):
        rows = list(block["rows"].items())[::-1]
        labels = [r["label"].replace("N ranks", f"{s['ranks']} ranks")
                  + (" (ignored)" if any("ignored" in note for note in r["notes"]) else "") for _, r in rows]
        values = [r["samples_per_s"] for _, r in rows]
        bars = ax.barh(range(len(rows)), values, color=[colors[BY_KEY[k].world] for k, _ in rows])
        hatch = [k.startswith("gloo/DDP") or k == "mpi/hand" or k.endswith("/none") or k == "single"
                 for k, _ in rows]
        for bar, baseline in zip(bars, hatch, strict=True):
            if baseline:
                bar.set_hatch("//")
        for i, (_, r) in enumerate(rows):
            extra = f"  eff {r['efficiency']:.2f}" if "efficiency" in r and r["ranks"] > 1 else ""
            ax.text(r["samples_per_s"], i, f" {r['samples_per_s']:.0f}{extra}", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        if DDP in block["rows"]:
            ax.axvline(block["rows"][DDP]["samples_per_s"], color="k", ls="--", lw=1, label="torch DDP (gloo)")
        if "single" in block["rows"]:
            ax.axvline(s["ranks"] * block["rows"]["single"]["samples_per_s"], color="g", ls=":", lw=1.2,
                       label=f"ideal: {s['ranks']} × 1 process")
        ax.set_xlabel("samples/s (all ranks)")
        ax.set_xlim(0, max(values + [s["ranks"] * block["rows"].get("single", {"samples_per_s": 0})[
            "samples_per_s"]]) * 1.3)
        ax.set_title(f"{MODELS[model_name]}, {block['params'] / 1e6:.2f}M params", fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"Training step, {s['ranks']} ranks × 1 thread, batch {s['batch_per_rank']}/rank "
                 f"(median of {s['rounds']} rounds × {s['steps']} steps)\n"
                 "blue: mpi world, orange: gloo world, grey: 1 process; hatched: baselines", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="ranks of the mpi and gloo worlds (default 2)")
    p.add_argument("--rounds", type=int, default=7, help="rounds; every figure is a median over them")
    p.add_argument("--steps", type=int, default=15, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant before timing")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn")
    p.add_argument("--variants", default=",".join(v.key for v in VARIANTS),
                   help="comma-separated variant keys (default: all): " + ", ".join(BY_KEY))
    p.add_argument("--mlp-width", type=int, default=1024, help="MLP hidden size (1024: 4.73M parameters)")
    p.add_argument("--cnn-width", type=int, default=16, help="CNN channels of the first conv layer")
    p.add_argument("--fresh-allocator", action="store_true",
                   help="measure in fresh processes' malloc state (page faults every step; see settle_allocator)")
    p.add_argument("--world-timeout", type=float, default=300, help="seconds one world may take")
    p.add_argument("--json", dest="json_path", help="write all raw numbers and the summary here")
    p.add_argument("--png", dest="png_path", help="write the chart here")
    p.add_argument("--replot", metavar="JSON", help="no run: print the table and chart from a JSON written before")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--world", choices=WORLDS, help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    args = _parser().parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.variants = [k for k in args.variants.split(",") if k]
    bad = [m for m in args.models if m not in MODELS] + [k for k in args.variants if k not in BY_KEY]
    if bad:
        raise SystemExit(f"train_step.py: unknown model or variant {', '.join(bad)}; models: "
                         f"{', '.join(MODELS)}; variants: {', '.join(BY_KEY)}")
    if args.worker:
        return worker(args)
    if "PHALANX_JOB_DIR" in os.environ or "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        raise SystemExit("train_step.py starts its own worlds: run it with `python benchmarks/train_step.py`, "
                         "not under `phalanx run` or mpiexec")
    if args.replot:
        with open(args.replot) as f:
            record = json.load(f)
    else:
        if args.rounds < 1 or args.steps < 1 or args.ranks < 2:
            raise SystemExit("train_step.py: --rounds and --steps must be >= 1 and --ranks >= 2")
        if DDP not in args.variants or "single" not in args.variants:
            print("train_step.py: without 'single' and 'gloo/DDP' there is no efficiency or ×DDP column",
                  file=sys.stderr)
        record = drive(args)
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(record, f, indent=1)
            print(f"results written to {args.json_path}")
    print(table(record))
    if args.png_path:
        plot(record, args.png_path)
        print(f"chart written to {args.png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
