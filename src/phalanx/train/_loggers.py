"""Loggers for training metrics: console, JSON lines, TensorBoard, Weights & Biases, MLflow.

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
:class:`TensorBoardLogger`, :class:`WandbLogger` and :class:`MLflowLogger`
import their package in the constructor and raise
:class:`~phalanx._errors.MissingDependencyError` when it is not installed
(``pip install 'phalanx[loggers]'``). Write your own by subclassing
:class:`Logger` and overriding its three methods.
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

from .._errors import InvalidArgumentError, MissingDependencyError, UsageError

__all__ = ["ConsoleLogger", "JSONLinesLogger", "Logger", "MLflowLogger", "TensorBoardLogger", "WandbLogger"]


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
        if isinstance(step, bool):
            raise TypeError
        value = operator.index(step)
    except TypeError:
        raise InvalidArgumentError(
            f"{call}: step must be an int (the global optimizer step), got {step!r} ({type(step).__name__})."
        ) from None
    if value < 0:
        raise InvalidArgumentError(f"{call}: step must be >= 0, got {value}.")
    return value


def _check_mapping(call: str, what: str, params: Any) -> dict[str, Any]:
    if not isinstance(params, Mapping):
        raise InvalidArgumentError(
            f"{call}: {what} must be a mapping {{name: value}}, got {type(params).__name__}. "
            "Pass e.g. `{'lr': 0.1, 'batch_size': 64}`."
        )
    for key in params:
        if not isinstance(key, str):
            raise InvalidArgumentError(f"{call}: {what} names must be str, got {key!r}.")
    return dict(params)


def _fmt(value: Any) -> str:
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


def _jsonable(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become "nan"/"inf"/"-inf", unknown objects their str."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return _jsonable(value.item())
    if hasattr(value, "tolist"):
        try:
            return _jsonable(value.tolist())
        except (TypeError, ValueError):
            pass
    return str(value)


def _require(module: str, package: str, who: str) -> Any:
    """Import ``module`` or raise :class:`MissingDependencyError` naming the pip package."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"phalanx.train.{who} needs the `{package}` package, which could not be imported ({exc}). "
            f"Install it with `pip install {package}` or `pip install 'phalanx[loggers]'`, "
            "or use a logger without dependencies (ConsoleLogger, JSONLinesLogger)."
        ) from exc


# -- the rank-0 machinery ----------------------------------------------------------------------

class _RankZeroLogger(Logger):
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
            checked = _check_mapping(self._call("log_hparams"), "params", params)
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
        checked = None if summary is None else _check_mapping(self._call("finish"), "summary", summary)
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

class ConsoleLogger(_RankZeroLogger):
    """One line per call, e.g. ``step 120  train/loss 0.4312  val/top1 0.9123  lr 0.05``.

    Numbers get 4 significant digits (magnitudes of 10,000 and more print as
    integers). Without ``stream`` a line goes through :func:`phalanx.print`
    (``[rank/size]`` prefix) when phalanx is initialized, else to stdout;
    with ``stream`` it is written there as is. ``finish(summary)`` prints a
    short block with one summary entry per line.
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
        self._write("hparams  " + "  ".join(f"{k} {_fmt(v)}" for k, v in params.items()))

    def _metrics(self, metrics: dict[str, int | float], step: int) -> None:
        self._write("  ".join([f"step {step}", *(f"{k} {_fmt(v)}" for k, v in metrics.items())]))

    def _close(self, summary: dict[str, Any] | None) -> None:
        if not summary:
            return
        width = max(len(k) for k in summary)
        self._write("\n".join(["summary", *(f"  {k.ljust(width)}  {_fmt(v)}" for k, v in summary.items())]))


# -- JSON lines --------------------------------------------------------------------------------

class JSONLinesLogger(_RankZeroLogger):
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
        self._write({"hparams": _jsonable(params)})

    def _metrics(self, metrics: dict[str, int | float], step: int) -> None:
        for reserved in ("step", "time"):
            if reserved in metrics:
                raise InvalidArgumentError(
                    f"{self._call('log_metrics')}: {reserved!r} is reserved in JSON lines records "
                    f"(every line has it); rename the metric, e.g. 'train/{reserved}'."
                )
        self._write({"step": step, "time": time.time(), **_jsonable(metrics)})

    def _close(self, summary: dict[str, Any] | None) -> None:
        file, self._file = self._file, None
        if file is None:
            return
        try:
            if summary is not None:
                file.write(json.dumps({"summary": _jsonable(summary)}, allow_nan=False,
                                      ensure_ascii=False) + "\n")
            file.flush()
            os.fsync(file.fileno())
        finally:
            file.close()


# -- TensorBoard -------------------------------------------------------------------------------

def _tb_value(value: Any) -> bool | int | float | str:
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return json.dumps(_jsonable(value)) if value is not None else "None"


def _markdown_table(values: Mapping[str, Any]) -> str:
    def cell(v: Any) -> str:
        return v if isinstance(v, str) else _fmt(v) if isinstance(v, numbers.Real) else json.dumps(_jsonable(v))

    rows = [f"| {k} | {cell(v)} |" for k, v in values.items()]
    return "\n".join(["| name | value |", "|---|---|", *rows])


class TensorBoardLogger(_RankZeroLogger):
    """Scalars in a TensorBoard event file under ``log_dir`` (``torch.utils.tensorboard``).

    Each metric is an ``add_scalar(name, value, step)``. Hyperparameters go to
    the HParams dashboard of the same run and, as a table, to the text tab
    (tag ``"hparams"``). ``finish(summary)`` adds numeric summary entries as
    scalars ``"summary/<name>"`` at the last logged step and the whole summary
    as text (tag ``"summary"``), then flushes and closes the writer.
    Needs ``tensorboard`` (``pip install tensorboard``).
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, all_ranks: bool = False) -> None:
        self.log_dir = os.fspath(log_dir)
        self.writer: Any = None
        super().__init__(all_ranks=all_ranks)

    def _start(self) -> None:
        module = _require("torch.utils.tensorboard", "tensorboard", "TensorBoardLogger")
        self.writer = module.SummaryWriter(log_dir=self.log_dir)

    def _hparams(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams({k: _tb_value(v) for k, v in params.items()}, {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("hparams", _markdown_table(params), global_step=self.last_step or 0)

    def _metrics(self, metrics: dict[str, int | float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def _close(self, summary: dict[str, Any] | None) -> None:
        try:
            if summary:
                step = self.last_step or 0
                for name, value in summary.items():
                    if isinstance(value, numbers.Real) and not isinstance(value, bool):
                        self.writer.add_scalar(f"summary/{name}", float(value), global_step=step)
                self.writer.add_text("summary", _markdown_table(summary), global_step=step)
            self.writer.flush()
        finally:
            self.writer.close()


# -- Weights & Biases --------------------------------------------------------------------------

class WandbLogger(_RankZeroLogger):
    """A Weights & Biases run: ``wandb.init`` in the constructor (rank 0 only), ``run.log`` per call.

    ``mode=None`` leaves the choice to wandb (``WANDB_MODE``, else online);
    ``mode="offline"`` writes the run under ``dir`` for a later ``wandb sync``.
    ``config`` and :meth:`log_hparams` go to ``run.config``, ``finish(summary)``
    to ``run.summary``; the run is finished with exit code 1 when a ``with``
    block ends in an exception. Extra keyword arguments go to ``wandb.init``.
    ``run`` is the wandb run (None on ranks that do not log). wandb writes
    through a service process: an offline run's ``.wandb`` file may still be
    growing for a moment after ``finish`` returns.
    Needs ``wandb`` (``pip install wandb``).
    """

    def __init__(self, project: str = "phalanx", *, name: str | None = None,
                 config: Mapping[str, Any] | None = None, mode: str | None = None,
                 dir: str | os.PathLike[str] | None = None, all_ranks: bool = False,  # noqa: A002
                 **init_kwargs: Any) -> None:
        if config is not None:
            config = _check_mapping("phalanx.train.WandbLogger()", "config", config)
        self.project = project
        self.name = name
        self.config = config
        self.mode = mode
        self.dir = None if dir is None else os.fspath(dir)
        self.init_kwargs = init_kwargs
        self.run: Any = None
        super().__init__(all_ranks=all_ranks)

    def _start(self) -> None:
        wandb = _require("wandb", "wandb", "WandbLogger")
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        self.run = wandb.init(project=self.project, name=self.name, config=self.config, mode=self.mode,
                              dir=self.dir, **self.init_kwargs)

    def _hparams(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def _metrics(self, metrics: dict[str, int | float], step: int) -> None:
        self.run.log(metrics, step=step)

    def _close(self, summary: dict[str, Any] | None) -> None:
        try:
            for name, value in (summary or {}).items():
                self.run.summary[name] = value
        finally:
            self.run.finish(exit_code=1 if self._failed else 0)


# -- MLflow ------------------------------------------------------------------------------------

def _tracking_uri(uri: str | os.PathLike[str] | None) -> str:
    """The tracking URI to use: ``uri``, else ``MLFLOW_TRACKING_URI``, else ``./mlruns`` as file: URI."""
    if uri is None:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or "mlruns"
    text = os.fspath(uri)
    if "://" in text or text.startswith("file:"):
        return text
    return Path(text).resolve().as_uri()  # a plain path: a local file store


class MLflowLogger(_RankZeroLogger):
    """An MLflow run: ``log_params`` for hyperparameters, ``log_metric(step=)`` per metric.

    ``tracking_uri``: where runs are stored. By default ``MLFLOW_TRACKING_URI``
    when set, else the local directory ``./mlruns`` (a ``file:`` URI; a plain
    path is turned into one). MLflow 3 keeps its file store behind the opt-in
    ``MLFLOW_ALLOW_FILE_STORE=true``; for a ``file:`` URI this logger sets that
    variable when it is unset. With the full ``mlflow`` package installed a
    database store such as ``"sqlite:///mlflow.db"`` works too, as does a
    tracking server (``"http://host:5000"``).

    The run is created in ``experiment`` (made if missing) through an
    :class:`mlflow.tracking.MlflowClient`, so it does not touch the active run
    of mlflow's fluent API. ``run_id`` and ``tracking_uri`` identify it;
    ``finish(summary)`` logs numeric entries as metrics ``"summary/<name>"``
    and the rest as tags, then ends the run (status FAILED when a ``with``
    block ends in an exception). Needs ``mlflow-skinny`` or ``mlflow``.
    """

    def __init__(self, experiment: str = "phalanx", *, tracking_uri: str | os.PathLike[str] | None = None,
                 run_name: str | None = None, all_ranks: bool = False) -> None:
        self.experiment = experiment
        self.run_name = run_name
        self._uri_arg = tracking_uri
        self.tracking_uri: str | None = None
        self.run_id: str | None = None
        self.client: Any = None
        super().__init__(all_ranks=all_ranks)

    def _start(self) -> None:
        _require("mlflow", "mlflow-skinny", "MLflowLogger")
        from mlflow.tracking import MlflowClient

        self.tracking_uri = _tracking_uri(self._uri_arg)
        if self.tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracking_uri=self.tracking_uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(self.experiment)
        self.run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
        self.client = client

    def _hparams(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        values = [Param(k, v if isinstance(v, str) else json.dumps(_jsonable(v))) for k, v in params.items()]
        for i in range(0, len(values), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(self.run_id, params=values[i:i + 100])

    def _metrics(self, metrics: dict[str, int | float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(values), 1000):
            self.client.log_batch(self.run_id, metrics=values[i:i + 1000])

    def _close(self, summary: dict[str, Any] | None) -> None:
        try:
            if summary:
                from mlflow.entities import Metric, RunTag

                now, step = int(time.time() * 1000), self.last_step or 0
                metrics = [Metric(f"summary/{k}", float(v), now, step) for k, v in summary.items()
                           if isinstance(v, numbers.Real) and not isinstance(v, bool)]
                tags = [RunTag(f"summary/{k}", v if isinstance(v, str) else json.dumps(_jsonable(v)))
                        for k, v in summary.items()
                        if not (isinstance(v, numbers.Real) and not isinstance(v, bool))]
                self.client.log_batch(self.run_id, metrics=metrics, tags=tags)
        finally:
            self.client.set_terminated(self.run_id, status="FAILED" if self._failed else "FINISHED")
