"""The ImageNet example as a new user runs it: train, stop with Ctrl-C, resume, open the curves.

``examples/imagenet_resnet.py`` trains a ResNet with ``phalanx.train.fit`` on
a generated tiny ImageNet tree (real JPEG files) named in a dataset registry.
These tests run it through ``phalanx run`` exactly as the README says, on 2
processes (mpi and gloo), stop it with SIGINT to the launcher (what Ctrl-C
sends), resume it with the same command, and run the replicas variant.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import AVAILABLE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "imagenet_resnet.py")


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("imagenet")
    path = tmp / "datasets.toml"
    path.write_text('[datasets.tiny-imagenet]\nformat = "imagenet"\npath = "tiny-imagenet"\n')
    return str(path)


def _phalanx(*args: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", *args]


def _metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("backend", [
    pytest.param(b, marks=pytest.mark.skipif(b not in AVAILABLE, reason=f"backend {b!r} is not available"))
    for b in ("mpi", "gloo")])
def test_example_trains_on_two_processes(registry: str, tmp_path, backend: str) -> None:
    out = str(tmp_path / "run")
    # --timeout 60: a rank that stalls is named by the others' CollectiveTimeoutError well within the 300 s
    proc = subprocess.run(_phalanx("run", "-n", "2", "--backend", backend, "--timeout", "60", EXAMPLE,
                                   "--registry", registry, "--out", out, "--epochs", "2", "--workers", "2"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "val top-1" in proc.stdout and proc.stdout.count("val top-1") == 1, proc.stdout  # rank 0 only
    assert "train:" in proc.stderr  # the progress bar
    lines = _metrics(out)
    assert lines[0]["hparams"]["ranks"] == 2 and lines[0]["hparams"]["global_batch"] == 32
    val = [r for r in lines if "val/top1" in r]
    assert [r["val/samples"] for r in val] == [120.0, 120.0]  # every validation image once, each epoch
    assert val[-1]["val/top1"] > 0.3  # 10 classes: chance is 0.1
    assert os.path.getsize(os.path.join(out, "curves.png")) > 10_000
    assert os.path.exists(os.path.join(out, "checkpoint-000000030.pt"))


@pytest.mark.skipif("mpi" not in AVAILABLE and "gloo" not in AVAILABLE, reason="no multi-process backend")
def test_ctrl_c_checkpoints_and_the_same_command_resumes(registry: str, tmp_path) -> None:
    out = str(tmp_path / "run")
    cmd = _phalanx("run", "-n", "2", EXAMPLE, "--registry", registry, "--out", out, "--epochs", "3",
                   "--workers", "0")
    log = open(tmp_path / "first.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(os.path.join(out, "metrics.jsonl")) and any(
                "train/loss" in r for r in _metrics(out)):
            break
        time.sleep(0.2)
    assert proc.poll() is None, open(tmp_path / "first.log").read()
    proc.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends the launcher
    assert proc.wait(timeout=60) == 130
    log.seek(0)
    first = log.read()
    assert "stopped by SIG" in first, first
    saved = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    stopped_at = int(saved[-1].split("-")[1].split(".")[0])
    assert 5 <= stopped_at < 45, (saved, first)

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    steps = [r["step"] for r in _metrics(out) if "train/loss" in r]
    assert steps[0] == 5 and steps[-1] == 45, steps  # the first run's lines are kept, then continued
    assert "after 45 steps" in again.stdout


def test_replicas_variant(registry: str, tmp_path) -> None:
    out = str(tmp_path / "run")
    proc = subprocess.run([sys.executable, EXAMPLE, "--registry", registry, "--out", out, "--replicas", "2",
                           "--epochs", "1", "--workers", "0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hparams = _metrics(out)[0]["hparams"]
    assert hparams["replicas"] == 2 and hparams["ranks"] == 1, hparams
    assert "after 15 steps" in proc.stdout, proc.stdout
