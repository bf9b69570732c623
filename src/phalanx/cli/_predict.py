"""``phalanx bench predict``: predicted step time and scaling efficiency from the α-β model.

::

    phalanx bench predict --model resnet101 --step-ms 250 --fabric 25gbe --ranks 2,4,...,1024 \\
        --ranks-per-host 8 --variants plain,bf16,powersgd,hierarchical --png scaling.png

The model and its assumptions: ``docs/scaling.md``; the arithmetic: :mod:`phalanx.cli._scaling`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

from .._errors import InvalidArgumentError, MissingDependencyError
from ._scaling import (
    Fabric,
    Settings,
    codec_flops,
    compressed_matrices,
    named_link,
    named_model,
    parse_variant,
    predict,
)
from ._scaling_data import LINKS, MODELS, Link, ModelShape

__all__ = ["main", "parse_ranks", "load_fabric"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx bench predict", description=__doc__.split("\n\n")[0],
                                epilog="Assumptions and sources of the named links: docs/scaling.md.")
    p.add_argument("--model", default=None, help=f"{', '.join(MODELS)}, or a JSON file "
                   "{\"matrices\": [[rows, cols], ...], \"vectors\": N}")
    p.add_argument("--params", default=None, help="instead of --model: a parameter count, e.g. 25.6M "
                   "(PowerSGD then assumes square matrices of 1024 rows)")
    p.add_argument("--step-ms", type=float, required=True, help="one rank's step time in ms (compute only)")
    p.add_argument("--fabric", default="25gbe", help=f"the link between hosts: {', '.join(LINKS)}, or "
                   "JSON files from `phalanx bench allreduce --json`, comma-separated (default 25gbe)")
    p.add_argument("--intra", default="pcie3", help="the link within a host when --fabric names none "
                   "(default pcie3)")
    p.add_argument("--ranks", default="1,2,4,...,1024", help="rank counts, e.g. 2,4,...,1024 or 2,3,4")
    p.add_argument("--ranks-per-host", type=int, default=1, help="ranks on each host (default 1)")
    p.add_argument("--variants", default="plain,bf16,powersgd,hierarchical",
                   help="plain, bf16, fp16, powersgd, hierarchical, or +-joined, comma-separated")
    p.add_argument("--overlap", type=float, default=0.0,
                   help="fraction of communication hidden behind backward, 0..1 (default 0)")
    p.add_argument("--backward-fraction", type=float, default=2 / 3,
                   help="share of the step that is backward, the most overlap can hide (default 2/3)")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD's rank (default 4)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size: one allreduce each (default 25)")
    p.add_argument("--cast-gbps", type=float, default=0.0,
                   help="bf16/fp16 cast speed, GB of fp32 per s (0: free, the default)")
    p.add_argument("--gflops", default="0", help="PowerSGD's local work, GFLOP/s (0: free, the default), or "
                   "'measure': time it for --model on one CPU thread of this machine (needs torch)")
    p.add_argument("--overhead-ms", type=float, default=0.0, help="fixed cost per step on N > 1 ranks")
    p.add_argument("--png", default=None, help="also draw efficiency against ranks into this PNG")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON instead of a table")
    return p


def parse_ranks(text: str) -> list[int]:
    """``"2,4,...,1024"`` (doubling, or any ratio/step the first two set) or ``"1,2,3"`` as a sorted list."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    out: list[int] = []
    try:
        for i, part in enumerate(parts):
            if part != "...":
                out.append(int(part))
                continue
            a, b, end = out[-2], out[-1], int(parts[i + 1])
            geometric = a > 0 and b % a == 0 and b // a > 1
            while True:
                nxt = out[-1] * (b // a) if geometric else out[-1] + (b - a)
                if nxt >= end or nxt <= out[-1]:
                    break
                out.append(nxt)
    except (ValueError, IndexError):
        out = []
    if not out or min(out) < 1:
        raise InvalidArgumentError(
            f"phalanx bench predict: --ranks {text!r} is not a list of rank counts; pass positive integers, "
            f"comma-separated, with '...' between two starts and an end, e.g. --ranks 2,4,...,1024.")
    return sorted(set(out))


def _parse_count(text: str) -> int:
    """``"25.6M"``, ``"138e6"``, ``"4733962"`` as a count (k, M, G are powers of 1000)."""
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(text.strip()[-1:].lower(), 1.0)
    try:
        value = float(text.strip()[:-1] if scale != 1.0 else text)
    except ValueError:
        value = -1.0
    if value * scale < 1:
        raise InvalidArgumentError(f"phalanx bench predict: --params {text!r} is not a parameter count; "
                                   f"pass e.g. --params 25.6M or --params 4733962.")
    return int(value * scale)


def _read_json(path: str, flag: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"phalanx bench predict: {flag} {path}: cannot read it as JSON ({exc}); "
                                   f"pass an existing JSON file or a name.") from None


def load_fabric(spec: str, intra: str) -> Fabric:
    """The fabric ``--fabric spec --intra intra`` names: a named link, or the ``fit`` of one or more
    ``phalanx bench allreduce --json`` files (each gives its link class, ``intra`` or ``inter``)."""
    links: dict[str, Link] = {}
    for item in [s.strip() for s in spec.split(",") if s.strip()] or [""]:
        if not os.path.exists(item) and not item.endswith(".json"):
            links.setdefault("inter", named_link(item, "--fabric"))
            continue
        fit = _read_json(item, "--fabric").get("fit")
        if not isinstance(fit, dict) or "class" not in fit:
            raise InvalidArgumentError(f"phalanx bench predict: --fabric {item} has no α-β fit; write one with "
                                       f"`phalanx bench allreduce --sizes 64K,1M,8M --json FILE` (2+ ranks).")
        chosen = fit["links"][fit["use"]]
        links[fit["class"]] = Link(chosen["alpha"], chosen["beta"], f"fitted in {item} ({fit['use']})")
    inter = links.get("inter") or links.get("intra")
    return Fabric(inter=inter, intra=links.get("intra") or named_link(intra, "--intra"),  # type: ignore[arg-type]
                  name=spec)


def _model(args: argparse.Namespace) -> ModelShape:
    if (args.model is None) == (args.params is None):
        raise InvalidArgumentError("phalanx bench predict: give exactly one of --model NAME|FILE and --params N "
                                   f"(got --model {args.model!r}, --params {args.params!r}); e.g. --model resnet101.")
    if args.params is not None:
        total = _parse_count(args.params)
        mats = ((1024, 1024),) * (total // (1024 * 1024))
        return ModelShape(f"{args.params} params", mats, total - 1024 * 1024 * len(mats))
    if os.path.exists(args.model) or args.model.endswith(".json"):
        data = _read_json(args.model, "--model")
        try:
            return ModelShape(os.path.basename(args.model), tuple((int(n), int(m)) for n, m in data["matrices"]),
                              int(data.get("vectors", 0)))
        except (KeyError, TypeError, ValueError):
            raise InvalidArgumentError(f"phalanx bench predict: --model {args.model} is not "
                                       "{\"matrices\": [[rows, cols], ...], \"vectors\": N}; write it so.") from None
    return named_model(args.model)


def _gflops(text: str) -> float:
    try:
        value = float(text)
        return value if math.isfinite(value) else -1.0  # nan, inf: refused by the range check
    except ValueError:
        if text.strip().lower() == "measure":
            return math.nan
        raise InvalidArgumentError(f"phalanx bench predict: --gflops {text!r} is neither a number nor 'measure'; "
                                   "pass e.g. --gflops 20, or --gflops measure.") from None


def measure_gflops(model: ModelShape, s: Settings) -> float:
    """GFLOP/s of PowerSGD's local work (``phalanx.torch.PowerSGD``'s own passes) on ``model``'s
    compressed matrices at ``s.rank``, on one CPU thread of this machine."""
    mats = compressed_matrices(model, s)
    if not mats:
        return 0.0
    try:
        import torch
    except ImportError:
        raise MissingDependencyError("phalanx bench predict: --gflops measure times PowerSGD with torch, which is "
                                     "not installed; `pip install torch`, or give --gflops a number.") from None
    from ..torch._powersgd import codec_seconds

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = codec_seconds(mats, s.rank)
    finally:
        torch.set_num_threads(threads)
    return sum(codec_flops(n, m, s.rank) for n, m in mats) / seconds / 1e9


def _settings(args: argparse.Namespace, model: ModelShape) -> Settings:
    gflops = _gflops(args.gflops)
    checks = [("--step-ms", args.step_ms > 0, "a positive time, e.g. 250"),
              ("--ranks-per-host", args.ranks_per_host >= 1, "1 or more"),
              ("--overlap", 0 <= args.overlap <= 1, "a fraction from 0 to 1"),
              ("--backward-fraction", 0 <= args.backward_fraction <= 1, "a fraction from 0 to 1"),
              ("--rank", args.rank >= 1, "1 or more, e.g. 4"), ("--bucket-mb", args.bucket_mb > 0, "positive"),
              ("--cast-gbps", args.cast_gbps >= 0, "0 or more"), ("--gflops", math.isnan(gflops) or gflops >= 0, "0 or more, or 'measure'"),
              ("--overhead-ms", args.overhead_ms >= 0, "0 or more")]
    for flag, ok, fix in checks:
        if not ok:
            value = getattr(args, flag[2:].replace("-", "_"))
            raise InvalidArgumentError(f"phalanx bench predict: {flag} {value} is out of range; pass {fix}.")
    s = Settings(t1=args.step_ms / 1e3, ranks_per_host=args.ranks_per_host, overlap=args.overlap,
                 backward_fraction=args.backward_fraction, rank=args.rank,
                 bucket_bytes=int(args.bucket_mb * (1 << 20)),
                 cast_s_per_byte=1 / (args.cast_gbps * 1e9) if args.cast_gbps else 0.0,
                 flops_per_s=0.0 if math.isnan(gflops) else gflops * 1e9, overhead=args.overhead_ms / 1e3)
    if math.isnan(gflops):
        s = dataclasses.replace(s, flops_per_s=measure_gflops(model, s) * 1e9)
    return s


def main(argv: list[str] | None = None) -> int:
    """Run ``phalanx bench predict`` with ``argv``; returns the exit status (2 for bad input)."""
    args = _parser().parse_args(argv)
    try:
        model = _model(args)
        settings = _settings(args, model)
        fabric = load_fabric(args.fabric, args.intra)
        variants = [parse_variant(v) for v in args.variants.split(",") if v.strip()]
        if not variants:
            variants = [parse_variant("")]
        rows = predict(model, variants, parse_ranks(args.ranks), fabric, settings)
        if args.png:
            _plot(rows, model, fabric, settings, args.png)
    except (InvalidArgumentError, MissingDependencyError) as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    if args.json:
        print(json.dumps({"model": model.name, "params": model.params, "fabric": _describe(fabric),
                          "settings": vars(args),
                          "powersgd_gflops": settings.flops_per_s / 1e9, "rows": rows}, indent=1))
    else:
        _print_table(rows, model, fabric, settings)
    return 0


def _describe(fabric: Fabric) -> dict[str, Any]:
    return {k: {"alpha": v.alpha, "beta": v.beta, "gbytes_per_s": v.gbytes_per_s, "note": v.note}
            for k, v in (("inter", fabric.inter), ("intra", fabric.intra))}


def _print_table(rows: list[dict[str, Any]], model: ModelShape, fabric: Fabric, s: Settings) -> None:
    print(f"phalanx bench predict: {model.name} ({model.params / 1e6:.2f}M params), one rank {s.t1 * 1e3:g} ms, "
          f"{s.ranks_per_host} rank(s) per host, overlap {s.overlap:g}"
          + (f", PowerSGD's local work at {s.flops_per_s / 1e9:.2f} GFLOP/s" if s.flops_per_s else ""))
    for cls, link in (("inter", fabric.inter), ("intra", fabric.intra)):
        print(f"  {cls}: α {link.alpha * 1e6:.2f} us, 1/β {link.gbytes_per_s:.3f} GB/s  ({link.note})")
    print(f"{'variant':>22} {'ranks':>6} {'MB sent':>9} {'comm ms':>9} {'step ms':>9} {'efficiency':>10}")
    for r in rows:
        print(f"{r['variant']:>22} {r['ranks']:>6} {r['bytes'] / 1e6:>9.2f} {r['comm_s'] * 1e3:>9.2f} "
              f"{r['step_s'] * 1e3:>9.2f} {r['efficiency']:>10.3f}")


def _plot(rows: list[dict[str, Any]], model: ModelShape, fabric: Fabric, s: Settings, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("phalanx bench predict: --png needs matplotlib, which is not installed; "
                                     "`pip install matplotlib` (or phalanx[dev]), or leave out --png.") from None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in dict.fromkeys(r["variant"] for r in rows):
        pts = [(r["ranks"], r["efficiency"]) for r in rows if r["variant"] == name]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("ranks")
    ax.set_ylabel("predicted efficiency (T1 / T(N))")
    ax.set_title(f"{model.name}, {s.t1 * 1e3:g} ms/step, {fabric.name}, {s.ranks_per_host}/host", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
