"""The state of a fit loop: how samples make up a step (:class:`Geometry`), where the run is
(:class:`Progress`), and what the reports and checkpoints read of a run (:class:`RunState`).

A leaf of ``phalanx.train``: the loop (``_run``) builds these; the reports (``_report``) and the
checkpoints (``_resume``) read them through :class:`RunState`, and a resume restores a
:class:`Progress` through its own :meth:`Progress.restore`, so none of them imports the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from .._errors import InvalidArgumentError
from ._history import History
from ._options import FitOptions

__all__ = ["Geometry", "Progress", "RunState"]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """How the samples of one run make up its steps (fixed for the run)."""

    batch_size: int  # samples per worker (a rank, or a replica) and micro-step
    ranks: int
    replicas: int  # in-process replicas per rank (1 without)
    accumulate: int  # micro-steps per optimizer step
    micro_per_epoch: int  # whole optimizer steps' worth of micro-steps in one epoch

    @classmethod
    def of(cls, samples: int, *, batch_size: int, ranks: int, replicas: int, accumulate: int) -> Geometry:
        """The geometry of ``samples`` training samples; InvalidArgumentError when they make no step."""
        global_batch = batch_size * replicas * ranks
        micro = samples // global_batch // accumulate * accumulate
        if micro == 0:
            raise InvalidArgumentError(
                f"phalanx.train.fit: train_data has {samples} samples, fewer than one optimizer step needs: "
                f"batch_size={batch_size} x {ranks} rank(s) x {replicas} replica(s) x accumulate="
                f"{accumulate} = {global_batch * accumulate}. Use a smaller (global_)batch_size.")
        return cls(batch_size, ranks, replicas, accumulate, micro)

    @property
    def local(self) -> int:
        """Samples per rank and micro-step."""
        return self.batch_size * self.replicas

    @property
    def global_batch(self) -> int:
        """Samples per micro-step, all ranks."""
        return self.local * self.ranks

    @property
    def step_samples(self) -> int:
        """Samples per optimizer step, all ranks and micro-steps."""
        return self.global_batch * self.accumulate

    @property
    def epoch_samples(self) -> int:
        """Samples the steps of one epoch take (the rest of the data set is left out)."""
        return self.micro_per_epoch * self.global_batch

    @property
    def steps_per_epoch(self) -> int:
        return self.micro_per_epoch // self.accumulate


@dataclasses.dataclass
class Progress:
    """Where a run is: its epoch, the samples of it already trained, its step, and at which step it
    last wrote a checkpoint and last validated (-1: not yet)."""

    epoch: int = 0
    start: int = 0  # samples of the epoch already trained, over all ranks
    global_step: int = 0
    saved_at: int = -1
    validated_at: int = -1

    def epochs_done(self, geometry: Geometry) -> float:
        return round(self.epoch + self.start / geometry.epoch_samples, 4)

    def position(self) -> dict[str, int]:
        """What a checkpoint records of it (the inverse of :meth:`restore`)."""
        return {"epoch": self.epoch, "samples_in_epoch": self.start, "global_step": self.global_step}

    def restore(self, position: Mapping[str, Any], *, validated_at: int = -1) -> None:
        """Continue from a checkpoint's ``position`` (written at its step, so not written again there).

        Raises KeyError, TypeError or ValueError when ``position`` lacks a field or holds no int,
        and then changes nothing (the caller says which checkpoint it was).
        """
        epoch, start, step = (int(position[key]) for key in ("epoch", "samples_in_epoch", "global_step"))
        self.epoch, self.start, self.global_step = epoch, start, step
        self.saved_at, self.validated_at = step, validated_at


class RunState(Protocol):
    """What the reports and the checkpoints read of a fit run (``_run.Run`` is one)."""

    o: FitOptions
    rank: int
    model: Any
    inner: Any  # the user's torch optimizer
    scheduler: Any
    scaler: Any
    policy: Any  # the FailurePolicy: its ``skipped`` count
    manager: Any  # the CheckpointManager, or None
    history: History
    loggers: list[Any]
    geometry: Geometry
    progress: Progress
    bar: Any
    started: float
    samples_done: int
    checkpoint: str | None
