"""Logger test body: every rank constructs every logger; only rank 0 (or ``all_ranks=True``) writes.

Each behaviour checks, on every rank, what that rank wrote or printed, and the
files the ranks share after a barrier.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

import phalanx
from behaviours import Behaviours

OPTIONAL = ("wandb", "mlflow", "torch.utils.tensorboard", "tensorboard")
LOGGERS = Behaviours()


def _read(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@LOGGERS.behaviour("jsonl-on-a-shared-path-holds-rank-0s-lines-only")
def _(tmp: str, r: int, n: int) -> None:
    import phalanx.train as pt

    shared = os.path.join(tmp, "shared", "metrics.jsonl")
    with pt.JSONLinesLogger(shared) as log:
        assert log.enabled == (r == 0)
        log.log_hparams({"rank": r})
        for step in range(3):
            log.log_metrics({"train/loss": 1.0 / (step + 1), "rank": r}, step=step)
        log.finish({"rank": r})
    phalanx.barrier()
    lines = _read(shared)
    assert lines[0] == {"hparams": {"rank": 0}} and lines[-1] == {"summary": {"rank": 0}}, lines
    assert [(x["step"], x["rank"]) for x in lines[1:-1]] == [(0, 0), (1, 0), (2, 0)], lines


@LOGGERS.behaviour("jsonl-with-all-ranks-writes-on-every-rank")
def _(tmp: str, r: int, n: int) -> None:
    import phalanx.train as pt

    with pt.JSONLinesLogger(os.path.join(tmp, "own", f"rank{r}.jsonl"), all_ranks=True) as mine:
        mine.log_metrics({"rank": r}, step=10 + r)
    assert [(x["step"], x["rank"]) for x in _read(os.path.join(tmp, "own", f"rank{r}.jsonl"))] == [(10 + r, r)]


@LOGGERS.behaviour("console-prints-on-rank-0-unless-all-ranks")
def _(tmp: str, r: int, n: int) -> None:
    import phalanx.train as pt

    printed, stream = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed):
        pt.ConsoleLogger().log_metrics({"rank": r}, step=5)
        pt.ConsoleLogger(all_ranks=True).log_metrics({"rank": r}, step=6)
    console = pt.ConsoleLogger(stream)
    console.log_metrics({"rank": r}, step=7)
    console.finish({"rank": r})
    if r == 0:
        assert printed.getvalue() == f"[0/{n}] step 5  rank 0\n[0/{n}] step 6  rank 0\n", printed.getvalue()
        assert stream.getvalue() == "step 7  rank 0\nsummary\n  rank  0\n", stream.getvalue()
    else:
        assert printed.getvalue() == f"[{r}/{n}] step 6  rank {r}\n", printed.getvalue()
        assert stream.getvalue() == ""


@LOGGERS.behaviour("optional-loggers-on-other-ranks-import-and-create-nothing")
def _(tmp: str, r: int, n: int) -> None:
    import phalanx.train as pt

    if r == 0:
        return
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
    assert sorted({m for m in OPTIONAL if m in sys.modules} - loaded) == []
    assert sorted(d for d in os.listdir(tmp) if d.endswith(str(r))) == []
    assert [logger.enabled for logger in loggers] == [False, False, False]


def rank_zero_only(tmp: str) -> dict[str, str | None]:
    return LOGGERS.run(tmp, phalanx.rank(), phalanx.size())
