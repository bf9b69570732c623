"""Loss and top-k accuracy, reduced across ranks as sums and counts.

::

    metrics = phalanx.train.evaluate(model, F.cross_entropy, val_set, batch_size=256, topk=(1, 5))
    # {"val/loss": 0.61, "val/top1": 0.83, "val/top5": 0.97, "val/samples": 10000.0}

Each rank evaluates its own part of the data (sizes differ by at most one,
every sample exactly once: ``remainder="exact"``), then the sums of losses,
of correct predictions and of samples are added up across ranks, so the
result is that of one process over the whole set, whatever the world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from .. import _world
from .._collectives import allreduce
from .._data import partition
from .._errors import InvalidArgumentError
from ._batches import sized

__all__ = ["evaluate", "batch_sums"]


def batch_sums(outputs: Any, targets: Any, loss: torch.Tensor, topk: Sequence[int]) -> list[float]:
    """``[loss * n, n, correct@k for k in topk]`` for one batch whose ``loss`` is a batch mean.

    Top-k counts are those of class logits (``outputs`` of shape ``(n, classes)`` and integer
    ``targets`` of shape ``(n,)``); for any other kind of output they are NaN (and not reported).
    """
    n = _batch_len(targets)
    sums = [float(loss.detach()) * n, float(n)]
    if topk and _is_classification(outputs, targets):
        with torch.no_grad():
            kmax = min(max(topk), outputs.shape[1])
            top = outputs.topk(kmax, dim=1).indices
            hit = top == targets.reshape(-1, 1).to(top.device)
            sums += [float(hit[:, :min(k, kmax)].any(dim=1).sum()) for k in topk]
    else:
        sums += [float("nan")] * len(topk)
    return sums


def _is_classification(outputs: Any, targets: Any) -> bool:
    return (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.ndim == 2
            and targets.ndim == 1 and not targets.is_floating_point() and not targets.is_complex())


def _batch_len(targets: Any) -> int:
    if isinstance(targets, torch.Tensor):
        return int(targets.shape[0]) if targets.ndim else 1
    return len(targets)


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors in a (nested) batch moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def split_batch(call: str, batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch from a dataset of ``(input, target)`` samples."""
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise InvalidArgumentError(
        f"phalanx.train.{call}: a batch must be (inputs, targets), i.e. the dataset's samples must be "
        f"(input, target) pairs; got a {type(batch).__name__}"
        + (f" of {len(batch)} parts" if isinstance(batch, (list, tuple)) else "")
        + ". Wrap the dataset so that it returns pairs, or pass collate_fn= to build them.")


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def evaluate(model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], data: Any, *,
             batch_size: int, topk: Sequence[int] = (1,), prefix: str = "val", num_workers: int = 0,
             collate_fn: Callable[[list[Any]], Any] | None = None, precision: str | None = None,
             reduce: bool = True) -> dict[str, float]:
    """Mean loss and top-k accuracy of ``model`` over all of ``data`` (collective when ``reduce``).

    >>> phalanx.train.evaluate(model, F.cross_entropy, val_set, batch_size=256, topk=(1, 5))
    {'val/loss': 0.41, 'val/top1': 0.89, 'val/top5': 0.99, 'val/samples': 10000.0}

    What is evaluated:
        model: a ``torch.nn.Module`` (or a ``phalanx.torch.DataParallel``); put in eval
            mode, run under ``torch.no_grad()``, and its mode restored afterwards.
        loss_fn: ``loss_fn(outputs, targets)`` returning the batch mean (as torch's
            losses do by default).
        data: a map-style dataset of ``(input, target)`` samples. Each rank
            evaluates its own exact share (no sample twice, none left out).
        topk: the ``k`` of each top-k accuracy (for class logits; skipped otherwise).

    How it is loaded:
        batch_size: samples per batch on each rank (an int >= 1).
        num_workers: DataLoader worker processes (0: load in this process).
        collate_fn: builds a batch from a list of samples (None: torch's default).
        precision: ``None`` (float32), ``"bf16"`` or ``"fp16"``: autocast for the forward pass.

    What comes back:
        prefix: the metric names' prefix (``"val"`` gives ``"val/loss"``).
        reduce: True: sum over all ranks (collective: every rank must call it);
            False: this rank's share only.

    Returns ``{prefix/loss, prefix/top{k}..., prefix/samples}`` as floats (the loss
    and accuracies NaN when there were no samples). Raises InvalidArgumentError
    (bad ``batch_size``, a dataset without ``len``, a batch that is not
    ``(inputs, targets)``), and when ``reduce`` the collective errors
    (CollectiveTimeoutError, RankFailedError).
    """
    data = sized("evaluate", "data", data)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"phalanx.train.evaluate(batch_size={batch_size!r}): give an int >= 1.")
    rank, size = (_world.rank(), _world.size()) if _world.initialized() else (0, 1)
    part = partition(len(data), rank, size, "exact")
    module = getattr(model, "module", model)  # DataParallel: no buffer broadcast (shards differ in length)
    whole = getattr(model, "full_parameters", contextlib.nullcontext)  # sharded parameters gathered once
    device = model_device(module)
    sums = np.zeros(2 + len(topk))
    with whole():  # collective: every rank, whatever its part
        if len(part):
            loader = DataLoader(Subset(data, list(part)), batch_size=batch_size, shuffle=False,
                                num_workers=num_workers, collate_fn=collate_fn, **loader_options(num_workers))
            was_training = module.training
            module.eval()
            try:
                with torch.no_grad(), autocast(device, precision):
                    for batch in loader:
                        inputs, targets = split_batch("evaluate", to_device(batch, device))
                        outputs = module(inputs)
                        sums += batch_sums(outputs, targets, loss_fn(outputs, targets), topk)
            finally:
                module.train(was_training)
    if reduce and size > 1:
        sums = allreduce(sums)
    count = sums[1]
    metrics = {f"{prefix}/loss": float(sums[0] / count) if count else float("nan")}
    for k, correct in zip(topk, sums[2:], strict=True):
        if not np.isnan(correct):  # NaN: the outputs are not class logits
            metrics[f"{prefix}/top{k}"] = float(correct / count) if count else float("nan")
    metrics[f"{prefix}/samples"] = float(count)
    return metrics


def autocast(device: torch.device, precision: str | None) -> Any:
    if precision is None:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def loader_options(num_workers: int) -> dict[str, Any]:
    if num_workers <= 0:
        return {}
    from ..torch import dataloader_context

    return {"multiprocessing_context": dataloader_context(num_workers)}
