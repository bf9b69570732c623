"""The summary, Markdown table and chart of ``benchmarks/multihost.py`` (one JSON record per configuration)."""

from __future__ import annotations

import statistics
from typing import Any

from train_step_worker import BY_KEY, MODELS, build_model

__all__ = ["OVERVIEW", "ddp_equivalent", "overview", "plain_equivalent", "plot", "summarize", "table"]

# the columns of the overview across configurations: (heading, variant key)
OVERVIEW = [("mpi", "mpi/DistributedOptimizer"), ("mpi bf16", "mpi/DistributedOptimizer+bf16"),
            ("mpi PowerSGD", "mpi/DistributedOptimizer+powersgd"), ("hand", "mpi/hand"),
            ("gloo", "gloo/DistributedOptimizer"), ("gloo bf16", "gloo/DistributedOptimizer+bf16"),
            ("gloo PowerSGD", "gloo/DistributedOptimizer+powersgd"), ("DDP", "gloo/DDP"),
            ("DDP fp16", "gloo/DDP+fp16")]


def ddp_equivalent(key: str) -> str | None:
    """The torch DDP variant ``key`` is compared with: plain DDP, or its hook of the same kind of compression."""
    kind, _, compression = key.split("/")[-1].partition("+")
    if key in ("single", "mpi/none"):
        return None
    return {"": "gloo/DDP", "bf16": "gloo/DDP+fp16", "fp16": "gloo/DDP+fp16",
            "powersgd": "gloo/DDP+powersgd"}.get(compression)


def plain_equivalent(key: str) -> str | None:
    """The uncompressed variant of the same engine and backend as ``key`` (None if ``key`` is uncompressed)."""
    base, plus, _ = key.partition("+")
    return base if plus else None


def _job(key: str) -> str:
    variant = BY_KEY[key]
    return key if variant.solo else variant.world


def _row(record: dict[str, Any], model: str, key: str, ranks: int) -> dict[str, Any]:
    """One variant's figures over the rounds: median slowest-rank step, bytes per step, status."""
    entries, failures, missing = [], [], []
    for rnd in record["rounds"]:
        world = rnd.get(_job(key), {})
        if "failed" in world:
            failures.append(world["failed"])
            continue
        entry = world.get("results", {}).get(f"{model}:{key}")
        if entry is None:
            continue
        if entry.get("status", "ok") == "ok":
            entries.append(entry)
        else:
            missing.append(entry.get("reason", ""))
    row: dict[str, Any] = {"label": BY_KEY[key].label, "ranks": 1 if key == "single" else ranks, "step_ms": None,
                           "bytes_per_step": None, "rounds_ok": len(entries)}
    if entries:
        slowest = [max(e["rank_s"]) * 1e3 for e in entries]
        sent = [max(e["sent_bytes_per_step"]) for e in entries if "sent_bytes_per_step" in e]
        row.update(status="ok", step_ms=statistics.median(slowest), rounds_ms=slowest,
                   bytes_per_step=int(statistics.median(sent)) if sent and key != "single" else None,
                   replicas_agree=all(e["replicas_agree"] for e in entries),
                   notes=sorted({n for e in entries for n in e["notes"]}))
        if failures:
            row["failed_rounds"] = failures
    elif missing:
        row.update(status="not available", reason=missing[0])
    else:
        row.update(status=f"failed: {failures[0] if failures else 'no result'}")
    return row


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """Per model: parameters, T_1 and per variant its row, with efficiency, ×DDP and ×plain where both ran."""
    s = record["settings"]
    ranks = s["hosts"] * s["ranks_per_host"]
    summary: dict[str, Any] = {}
    for model in s["models"]:
        width = s["mlp_width"] if model == "mlp" else s["cnn_width"]
        params = sum(p.numel() for p in build_model(model, width).parameters())
        rows = {key: _row(record, model, key, ranks) for key in s["variants"]}
        single = rows.get("single", {})
        t1 = single.get("step_ms")
        for key, row in rows.items():
            if row["step_ms"] is None:
                continue
            if t1 is not None:
                row["efficiency"] = t1 / row["step_ms"]
            for name, other in (("x_ddp", ddp_equivalent(key)), ("x_plain", plain_equivalent(key))):
                if other in rows:
                    row[name.replace("x_", "") + "_equivalent"] = other
                    if rows[other]["step_ms"] is not None:
                        row[name] = rows[other]["step_ms"] / row["step_ms"]
        summary[model] = {"params": params, "t1_ms": t1, "rows": rows}
    return summary


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(record: dict[str, Any]) -> str:
    """The summary as Markdown: one table per model, under a line naming the configuration."""
    s = record["settings"]
    ranks = s["hosts"] * s["ranks_per_host"]
    bound = f", **CPU-bound** ({record['cpu_bound_reason']})" if record.get("cpu_bound") else ""
    lines = []
    for model, block in record["summary"].items():
        lines.append(f"\n{s['hosts']} hosts × {s['ranks_per_host']} rank{'s' * (s['ranks_per_host'] > 1)} "
                     f"({ranks} ranks), {s['rate']} links{bound}; {MODELS[model]}, "
                     f"{block['params'] / 1e6:.2f}M parameters, batch {s['batch']}/rank, T_1 "
                     f"{_fmt(block['t1_ms'], '.1f')} ms; median of {s['rounds']} rounds × {s['steps']} steps\n")
        lines.append("| variant | step ms | efficiency | ×DDP equivalent | ×uncompressed | MB sent/host/step |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for row in block["rows"].values():
            label = row["label"]
            if row["status"] != "ok":
                lines.append(f"| {label} | {row['status'][:120]} | | | | |")
                continue
            if any("ignored" in note for note in row.get("notes", [])):
                label += " (compression ignored)"
            mb = None if row["bytes_per_step"] is None else row["bytes_per_step"] / 1e6
            lines.append(f"| {label} | {row['step_ms']:.1f} | {_fmt(row.get('efficiency'), '.2f')} | "
                         f"{_fmt(row.get('x_ddp'), '.2f')} | {_fmt(row.get('x_plain'), '.2f')} | "
                         f"{_fmt(mb, '.2f')} |")
    return "\n".join(lines)


def overview(records: list[dict[str, Any]]) -> str:
    """One Markdown table per model across configurations: T_1 and the main variants' step ms."""
    lines = []
    models = sorted({m for r in records for m in r["summary"]}, key=list(MODELS).index)
    for model in models:
        lines.append(f"\n{MODELS[model]}: step ms (median of rounds, slowest rank)\n")
        lines.append("| hosts × ranks, link | rounds | T_1 | " + " | ".join(h for h, _ in OVERVIEW) + " |")
        lines.append("|---|---:|---:|" + "---:|" * len(OVERVIEW))
        for record in records:
            if model not in record["summary"]:
                continue
            s, block = record["settings"], record["summary"][model]
            cells = [_fmt(block["rows"].get(k, {}).get("step_ms"), ".0f") for _, k in OVERVIEW]
            bound = " (CPU-bound)" if record.get("cpu_bound") else ""
            lines.append(f"| {s['hosts']}×{s['ranks_per_host']}, {s['rate']}{bound} | {s['rounds']} | "
                         f"{_fmt(block['t1_ms'], '.1f')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: str) -> None:
    """A PNG: one panel per configuration and model, each variant's step time (bars), DDP and T_1 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(r, m, b) for r in records for m, b in r["summary"].items()]
    cols = min(len(panels), 3)
    nrows = -(-len(panels) // cols)
    height = 0.32 * max(len(b["rows"]) for _, _, b in panels) + 1.6
    fig, axes = plt.subplots(nrows, cols, figsize=(7 * cols, height * nrows), squeeze=False)
    colors = {"single": "#999999", "mpi": "#1f77b4", "gloo": "#ff7f0e"}
    for ax, (record, model, block) in zip(axes.flat, panels, strict=False):
        s = record["settings"]
        rows = list(block["rows"].items())[::-1]
        values = [r["step_ms"] or 0.0 for _, r in rows]
        bars = ax.barh(range(len(rows)), values, color=[colors[BY_KEY[k].world] for k, _ in rows])
        for bar, (key, _) in zip(bars, rows, strict=True):
            if key.startswith("gloo/DDP"):
                bar.set_hatch("//")
        for i, (_, r) in enumerate(rows):
            text = f" {r['step_ms']:.0f} ms" if r["step_ms"] is not None else f" {r['status'][:40]}"
            if r.get("x_ddp") is not None and not r["label"].startswith("torch DDP"):
                text += f"  ×DDP {r['x_ddp']:.2f}"
            ax.text(values[i], i, text, va="center", fontsize=7)
        ax.set_yticks(range(len(rows)), [r["label"] for _, r in rows], fontsize=7)
        ddp = block["rows"].get("gloo/DDP", {}).get("step_ms")
        if ddp:
            ax.axvline(ddp, color="k", ls="--", lw=1, label="torch DDP (gloo)")
        if block["t1_ms"]:
            ax.axvline(block["t1_ms"], color="g", ls=":", lw=1.2, label="T_1 (ideal weak scaling)")
        ax.set_xlim(0, max(values) * 1.45 or 1)
        ax.set_xlabel("step ms (slowest rank, median of rounds; lower is better)", fontsize=8)
        bound = ", CPU-bound" if record.get("cpu_bound") else ""
        ax.set_title(f"{s['hosts']}×{s['ranks_per_host']} ranks, {s['rate']}{bound}: {model} "
                     f"({block['params'] / 1e6:.2f}M params)", fontsize=9)
        ax.legend(loc="lower right", fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("Training step across simulated hosts (tc tbf links), 1 thread per rank\n"
                 "blue: mpi, orange: gloo (hatched: torch DDP), grey: 1 process", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the two-line title
    fig.savefig(path, dpi=100)
    plt.close(fig)
