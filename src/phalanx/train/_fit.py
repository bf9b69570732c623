"""``phalanx.train.fit``: the training loop, over processes or in-process replicas."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .. import _world
from .._errors import InvalidArgumentError
from ._history import History
from ._options import FailurePolicy, FitOptions, Precision, SchedulerInterval

__all__ = ["fit"]


def fit(model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], optimizer: torch.optim.Optimizer,
        train_data: Any, *, batch_size: int | None = None, global_batch_size: int | None = None,
        epochs: int | None = None, steps: int | None = None,
        val_data: Any = None, val_every: int | None = None, val_batch_size: int | None = None,
        topk: Sequence[int] = (1,), scheduler: Any = None, scheduler_interval: SchedulerInterval = "step",
        accumulate: int = 1, precision: Precision = None, grad_clip: float | None = None,
        replicas: int | Sequence[Any] | None = None, loggers: Iterable[Any] = (), log_every: int = 10,
        progress: bool = True, checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None, keep: int = 3, resume: str | os.PathLike[str] | None = None,
        plot: str | os.PathLike[str] | bool | None = None, on_nonfinite: FailurePolicy = "skip",
        on_oom: FailurePolicy = "skip", max_skipped: int = 10, seed: int = 0, shuffle: bool = True,
        num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
        compression: str | None = None, bucket_cap_mb: float = 25) -> History:
    """Train ``model`` data-parallel on every rank (and replica) and return the metrics' :class:`History`.

    ::

        phalanx.init()
        history = phalanx.train.fit(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                                    train_set, batch_size=64, epochs=10, val_data=val_set,
                                    checkpoint_dir="runs/ckpt", resume="latest")

    Every rank calls it with the same arguments. Each optimizer step trains on
    one global batch of ``batch_size x ranks x replicas x accumulate`` samples,
    the same samples in the same order at any world size, with the gradients
    averaged over all workers; every rank starts from rank 0's model and
    optimizer state. After each step the ranks agree on its outcome, so they
    apply, skip or stop together. SIGTERM or Ctrl-C ends the run after the
    current step with a checkpoint (a second Ctrl-C interrupts at once).

    Data:
        model, loss_fn: a ``torch.nn.Module`` (or a :class:`phalanx.torch.DataParallel`, used as it
            is) and ``loss_fn(outputs, targets)`` returning the batch-mean loss.
        train_data: a map-style dataset of ``(input, target)`` samples, or a tuple ``(X, Y)``.
        batch_size: samples per worker (a rank, or a replica) and micro-step.
        global_batch_size: instead of ``batch_size``: samples per optimizer step over every worker and
            micro-step; each worker takes ``global_batch_size / (ranks x replicas x accumulate)``, so the
            steps, and the result, stay the same when a restart changes the number of ranks.
        epochs, steps: when to stop, in epochs and/or optimizer steps (whichever comes first).
        val_data, val_every, val_batch_size: evaluated every ``val_every`` steps (default: every
            epoch and at the end), every sample exactly once across ranks.
        topk: top-k accuracies reported for class logits, e.g. ``(1, 5)``.
        seed, shuffle, num_workers, collate_fn: sample order and the DataLoader.
    Optimisation:
        optimizer: a ``torch.optim.Optimizer`` over the model; fit wraps it in a
            :class:`phalanx.torch.DistributedOptimizer` for the run (one you pass is used as it is).
        scheduler, scheduler_interval: an LR scheduler (or ``optimizer -> scheduler``), stepped
            every ``"step"`` or ``"epoch"``.
        accumulate: micro-batches per optimizer step. grad_clip: the maximal gradient norm.
        replicas: in-process replicas (an int or a list of devices), composable with processes.
        compression, bucket_cap_mb: for the DistributedOptimizer fit makes (compression: None, ``"bf16"``,
            ``"fp16"``, ``"powersgd"`` or a ``phalanx.torch.PowerSGD``).
    Precision:
        precision: ``None``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast and a GradScaler).
    Checkpointing:
        checkpoint_dir, checkpoint_every, keep: written atomically by rank 0 every
            ``checkpoint_every`` steps (default: every epoch), on a stop signal and at the end;
            the newest ``keep`` are kept.
        resume: ``"latest"`` (the newest checkpoint every rank can load; a damaged one makes every
            rank fall back to the previous one) or a path: continue from the exact sample and RNG
            state, also at another number of workers.
    Failure policy:
        on_nonfinite: a NaN/Inf loss, or NaN/Inf gradients with a finite loss, on any rank:
            ``"skip"`` the step or ``"raise"`` TrainingError, on every rank alike.
        on_oom: an out-of-memory error on any rank: the same choice.
        max_skipped: more skipped steps in a row raise TrainingError.
    Logging:
        loggers, log_every: loggers (on rank 0) and how often training metrics are recorded.
        progress: a progress bar and a summary on rank 0. plot: the curves PNG written at the end
            (default ``<checkpoint_dir>/curves.png``; ``False`` for none).

    Returns:
        The :class:`History` (the same on every rank): metrics by step, and ``summary``.

    Raises:
        InvalidArgumentError: a bad argument, naming it and the fix (nothing has run): e.g. both or
            neither of ``batch_size`` and ``global_batch_size``, or a world that does not divide the latter.
        TrainingError: the failure policy stopped the run, on every rank alike, naming the step and
            the ranks where the loss or the local gradients were NaN/Inf or memory ran out.
        CheckpointError: ``resume`` names a file that cannot be restored, or no checkpoint in
            ``checkpoint_dir`` can be loaded on every rank, or rank 0 cannot write one.
    """
    options = FitOptions(
        batch_size=batch_size, global_batch_size=global_batch_size, epochs=epochs, steps=steps, val_data=val_data, val_every=val_every,
        val_batch_size=val_batch_size, topk=topk, seed=seed, shuffle=shuffle, num_workers=num_workers,
        collate_fn=collate_fn, scheduler=scheduler, scheduler_interval=scheduler_interval,
        accumulate=accumulate, grad_clip=grad_clip, replicas=replicas, compression=compression,
        bucket_cap_mb=bucket_cap_mb, precision=precision, checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every, keep=keep, resume=resume, on_nonfinite=on_nonfinite,
        on_oom=on_oom, max_skipped=max_skipped, loggers=loggers, log_every=log_every, progress=progress,
        plot=plot)
    _check_objects(model, loss_fn, optimizer)
    if not _world.initialized():
        _world.init()
    from ._run import Run

    return Run(model, loss_fn, optimizer, train_data, options).run()


def _check_objects(model: Any, loss_fn: Any, optimizer: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(f"phalanx.train.fit(model={type(model).__name__}): pass a torch.nn.Module.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(f"phalanx.train.fit(optimizer={type(optimizer).__name__}): pass a "
                                   "torch.optim.Optimizer over the model.")
    if not callable(loss_fn):
        raise InvalidArgumentError(f"phalanx.train.fit(loss_fn={type(loss_fn).__name__}): pass a callable "
                                   "loss_fn(outputs, targets) returning the batch-mean loss.")
