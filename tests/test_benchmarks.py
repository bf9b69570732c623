"""The training-step benchmark driver runs end to end in a tiny configuration (and its arithmetic is right).

::

    python -m pytest -q tests/test_benchmarks.py

One round of one timed step per variant, on shrunken models (MLP width 32,
CNN width 4): the driver starts its 1-process, mpi and gloo worlds with the
phalanx launcher, every variant trains, replicas that reduce gradients stay
identical (and the variant without communication drifts apart), and the JSON,
table and PNG come out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from phalanx.testing import available_backends

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "benchmarks", "train_step.py")
sys.path.insert(0, os.path.dirname(SCRIPT))

import train_step  # noqa: E402


def test_driver_runs_every_variant_and_writes_json_and_png(tmp_path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    cmd = [sys.executable, SCRIPT, "--rounds", "1", "--steps", "1", "--warmup", "1", "--batch", "8",
           "--mlp-width", "32", "--cnn-width", "4", "--json", str(out), "--png", str(png)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| variant | step ms | samples/s | efficiency | ×DDP |" in done.stdout
    record = json.loads(out.read_text())
    worlds = {"single"} | ({"mpi", "gloo"} & set(available_backends()))
    expected = [v.key for v in train_step.VARIANTS if v.world in worlds]
    assert record["settings"]["variants"] == expected
    assert set(record["rounds"][0]) == worlds
    for model in ("mlp", "cnn"):
        rows = record["summary"][model]["rows"]
        assert list(rows) == expected
        for key, row in rows.items():
            assert row["step_ms"] > 0 and row["samples_per_s"] > 0, (model, key, row)
            assert row["ranks"] == (1 if key == "single" else 2)
            # every reducing variant keeps the replicas identical; with no communication they drift
            assert row["replicas_agree"] == (key != "mpi/none"), (model, key, row)
        assert rows["single"]["efficiency"] == pytest.approx(1.0)
        if "gloo" in worlds:
            assert rows["gloo/DDP"]["x_ddp"] == pytest.approx(1.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    replot = subprocess.run([sys.executable, SCRIPT, "--replot", str(out), "--png", str(tmp_path / "b.png")],
                            capture_output=True, text=True, timeout=60)
    assert replot.returncode == 0 and "×DDP" in replot.stdout, replot.stderr
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_summary_arithmetic() -> None:
    keys = ["single", "mpi/DistributedOptimizer", "gloo/DDP"]
    times = {"single": [[0.040], [0.050], [0.060]],               # median 50 ms, 1 rank: 1280 samples/s
             "mpi/DistributedOptimizer": [[0.050, 0.055], [0.060, 0.062], [0.070, 0.071]],  # median 62 ms
             "gloo/DDP": [[0.080, 0.079], [0.075, 0.075], [0.090, 0.080]]}                # median 80 ms
    rounds = [{w: {"results": {f"mlp:{k}": {"rank_s": times[k][r], "notes": [], "replicas_agree": True}
                               for k in keys if train_step.BY_KEY[k].world == w}}
               for w in ("single", "mpi", "gloo")} for r in range(3)]
    record = {"settings": {"ranks": 2, "batch_per_rank": 64, "models": ["mlp"], "variants": keys,
                           "mlp_width": 8, "cnn_width": 4}, "rounds": rounds}
    rows = train_step.summarize(record)["mlp"]["rows"]
    assert rows["single"]["samples_per_s"] == pytest.approx(64 / 0.050)
    ours = rows["mpi/DistributedOptimizer"]
    assert ours["step_ms"] == pytest.approx(62.0)            # median over rounds of the slowest rank
    assert ours["samples_per_s"] == pytest.approx(128 / 0.062)
    assert ours["efficiency"] == pytest.approx(0.050 / 0.062)  # (2·64/T_2) / (2 · 64/T_1)
    assert ours["x_ddp"] == pytest.approx(0.080 / 0.062)
    assert rows["gloo/DDP"]["efficiency"] == pytest.approx(0.050 / 0.080)
