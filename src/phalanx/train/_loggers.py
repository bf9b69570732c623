"""Loggers for training metrics: the :class:`Logger` protocol, console and JSON lines.

::

    import phalanx, phalanx.train as pt
    phalanx.init()
    with pt.JSONLinesLogger("runs/exp1/metrics.jsonl") as log:      # does nothing on ranks != 0
        log.log_hparams({"lr": 0.1, "batch_size": 64})
        log.log_metrics({"train/loss": 0.43, "lr": 0.1}, step=120)
        log.finish({"best/val_top1": 0.91})                          # also called by __exit__

Metrics are flat ``{name: number}`` dicts (``"train/loss"``, ``"val/top1"``,
``"lr"``, ``"epoch"``, ``"samples_per_s"``, ...) and ``step`` is the global
optimizer step. Every logger here acts on rank 0 only (checked at each call,
so constructing one on every rank is safe: other ranks create no file and
import no optional package); pass ``all_ranks=True`` to log on every rank.
The TensorBoard, W&B and MLflow loggers are in :mod:`phalanx.train._integrations`.
Write your own by subclassing :class:`Logger` and overriding its three methods.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import phalanx

from .._errors import InvalidArgumentError, UsageError

__all__ = ["ConsoleLogger", "JSONLinesLogger", "Logger", "RankZeroLogger", "check_mapping", "fmt", "jsonable"]


class Logger:
    """A sink for hyperparameters, metrics and a final summary; the base methods do nothing.

    Subclass it to send metrics elsewhere::

        class PrintLogger(phalanx.train.Logger):
            def log_metrics(self, metrics, step):
                print(step, dict(metrics))

    A logger is a context manager: leaving the ``with`` block calls :meth:`finish`.
    """

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters (any JSON-like values)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` (``{name: number}``) at optimizer step ``step``."""

    def finish(self, summary: Mapping[str, Any] | None = None) -> None:
        """Record an optional final ``summary`` and release the sink. Calling it again does nothing."""

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish()


# -- argument checks ---------------------------------------------------------------------------

def _number(call: str, name: str, value: Any) -> int | float:
    """``value`` as a Python int or float (NumPy scalars and 0-d tensors via ``.item()``)."""
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise InvalidArgumentError(
        f"{call}: metric {name!r} is {value!r} ({type(value).__name__}); metric values must be numbers. "
        f"Pass e.g. `float(loss)` or `loss.item()`, and put other values in log_hparams or the summary."
    )


def _check_metrics(call: str, metrics: Any) -> dict[str, int | float]:
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentError(
            f"{call}: metrics must be a mapping {{name: number}}, got {type(metrics).__name__}. "
            "Pass e.g. `{'train/loss': 0.43, 'lr': 0.1}`."
        )
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise InvalidArgumentError(f"{call}: metric names must be str, got {key!r}. Use e.g. 'train/loss'.")
        out[key] = _number(call, key, value)
    return out


def _check_step(call: str, step: Any) -> int:
    try:
        value = None if isinstance(step, bool) else operator.index(step)
    except TypeError:
        value = None
    if value is None:
        raise InvalidArgumentError(
            f"{call}: step must be an int (the global optimizer step), got {step!r} ({type(step).__name__}).")
    if value < 0:
        raise InvalidArgumentError(f"{call}: step must be >= 0, got {value}.")
    return value


def check_mapping(call: str, what: str, params: Any) -> dict[str, Any]:
    if not isinstance(params, Mapping):
        raise InvalidArgumentError(
            f"{call}: {what} must be a mapping {{name: value}}, got {type(params).__name__}. "
            "Pass e.g. `{'lr': 0.1, 'batch_size': 64}`."
        )
    for key in params:
        if not isinstance(key, str):
            raise InvalidArgumentError(f"{call}: {what} names must be str, got {key!r}.")
    return dict(params)


def fmt(value: Any) -> str:
    """A number with 4 significant digits (large magnitudes as integers); other values as str."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    if 1e4 <= abs(value) < 1e15:
        return f"{value:.0f}"
    return f"{value:.4g}"


def jsonable(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become "nan"/"inf"/"-inf", unknown objects their str."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return jsonable(value.item())
    if hasattr(value, "tolist"):
        try:
            return jsonable(value.tolist())
        except (TypeError, ValueError):
            pass
    return str(value)


# -- the rank-0 machinery ----------------------------------------------------------------------

class RankZeroLogger(Logger):
    """Shared behaviour: rank-0 gating, argument checks, lazy start, idempotent finish.

    Subclasses implement ``_start``, ``_hparams``, ``_metrics`` and ``_close``.
    """

    def __init__(self, *, all_ranks: bool = False) -> None:
        self.all_ranks = bool(all_ranks)
        self._started = False
        self._finished = False
        self._failed = False
        self.last_step: int | None = None
        if self.enabled:
            self._begin()

    @property
    def enabled(self) -> bool:
        """Whether this process logs: rank 0 (or not initialized), or every rank with ``all_ranks=True``."""
        return self.all_ranks or not (phalanx.initialized() and phalanx.rank() != 0)

    def _call(self, method: str) -> str:
        return f"phalanx.train.{type(self).__name__}.{method}()"

    def _begin(self) -> None:
        self._start()
        self._started = True

    def _open(self, method: str) -> bool:
        """False on a rank that does not log; UsageError after finish()."""
        if not self.enabled:
            return False
        if self._finished:
            raise UsageError(
                f"{self._call(method)} was called after finish(): this logger is closed. "
                f"Create a new {type(self).__name__} to log more."
            )
        return True

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters (on rank 0 unless ``all_ranks``)."""
        if self._open("log_hparams"):
            checked = check_mapping(self._call("log_hparams"), "params", params)
            if not self._started:
                self._begin()
            self._hparams(checked)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` at optimizer step ``step`` (on rank 0 unless ``all_ranks``)."""
        if self._open("log_metrics"):
            call = self._call("log_metrics")
            step = _check_step(call, step)
            checked = _check_metrics(call, metrics)
            if not self._started:
                self._begin()
            self._metrics(checked, step)
            self.last_step = step

    def finish(self, summary: Mapping[str, Any] | None = None) -> None:
        """Record ``summary`` (if given) and close; later calls do nothing."""
        if self._finished or not self.enabled:
            return
        checked = None if summary is None else check_mapping(self._call("finish"), "summary", summary)
        if not self._started:
            self._begin()
        self._finished = True
        self._close(checked)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._failed = exc_type is not None
        self.finish()

    # hooks
    def _start(self) -> None:
        pass

    def _hparams(self, params: dict[str, Any]) -> None:
        pass

    def _metrics(self, metrics: dict[str, int | float], step: int) -> None:
        pass

    def _close(self, summary: dict[str, Any] | None) -> None:
        pass


# -- console -----------------------------------------------------------------------------------

class ConsoleLogger(RankZeroLogger):
    """One line per call, e.g. ``step 120  train/loss 0.4312  val/top1 0.9123  lr 0.05``.

    Numbers get 4 significant digits (magnitudes of 10,000 and more print as
    integers). Without ``stream`` a line goes through :func:`phalanx.print`
    (``[rank/size]`` prefix) when phalanx is initialized, else to stdout;
    with ``stream`` it is written there as is. ``finish(summary)`` prints a
    short block with one summary entry per line.

    Arguments:
        stream: a text stream to write to (e.g. ``sys.stderr`` or an open file),
            or None for :func:`phalanx.print`/stdout as above.
        all_ranks: False: only rank 0 logs (other ranks' calls do nothing); True:
            every rank logs.

    Raises InvalidArgumentError (a metric that is not a number, a bad step) and
    UsageError (logging after ``finish``) from its methods.
    """

    def __init__(self, stream: TextIO | None = None, *, all_ranks: bool = False) -> None:
        self.stream = stream
        super().__init__(all_ranks=all_ranks)

    def _write(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(text + "\n")
            self.stream.flush()
        elif phalanx.initialized():
            phalanx.print(text)
        else:
            print(text, file=sys.stdout, flush=True)

    def _hparams(self, params: dict[str, Any]) -> None:
        self._write("hparams  " + "  ".join(f"{k} {fmt(v)}" for k, v in params.items()))

    def _metrics(self, metrics: dict[str, int | float], step: int) -> None:
        self._write("  ".join([f"step {step}", *(f"{k} {fmt(v)}" for k, v in metrics.items())]))

    def _close(self, summary: dict[str, Any] | None) -> None:
        if not summary:
            return
        width = max(len(k) for k in summary)
        self._write("\n".join(["summary", *(f"  {k.ljust(width)}  {fmt(v)}" for k, v in summary.items())]))


# -- JSON lines --------------------------------------------------------------------------------

class JSONLinesLogger(RankZeroLogger):
    """One JSON object per line: ``{"step": 120, "time": <unix seconds>, "train/loss": 0.43, ...}``.

    ``log_hparams`` writes ``{"hparams": {...}}`` and ``finish(summary)``
    writes ``{"summary": {...}}``. The file is opened in append mode, so a
    resumed run continues the same file (a line cut short by a crash is ended
    first, so it cannot swallow the next one); parent directories are created.
    Each line is flushed as written, and ``finish`` fsyncs the file.

    Non-finite numbers are written as the JSON strings ``"nan"``, ``"inf"`` and
    ``"-inf"``, so every line is standard JSON; read them back with
    ``float(value)``. Values that JSON cannot hold (in hparams or the
    summary) are written as their ``str``. ``"step"`` and ``"time"`` are not
    allowed as metric names.

    Arguments:
        path: the file to append to (str or os.PathLike), e.g. ``"runs/exp1/metrics.jsonl"``.
        all_ranks: False: only rank 0 writes (other ranks' calls do nothing); True:
            every rank writes (give each rank its own ``path``).

    Raises InvalidArgumentError (``path`` not a path, a metric that is not a number
    or is named ``"step"``/``"time"``), UsageError (logging after ``finish``), and
    OSError when the file cannot be written.
    """

    def __init__(self, path: str | os.PathLike[str], *, all_ranks: bool = False) -> None:
        try:
            self.path = Path(os.fspath(path))
        except TypeError:
            raise InvalidArgumentError(
                f"phalanx.train.JSONLinesLogger(path={path!r}): path must be a str or os.PathLike, "
                "e.g. 'runs/exp1/metrics.jsonl'."
            ) from None
        self._file: TextIO | None = None
        super().__init__(all_ranks=all_ranks)

    def _start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torn = False
        if self.path.is_file() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish()
        if torn:
            self._file.write("\n")

    def _write(self, record: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(record, allow_nan=False, ensure_ascii=False) + "\n")
        self._file.flush()

    def _hparams(self, params: dict[str, Any]) -> None:
        self._write({"hparams": jsonable(params)})

    def _metrics(self, metrics: dict[str, int | float], step: int) -> None:
        for reserved in ("step", "time"):
            if reserved in metrics:
                raise InvalidArgumentError(
                    f"{self._call('log_metrics')}: {reserved!r} is reserved in JSON lines records "
                    f"(every line has it); rename the metric, e.g. 'train/{reserved}'."
                )
        self._write({"step": step, "time": time.time(), **jsonable(metrics)})

    def _close(self, summary: dict[str, Any] | None) -> None:
        file, self._file = self._file, None
        if file is None:
            return
        try:
            if summary is not None:
                file.write(json.dumps({"summary": jsonable(summary)}, allow_nan=False,
                                      ensure_ascii=False) + "\n")
            file.flush()
            os.fsync(file.fileno())
        finally:
            file.close()
