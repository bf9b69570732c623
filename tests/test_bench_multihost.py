"""The multi-host training-step benchmark runs end to end on simulated hosts, and its JSON has the agreed shape.

::

    python -m pytest -q tests/test_bench_multihost.py

``benchmarks/multihost.py`` on 2 simulated hosts × 1 rank over 1 Gbit/s links,
1 round of 2 timed steps on an MLP of width 128: the 1-process world, the mpi
and gloo worlds started from host 0 with ``phalanx run --hosts --rsh``, and
torch DDP's PowerSGD hook in a world of its own. Every row has a status;
reducing variants send bytes on the link and keep the replicas identical; the
summary's arithmetic (efficiency, ×DDP, ×uncompressed) follows from the rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import requires_hosts
from phalanx.testing import available_backends

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "multihost.py"
VARIANTS = ["single", "mpi/DistributedOptimizer", "gloo/DistributedOptimizer",
            "gloo/DistributedOptimizer+bf16", "gloo/DDP", "gloo/DDP+fp16", "gloo/DDP+powersgd"]

pytestmark = [requires_hosts, pytest.mark.skipif(sys.platform != "linux", reason="simulated hosts need Linux")]


def test_two_hosts_one_round_writes_every_variant_with_status_and_the_agreed_schema(tmp_path: Path) -> None:
    if not {"mpi", "gloo"} <= set(available_backends()):
        pytest.skip("needs the mpi and gloo backends")
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(SCRIPT), "--hosts", "2", "--ranks-per-host", "1", "--rate", "1gbit",
           "--rounds", "1", "--steps", "2", "--warmup", "2", "--batch", "8", "--mlp-width", "128",
           "--variants", ",".join(VARIANTS), "--world-timeout", "30", "--json", str(out),
           "--png", str(tmp_path / "r.png")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "OMPI_", "PMI", "MASTER_"))}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| variant | step ms | efficiency | ×DDP equivalent |" in done.stdout
    record = json.loads(out.read_text())
    s = record["settings"]
    assert (s["hosts"], s["ranks_per_host"], s["rate"], s["steps"], s["rounds"], s["batch"]) == \
        (2, 1, "1gbit", 2, 1, 8)
    assert record["cpu_bound"] is False  # 2 ranks on 2 cores at 1 Gbit/s
    block = record["summary"]["mlp"]
    assert isinstance(block["params"], int) and block["t1_ms"] > 0
    rows = block["rows"]
    assert list(rows) == VARIANTS
    for key, row in rows.items():
        assert set(row) >= {"step_ms", "ranks", "bytes_per_step", "status"}, key
        assert row["status"] == "ok" or row["status"].startswith("failed: ") or row["status"] == "not available"
        assert row["ranks"] == (1 if key == "single" else 2)
        if row["status"] != "ok":
            assert key == "gloo/DDP+powersgd" and row["step_ms"] is None, (key, row)
            continue
        assert row["step_ms"] > 0
        assert row["efficiency"] == pytest.approx(block["t1_ms"] / row["step_ms"])
        if key == "single":
            assert row["bytes_per_step"] is None
        elif "powersgd" not in key:  # a 2-rank allreduce of the gradients sends at least their bytes
            assert row["bytes_per_step"] >= (2 if "+" in key else 4) * block["params"], (key, row)
            assert row["replicas_agree"], (key, row)
    ours, ddp = rows["gloo/DistributedOptimizer"], rows["gloo/DDP"]
    assert ours["x_ddp"] == pytest.approx(ddp["step_ms"] / ours["step_ms"])
    bf16 = rows["gloo/DistributedOptimizer+bf16"]
    assert bf16["x_plain"] == pytest.approx(ours["step_ms"] / bf16["step_ms"])
    assert bf16["x_ddp"] == pytest.approx(rows["gloo/DDP+fp16"]["step_ms"] / bf16["step_ms"])
    assert bf16["bytes_per_step"] < ours["bytes_per_step"]
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
