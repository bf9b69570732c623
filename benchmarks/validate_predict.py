"""Predicted against measured: the scaling model (``phalanx bench predict``) checked on the
simulated-host runs of ``benchmarks/multihost.py``.

::

    python benchmarks/validate_predict.py                     # every results/multihost-*-1gbit.json
    python benchmarks/validate_predict.py --markdown          # the table for benchmarks/README.md

For each run that is not CPU-bound, each model and each variant that ran, it predicts the step
time from the run's one-rank step time (``t1_ms``) and the α-β fit of the link measured by
``phalanx bench allreduce --json`` across two simulated hosts at the same rate (``--fabric``):
the fit of phalanx on MPI for ``mpi/...`` variants, of raw mpi4py for ``mpi/hand``, of
phalanx on Gloo for ``gloo/...`` (DDP, the Horovod API on Gloo: the same transport). PowerSGD's
local work is timed here, on one thread, once per model (``phalanx bench predict --gflops
measure``: the ranks of the runs have one thread and, when not CPU-bound, a core each). Nothing
is fitted to the step times themselves. CPU-bound runs are listed apart and not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from phalanx.cli._predict import measure_gflops  # noqa: E402
from phalanx.cli._scaling import Fabric, Settings, parse_variant, step_time  # noqa: E402
from phalanx.cli._scaling_data import LINKS, MODELS, Link, ModelShape  # noqa: E402


def model_shape(name: str, settings: dict[str, Any]) -> ModelShape:
    """The named model's shapes; the benchmark's CNN and resnet_tiny read from torch (lazily)."""
    if name == "mlp" and settings.get("mlp_width", 1024) == 1024:
        return MODELS["mlp"]
    sys.path.insert(0, HERE)
    from train_step_worker import build_model

    width = settings.get("mlp_width" if name == "mlp" else "cnn_width", 16)
    mats, vectors = [], 0
    for p in build_model(name, width).parameters():
        if p.dim() >= 2:
            mats.append((p.shape[0], p.numel() // p.shape[0]))
        else:
            vectors += p.numel()
    return ModelShape(name, tuple(mats), vectors)


def link_for(variant: str, fits: dict[str, Any]) -> tuple[Link, str]:
    """The fitted link whose transport the measured ``variant`` uses."""
    backend = variant.split("/")[0]
    impl = "mpi4py" if variant == "mpi/hand" else f"phalanx-{backend}"
    if impl not in fits:
        impl = next(iter(fits))
    fit = fits[impl]
    return Link(fit["alpha"], fit["beta"], impl), impl


def model_variant(variant: str) -> str:
    """The scaling model's variant for a measured one (``gloo/DDP+fp16`` -> ``bf16``)."""
    words = variant.lower().split("/")[-1]
    name = "plain"
    if "bf16" in words or "fp16" in words:
        name = "bf16"
    if "powersgd" in words:
        name = "powersgd"
    if "hier" in words:
        name += "+hierarchical"
    return name


_MEASURED: dict[tuple[str, tuple[tuple[int, int], ...], int], float] = {}


def gflops(shape: ModelShape, s: Settings, args: argparse.Namespace) -> float:
    """``--gflops`` as a number, or (``measure``) PowerSGD's local work timed once per model on one thread."""
    if args.gflops != "measure":
        return float(args.gflops)
    key = (shape.name, shape.matrices, s.rank)
    if key not in _MEASURED:
        _MEASURED[key] = measure_gflops(shape, s)
    return _MEASURED[key]


def rows_of(path: str, fits: dict[str, Any], intra: Link, args: argparse.Namespace) -> list[dict[str, Any]]:
    record = json.load(open(path))
    settings = record["settings"]
    out = []
    for model_name, block in record["summary"].items():
        shape = model_shape(model_name, settings)
        for variant, row in block["rows"].items():
            if row.get("status") != "ok" or not row.get("step_ms") or row.get("ranks", 1) < 2 \
                    or variant.endswith("/none"):
                continue
            link, impl = link_for(variant, fits)
            s = Settings(t1=block["t1_ms"] / 1e3, ranks_per_host=settings.get("ranks_per_host", 1),
                         rank=settings.get("powersgd_rank", 4), overlap=args.overlap,
                         cast_s_per_byte=1 / (args.cast_gbps * 1e9) if args.cast_gbps else 0.0)
            s = dataclasses.replace(s, flops_per_s=gflops(shape, s, args) * 1e9)
            pred = step_time(row["ranks"], shape, parse_variant(model_variant(variant)), Fabric(link, intra), s)
            out.append({"file": os.path.basename(path), "cpu_bound": bool(record.get("cpu_bound")),
                        "model": model_name, "variant": variant, "as": model_variant(variant), "link": impl,
                        "ranks": row["ranks"], "measured_ms": row["step_ms"], "predicted_ms": pred["step_s"] * 1e3,
                        "error": pred["step_s"] * 1e3 / row["step_ms"] - 1})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=os.path.join(HERE, "results", "multihost-*-1gbit.json"))
    p.add_argument("--fabric", default=os.path.join(HERE, "results", "allreduce-2x1-1gbit.json"),
                   help="`phalanx bench allreduce --json` across 2 simulated hosts at the same rate")
    p.add_argument("--overlap", type=float, default=0.0)
    p.add_argument("--cast-gbps", type=float, default=0.0)
    p.add_argument("--gflops", default="measure",
                   help="PowerSGD's local work in GFLOP/s, or 'measure' (the default: timed here, one thread)")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    fits = json.load(open(args.fabric))["fit"]["links"]
    rows = [r for path in sorted(glob.glob(args.results)) for r in rows_of(path, fits, LINKS["shm"], args)]
    counted = [r for r in rows if not r["cpu_bound"]]
    if args.markdown:
        print("| run | model | variant (modelled as) | measured ms | predicted ms | error |")
        print("|---|---|---|---:|---:|---:|")
    for r in rows:
        run = r["file"].removeprefix("multihost-").removesuffix(".json") + (" (CPU-bound)" if r["cpu_bound"] else "")
        if args.markdown:
            print(f"| {run} | {r['model']} | {r['variant']} ({r['as']}) | {r['measured_ms']:.1f} | "
                  f"{r['predicted_ms']:.1f} | {r['error']:+.0%} |")
        else:
            print(f"{run:>24} {r['model']:>11} {r['variant']:>36} {r['as']:>14} {r['measured_ms']:9.1f} "
                  f"{r['predicted_ms']:9.1f} {r['error']:+7.1%}")
    if counted:
        worst = max(counted, key=lambda r: abs(r["error"]))
        within = sum(abs(r["error"]) <= 0.2 for r in counted)
        print(f"\n{within} of {len(counted)} predictions (not CPU-bound) within 20%; worst "
              f"{worst['error']:+.1%} ({worst['file']}, {worst['model']}, {worst['variant']})")
    else:
        print("\nno run that is not CPU-bound: nothing to validate")
    for (name, _, rank), value in _MEASURED.items():
        print(f"PowerSGD's local work ({name}, rank {rank}) measured at {value:.2f} GFLOP/s on one thread")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
