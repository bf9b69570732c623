"""fit's checkpoints: what a step's state holds, and resuming from the newest one every rank can use."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from .._errors import CheckpointError
from ._checkpoint import load_checkpoint
from ._history import History
from ._progress import RunState
from ._state import capture_state, restore_state

__all__ = ["SHARDS", "capture", "resume"]

SHARDS = ".shards"  # a parameter-sharded run's checkpoint: <name>.pt and the directory <name>.pt.shards


def capture(run: RunState, path: str) -> dict[str, Any]:
    """The state of ``run`` at its current step (collective), for the checkpoint file ``path``.

    With ``shard="parameters"`` no rank assembles the model or the optimizer: each rank writes its
    shards to the directory ``<path>.shards`` first (``save_sharded``), and the state names it; the
    file itself, written after, commits the two."""
    from ..torch._sharded import whole_state  # a sharded optimizer's state is saved whole

    g = run.geometry
    progress = {**run.progress.position(), "world_size": g.ranks, "replicas": g.replicas,
                "batch_size": g.batch_size, "accumulate": g.accumulate, "global_batch": g.step_samples,
                "skipped": run.policy.skipped}
    extra = {"history": run.history.to_json()}
    if not _sharded(run):
        return capture_state(model=run.model, optimizer=whole_state(run.inner), scheduler=run.scheduler,
                             scaler=run.scaler, progress=progress, extra=extra)
    from ..torch import save_sharded

    save_sharded(path + SHARDS, run.model, run.inner)
    state = capture_state(model=torch.nn.Module(), scheduler=run.scheduler, scaler=run.scaler, progress=progress,
                          extra=extra)
    state["sharded"] = os.path.basename(path) + SHARDS
    return state


def _sharded(run: RunState) -> bool:
    return bool(getattr(run.model, "shards_parameters", False))


def resume(run: RunState, until: int | None = None) -> bool:
    """Restore ``run`` from ``resume=``; False when ``"latest"`` finds no checkpoint (a fresh start).

    ``"latest"`` takes the newest checkpoint that loads *and* restores on every rank: a damaged one
    (digest mismatch, bad RNG state) on any rank makes every rank fall back to the previous one.
    ``until``: instead of ``resume=``, the newest checkpoint of ``checkpoint_dir`` written at a step
    no later than ``until`` (a sharded ``fit(elastic=True)`` reloading in process).
    """
    from ..torch._sharded import whole_state

    o = run.o
    latest = until is not None or str(o.resume) == "latest"

    def use(state: dict[str, Any]) -> dict[str, Any]:
        step = (state.get("progress") or {}).get("global_step")
        if until is not None and (not isinstance(step, int) or step > until):
            raise CheckpointError(f"written at step {step}, after step {until}: not this run's")
        if "sharded" in state:  # the model and optimizer are in the shard directory beside the file
            from ..torch import load_sharded

            where = run.manager.directory if latest else os.path.dirname(str(o.resume))
            load_sharded(os.path.join(where, state["sharded"]), run.model, run.inner)
            progress = restore_state(state, model=torch.nn.Module(), scheduler=run.scheduler, scaler=run.scaler)
        else:  # a whole state: into sharded parameters too, each rank keeping its elements
            progress = restore_state(state, model=run.model, optimizer=whole_state(run.inner),
                                     scheduler=run.scheduler, scaler=run.scaler)
        try:
            run.progress.restore(progress)
            run.policy.skipped = int(progress.get("skipped", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"phalanx.train.fit(resume={o.resume!r}): the checkpoint has no training "
                                  f"position (progress={progress!r}); was it written by fit?") from exc
        return state

    if latest:
        found = run.manager.first_good(use)
        if found is None:
            return False
        state = found[1]
    elif o.resume is not None:
        state = use(load_checkpoint(os.fspath(o.resume)))
    else:
        return False
    _check_global_batch(run, state.get("progress") or {})
    extra = state.get("extra") or {}
    if isinstance(extra.get("history"), str):
        run.history.records = History.from_json(extra["history"]).records
    val_steps = run.history.steps("val/loss") if "val/loss" in run.history else []
    run.progress.validated_at = val_steps[-1] if val_steps else -1
    return True


def _check_global_batch(run: RunState, progress: dict[str, Any]) -> None:
    """Warn (rank 0) when the checkpoint's steps had another global batch: the position carries over,
    but the steps that follow differ from those of an uninterrupted run."""
    saved = progress.get("global_batch")
    if saved is None and all(k in progress for k in ("batch_size", "world_size", "replicas", "accumulate")):
        saved = progress["batch_size"] * progress["world_size"] * progress["replicas"] * progress["accumulate"]
    g = run.geometry
    now = g.step_samples
    if saved is None or saved == now or run.rank != 0:
        return
    warnings.warn(
        f"phalanx.train.fit(resume={run.o.resume!r}): the checkpoint was written with a global batch of {saved} "
        f"samples per step, this run takes {now} ({g.batch_size} per worker x {g.ranks} rank(s) x {g.replicas} "
        f"replica(s) x accumulate={g.accumulate}); training continues at the next unseen sample, but not as "
        f"the uninterrupted run would. Pass global_batch_size={saved} to keep it at any number of ranks.",
        RuntimeWarning, stacklevel=4)
