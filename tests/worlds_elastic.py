"""Bodies and the training script for tests/test_elastic.py: a fixed global batch survives a smaller world.

World bodies (``run_world``): ``shrink(tmp, "write")`` trains 3 ranks for 7
steps of ``global_batch_size=12`` (checkpoints at 3, 6 and 7: the last one in
the middle of the second epoch); ``shrink(tmp, "resume")`` resumes it on 2
ranks to step 12. Compared with the hand-written one-process loop of
``worlds_fit.reference`` on the same global batch (Adam, a StepLR schedule:
the optimizer and scheduler states must carry over), float64.

The script (``python worlds_elastic.py DIR MODE [RANK STEP]``, run by
``phalanx run --max-restarts``): the same training with ``resume="latest"``;
on attempt 0 (``PHALANX_RESTART_COUNT``) rank RANK fails at step STEP once
(MODE ``raise``: an exception; ``kill``: SIGKILL itself; a marker file in DIR
says it happened), on every attempt (``always``), waits to be killed from
outside (``wait``: a marker ``waiting-rank<r>`` first), or never (``none``).
At the end rank 0 writes ``DIR/result.json``: the attempts seen and the
largest absolute difference of the parameters from the one-process loop.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from typing import Any

import phalanx
import phalanx.train
from behaviours import Behaviours
from helpers import raises

GLOBAL = 12  # samples per optimizer step: 3 ranks x 4, 2 ranks x 6, 1 x 12
STEPS = 12  # 60 samples: 5 steps an epoch
WRITTEN = 7  # the write phase stops here (mid-epoch: 2 steps into epoch 1)
TOL = 1e-9


def _fit_world() -> Any:
    import worlds_fit

    return worlds_fit


def _step_lr(opt: Any) -> Any:
    import torch

    return torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)


def max_difference(a: Any, b: Any) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def train(directory: str, steps: int, loss_fn: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    """fit with global_batch_size=12, Adam and StepLR, checkpoints every 3 steps, resumed when there is one.
    Every rank starts from another model: only fit's broadcast (or the checkpoint) makes them agree."""
    wf = _fit_world()
    torch = wf._torch()
    m = wf.model(torch, 0 if phalanx.rank() == 0 else 100 + phalanx.rank())
    ds = wf.data(torch)
    h = phalanx.train.fit(m, loss_fn or torch.nn.functional.cross_entropy, wf.adam(torch, m), ds,
                          global_batch_size=GLOBAL, steps=steps, scheduler=_step_lr,
                          checkpoint_dir=os.path.join(directory, "ckpt"), checkpoint_every=3, resume="latest",
                          progress=False, plot=False, **kwargs)
    return m, h


def reference(steps: int = STEPS) -> Any:
    """One process, plain torch, the whole global batch: what every world must end with."""
    wf = _fit_world()
    torch = wf._torch()
    return wf.reference(torch, wf.model(torch, 0), wf.adam, wf.data(torch), steps=steps, make_sched=_step_lr)


# -- a 3-rank world's checkpoint resumed by 2 ranks ----------------------------------------------------

WRITE, RESUME = Behaviours(), Behaviours()


@WRITE.behaviour("three-ranks-train-seven-steps-of-the-global-batch")
def _(tmp: str) -> None:
    m, h = train(tmp, WRITTEN)
    assert h.summary["steps"] == WRITTEN and h.summary["samples"] == WRITTEN * GLOBAL, h.summary
    names = sorted(os.listdir(os.path.join(tmp, "ckpt")))
    assert names[-1] == f"checkpoint-{WRITTEN:09d}.pt", names
    assert max_difference(m, reference(WRITTEN)) < TOL


@WRITE.behaviour("a-world-that-does-not-divide-the-global-batch-is-refused-on-every-rank")
def _(tmp: str) -> None:
    wf = _fit_world()
    torch = wf._torch()
    m = wf.model(torch, 0)
    with raises(phalanx.InvalidArgumentError, f"fit(global_batch_size=10) ran on {phalanx.size()} ranks") as raised:
        phalanx.train.fit(m, torch.nn.functional.cross_entropy, wf.sgd(torch, m), wf.data(torch),
                          global_batch_size=10, steps=1, progress=False)
    exc = raised.value
    text = str(exc)
    assert "fit(global_batch_size=10)" in text and f"{phalanx.size()} rank(s)" in text, text
    assert "Give a multiple of 3 (e.g. 9 or 12)" in text, text
    with raises(phalanx.InvalidArgumentError, "fit took both batch_size and global_batch_size") as raised:
        phalanx.train.fit(m, torch.nn.functional.cross_entropy, wf.sgd(torch, m), wf.data(torch),
                          batch_size=4, global_batch_size=12, steps=1, progress=False)
    exc = raised.value
    assert "give exactly one" in str(exc), str(exc)


@RESUME.behaviour("two-ranks-resume-mid-epoch-and-end-equal-to-one-process")
def _(tmp: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m, h = train(tmp, STEPS)
    assert h.summary["steps"] == STEPS and h.summary["samples"] == (STEPS - WRITTEN) * GLOBAL, h.summary
    assert not [w for w in caught if "global batch" in str(w.message)], [str(w.message) for w in caught]
    diff = max_difference(m, reference())
    if phalanx.rank() == 0:
        with open(os.path.join(tmp, "shrink-difference.json"), "w") as f:
            json.dump({"max_abs_diff": diff}, f)
    assert diff < TOL, f"2 ranks resumed from 3 differ from one process by {diff:.3g}"


@RESUME.behaviour("a-resume-with-another-global-batch-warns-on-rank-0")
def _(tmp: str) -> None:
    wf = _fit_world()
    torch = wf._torch()
    m = wf.model(torch, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        phalanx.train.fit(m, torch.nn.functional.cross_entropy, wf.adam(torch, m), wf.data(torch), batch_size=3,
                          steps=WRITTEN + 1, scheduler=_step_lr, progress=False, plot=False,
                          resume=os.path.join(tmp, "ckpt", f"checkpoint-{WRITTEN:09d}.pt"))
    said = [str(w.message) for w in caught if "global batch" in str(w.message)]
    if phalanx.rank() == 0:
        assert said and f"global batch of {GLOBAL} samples" in said[0] and "this run takes 6" in said[0], said
        assert f"global_batch_size={GLOBAL}" in said[0], said
    else:
        assert not said, said


def shrink(tmp: str, phase: str) -> dict[str, str | None]:
    """``"write"``: 3 ranks, 7 steps; ``"resume"``: 2 ranks continue to 12 (see the module docstring)."""
    return (WRITE if phase == "write" else RESUME).run(tmp)


# -- the script phalanx run --max-restarts starts ------------------------------------------------------

def _failing(directory: str, mode: str, rank: int, step: int) -> Any:
    """A loss function that fails on ``rank`` at ``step`` as ``mode`` says (see the module docstring)."""
    import torch

    attempt = int(os.environ.get("PHALANX_RESTART_COUNT", "-1"))
    marker = os.path.join(directory, "failed-once")
    calls = {"n": 0}

    def loss_fn(out: Any, y: Any) -> Any:
        here = phalanx.rank() == rank and calls["n"] == step
        calls["n"] += 1
        if here and (mode == "always" or attempt == 0 and not os.path.exists(marker)):
            open(marker, "w").close()
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "wait":
                open(os.path.join(directory, f"waiting-rank{phalanx.rank()}"), "w").close()
                time.sleep(120)  # until killed from outside
            raise RuntimeError(f"injected failure on rank {rank} at step {step} (attempt {attempt})")
        return torch.nn.functional.cross_entropy(out, y)

    return loss_fn


def main(argv: list[str]) -> int:
    directory, mode = argv[0], argv[1]
    rank, step = (int(argv[2]), int(argv[3])) if len(argv) > 3 else (0, 0)
    phalanx.init()
    attempt = os.environ.get("PHALANX_RESTART_COUNT")
    with open(os.path.join(directory, f"attempts-rank{phalanx.rank()}"), "a") as f:
        f.write(f"{attempt} {phalanx.size()} {os.environ.get('MASTER_PORT')}\n")
    m, h = train(directory, STEPS, _failing(directory, mode, rank, step))
    if phalanx.rank() == 0:
        result = {"attempt": attempt, "size": phalanx.size(), "steps": h.summary["steps"],
                  "max_abs_diff": max_difference(m, reference())}
        with open(os.path.join(directory, "result.json"), "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
