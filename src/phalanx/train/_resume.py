"""fit's checkpoints: what a step's state holds, and resuming from the newest one every rank can use."""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointError
from ._checkpoint import load_checkpoint
from ._history import History
from ._state import capture_state, restore_state

if TYPE_CHECKING:
    from ._run import Run

__all__ = ["capture", "resume"]


def capture(run: Run) -> dict[str, Any]:
    """The state of ``run`` at its current step (collective)."""
    progress = {"epoch": run.epoch, "samples_in_epoch": run.start, "global_step": run.global_step,
                "world_size": run.size, "replicas": run.k, "batch_size": run.batch_size,
                "accumulate": run.o.accumulate, "global_batch": run.global_batch * run.o.accumulate,
                "skipped": run.policy.skipped}
    return capture_state(model=run.model, optimizer=run.inner, scheduler=run.scheduler, scaler=run.scaler,
                         progress=progress, extra={"history": run.history.to_json()})


def resume(run: Run) -> bool:
    """Restore ``run`` from ``resume=``; False when ``"latest"`` finds no checkpoint (a fresh start).

    ``"latest"`` takes the newest checkpoint that loads *and* restores on every rank: a damaged one
    (digest mismatch, bad RNG state) on any rank makes every rank fall back to the previous one.
    """
    o = run.o

    def use(state: dict[str, Any]) -> dict[str, Any]:
        progress = restore_state(state, model=run.model, optimizer=run.inner, scheduler=run.scheduler,
                                 scaler=run.scaler)
        try:
            run.epoch = int(progress["epoch"])
            run.start = int(progress["samples_in_epoch"])
            run.global_step = int(progress["global_step"])
            run.policy.skipped = int(progress.get("skipped", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"phalanx.train.fit(resume={o.resume!r}): the checkpoint has no training "
                                  f"position (progress={progress!r}); was it written by fit?") from exc
        return state

    if str(o.resume) == "latest":
        found = run.manager.first_good(use)
        if found is None:
            return False
        state = found[1]
    else:
        state = use(load_checkpoint(os.fspath(o.resume)))
    _check_global_batch(run, state.get("progress") or {})
    extra = state.get("extra") or {}
    if isinstance(extra.get("history"), str):
        run.history.records = History.from_json(extra["history"]).records
    run._saved_at = run.global_step
    val_steps = run.history.steps("val/loss") if "val/loss" in run.history else []
    run._validated_at = val_steps[-1] if val_steps else -1
    return True


def _check_global_batch(run: Run, progress: dict[str, Any]) -> None:
    """Warn (rank 0) when the checkpoint's steps had another global batch: the position carries over,
    but the steps that follow differ from those of an uninterrupted run."""
    saved = progress.get("global_batch")
    if saved is None and all(k in progress for k in ("batch_size", "world_size", "replicas", "accumulate")):
        saved = progress["batch_size"] * progress["world_size"] * progress["replicas"] * progress["accumulate"]
    now = run.global_batch * run.o.accumulate
    if saved is None or saved == now or run.rank != 0:
        return
    warnings.warn(
        f"phalanx.train.fit(resume={run.o.resume!r}): the checkpoint was written with a global batch of {saved} "
        f"samples per step, this run takes {now} ({run.batch_size} per worker x {run.size} rank(s) x {run.k} "
        f"replica(s) x accumulate={run.o.accumulate}); training continues at the next unseen sample, but not as "
        f"the uninterrupted run would. Pass global_batch_size={saved} to keep it at any number of ranks.",
        RuntimeWarning, stacklevel=4)
