"""fit's failure policy: the per-step agreement across ranks, and the one decision every rank takes from it.

Each step every rank contributes one small row: which failures it saw (a
NaN/Inf loss, NaN/Inf local gradients with a finite loss, an out-of-memory
error), whether a stop signal arrived, and its metric sums. The rows are
allgathered, so every rank sees the same table and takes the same decision:
apply the step, skip it, or raise :class:`TrainingError` naming the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from .._collectives import allgather
from .._errors import TrainingError

__all__ = ["NONFINITE_GRAD", "NONFINITE_LOSS", "OOM", "FailurePolicy", "NonFiniteLoss", "free_memory",
           "grads_finite", "is_oom"]

NONFINITE_LOSS, OOM, NONFINITE_GRAD = 1, 2, 4
_WHAT = ((NONFINITE_LOSS, "a NaN/Inf loss"), (NONFINITE_GRAD, "NaN/Inf local gradients (the loss was finite)"),
         (OOM, "an out-of-memory error"))


class NonFiniteLoss(Exception):
    """Internal: a pass's loss was NaN/Inf (caught by the step loop, never seen by users)."""


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def grads_finite(params: Iterable[torch.Tensor]) -> bool:
    """Whether every ``.grad`` of ``params`` is NaN/Inf-free (one host synchronisation in all)."""
    finite: torch.Tensor | None = None
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a sharded gradient: this rank's part
            ok = torch.isfinite(g).all()
            finite = ok if finite is None else finite & ok.to(finite.device)
    return True if finite is None else bool(finite)


class FailurePolicy:
    """The agreement and the skip/raise decision of one fit run (counts skipped steps)."""

    def __init__(self, *, on_nonfinite: str, on_oom: str, max_skipped: int, rank: int, size: int) -> None:
        self.on_nonfinite, self.on_oom, self.max_skipped = on_nonfinite, on_oom, max_skipped
        self.rank, self.size = rank, size
        self.skipped = 0
        self.skipped_in_a_row = 0

    def agree(self, failure: int, stop: float, sums: np.ndarray) -> np.ndarray:
        """Every rank's ``[failure bits, stop, loss sum, count, top-k hits...]``, as rows (collective);
        ``stop``: 1 for a stop signal, plus 2 to admit a waiting replacement (fit(elastic=True))."""
        mine = np.concatenate([[float(failure), float(stop)], sums])
        if self.size == 1:
            return mine[None, :]
        return np.asarray(allgather(mine))

    def decide(self, failures: np.ndarray, where: str, report: Callable[[str], Any]) -> bool:
        """Whether to apply the step, given every rank's failure bits; raises TrainingError per the
        policy, else counts the skip (``report`` gets the notice, on rank 0)."""
        if not failures.any():
            self.skipped_in_a_row = 0
            return True
        found = [f"{text} on rank(s) {[int(r) for r in np.flatnonzero(failures & bit)]}"
                 for bit, text in _WHAT if (failures & bit).any()]
        at = f"{where}: {' and '.join(found)}"
        nonfinite = (failures & (NONFINITE_LOSS | NONFINITE_GRAD)).any()
        if (nonfinite and self.on_nonfinite == "raise") or ((failures & OOM).any() and self.on_oom == "raise"):
            raise TrainingError(
                f"phalanx.train.fit stopped at {at}. Every rank stops here (on_nonfinite/on_oom='raise'); "
                "with 'skip' the step is skipped on every rank instead. Lower the learning rate or the batch "
                "size, or use precision=None.")
        self.skipped += 1
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row > self.max_skipped:
            raise TrainingError(
                f"phalanx.train.fit stopped at {at}: {self.skipped_in_a_row} steps in a row were skipped "
                f"(max_skipped={self.max_skipped}). The run is not recovering: lower the learning rate or the "
                "batch size, or raise max_skipped.")
        if self.rank == 0:
            report(f"phalanx.train.fit: skipped {at} (the same on every rank)")
        return False
