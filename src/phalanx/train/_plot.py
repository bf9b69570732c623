"""Training curves as a PNG: losses, accuracies and the learning rate against the step.

::

    history = phalanx.train.fit(...)
    phalanx.train.plot_curves(history.records, "runs/exp1/curves.png", title="resnet18, 4 ranks")

    # or from a JSONLinesLogger file (hparams/summary lines have no "step" and are skipped)
    records = [json.loads(line) for line in open("runs/exp1/metrics.jsonl")]
    phalanx.train.plot_curves(records, "curves.png")

Drawn with matplotlib's Agg canvas on a private figure: no display is needed
and pyplot's state and backend are left alone.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._errors import InvalidArgumentError
from .._files import write_atomically

__all__ = ["plot_curves"]

_SPLIT_COLORS = {"train": "C0", "val": "C1", "test": "C2"}
_STYLES = ["-", "--", ":", "-."]


def _value(value: Any) -> float | None:
    """A finite float, or None (missing, non-numeric, NaN/inf, or the JSON-lines strings "nan"/"inf")."""
    if isinstance(value, bool) or value is None:
        return None
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            return None
    if not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _panel(name: str) -> str | None:
    last = name.rsplit("/", 1)[-1]
    if last == "loss":
        return "loss"
    if last.startswith("top"):
        return "accuracy"
    if name == "lr" or last == "lr":
        return "lr"
    return None


def _series(records: Sequence[Any]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """``{panel: {metric: [(step, value), ...]}}``, in first-seen order, sorted by step."""
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {"loss": {}, "accuracy": {}, "lr": {}}
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise InvalidArgumentError(
                f"phalanx.train.plot_curves(): records[{i}] is {type(record).__name__}, not a dict; pass "
                "dicts like {'step': 100, 'train/loss': 0.4} (e.g. history.records)."
            )
        if "step" not in record:
            continue  # hparams / summary lines of a JSON lines file
        step = _value(record["step"])
        if step is None:
            raise InvalidArgumentError(
                f"phalanx.train.plot_curves(): records[{i}]['step'] is {record['step']!r}; steps must be numbers."
            )
        for name, raw in record.items():
            panel = _panel(str(name)) if name != "step" else None
            value = _value(raw) if panel is not None else None
            if value is not None:
                panels[panel].setdefault(str(name), []).append((step, value))  # type: ignore[index]
    for metrics in panels.values():
        for points in metrics.values():
            points.sort(key=lambda p: p[0])
    return {panel: metrics for panel, metrics in panels.items() if metrics}


def plot_curves(records: Iterable[Mapping[str, Any]], path: str | os.PathLike[str], *,
                title: str | None = None) -> str:
    """Draw training curves (losses, accuracies, learning rate against the step) to a PNG; returns its path.

    Arguments:
        records: dicts with ``"step"`` and metrics, e.g. ``history.records`` or the lines of a
            :class:`JSONLinesLogger` file. Records without ``"step"`` are skipped, as are missing
            and non-finite values.
        path: the PNG to write, atomically (parent directories are created).
        title: a title above the panels.

    Panels, top to bottom, each when it has data: losses (``*/loss``),
    accuracies (``*/top1``, ``*/top5``, ...) and ``lr``. Every metric is one
    line (colour by split: train, val, ...; line style by metric); series with
    few points, such as per-epoch validation, get markers. Drawn on a private
    matplotlib figure: no display is needed and pyplot's state is left alone.

    Returns:
        ``path`` as a string.

    Raises:
        InvalidArgumentError: ``records`` is not a list of dicts, or holds nothing to plot.
    """
    panels = _panels_of(records)
    fig = _draw(panels, title)
    target = os.fspath(path)
    with write_atomically(target, durable=False) as f:
        fig.savefig(f, format="png")
    return target


def _panels_of(records: Any) -> dict[str, dict[str, list[tuple[float, float]]]]:
    if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Iterable):
        raise InvalidArgumentError(
            f"phalanx.train.plot_curves(): records must be a list of dicts, got {type(records).__name__}. "
            "Pass e.g. history.records."
        )
    records = list(records)
    if not records:
        raise InvalidArgumentError(
            "phalanx.train.plot_curves(): records is empty, so there is nothing to plot. "
            "Pass the records of a run that logged metrics (e.g. history.records)."
        )
    panels = _series(records)
    if not panels:
        seen = sorted({str(k) for r in records for k in r if k != "step"})
        raise InvalidArgumentError(
            "phalanx.train.plot_curves(): no numeric metric to plot in the records (with a 'step') "
            f"among keys {seen[:12]}. It plots '*/loss', '*/top1'-style accuracies and 'lr'."
        )
    return panels


def _draw(panels: dict[str, dict[str, list[tuple[float, float]]]], title: str | None) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    top, bottom = (0.6 if title else 0.25), 0.55  # margins in inches: fixed, as tight_layout is slow
    height = 2.4 * len(panels) + top + bottom
    fig = Figure(figsize=(8.0, height), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    densest = max(len(p) for metrics in panels.values() for p in metrics.values())
    for ax, (panel, metrics) in zip(axes, panels.items(), strict=True):
        _draw_panel(ax, panel, metrics, densest)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=bottom / height, top=1 - top / height, hspace=0.12)
    return fig


def _draw_panel(ax: Any, panel: str, metrics: dict[str, list[tuple[float, float]]], densest: int) -> None:
    styles: dict[str, str] = {}
    for name, points in metrics.items():
        split, _, metric = name.rpartition("/")
        color = _SPLIT_COLORS.get(split, f"C{3 + len(styles) % 7}") if split else "C4"
        style = styles.setdefault(metric, _STYLES[len(styles) % len(_STYLES)])
        sparse = len(points) <= 30 or len(points) * 4 <= densest
        ax.plot([p[0] for p in points], [p[1] for p in points], linestyle=style, color=color,
                marker="o" if sparse else None, markersize=4, linewidth=1.4, label=name)
    values = [v for points in metrics.values() for _, v in points]
    if panel in ("loss", "lr") and min(values) > 0 and max(values) / min(values) > 100:
        ax.set_yscale("log")
    ax.set_ylabel({"loss": "loss", "accuracy": "accuracy", "lr": "learning rate"}[panel])
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
