"""One rank of ``benchmarks/recovery.py``: ``fit(elastic=True)`` on an MLP whose state (fp32 parameters
and Adam's two moments) is about ``STATE_MB`` MB, killing itself as ``KILLS`` says.

``KILLS``: JSON ``[[step, rank], ...]``: the process that is rank ``rank`` at the first step from
``step`` on at which the world has ``FULL`` ranks SIGKILLs itself (once per entry, marked in ``MARKS``);
steps on fewer ranks sleep ``SLOW_S`` seconds more (default 0.5), so a replacement joins before the end.
Every process appends ``step time rank size`` per loss to ``MARKS/steps-<pid>`` and, when ``fit``
returns, writes its recoveries (``History.recoveries``) to ``MARKS/done-<pid>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch

import phalanx
from phalanx.train import fit

phalanx.init()
torch.manual_seed(0)
STATE_MB, FULL = float(os.environ.get("STATE_MB", "100")), int(os.environ.get("FULL", "0"))
MARKS, KILLS = os.environ["MARKS"], json.loads(os.environ.get("KILLS", "[]"))
SLOW_S = float(os.environ.get("SLOW_S", "0.5"))
PARAMS = int(STATE_MB * 1e6 / 12)  # 4 bytes of parameter + 8 of Adam's moments per parameter
WIDTH = 256 if PARAMS < 4e6 else 1024 if PARAMS < 3e7 else 4096
DEPTH = max(1, round(PARAMS / (WIDTH * WIDTH)))
model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(96, WIDTH, generator=g), torch.randn(96, WIDTH, generator=g)
first = next(iter(model.parameters()))
log = open(os.path.join(MARKS, f"steps-{os.getpid()}"), "a")


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    done = opt.state.get(first, {}).get("step")
    step = int(done) if done is not None else 0
    log.write(f"{step} {time.time()} {phalanx.rank()} {phalanx.size()}\n")
    log.flush()
    if FULL and phalanx.size() < FULL:
        time.sleep(SLOW_S)  # short-handed steps are slow: the replacement joins before the run ends
    for at, rank in KILLS:
        mark = os.path.join(MARKS, f"kill-{at}-{rank}")
        if step >= at and phalanx.size() == FULL and phalanx.rank() == rank and not os.path.exists(mark):
            with open(mark, "w") as f:
                json.dump({"time": time.time(), "pid": os.getpid(), "step": step}, f)
            os.kill(os.getpid(), signal.SIGKILL)
    return torch.nn.functional.mse_loss(out, y)


history = fit(model, loss_fn, opt, (X, Y), global_batch_size=24, steps=int(os.environ.get("STEPS", "60")),
              elastic=True, progress=False, log_every=1000)
with open(os.path.join(MARKS, f"done-{os.getpid()}.json"), "w") as f:
    json.dump({"recoveries": history.recoveries, "params": sum(p.numel() for p in model.parameters()),
               "joined": os.environ.get("PHALANX_JOINING") == "1"}, f)
