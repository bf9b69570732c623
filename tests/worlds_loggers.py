"""Logger test body: every rank constructs every logger; only rank 0 (or ``all_ranks=True``) writes.

Each rank returns what it observed; the test reads the files the world left behind.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any

import phalanx

OPTIONAL = ("wandb", "mlflow", "torch.utils.tensorboard", "tensorboard")


def rank_zero_only(tmp: str) -> dict[str, Any]:
    import phalanx.train as pt

    r = phalanx.rank()
    seen: dict[str, Any] = {"rank": r}

    # Every rank logs to the same path: the file must hold rank 0's lines only.
    shared = os.path.join(tmp, "shared", "metrics.jsonl")
    with pt.JSONLinesLogger(shared) as log:
        seen["enabled"] = log.enabled
        log.log_hparams({"rank": r})
        for step in range(3):
            log.log_metrics({"train/loss": 1.0 / (step + 1), "rank": r}, step=step)
        log.finish({"rank": r})
    phalanx.barrier()
    seen["shared_exists_after_barrier"] = os.path.exists(shared)

    # all_ranks=True writes everywhere.
    with pt.JSONLinesLogger(os.path.join(tmp, "own", f"rank{r}.jsonl"), all_ranks=True) as mine:
        mine.log_metrics({"rank": r}, step=10 + r)

    # Console: default output through phalanx.print, and an explicit stream.
    printed, stream = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed):
        pt.ConsoleLogger().log_metrics({"rank": r}, step=5)
        pt.ConsoleLogger(all_ranks=True).log_metrics({"rank": r}, step=6)
    console = pt.ConsoleLogger(stream)
    console.log_metrics({"rank": r}, step=7)
    console.finish({"rank": r})
    seen["printed"], seen["stream"] = printed.getvalue(), stream.getvalue()

    # Optional loggers on a non-zero rank: no import, no directory, no run.
    if r != 0:
        loaded = {m for m in OPTIONAL if m in sys.modules}
        loggers = [
            pt.TensorBoardLogger(os.path.join(tmp, f"tb{r}")),
            pt.WandbLogger(mode="offline", dir=os.path.join(tmp, f"wandb{r}")),
            pt.MLflowLogger(tracking_uri=os.path.join(tmp, f"mlruns{r}")),
        ]
        for logger in loggers:
            logger.log_hparams({"lr": 0.1})
            logger.log_metrics({"train/loss": 0.5}, step=1)
            logger.finish({"best": 1.0})
        seen["optional_imported"] = sorted({m for m in OPTIONAL if m in sys.modules} - loaded)
        seen["optional_dirs"] = sorted(d for d in os.listdir(tmp) if d.endswith(str(r)))
        seen["optional_enabled"] = [logger.enabled for logger in loggers]
    return seen
