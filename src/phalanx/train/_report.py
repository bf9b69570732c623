"""What fit shows and records: the progress bar, training metrics, validation lines, the final summary."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import numpy as np

from .. import _world
from ._loggers import ConsoleLogger
from ._progress import RunState

__all__ = ["finish", "hparams", "message", "progress_bar", "train_metrics", "validation"]


def lr(run: RunState) -> float:
    return float(run.inner.param_groups[0]["lr"])


def hparams(run: RunState, total: int) -> dict[str, Any]:
    o, g = run.o, run.geometry
    return {"batch_size": g.batch_size, "global_batch": g.step_samples,
            "ranks": g.ranks, "replicas": g.replicas, "accumulate": g.accumulate, "steps": total,
            "epochs": o.epochs, "optimizer": type(run.inner).__name__, "lr": lr(run),
            "precision": o.precision or "fp32", "backend": _world.backend(), "seed": o.seed}


def train_metrics(run: RunState, window: np.ndarray) -> dict[str, float] | None:
    """The training metrics of the steps summed in ``window`` (None when it holds no sample)."""
    if not window[1]:
        return None
    elapsed = time.monotonic() - run.started
    metrics = {"train/loss": float(window[0] / window[1])}
    for k, hits in zip(run.o.topk, window[2:], strict=True):
        if not math.isnan(hits):  # NaN: the outputs are not class logits
            metrics[f"train/top{k}"] = float(hits / window[1])
    metrics.update({"lr": lr(run), "samples_per_s": run.samples_done / elapsed if elapsed else 0.0})
    if run.bar is not None:
        run.bar.set_postfix({"loss": f"{metrics['train/loss']:.4g}", "lr": f"{metrics['lr']:.3g}"},
                            refresh=False)
    return metrics


def validation(run: RunState, metrics: dict[str, float]) -> None:
    """A line on rank 0 (unless a ConsoleLogger already prints the metrics)."""
    if run.rank != 0 or any(isinstance(lg, ConsoleLogger) for lg in run.loggers):
        return
    shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if not k.endswith("/samples"))
    train = run.history.last("train/loss")
    head = f"epoch {run.progress.epochs_done(run.geometry):g} step {run.progress.global_step}:"
    message(run.bar, f"{head} {'' if train is None else f'train/loss {train:.4g}  '}{shown}")


def finish(run: RunState, total: int) -> None:
    """The summary: into the History, the loggers, the curves PNG and (rank 0) stderr."""
    o, h, g, steps = run.o, run.history, run.geometry, run.progress.global_step
    elapsed = time.monotonic() - run.started
    summary: dict[str, Any] = {
        "steps": steps, "epochs": round(steps / g.steps_per_epoch, 3),
        "samples": run.samples_done, "time_s": round(elapsed, 3),
        "samples_per_s": round(run.samples_done / elapsed, 1) if elapsed else 0.0,
        "skipped_steps": run.policy.skipped, "ranks": g.ranks, "replicas": g.replicas,
        "stopped": h.stopped}
    for key in h.keys():
        value = h.last(key)
        if key.startswith(("train/", "val/")) and isinstance(value, float):
            summary[key] = value
    if "val/top1" in h:
        summary["best val/top1"] = h.best("val/top1")
    if run.checkpoint is not None:
        summary["checkpoint"] = run.checkpoint
    curves = _curves_path(o.plot, o.checkpoint_dir)
    if curves is not None and run.rank == 0 and any(len(r) > 2 for r in h.records):
        from ._plot import plot_curves

        summary["curves"] = plot_curves(h.records, curves, title="phalanx.train.fit")
    h.summary = summary
    for lg in run.loggers:
        lg.finish(summary)
    if run.rank == 0 and o.progress:
        lines = [f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}" for k, v in summary.items()]
        end = f"stopped by {h.stopped}" if h.stopped else "done"
        print(f"phalanx.train.fit {end}:\n" + "\n".join(lines), file=sys.stderr, flush=True)


def _curves_path(plot: Any, checkpoint_dir: Any) -> str | None:
    if plot is False:
        return None
    if plot is None or plot is True:
        return os.path.join(os.fspath(checkpoint_dir), "curves.png") if checkpoint_dir is not None else None
    return os.fspath(plot)


def progress_bar(show: bool, total: int, initial: int) -> Any:
    if not show:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=True,
                mininterval=0.2 if tty else 10.0, file=sys.stderr, desc="train")


def message(bar: Any, text: str) -> None:
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)
