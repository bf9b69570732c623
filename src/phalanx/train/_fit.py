"""``phalanx.train.fit``: the training loop, over processes or in-process replicas."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch

from .. import _world
from .._errors import InvalidArgumentError
from ..torch._common import Compression
from ._history import History
from ._options import OPTION_NAMES, OPTIONS_DOC, FailurePolicy, FitOptions, Precision, SchedulerInterval

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
        on_oom: FailurePolicy = "skip", max_skipped: int = 10, elastic: bool = False, seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
        compression: Compression | None = None, bucket_cap_mb: float = 25,
        shard: Literal["optimizer", "gradients", "parameters"] | None = None, units: Any = None) -> History:
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

    What to train:
        model, loss_fn: a ``torch.nn.Module`` (or a :class:`phalanx.torch.DataParallel`, used as it
            is) and ``loss_fn(outputs, targets)`` returning the batch-mean loss.
        optimizer: a ``torch.optim.Optimizer`` over the model; fit wraps it in a
            :class:`phalanx.torch.DistributedOptimizer` for the run (one you pass is used as it is).
        train_data: a map-style dataset of ``(input, target)`` samples, or a tuple ``(X, Y)``.
    {OPTIONS}

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
    given = locals()  # the keyword options, exactly FitOptions' fields (tests/test_fit.py checks it)
    options = FitOptions(**{name: given[name] for name in OPTION_NAMES})
    _check_objects(model, loss_fn, optimizer)
    if not _world.initialized():
        _world.init()
    from ._run import Run

    return Run(model, loss_fn, optimizer, train_data, options).run()


# The keyword options' documentation is written once, with their declaration (FitOptions).
fit.__doc__ = (fit.__doc__ or "").replace("\n    {OPTIONS}", OPTIONS_DOC)


def _check_objects(model: Any, loss_fn: Any, optimizer: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(f"phalanx.train.fit(model={type(model).__name__}): pass a torch.nn.Module.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(f"phalanx.train.fit(optimizer={type(optimizer).__name__}): pass a "
                                   "torch.optim.Optimizer over the model.")
    if not callable(loss_fn):
        raise InvalidArgumentError(f"phalanx.train.fit(loss_fn={type(loss_fn).__name__}): pass a callable "
                                   "loss_fn(outputs, targets) returning the batch-mean loss.")
