"""Rank bodies for the trace tests: ``phalanx.start_trace`` on every rank, and Horovod's timeline on rank 0."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

import phalanx

STEPS = 3
MB = 1 << 20


def _train(steps: int) -> list[tuple[float, float]]:
    """``steps`` steps of phalanx's DistributedOptimizer on a small MLP (several buckets); each
    step's (start, end) in wall-clock microseconds."""
    import torch

    import phalanx.torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = phalanx.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), bucket_cap_mb=0.2)
    x, y = torch.randn(16, 256), torch.randn(16, 8)
    windows = []
    for _ in range(steps):
        start = time.time() * 1e6
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        windows.append((start, time.time() * 1e6))
    return windows


def traced(out_dir: str) -> dict[str, Any]:
    """Every rank records its own trace of plain collectives and training steps."""
    start = time.time() * 1e6
    path = phalanx.start_trace(os.path.join(out_dir, "trace-{rank}.json"))
    phalanx.allreduce(np.ones(MB // 4, np.float32))
    phalanx.broadcast(np.arange(10.0), root=phalanx.size() - 1)
    phalanx.allgather(np.ones(3, np.int64))
    phalanx.barrier()
    phalanx.iallreduce(np.ones(5)).wait()
    windows = _train(STEPS)
    assert phalanx.stop_trace() == path and phalanx.stop_trace() is None
    with open(path) as f:
        trace = json.load(f)
    return {"path": path, "trace": trace, "start": start, "end": time.time() * 1e6, "windows": windows}


def timeline(out_dir: str) -> dict[str, Any]:
    """Horovod's timeline: every rank calls start/stop, rank 0 records (with cycle marks)."""
    import phalanx.horovod.torch as hvd
    from phalanx import _trace

    hvd.init()
    path = os.path.join(out_dir, f"timeline-{phalanx.backend().name}.json")
    hvd.start_timeline(path, mark_cycles=True)
    recording = _trace.tracing()
    phalanx.allreduce(np.ones(1000, np.float32))
    _train(STEPS)
    hvd.stop_timeline()
    phalanx.barrier()
    with open(path) as f:
        trace = json.load(f)
    return {"recording": recording, "trace": trace}
