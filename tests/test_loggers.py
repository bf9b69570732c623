"""Loggers and plot_curves: every logger's output is read back from the files it wrote.

JSON lines are parsed (append on resume, torn last line, non-finite values);
TensorBoard event files are read with tensorboard's EventAccumulator; the W&B
offline run's ``.wandb`` file is decoded record by record; MLflow metrics come
back through ``MlflowClient``. A 2-rank world checks that only rank 0 writes.
Missing optional packages are simulated with ``sys.modules[name] = None``.
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import struct
import sys
import time
from typing import Any

import numpy as np
import pytest

import phalanx
import phalanx.train as pt
import worlds_loggers as bodies
from conftest import AVAILABLE, world_params
from phalanx._errors import InvalidArgumentError, MissingDependencyError, PhalanxError, UsageError


def _strict_json(line: str) -> Any:
    def no_constants(name: str) -> Any:
        raise AssertionError(f"non-standard JSON constant {name} in {line!r}")

    return json.loads(line, parse_constant=no_constants)


def _read_jsonl(path: Any) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        return [_strict_json(line) for line in f if line.strip()]


# -- Logger base and argument checks -------------------------------------------------------------

def test_base_logger_is_a_no_op_context_manager() -> None:
    log = pt.Logger()
    with log as same:
        assert same is log
        log.log_hparams({"lr": 0.1})
        log.log_metrics({"train/loss": 1.0}, step=0)
    log.finish({"x": 1})
    log.finish()


def test_arguments_are_checked_with_helpful_messages() -> None:
    log = pt.ConsoleLogger(io.StringIO())
    bad = [(({"train/loss": "low"}, 1), "metric 'train/loss' is 'low'"),
           (({"a": 1.0}, -1), "step must be >= 0"),
           (({"a": 1.0}, 1.5), "step must be an int"),
           (({"a": 1.0}, True), "step must be an int"),
           (([("a", 1.0)], 1), "metrics must be a mapping"),
           (({3: 1.0}, 1), "metric names must be str")]
    for args, text in bad:
        with pytest.raises(InvalidArgumentError, match="ConsoleLogger.log_metrics") as info:
            log.log_metrics(*args)
        assert text in str(info.value)
    with pytest.raises(InvalidArgumentError, match="params must be a mapping"):
        log.log_hparams(["lr"])
    with pytest.raises(InvalidArgumentError, match="path must be a str"):
        pt.JSONLinesLogger(3.5)  # type: ignore[arg-type]


# -- console --------------------------------------------------------------------------------------

def test_console_logger_lines_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    stream = io.StringIO()
    with pt.ConsoleLogger(stream) as log:
        log.log_hparams({"lr": 0.1, "model": "resnet18"})
        log.log_metrics({"train/loss": 0.43123456, "val/top1": np.float32(0.91234), "lr": 0.05}, step=120)
        log.log_metrics({"epoch": 3, "samples_per_s": 12345.67, "train/loss": torch.tensor(float("nan")),
                         "lr": 1e-5}, step=121)
        log.finish({"best/val_top1": 0.9123, "epochs": 10})
    log.finish({"ignored": 1})  # idempotent: nothing more is printed
    assert stream.getvalue().splitlines() == [
        "hparams  lr 0.1  model resnet18",
        "step 120  train/loss 0.4312  val/top1 0.9123  lr 0.05",
        "step 121  epoch 3  samples_per_s 12346  train/loss nan  lr 1e-05",
        "summary",
        "  best/val_top1  0.9123",
        "  epochs         10",
    ]
    assert capsys.readouterr().out == ""

    assert not phalanx.initialized()
    with pt.ConsoleLogger() as log:  # no stream, phalanx not initialized: plain stdout
        log.log_metrics({"train/loss": 2.0}, step=0)
    assert capsys.readouterr().out == "step 0  train/loss 2\n"
    with pytest.raises(UsageError, match="after finish"):
        log.log_metrics({"train/loss": 2.0}, step=1)


# -- JSON lines -----------------------------------------------------------------------------------

def test_jsonlines_records_nonfinite_values_and_append_on_resume(tmp_path: Any) -> None:
    path = tmp_path / "runs" / "exp" / "metrics.jsonl"  # parent directories do not exist yet
    log = pt.JSONLinesLogger(path)
    log.log_hparams({"lr": 0.1, "shape": (3, 4), "decay": float("inf"), "opt": None})
    log.log_metrics({"train/loss": 0.5, "epoch": np.int64(0)}, step=1)
    log.log_metrics({"train/loss": float("nan"), "val/top1": float("-inf")}, step=np.int64(2))
    # flushed as written: readable while the logger is open
    assert [r.get("step") for r in _read_jsonl(path)] == [None, 1, 2]
    with pytest.raises(InvalidArgumentError, match="'time' is reserved"):
        log.log_metrics({"time": 3.0}, step=3)
    log.finish({"best/val_top1": 0.75, "note": "ok"})
    log.finish({"again": 1})

    first = _read_jsonl(path)
    assert first[0] == {"hparams": {"lr": 0.1, "shape": [3, 4], "decay": "inf", "opt": None}}
    assert first[1]["step"] == 1 and first[1]["train/loss"] == 0.5 and first[1]["epoch"] == 0
    assert isinstance(first[1]["time"], float) and abs(first[1]["time"] - first[2]["time"]) < 60
    assert first[2]["train/loss"] == "nan" and first[2]["val/top1"] == "-inf"
    assert math.isnan(float(first[2]["train/loss"]))
    assert first[3] == {"summary": {"best/val_top1": 0.75, "note": "ok"}}
    assert len(first) == 4

    # A resumed run appends to the same file: nothing written before is lost.
    with pt.JSONLinesLogger(str(path)) as log:
        log.log_metrics({"train/loss": 0.25}, step=3)
    both = _read_jsonl(path)
    assert both[:4] == first and [r["step"] for r in both[4:]] == [3]

    # A line cut short by a crash is ended first, so the next record stays parseable.
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 4, "caf\u00e9')  # torn; its last character is 2 bytes in UTF-8
    with pt.JSONLinesLogger(path) as log:
        log.log_metrics({"train/loss": 0.125}, step=5)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[-2] == '{"step": 4, "caf\u00e9'
    assert _strict_json(lines[-1])["train/loss"] == 0.125
    with pytest.raises(UsageError, match=r"JSONLinesLogger.log_hparams\(\) was called after finish"):
        log.log_hparams({"lr": 1})


# -- TensorBoard ----------------------------------------------------------------------------------

def test_tensorboard_scalars_hparams_and_summary(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tb"
    with pt.TensorBoardLogger(log_dir) as log:
        log.log_hparams({"lr": 0.1, "layers": [64, 64], "name": "mlp"})
        for step in (10, 20, 30):
            log.log_metrics({"train/loss": 1.0 / step, "lr": 0.1}, step=step)
        log.log_metrics({"val/top1": 0.5, "val/loss": float("nan")}, step=30)
        log.finish({"best/val_top1": 0.5, "note": "done"})

    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = events.Tags()
    assert {"train/loss", "lr", "val/top1", "val/loss", "summary/best/val_top1"} <= set(tags["scalars"])
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [10, 20, 30]
    assert np.allclose([e.value for e in loss], [0.1, 0.05, 1 / 30])
    assert [(e.step, e.value) for e in events.Scalars("val/top1")] == [(30, 0.5)]
    assert math.isnan(events.Scalars("val/loss")[0].value)
    text = events.Tensors("hparams/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| lr | 0.1 |" in text and "| layers | [64, 64] |" in text and "| name | mlp |" in text
    assert "_hparams_/experiment" in events.PluginTagToContent("hparams")
    assert "| note | done |" in events.Tensors("summary/text_summary")[0].tensor_proto.string_val[0].decode()


# -- Weights & Biases -----------------------------------------------------------------------------

def _wandb_records(path: str) -> list[Any]:
    """Decode a .wandb file: a 7-byte header, then LevelDB-log style chunks in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", (len(data), data[:7])
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += (block - pos % block) % block
            continue
        pending += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_holds_history_config_and_summary(tmp_path: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    for name, value in {"WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
                        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
                        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
                        "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "wb"
    with pt.WandbLogger("phalanx-test", name="unit", config={"lr": 0.1}, mode="offline",
                        dir=run_dir) as log:
        assert log.run is not None
        log.log_hparams({"batch_size": 64})
        log.log_metrics({"train/loss": 0.5, "lr": 0.1}, step=1)
        log.log_metrics({"train/loss": 0.25, "val/top1": float("nan")}, step=5)
        log.finish({"best/val_top1": 0.875})

    files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, sorted(map(str, run_dir.rglob("*")))
    # run.finish() can return before wandb's service process has written the file: wait for the exit record.
    deadline = time.monotonic() + 20
    while True:
        records = _wandb_records(files[0])
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert "run" in kinds and "exit" in kinds, kinds

    run = next(r.run for r in records if r.HasField("run"))
    assert run.project == "phalanx-test" and run.display_name == "unit"
    config = {u.key: json.loads(u.value_json) for r in records if r.HasField("config") for u in r.config.update}
    config.update({u.key: json.loads(u.value_json) for u in run.config.update})
    assert config["lr"] == 0.1 and config["batch_size"] == 64

    def item_key(item: Any) -> str:
        return item.key or "/".join(item.nested_key)

    history = [{item_key(i): i.value_json for i in r.history.item} for r in records if r.HasField("history")]
    user = [{k: v for k, v in h.items() if not k.startswith("_")} | {"_step": h["_step"]} for h in history]
    assert user[0] == {"train/loss": "0.5", "lr": "0.1", "_step": "1"}
    assert user[1]["train/loss"] == "0.25" and user[1]["_step"] == "5" and user[1]["val/top1"] == "NaN"

    summary = {item_key(u): json.loads(u.value_json) for r in records if r.HasField("summary")
               for u in r.summary.update}
    assert summary["best/val_top1"] == 0.875 and summary["train/loss"] == 0.25
    assert next(r.exit for r in records if r.HasField("exit")).exit_code == 0


# -- MLflow ---------------------------------------------------------------------------------------

def test_mlflow_metrics_params_summary_and_default_store(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # recorded so the logger's setting is undone
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.chdir(tmp_path)

    with pt.MLflowLogger("exp-a", run_name="first") as log:  # default store: ./mlruns as a file: URI
        assert log.tracking_uri == (tmp_path / "mlruns").as_uri()
        assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
        log.log_hparams({"lr": 0.1, "layers": [64, 64], "name": "mlp"})
        for step in (1, 2, 3):
            log.log_metrics({"train/loss": 1.0 / step, "lr": 0.1}, step=step)
        log.log_metrics({"val/top1": float("nan")}, step=3)
        log.finish({"best/val_top1": 0.9, "note": "done"})

    client = MlflowClient(tracking_uri=log.tracking_uri)
    history = client.get_metric_history(log.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert math.isnan(client.get_metric_history(log.run_id, "val/top1")[0].value)
    run = client.get_run(log.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    assert run.data.params == {"lr": "0.1", "layers": "[64, 64]", "name": "mlp"}
    assert run.data.metrics["summary/best/val_top1"] == 0.9 and run.data.tags["summary/note"] == "done"
    assert client.get_experiment(run.info.experiment_id).name == "exp-a"

    # A second run reuses the experiment; a `with` block ending in an exception marks it FAILED.
    with pytest.raises(RuntimeError, match="boom"), \
            pt.MLflowLogger("exp-a", tracking_uri=tmp_path / "mlruns") as second:
        second.log_metrics({"train/loss": 0.1}, step=7)
        raise RuntimeError("boom")
    failed = client.get_run(second.run_id)
    assert failed.info.status == "FAILED" and failed.info.experiment_id == run.info.experiment_id
    assert [(m.step, m.value) for m in client.get_metric_history(second.run_id, "train/loss")] == [(7, 0.1)]


# -- missing packages and other ranks -------------------------------------------------------------

def test_missing_optional_packages_raise_missing_dependency_error(tmp_path: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("wandb", "mlflow", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)
    cases = [(lambda: pt.WandbLogger(mode="offline", dir=tmp_path / "wb"), "wandb"),
             (lambda: pt.MLflowLogger(tracking_uri=tmp_path / "ml"), "mlflow-skinny"),
             (lambda: pt.TensorBoardLogger(tmp_path / "tb"), "tensorboard")]
    for make, package in cases:
        with pytest.raises(MissingDependencyError) as info:
            make()
        assert isinstance(info.value, ImportError) and isinstance(info.value, PhalanxError)
        assert f"pip install {package}" in str(info.value) and "phalanx[loggers]" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == []


def test_loggers_on_a_nonzero_rank_do_nothing(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend to be rank 1 of an initialized world; optional packages are blocked, so any import fails.
    monkeypatch.setattr(phalanx, "initialized", lambda: True)
    monkeypatch.setattr(phalanx, "rank", lambda: 1)
    for module in ("wandb", "mlflow", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)
    stream = io.StringIO()
    loggers = [pt.ConsoleLogger(stream), pt.JSONLinesLogger(tmp_path / "m" / "a.jsonl"),
               pt.TensorBoardLogger(tmp_path / "tb"), pt.WandbLogger(dir=tmp_path / "wb"),
               pt.MLflowLogger(tracking_uri=tmp_path / "ml")]
    for log in loggers:
        assert not log.enabled
        with log:
            log.log_hparams({"lr": 0.1})
            log.log_metrics({"train/loss": 0.5}, step=1)
            log.log_metrics({"bad": "not checked off rank 0"}, step=-1)
            log.finish({"best": 1.0})
        log.log_metrics({"train/loss": 0.5}, step=2)
    assert stream.getvalue() == "" and sorted(os.listdir(tmp_path)) == []
    # all_ranks=True logs here too
    with pt.JSONLinesLogger(tmp_path / "own.jsonl", all_ranks=True) as own:
        own.log_metrics({"train/loss": 0.5}, step=1)
    assert [r["step"] for r in _read_jsonl(tmp_path / "own.jsonl")] == [1]


_WORLD_BACKEND = "mpi" if "mpi" in AVAILABLE else "gloo"


@pytest.mark.parametrize("behaviour", bodies.LOGGERS.names)
@pytest.mark.parametrize("backend,n", world_params([(_WORLD_BACKEND, 2)]))
def test_a_world_of_two_writes_rank_zero_lines_only(worlds, tmp_path_factory, backend: str, n: int,
                                                    behaviour: str) -> None:
    if "directory" not in _SHARED:
        _SHARED["directory"] = str(tmp_path_factory.mktemp("loggers"))
    worlds.check(bodies.rank_zero_only, backend, n, behaviour, timeout=120, op_timeout=60,
                 args=(_SHARED["directory"],))


_SHARED: dict[str, str] = {}


# -- plot_curves ----------------------------------------------------------------------------------

def _records(val: bool) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [
        {"step": s, "epoch": s // 100, "train/loss": 2 * math.exp(-s / 300), "train/top1": 1 - math.exp(-s / 300),
         "samples_per_s": 1000.0} for s in range(0, 1000, 10)]
    if val:
        for record in records:
            record["lr"] = 0.1 * (1 - record["step"] / 1000)
        records += [{"step": s, "val/loss": 2.2 * math.exp(-s / 300), "val/top1": 0.9 - math.exp(-s / 300),
                     "val/top5": 1 - 0.5 * math.exp(-s / 300)} for s in range(100, 1001, 100)]
        records += [{"hparams": {"lr": 0.1}}, {"step": 1000, "val/loss": "nan"}, {"summary": {"best": 1}}]
    return records


def _colors(path: str) -> tuple[tuple[int, int], set[tuple[int, int, int]]]:
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        rgb = image.convert("RGB")
        return rgb.size, {c for _, c in rgb.getcolors(maxcolors=1 << 20)}


def test_plot_curves_writes_pngs(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("PIL")
    blue, orange = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's C0 (train) and C1 (val)

    path = tmp_path / "plots" / "train.png"
    assert pt.plot_curves(_records(val=False), path) == str(path)
    size, colors = _colors(str(path))
    assert size[0] == 800 and 500 < size[1] < 600  # two panels: loss, accuracy
    assert blue in colors and orange not in colors

    path = tmp_path / "plots" / "curves.png"
    path.write_bytes(b"old")  # replaced atomically
    assert pt.plot_curves(_records(val=True), str(path), title="a run") == str(path)
    size, colors = _colors(str(path))
    assert size[0] == 800 and 800 < size[1] < 900  # three panels: loss, accuracy, lr
    assert blue in colors and orange in colors
    assert sorted(os.listdir(tmp_path / "plots")) == ["curves.png", "train.png"]  # no temporary file left

    lr_only = pt.plot_curves([{"step": 0, "lr": 0.1}, {"step": 5, "lr": 0.05}], tmp_path / "lr.png")
    assert _colors(lr_only)[0][1] < 400  # one panel


def test_plot_curves_rejects_nothing_to_plot(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    with pytest.raises(InvalidArgumentError, match="records is empty"):
        pt.plot_curves([], tmp_path / "x.png")
    with pytest.raises(InvalidArgumentError, match="no numeric metric to plot"):
        pt.plot_curves([{"step": 1, "epoch": 0, "train/loss": "low"}, {"hparams": {}}], tmp_path / "x.png")
    with pytest.raises(InvalidArgumentError, match=r"records\[1\] is str"):
        pt.plot_curves([{"step": 1, "train/loss": 1.0}, "oops"], tmp_path / "x.png")
    with pytest.raises(InvalidArgumentError, match="steps must be numbers"):
        pt.plot_curves([{"step": "one", "train/loss": 1.0}], tmp_path / "x.png")
    with pytest.raises(InvalidArgumentError, match="list of dicts"):
        pt.plot_curves({"step": 1, "train/loss": 1.0}, tmp_path / "x.png")
    assert not os.path.exists(tmp_path / "x.png")
