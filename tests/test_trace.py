"""The trace of phalanx's collectives (``phalanx.start_trace``) and Horovod's timeline on it.

* at 2 ranks on mpi and gloo each rank's file is Chrome-trace JSON with one event per
  collective (name, op, dtype, shape, bytes, a start inside the run, a plausible duration), per
  non-blocking call and per gradient-bucket reduction (each bucket on its own row, launched
  during its step);
* ``hvd.start_timeline``/``stop_timeline`` record on rank 0 only, with cycle marks;
  ``HOROVOD_TIMELINE`` (and ``--timeline-filename``) under ``phalanx run`` does the same for a
  whole script;
* with no trace the core's hooks are never called; misuse is refused with phalanx errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import phalanx
import worlds_trace as bodies
from conftest import AVAILABLE, world_params
from phalanx import _trace

pytest.importorskip("torch")

TWO = world_params([("mpi", 2), ("gloo", 2)])
SECOND = 1e6  # microseconds


@pytest.fixture(scope="session")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("traces"))


def events(trace: dict[str, Any], cat: str | None = None, name: str | None = None) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] in ("X", "i") and (cat is None or e.get("cat") == cat)
            and (name is None or e["name"] == name)]


def first(trace: dict[str, Any], name: str) -> dict[str, Any]:
    """The first event called ``name`` (the bodies make theirs before any other of that name)."""
    found = events(trace, name=name)
    assert found, f"no {name} event in {[e['name'] for e in events(trace)]}"
    return found[0]


@pytest.mark.parametrize("backend,n", TWO)
def test_each_rank_writes_its_own_trace_of_every_collective(worlds, out_dir: str, backend: str, n: int) -> None:
    for r, got in enumerate(worlds.results(bodies.traced, backend, n, args=(out_dir,))):
        trace = got["trace"]
        assert got["path"].endswith(f"trace-{r}.json")
        assert {e["pid"] for e in trace["traceEvents"]} == {r}
        names = [e["name"] for e in events(trace, cat="collective")]
        assert names[:4] == ["allreduce", "broadcast", "allgather", "barrier"], names
        meta = {(e["name"], e["tid"]): e["args"] for e in trace["traceEvents"] if e["ph"] == "M"}
        assert meta[("process_name", 0)] == {"name": f"rank {r}"} and meta[("thread_name", 0)]["name"] == "collectives"


@pytest.mark.parametrize("backend,n", TWO)
def test_a_collective_event_says_what_was_reduced_when_and_how_long(worlds, out_dir: str, backend: str,
                                                                    n: int) -> None:
    for got in worlds.results(bodies.traced, backend, n, args=(out_dir,)):
        allreduce = first(got["trace"], "allreduce")
        assert allreduce["args"] == {"dtype": "float32", "shape": [bodies.MB // 4], "bytes": bodies.MB, "op": "sum"}
        assert got["start"] <= allreduce["ts"] <= got["end"], (got["start"], allreduce, got["end"])
        assert 0 < allreduce["dur"] < 30 * SECOND  # 1 MB between two local ranks: microseconds to a second
        broadcast = first(got["trace"], "broadcast")
        assert broadcast["args"] == {"dtype": "float64", "shape": [10], "bytes": 80, "root": n - 1}
        assert broadcast["ts"] >= allreduce["ts"] + allreduce["dur"] - 1  # in call order, not overlapping
        assert first(got["trace"], "allgather")["args"]["bytes"] == 24


@pytest.mark.parametrize("backend,n", TWO)
def test_a_non_blocking_call_is_timed_to_its_wait(worlds, out_dir: str, backend: str, n: int) -> None:
    for got in worlds.results(bodies.traced, backend, n, args=(out_dir,)):
        event = first(got["trace"], "iallreduce")
        assert event["cat"] == "non-blocking" and event["tid"] >= 100 and event["args"]["shape"] == [5]
        assert 0 <= event["dur"] < 30 * SECOND


@pytest.mark.parametrize("backend,n", TWO)
def test_each_gradient_bucket_reduction_is_an_event_on_its_own_row_during_its_step(worlds, out_dir: str,
                                                                                  backend: str, n: int) -> None:
    for got in worlds.results(bodies.traced, backend, n, args=(out_dir,)):
        buckets = events(got["trace"], cat="gradient bucket")
        rows = {e["tid"] for e in buckets}
        assert len(rows) >= 2 and len(buckets) == bodies.STEPS * len(rows), [(e["name"], e["ts"]) for e in buckets]
        names = {e["tid"]: e["name"] for e in buckets}
        assert sorted(names.values()) == [f"torch.DistributedOptimizer bucket {b}" for b in range(len(rows))]
        assert sum(e["args"]["params"] for e in buckets) == bodies.STEPS * 6  # 3 layers: weight and bias
        assert sum(e["args"]["numel"] for e in buckets) // bodies.STEPS == 256 * 256 * 2 + 256 * 8 + 256 * 2 + 8 \
            + 6 + len(rows)  # the gradients, one presence slot per parameter and a flag per bucket
        for e in buckets:
            assert e["args"]["bytes"] == 4 * e["args"]["numel"] and e["args"]["dtype"] == "float32"
            assert any(start <= e["ts"] <= end for start, end in got["windows"]), e  # launched during a step
            assert 0 <= e["dur"] < 30 * SECOND


@pytest.mark.parametrize("backend,n", TWO)
def test_hvd_timeline_is_recorded_on_rank_0_only_with_cycle_marks(worlds, out_dir: str, backend: str,
                                                                  n: int) -> None:
    results = worlds.results(bodies.timeline, backend, n, args=(out_dir,))
    assert results[0]["recording"] and results[1]["recording"] is None
    trace = results[0]["trace"]
    assert {e["pid"] for e in trace["traceEvents"]} == {0}
    assert [1000] in [e["args"].get("shape") for e in events(trace, name="allreduce")]
    assert len(events(trace, cat="cycle", name="CYCLE_START")) == bodies.STEPS
    assert len(events(trace, cat="gradient bucket")) >= 2 * bodies.STEPS


SCRIPT = """\
import numpy as np
import phalanx
import phalanx.horovod.torch as hvd

hvd.init()
for _ in range(3):
    phalanx.allreduce(np.ones(100, np.float32))
phalanx.broadcast(np.ones(4), root=1)
"""


@pytest.mark.parametrize("how", [pytest.param(("gloo", "env"), id="gloo-HOROVOD_TIMELINE"),
                                 pytest.param(("mpi", "flag"), id="mpi-timeline-filename")])
def test_horovod_timeline_under_phalanx_run_records_rank_0s_collectives(tmp_path: Path, how: tuple[str, str]) -> None:
    backend, way = how
    if backend not in AVAILABLE:
        pytest.skip(f"no {backend} backend here")
    script, path = tmp_path / "job.py", tmp_path / "timeline.json"
    script.write_text(SCRIPT)
    env = dict(os.environ, HOROVOD_TIMELINE=str(path)) if way == "env" else dict(os.environ)
    flag = ["--timeline-filename", str(path)] if way == "flag" else []
    out = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", f"--{backend}", *flag, "python",
                          str(script)], capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    trace = json.loads(path.read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0}
    assert [e["name"] for e in events(trace, cat="collective")][-4:] == ["allreduce"] * 3 + ["broadcast"]


def test_without_a_trace_the_hooks_are_never_called(monkeypatch) -> None:
    def called(*args: Any) -> None:
        raise AssertionError("a trace hook ran while no trace was recorded")

    for hook in ("begin", "end", "span_begin", "span_end", "bucket_launch", "bucket_done"):
        monkeypatch.setattr(_trace, hook, called)
    assert _trace.ON is False and _trace.tracing() is None
    phalanx.init("local")
    try:
        phalanx.allreduce(np.ones(3))
        phalanx.broadcast(np.ones(3))
        phalanx.iallreduce(np.ones(3)).wait()
    finally:
        phalanx.shutdown()


def test_misuse_is_refused_with_phalanx_errors(tmp_path: Path) -> None:
    with pytest.raises(phalanx.NotInitializedError, match=r"start_trace"):
        phalanx.start_trace(str(tmp_path / "t.json"))
    phalanx.init("local")
    try:
        with pytest.raises(phalanx.InvalidArgumentError, match="does not exist"):
            phalanx.start_trace(str(tmp_path / "no" / "t.json"))
        path = phalanx.start_trace(str(tmp_path / "t-{rank}.json"))
        with pytest.raises(phalanx.UsageError, match="already being recorded"):
            phalanx.start_trace(str(tmp_path / "u.json"))
        phalanx.allreduce(np.ones(2))
        assert phalanx.stop_trace() == path == str(tmp_path / "t-0.json")
        assert phalanx.stop_trace() is None
        assert first(json.loads(Path(path).read_text()), "allreduce")["args"]["bytes"] == 16
    finally:
        phalanx.stop_trace()
        phalanx.shutdown()
