"""Loggers for tracking services: TensorBoard, Weights & Biases, MLflow.

Each acts on rank 0 only (unless ``all_ranks=True``) and imports its package
when it starts, on the ranks that log: a missing package raises
:class:`~phalanx.MissingDependencyError` naming what to install
(``pip install 'phalanx[loggers]'``); ranks that do not log import nothing.
"""

from __future__ import annotations

import json
import numbers
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._errors import MissingDependencyError
from ._loggers import RankZeroLogger, check_mapping, fmt, jsonable

__all__ = ["MLflowLogger", "TensorBoardLogger", "WandbLogger"]


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


# -- TensorBoard -------------------------------------------------------------------------------

def _tb_value(value: Any) -> bool | int | float | str:
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return json.dumps(jsonable(value)) if value is not None else "None"


def _markdown_table(values: Mapping[str, Any]) -> str:
    def cell(v: Any) -> str:
        return v if isinstance(v, str) else fmt(v) if isinstance(v, numbers.Real) else json.dumps(jsonable(v))

    rows = [f"| {k} | {cell(v)} |" for k, v in values.items()]
    return "\n".join(["| name | value |", "|---|---|", *rows])


class TensorBoardLogger(RankZeroLogger):
    """Scalars in a TensorBoard event file under ``log_dir`` (``torch.utils.tensorboard``).

    Each metric is an ``add_scalar(name, value, step)``. Hyperparameters go to
    the HParams dashboard of the same run and, as a table, to the text tab
    (tag ``"hparams"``). ``finish(summary)`` adds numeric summary entries as
    scalars ``"summary/<name>"`` at the last logged step and the whole summary
    as text (tag ``"summary"``), then flushes and closes the writer.

    Arguments:
        log_dir: the run's directory (str or os.PathLike), e.g. ``"runs/exp1"``.
        all_ranks: False: only rank 0 writes (other ranks' calls do nothing); True:
            every rank writes (give each rank its own ``log_dir``).

    Raises MissingDependencyError without ``tensorboard`` (``pip install
    tensorboard``), InvalidArgumentError (a metric that is not a number) and
    UsageError (logging after ``finish``).
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

class WandbLogger(RankZeroLogger):
    """A Weights & Biases run: ``wandb.init`` in the constructor (rank 0 only), ``run.log`` per call.

    ``mode=None`` leaves the choice to wandb (``WANDB_MODE``, else online);
    ``mode="offline"`` writes the run under ``dir`` for a later ``wandb sync``.
    ``config`` and :meth:`log_hparams` go to ``run.config``, ``finish(summary)``
    to ``run.summary``; the run is finished with exit code 1 when a ``with``
    block ends in an exception. Extra keyword arguments go to ``wandb.init``.
    ``run`` is the wandb run (None on ranks that do not log). wandb writes
    through a service process: an offline run's ``.wandb`` file may still be
    growing for a moment after ``finish`` returns.

    The run:
        project: the W&B project the run goes to.
        name: the run's display name (None: wandb picks one).
        config: a mapping of hyperparameters stored as ``run.config``.
    Where it goes:
        mode: None (wandb decides), ``"online"``, ``"offline"`` or ``"disabled"``.
        dir: the local directory wandb writes under (None: wandb's default).
        all_ranks: False: only rank 0 makes a run (other ranks' calls do nothing);
            True: every rank makes its own run.
        init_kwargs: any further keyword arguments, passed to ``wandb.init`` as is.

    Raises MissingDependencyError without ``wandb`` (``pip install wandb``),
    InvalidArgumentError (``config`` not a mapping, a metric that is not a number)
    and UsageError (logging after ``finish``).
    """

    def __init__(self, project: str = "phalanx", *, name: str | None = None,
                 config: Mapping[str, Any] | None = None, mode: str | None = None,
                 dir: str | os.PathLike[str] | None = None, all_ranks: bool = False,  # noqa: A002
                 **init_kwargs: Any) -> None:
        if config is not None:
            config = check_mapping("phalanx.train.WandbLogger()", "config", config)
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


class MLflowLogger(RankZeroLogger):
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
    block ends in an exception).

    Arguments:
        experiment: the experiment's name (made if missing).
        tracking_uri: where runs are stored, as above.
        run_name: the run's display name (None: MLflow picks one).
        all_ranks: False: only rank 0 makes a run (other ranks' calls do nothing);
            True: every rank makes its own run.

    Raises MissingDependencyError without ``mlflow-skinny`` or ``mlflow``,
    InvalidArgumentError (a metric that is not a number) and UsageError (logging
    after ``finish``).
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

        values = [Param(k, v if isinstance(v, str) else json.dumps(jsonable(v))) for k, v in params.items()]
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
                tags = [RunTag(f"summary/{k}", v if isinstance(v, str) else json.dumps(jsonable(v)))
                        for k, v in summary.items()
                        if not (isinstance(v, numbers.Real) and not isinstance(v, bool))]
                self.client.log_batch(self.run_id, metrics=metrics, tags=tags)
        finally:
            self.client.set_terminated(self.run_id, status="FAILED" if self._failed else "FINISHED")
