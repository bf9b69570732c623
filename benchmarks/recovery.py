"""Recovery in place, measured: the stall per lost rank, and how fast a replacement receives its state.

::

    python benchmarks/recovery.py                                   # phalanx only
    python benchmarks/recovery.py --torchft-python /path/venv/bin/python --json benchmarks/results/recovery.json

Every job is ``phalanx run --backend gloo`` (``--backend mpi``: Open MPI 5's ULFM) of ``benchmarks/recovery_worker.py`` (``fit(elastic=True)``,
Adam, an MLP whose fp32 parameters and Adam moments make ``STATE_MB``):

* **stall**: 4 ranks, 100 MB of state, ``--timeout 10 --max-restarts 3``; ranks 1, 0 and 2 are SIGKILLed
  (at steps 20, 50, 80, each once the world is back at 4). A failure's stall is the time from the kill to
  the survivors' next completed step; the survivors' own re-forming time (``History.recoveries``) is
  shown beside it;
* **receive**: 2 ranks, ``--max-restarts 1``, rank 1 SIGKILLed at step 2; the replacement's time from
  its admission to holding the state (the newest rank packs it, broadcasts it, the replacement loads
  it), for 10 MB, 100 MB and 1 GB of state;
* **torchft** (with ``--torchft-python``, an interpreter that has torchft): the same failure schedule
  on torchft's gloo (``benchmarks/recovery_torchft.py``: 2 replica groups, one SIGKILLed and relaunched),
  in the same run.

Repeats (``--repeats``) give medians; the machine is shared, so compare figures of one run only.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "recovery_worker.py")
BACKEND = ["gloo"]  # --backend


def _job(n: int, flags: list[str], env: dict[str, str], timeout: float) -> tuple[str, str]:
    """Run one job; returns (its marks directory, its output). Raises with the output when it fails."""
    marks = tempfile.mkdtemp(prefix="phalanx-recovery-")
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", str(n), "--backend", BACKEND[0], *flags, WORKER],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", MARKS=marks, **env))
    if done.returncode != 0:
        raise RuntimeError(f"job failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return marks, done.stdout + done.stderr


def _steps(marks: str) -> dict[int, list[tuple[int, float]]]:
    out = {}
    for path in glob.glob(os.path.join(marks, "steps-*")):
        with open(path) as f:
            out[int(path.rsplit("-", 1)[1])] = [(int(a), float(b)) for a, b, *_ in (line.split() for line in f)]
    return out


def _done(marks: str) -> list[dict[str, Any]]:
    out = []
    for path in glob.glob(os.path.join(marks, "done-*.json")):
        with open(path) as f:
            out.append(json.load(f))
    return out


def stall(repeats: int) -> dict[str, Any]:
    stalls, reforms, sizes = [], [], []
    for _ in range(repeats):
        marks, _ = _job(4, ["--timeout", "10", "--max-restarts", "3"],
                        {"STATE_MB": "100", "FULL": "4", "STEPS": "150", "SLOW_S": "0",
                         "KILLS": json.dumps([[20, 1], [50, 0], [80, 2]])}, 600)
        steps = _steps(marks)
        for path in sorted(glob.glob(os.path.join(marks, "kill-*"))):
            with open(path) as f:
                kill = json.load(f)
            after = [t for pid, rows in steps.items() if pid != kill["pid"]
                     for step, t in rows if t > kill["time"] and step > kill["step"]]
            stalls.append(min(after) - kill["time"])
        for d in _done(marks):
            reforms += [r["seconds"] for r in d["recoveries"] if r["lost"]]
            sizes.append(d["params"])
        shutil.rmtree(marks, ignore_errors=True)
    return {"failures": len(stalls), "stall_s": stalls, "median_stall_s": statistics.median(stalls),
            "max_stall_s": max(stalls), "median_reform_s": statistics.median(reforms),
            "state_mb": 100, "params": sizes[0] if sizes else None}


def receive(sizes_mb: list[float], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for mb in sizes_mb:
        seconds, got = [], 0
        for _ in range(repeats):
            marks, _ = _job(2, ["--timeout", "60", "--max-restarts", "1"],
                            {"STATE_MB": str(mb), "FULL": "2", "STEPS": "16", "KILLS": json.dumps([[2, 1]])}, 900)
            for d in _done(marks):
                for r in d["recoveries"]:
                    if r.get("cause") == "joined a running job":
                        seconds.append(r["seconds"])
                        got = r["received_bytes"]
            shutil.rmtree(marks, ignore_errors=True)
        rows.append({"state_mb": mb, "received_mb": got / 1e6, "seconds": seconds,
                     "median_s": statistics.median(seconds) if seconds else None})
    return rows


def torchft(python: str, failures: int) -> dict[str, Any]:
    script = os.path.join(HERE, "recovery_torchft.py")
    out = tempfile.mktemp(suffix=".json")
    done = subprocess.run([python, script, "--failures", str(failures), "--steps", "300", "--state-mb", "100",
                           "--json", out], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0 or not os.path.exists(out):
        return {"error": (done.stdout + done.stderr)[-2000:]}
    with open(out) as f:
        return dict(json.load(f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sizes-mb", default="10,100,1000")
    parser.add_argument("--torchft-python", help="an interpreter with torchft installed: its figures beside ours")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "mpi"], help="mpi: under Open MPI 5 (ULFM)")
    args = parser.parse_args()
    BACKEND[0] = args.backend
    started = time.time()
    result: dict[str, Any] = {"stall": stall(args.repeats),
                              "receive": receive([float(s) for s in args.sizes_mb.split(",")], args.repeats)}
    if args.torchft_python:
        result["torchft"] = torchft(args.torchft_python, 3)
    result["wall_s"] = time.time() - started
    s = result["stall"]
    result["backend"] = args.backend
    print(f"phalanx {args.backend}, 4 ranks, {s['state_mb']} MB of state: {s['failures']} kills, stall median "
          f"{s['median_stall_s']:.2f} s (max {s['max_stall_s']:.2f} s), re-forming median {s['median_reform_s']:.2f} s")
    for row in result["receive"]:
        print(f"phalanx, a replacement receives {row['received_mb']:.0f} MB of state in {row['median_s']:.2f} s")
    if "torchft" in result:
        t = result["torchft"]
        print("torchft: " + (f"stall median {t['median_stall_s']:.2f} s, rejoin median {t['median_rejoin_s']:.2f} s"
                             if "median_stall_s" in t else t.get("error", "no figures")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
