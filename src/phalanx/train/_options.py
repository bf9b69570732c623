"""The keyword options of :func:`phalanx.train.fit`: declared, typed, documented and checked in one place."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from .._errors import InvalidArgumentError

if TYPE_CHECKING:  # phalanx.torch imports torch; this module stays light
    from ..torch._common import Compression

__all__ = ["OPTIONS_DOC", "OPTION_NAMES", "FailurePolicy", "FitOptions", "Precision", "SchedulerInterval",
           "worker_batch"]

Precision = Literal["bf16", "fp16"] | None
FailurePolicy = Literal["skip", "raise"]
SchedulerInterval = Literal["step", "epoch"]

_POLICIES = ("skip", "raise")
_PRECISIONS = (None, "bf16", "fp16")


# The documentation of every option, written once: the docstrings of FitOptions and of fit are built
# from it (the option names are FitOptions' fields; fit's signature takes exactly those keywords).
OPTIONS_DOC = """
    Data:
        batch_size: samples per worker (a rank, or a replica) and micro-step.
        global_batch_size: instead of ``batch_size``: samples per optimizer step over every worker and
            micro-step; each worker takes ``global_batch_size / (ranks x replicas x accumulate)``, so the
            steps, and the result, stay the same when a restart changes the number of ranks.
        epochs, steps: when to stop, in epochs and/or optimizer steps (whichever comes first).
        val_data, val_every, val_batch_size: evaluated every ``val_every`` steps (default: every
            epoch and at the end), every sample exactly once across ranks, in batches of
            ``val_batch_size`` (default ``batch_size``).
        topk: top-k accuracies reported for class logits, e.g. ``(1, 5)``; ``()`` for none.
        seed, shuffle: the sample order of each epoch (the same at any world size).
        num_workers, collate_fn: passed to the DataLoader.
    Optimisation:
        scheduler, scheduler_interval: an LR scheduler over the optimizer (or a function
            ``optimizer -> scheduler``), stepped every optimizer ``"step"`` or every ``"epoch"``.
        accumulate: micro-batches per optimizer step (the first ones without communication).
        grad_clip: the maximal gradient norm, or ``None``.
        replicas: in-process replicas (an int or a list of devices), composable with processes.
        compression, bucket_cap_mb: for the :class:`phalanx.torch.DistributedOptimizer` fit wraps around
            the optimizer (compression: None, ``"bf16"``, ``"fp16"``, ``"powersgd"`` or a
            ``phalanx.torch.PowerSGD``).
        shard: ``"optimizer"`` or ``"gradients"``: shard the optimizer state (and the gradients) across
            the ranks, ZeRO stage 1 or 2 (``docs/sharding.md``; not with replicas); ``"parameters"``:
            the parameters too, ZeRO stage 3 (fit wraps the model in ``DataParallel(shard="parameters",
            units=units)`` and moves the optimizer onto its sharded parameters); None: no sharding.
            Checkpoints hold the whole state and resume at any number of ranks, sharded or not.
        units: with ``shard="parameters"``, the modules gathered together (module classes, a callable
            picking modules, or None: each block of the model's ``nn.ModuleList``).
    Precision:
        precision: ``None`` (as the model is), ``"bf16"`` (autocast) or ``"fp16"`` (autocast and a
            GradScaler).
    Checkpointing:
        checkpoint_dir, checkpoint_every, keep: written atomically by rank 0 every
            ``checkpoint_every`` steps (default: every epoch), on a stop signal and at the end;
            the newest ``keep`` are kept.
        resume: ``"latest"`` (the newest checkpoint in ``checkpoint_dir`` every rank can load; a damaged
            one makes every rank fall back to the previous one) or a path: continue from the exact
            sample and RNG state, also at another number of workers.
    Failure policy:
        on_nonfinite: a NaN/Inf loss, or NaN/Inf gradients with a finite loss, on any rank:
            ``"skip"`` the step or ``"raise"`` TrainingError, on every rank alike.
        on_oom: an out-of-memory error on any rank: the same choice.
        max_skipped: more skipped steps in a row than this raise TrainingError.
        elastic: go on through lost ranks in place: under ``phalanx run --backend gloo --max-restarts K``
            (or ``--min-ranks M``) the survivors re-form the world, redo the interrupted step on the same
            ``global_batch_size`` (required) and continue; replacements join at a step boundary and
            receive the state from a live peer (sharded: every rank reloads the last checkpoint of
            ``checkpoint_dir``, required). The result equals an uninterrupted run. Elsewhere (one process,
            mpi, no such flag) it changes nothing. Not with replicas, ``shard="parameters"`` or PowerSGD.
    Logging:
        loggers, log_every: loggers (on rank 0) and how often training metrics are recorded.
        progress: a progress bar and a summary on rank 0.
        plot: the curves PNG written at the end (default ``<checkpoint_dir>/curves.png``;
            ``False`` for none)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitOptions:
    # The option names, types and defaults: fit's keyword arguments are exactly these fields.
    batch_size: int | None = None
    global_batch_size: int | None = None
    epochs: int | None = None
    steps: int | None = None
    val_data: Any = None
    val_every: int | None = None
    val_batch_size: int | None = None
    topk: Sequence[int] = (1,)
    seed: int = 0
    shuffle: bool = True
    num_workers: int = 0
    collate_fn: Callable[[list[Any]], Any] | None = None
    scheduler: Any = None
    scheduler_interval: SchedulerInterval = "step"
    accumulate: int = 1
    grad_clip: float | None = None
    replicas: int | Sequence[Any] | None = None
    compression: Compression | None = None
    bucket_cap_mb: float = 25
    shard: Literal["optimizer", "gradients", "parameters"] | None = None
    units: Any = None
    precision: Precision = None
    checkpoint_dir: str | os.PathLike[str] | None = None
    checkpoint_every: int | None = None
    keep: int = 3
    resume: str | os.PathLike[str] | None = None
    on_nonfinite: FailurePolicy = "skip"
    on_oom: FailurePolicy = "skip"
    max_skipped: int = 10
    elastic: bool = False
    loggers: Iterable[Any] = ()
    log_every: int = 10
    progress: bool = True
    plot: str | os.PathLike[str] | bool | None = None

    def __post_init__(self) -> None:
        bad = _problem(self)
        if bad:
            raise InvalidArgumentError(f"phalanx.train.fit({bad}")
        object.__setattr__(self, "topk", tuple(int(k) for k in self.topk))
        object.__setattr__(self, "loggers", tuple(self.loggers))


FitOptions.__doc__ = f"""Every keyword option of :func:`phalanx.train.fit`, checked when built; immutable.

    ``fit`` builds one from its keyword arguments; build one yourself to check
    a configuration before starting (``FitOptions(batch_size=64, epochs=10)``)
    or to reuse it (``fit(model, loss_fn, opt, data, **dataclasses.asdict(options))``
    keeps the values).
{OPTIONS_DOC}

    Raises:
        InvalidArgumentError: an option out of range, naming it and what to give instead.
    """
OPTION_NAMES = tuple(field.name for field in dataclasses.fields(FitOptions))


def _positive(value: Any, allow_none: bool = False) -> bool:
    if value is None:
        return allow_none
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _problem(o: FitOptions) -> str | None:
    """What is wrong with ``o``, as ``"name=value): what to give"``, or None."""
    if (o.batch_size is None) == (o.global_batch_size is None):
        return (f"batch_size={o.batch_size!r}, global_batch_size={o.global_batch_size!r}): give exactly one: "
                "batch_size (samples per worker) or global_batch_size (samples per optimizer step over every "
                "worker, kept when the number of ranks changes).")
    for name in ("accumulate", "log_every", "keep"):
        if not _positive(getattr(o, name)):
            return f"{name}={getattr(o, name)!r}): give an int >= 1."
    for name in ("batch_size", "global_batch_size", "epochs", "steps", "val_every", "val_batch_size",
                 "checkpoint_every"):
        if not _positive(getattr(o, name), allow_none=True):
            return f"{name}={getattr(o, name)!r}): give an int >= 1, or leave it out."
    if o.epochs is None and o.steps is None:
        return "...): give epochs= or steps= (or both: training stops at whichever comes first)."
    if isinstance(o.max_skipped, bool) or not isinstance(o.max_skipped, int) or o.max_skipped < 0:
        return f"max_skipped={o.max_skipped!r}): give an int >= 0."
    for name in ("on_nonfinite", "on_oom"):
        if getattr(o, name) not in _POLICIES:
            return f"{name}={getattr(o, name)!r}): use 'skip' (skip the step on every rank) or 'raise'."
    if o.precision not in _PRECISIONS:
        return f"precision={o.precision!r}): use None, 'bf16' or 'fp16'."
    if o.scheduler_interval not in ("step", "epoch"):
        return f"scheduler_interval={o.scheduler_interval!r}): use 'step' or 'epoch'."
    if isinstance(o.topk, (str, bytes)) or not isinstance(o.topk, Iterable) or any(
            isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in o.topk):
        return f"topk={o.topk!r}): give positive ints, e.g. (1, 5), or () for none."
    if o.shard is not None and o.shard not in ("optimizer", "gradients", "parameters"):
        return (f"shard={o.shard!r}): use None, 'optimizer' (ZeRO stage 1: each rank keeps 1/N of the "
                "optimizer state), 'gradients' (stage 2: also 1/N of the gradients) or 'parameters' (stage 3: "
                "also 1/N of the parameters).")
    if o.units is not None and o.shard != "parameters":
        return (f"units={o.units!r}, shard={o.shard!r}): units are what shard='parameters' gathers together. "
                "Use shard='parameters', or leave units out.")
    if o.shard is not None and o.replicas is not None:
        return (f"shard={o.shard!r}, replicas={o.replicas!r}): sharding splits the state among processes; "
                "in-process replicas each need the whole state. Use processes (phalanx run -n N) with shard=, "
                "or replicas without it.")
    if o.grad_clip is not None and not (isinstance(o.grad_clip, (int, float)) and o.grad_clip > 0):
        return f"grad_clip={o.grad_clip!r}): give the maximal gradient norm (> 0), or leave it out."
    if o.resume is not None and o.checkpoint_dir is None and str(o.resume) == "latest":
        return "resume='latest'): it needs checkpoint_dir= (where to look for the latest checkpoint)."
    if isinstance(o.num_workers, bool) or not isinstance(o.num_workers, int) or o.num_workers < 0:
        return f"num_workers={o.num_workers!r}): give an int >= 0."
    return None


def worker_batch(o: FitOptions, ranks: int, replicas: int) -> int:
    """Samples per worker and micro-step: ``batch_size``, or ``global_batch_size`` split over
    ``ranks x replicas x accumulate`` (InvalidArgumentError, alike on every rank, when it does not divide)."""
    if o.global_batch_size is None:
        assert o.batch_size is not None  # checked when o was built
        return o.batch_size
    g, parts = o.global_batch_size, ranks * replicas * o.accumulate
    if g % parts == 0:
        return g // parts
    near = " or ".join(str(m) for m in sorted({g // parts * parts, (g // parts + 1) * parts}) if m > 0)
    per_rank = replicas * o.accumulate
    ranks_hint = (f", or run on a number of ranks that divides {g // per_rank}" if g % per_rank == 0 else "")
    raise InvalidArgumentError(
        f"phalanx.train.fit(global_batch_size={g}): it does not split into {ranks} rank(s) x {replicas} "
        f"replica(s) x accumulate={o.accumulate} = {parts} equal parts. Give a multiple of {parts} "
        f"(e.g. {near}){ranks_hint}.")
