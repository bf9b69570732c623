"""``phalanx.train.fit``: the training loop, over processes or in-process replicas.

::

    phalanx.init()
    history = phalanx.train.fit(
        model, torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
        train_set, batch_size=64, epochs=10,               # 64 samples per worker and step
        val_data=val_set, topk=(1, 5),                     # every epoch, on the whole set, once
        scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000),
        checkpoint_dir="runs/ckpt", resume="latest",       # atomic, exact resume, SIGTERM-safe
        loggers=[phalanx.train.JSONLinesLogger("runs/metrics.jsonl")], plot="runs/curves.png")

What one step does, on every rank alike:

1. each rank (each replica, with ``replicas=k``) takes its part of the next
   global batch (see :mod:`phalanx.train._batches`: the same samples per step
   at any world size), runs forward and backward (``accumulate`` times, the
   first ones without communication), under autocast with ``precision``;
2. gradients are averaged over all workers — by
   :class:`phalanx.torch.DistributedOptimizer` (wrapped around your optimizer
   for the run) while backward runs, or, with replicas, across the replicas
   and then across processes;
3. the ranks exchange one small vector: loss sums, sample counts, top-k hits,
   whether a loss was NaN/Inf or an out-of-memory error was caught, whether a
   stop signal arrived. Every rank then takes the same decision: step, skip
   the step (``on_nonfinite="skip"``/``on_oom="skip"``, the default), or raise
   :class:`TrainingError` (``"raise"``) — never a hang, never replicas that
   diverge;
4. clip (``grad_clip``), optimizer step (through the ``GradScaler`` for
   ``precision="fp16"``), LR schedule (``scheduler_interval``), and with
   replicas, replica 0's new parameters copied to the others.

Validation (``val_every`` steps, else every epoch and at the end) counts every
sample of ``val_data`` exactly once across ranks. Metrics go to a progress bar
and the ``loggers`` on rank 0; the returned :class:`History` holds them on
every rank. Checkpoints (``checkpoint_dir``) are written by rank 0 atomically,
every ``checkpoint_every`` steps, else every epoch, on a stop signal and at the
end; ``resume="latest"`` (or a path) continues from the exact sample and RNG
state, also at another number of workers. SIGTERM or Ctrl-C (SIGINT) ends the
run after the current step with a checkpoint; a second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from .. import _world
from .._collectives import allgather
from .._errors import InvalidArgumentError, TrainingError
from .._sync import synchronize
from ._batches import GlobalBatches, SeededSamples, sized
from ._history import History
from ._metrics import autocast, batch_sums, evaluate, loader_options, model_device, split_batch, to_device

__all__ = ["fit", "History", "TrainingError"]

_NONFINITE, _OOM = 1, 2
_POLICIES = ("skip", "raise")
_PRECISIONS = (None, "bf16", "fp16")


def fit(model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], optimizer: torch.optim.Optimizer,
        train_data: Any, *, batch_size: int, epochs: int | None = None, steps: int | None = None,
        val_data: Any = None, val_every: int | None = None, val_batch_size: int | None = None,
        topk: Sequence[int] = (1,), scheduler: Any = None, scheduler_interval: str = "step",
        accumulate: int = 1, precision: str | None = None, grad_clip: float | None = None,
        replicas: int | Sequence[Any] | None = None, loggers: Iterable[Any] = (), log_every: int = 10,
        progress: bool = True, checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None, keep: int = 3, resume: str | os.PathLike[str] | None = None,
        plot: str | os.PathLike[str] | bool | None = None, on_nonfinite: str = "skip",
        on_oom: str = "skip", max_skipped: int = 10, seed: int = 0, shuffle: bool = True,
        num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
        compression: str | None = None, bucket_cap_mb: float = 25) -> History:
    """Train ``model`` on ``train_data`` and return the :class:`History` (see the module docstring).

    ``batch_size``: samples per worker and micro-step (a worker is a rank,
    or a replica with ``replicas``): the global batch of one optimizer step
    is ``batch_size x ranks x replicas x accumulate``. ``epochs`` and/or
    ``steps`` (optimizer steps) say when to stop. ``scheduler``: an LR
    scheduler over ``optimizer``, or a function ``optimizer -> scheduler``;
    stepped every optimizer step (``scheduler_interval="step"``) or epoch.
    ``precision``: ``None``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast
    and a ``GradScaler``). ``replicas``: an int k or a list of devices for
    in-process replicas (:func:`phalanx.torch.replicate`), composable with
    processes. ``plot``: where to write the curves PNG at the end (default
    ``<checkpoint_dir>/curves.png``; ``False`` for none). ``on_nonfinite`` /
    ``on_oom``: ``"skip"`` the step on every rank or ``"raise"``
    :class:`TrainingError` on every rank; more than ``max_skipped`` skips in
    a row raise too. ``compression``/``bucket_cap_mb``: for the
    :class:`~phalanx.torch.DistributedOptimizer` that ``fit`` wraps around
    ``optimizer`` (a ``DistributedOptimizer`` you pass, or a
    :class:`~phalanx.torch.DataParallel` model, is used as it is).
    """
    if not _world.initialized():
        _world.init()
    options = _Options.check(locals())
    return _Run(options).run()


class _Options:
    """The arguments of fit, checked once (errors name the argument and the fix)."""

    @classmethod
    def check(cls, args: dict[str, Any]) -> _Options:
        self = cls()
        self.__dict__.update(args)
        bad = _bad_arguments(args)
        if bad:
            raise InvalidArgumentError(f"phalanx.train.fit: {bad}")
        self.train_data = sized("fit", "train_data", args["train_data"])
        if args["val_data"] is not None:
            self.val_data = sized("fit", "val_data", args["val_data"])
        self.topk = tuple(int(k) for k in args["topk"])
        self.loggers = list(args["loggers"])
        return self


def _positive(value: Any, allow_none: bool = False) -> bool:
    if value is None:
        return allow_none
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _bad_arguments(a: dict[str, Any]) -> str | None:
    if not isinstance(a["model"], torch.nn.Module):
        return f"model={type(a['model']).__name__}: pass a torch.nn.Module."
    if not isinstance(a["optimizer"], torch.optim.Optimizer):
        return f"optimizer={type(a['optimizer']).__name__}: pass a torch.optim.Optimizer over the model."
    if not callable(a["loss_fn"]):
        return "loss_fn must be callable as loss_fn(outputs, targets) -> the batch-mean loss."
    for name in ("batch_size", "accumulate", "log_every", "keep"):
        if not _positive(a[name]):
            return f"{name}={a[name]!r}: give an int >= 1."
    for name in ("epochs", "steps", "val_every", "val_batch_size", "checkpoint_every"):
        if not _positive(a[name], allow_none=True):
            return f"{name}={a[name]!r}: give an int >= 1, or leave it out."
    if a["epochs"] is None and a["steps"] is None:
        return "give epochs= or steps= (or both: training stops at whichever comes first)."
    if isinstance(a["max_skipped"], bool) or not isinstance(a["max_skipped"], int) or a["max_skipped"] < 0:
        return f"max_skipped={a['max_skipped']!r}: give an int >= 0."
    for name in ("on_nonfinite", "on_oom"):
        if a[name] not in _POLICIES:
            return f"{name}={a[name]!r}: use 'skip' (skip the step on every rank) or 'raise'."
    if a["precision"] not in _PRECISIONS:
        return f"precision={a['precision']!r}: use None, 'bf16' or 'fp16'."
    if a["scheduler_interval"] not in ("step", "epoch"):
        return f"scheduler_interval={a['scheduler_interval']!r}: use 'step' or 'epoch'."
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in a["topk"]):
        return f"topk={a['topk']!r}: give positive ints, e.g. (1, 5), or () for none."
    if a["grad_clip"] is not None and not (isinstance(a["grad_clip"], (int, float)) and a["grad_clip"] > 0):
        return f"grad_clip={a['grad_clip']!r}: give the maximal gradient norm (> 0), or leave it out."
    if a["resume"] is not None and a["checkpoint_dir"] is None and str(a["resume"]) == "latest":
        return "resume='latest' needs checkpoint_dir= (where to look for the latest checkpoint)."
    if not isinstance(a["num_workers"], int) or a["num_workers"] < 0:
        return f"num_workers={a['num_workers']!r}: give an int >= 0."
    return None


class _Run:
    """One call of fit: the state of the loop."""

    def __init__(self, o: _Options) -> None:
        from ..torch import DataParallel, DistributedOptimizer

        self.o = o
        self.rank, self.size = _world.rank(), _world.size()
        self.model = o.model
        self.history = History()
        self.loggers = o.loggers if self.rank == 0 else []
        self.dist_opt: Any = None  # a DistributedOptimizer fit made (closed at the end)
        self.replicas: Any = None
        user_opt = o.optimizer
        self.inner = user_opt.optimizer if isinstance(user_opt, DistributedOptimizer) else user_opt
        self.step_opt = user_opt
        self.engine: Any = None  # the gradient engine to complete after a failed pass
        if o.replicas is not None:
            if isinstance(user_opt, DistributedOptimizer) or isinstance(o.model, DataParallel):
                raise InvalidArgumentError(
                    "phalanx.train.fit(replicas=...): pass the plain model and optimizer; with replicas, "
                    "fit averages gradients over the replicas and then across processes itself.")
            from ..torch import replicate

            self.replicas = replicate(o.model, o.replicas)
        self.k = self.replicas.count if self.replicas is not None else 1
        self.device = model_device(o.model)
        self.scaler = _scaler(self.device, o.precision)
        self.scheduler = o.scheduler(self.inner) if callable(o.scheduler) and not hasattr(
            o.scheduler, "step") else o.scheduler
        self.manager: Any = None
        if o.checkpoint_dir is not None:
            from ._checkpoint import CheckpointManager

            self.manager = CheckpointManager(os.fspath(o.checkpoint_dir), keep=o.keep)
        self.local = o.batch_size * self.k  # samples per rank and micro-step
        self.global_batch = self.local * self.size  # samples per micro-step, all ranks
        n = len(o.train_data)
        self.micro_per_epoch = n // self.global_batch // o.accumulate * o.accumulate
        if self.micro_per_epoch == 0:
            raise InvalidArgumentError(
                f"phalanx.train.fit: train_data has {n} samples, fewer than one optimizer step needs: "
                f"batch_size={o.batch_size} x {self.size} rank(s) x {self.k} replica(s) x "
                f"accumulate={o.accumulate} = {self.global_batch * o.accumulate}. Use a smaller batch_size.")
        self.steps_per_epoch = self.micro_per_epoch // o.accumulate
        self.epoch, self.start, self.global_step = 0, 0, 0
        self.skipped = self.skipped_in_a_row = 0
        self.window = np.zeros(2 + len(o.topk))
        self.stop_signal: Any = None
        self.checkpoint: str | None = None
        self._saved_at = self._validated_at = -1
        self.bar: Any = None
        self.started = time.monotonic()
        self.samples_done = 0
        if o.resume is not None:
            self._resume()
        if self.replicas is not None:
            if self.size > 1:
                with torch.no_grad():
                    synchronize({"model": o.model, "optimizer": self.inner}, root=0)
            self.replicas.synchronize()
        elif self.size > 1 and not isinstance(o.model, DataParallel):
            if not isinstance(user_opt, DistributedOptimizer):
                self.dist_opt = DistributedOptimizer(
                    user_opt, compression=o.compression, bucket_cap_mb=o.bucket_cap_mb,
                    named_parameters=o.model.named_parameters())
                self.step_opt = self.dist_opt
            self.engine = self.step_opt._engine
        elif isinstance(o.model, DataParallel):
            self.engine = o.model._engine

    # -- the loop -------------------------------------------------------------------
    def total_steps(self) -> int:
        o = self.o
        limits = [s for s in (o.steps, o.epochs * self.steps_per_epoch if o.epochs else None) if s]
        return min(limits)

    def run(self) -> History:
        o = self.o
        total = self.total_steps()
        for lg in self.loggers:
            lg.log_hparams(self._hparams(total))
        self.bar = _progress_bar(o.progress and self.rank == 0, total, self.global_step)
        from ._signals import StopSignal

        stop_ctx = StopSignal() if threading.current_thread() is threading.main_thread() else None
        try:
            with stop_ctx if stop_ctx is not None else contextlib.nullcontext():
                self.stop_signal = stop_ctx
                self._train(total)
            self._log_train()
            if self.history.stopped is None:
                self._validate_if()
            self._checkpoint()
        finally:
            if self.bar is not None:
                self.bar.close()
            if self.dist_opt is not None:
                self.dist_opt.close()
        self._finish(total)
        return self.history

    def _train(self, total: int) -> None:
        o = self.o
        train = SeededSamples(o.train_data, o.seed)
        per_step = self.global_batch * o.accumulate
        batches = GlobalBatches(len(o.train_data), local=self.local, parts_before=self.rank * self.local,
                                total=self.global_batch, epoch=self.epoch, seed=o.seed, shuffle=o.shuffle)
        # One loader for the whole run: its workers persist across epochs; the batch sampler runs in
        # this process, so setting its epoch and start before each iter() is enough.
        loader = DataLoader(train, batch_sampler=batches, num_workers=o.num_workers, collate_fn=o.collate_fn,
                            persistent_workers=o.num_workers > 0, **loader_options(o.num_workers))
        while self.global_step < total:
            steps_left = (self.micro_per_epoch * self.global_batch - self.start) // per_step
            limit = min(steps_left, total - self.global_step)
            done = 0
            if limit > 0:
                batches.epoch, batches.start = self.epoch, self.start
                micro: list[Any] = []
                for batch in loader:
                    micro.append(batch)
                    if len(micro) < o.accumulate:
                        continue
                    stop = self._step(micro)
                    micro = []
                    self.start += per_step
                    done += 1
                    if stop:
                        break
                    if o.val_every and self.global_step % o.val_every == 0:
                        self._validate()
                    if o.checkpoint_every and self.global_step % o.checkpoint_every == 0:
                        self._checkpoint()
                    if done == limit:
                        break
            if self.history.stopped is not None:
                self._checkpoint()
                return
            if done == steps_left:  # the epoch is complete
                self.epoch, self.start = self.epoch + 1, 0
                if self.scheduler is not None and o.scheduler_interval == "epoch":
                    self.scheduler.step()
                if self.global_step < total:
                    if not o.val_every:
                        self._validate_if()
                    if not o.checkpoint_every:
                        self._checkpoint()

    def _step(self, micro: list[Any]) -> bool:
        """One optimizer step over the micro-batches; returns whether to stop (a signal)."""
        o = self.o
        self.step_opt.zero_grad(set_to_none=True)
        if self.replicas is not None:
            self.replicas.zero_grad(set_to_none=True)
        sums = np.zeros(2 + len(o.topk))
        failure = 0
        for j, batch in enumerate(micro):
            last = j == len(micro) - 1
            try:
                if self.replicas is not None:
                    sums += self._replica_pass(batch)
                else:
                    with self._no_sync(last):
                        sums += self._pass(batch)
            except _NonFinite:
                failure |= _NONFINITE
            except Exception as exc:
                if not _is_oom(exc):
                    raise
                failure |= _OOM
                _free_memory(self.device)
                if last and self.engine is not None:
                    self.engine.reduce()  # peers wait for this rank's buckets: send what there is
        if self.replicas is not None:
            self.replicas.allreduce_gradients("avg")
        stop = self.stop_signal is not None and self.stop_signal.requested
        view = self._agree(failure, stop, sums)
        failures = view[:, 0].astype(int)
        if failures.any():
            self._on_failure(failures)
            self.step_opt.zero_grad(set_to_none=True)
        else:
            self.skipped_in_a_row = 0
            self._apply_step()
        self.samples_done += self.global_batch * o.accumulate
        totals = view[:, 2:].sum(axis=0)
        self.window += totals
        self.global_step += 1
        if self.bar is not None:
            self.bar.update(1)
        if self.global_step % o.log_every == 0:
            self._log_train()
        if view[:, 1].any():
            self.history.stopped = self._stop_name()
            return True
        return False

    def _pass(self, batch: Any) -> np.ndarray:
        o = self.o
        inputs, targets = split_batch("fit", to_device(batch, self.device))
        with autocast(self.device, o.precision):
            outputs = self.model(inputs)
            loss = o.loss_fn(outputs, targets)
        sums = np.array(batch_sums(outputs, targets, loss, o.topk))
        finite = math.isfinite(sums[0])
        scaled = loss / o.accumulate
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        if not finite:
            raise _NonFinite
        return sums

    def _replica_pass(self, batch: Any) -> np.ndarray:
        o = self.o
        from ..torch import withdevices

        inputs, targets = split_batch("fit", batch)
        parts = self.replicas.scatter((inputs, targets))
        reps = self.replicas

        def work(i: int, device: torch.device) -> list[float]:
            x, y = parts[i]
            with autocast(device, o.precision):
                outputs = reps[i](x)
                loss = o.loss_fn(outputs, y)
            sums = batch_sums(outputs, y, loss, o.topk)
            scaled = loss / o.accumulate
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            return sums

        results = np.array(withdevices(work, reps))
        if not np.isfinite(results[:, 0]).all():
            raise _NonFinite
        return results.sum(axis=0)

    def _no_sync(self, last: bool) -> Any:
        if last or self.size == 1:
            return contextlib.nullcontext()
        return self.step_opt.no_sync() if hasattr(self.step_opt, "no_sync") else self.model.no_sync()

    def _agree(self, failure: int, stop: bool, sums: np.ndarray) -> np.ndarray:
        """Every rank's ``[failure bits, stop, loss sum, count, top-k hits...]``, as rows."""
        mine = np.concatenate([[float(failure), float(stop)], sums])
        if self.size == 1:
            return mine[None, :]
        return np.asarray(allgather(mine))

    def _on_failure(self, failures: np.ndarray) -> None:
        o = self.o
        ranks = [int(r) for r in np.flatnonzero(failures)]
        what = []
        if (failures & _NONFINITE).any():
            what.append("a NaN/Inf loss")
        if (failures & _OOM).any():
            what.append("an out-of-memory error")
        where = f"step {self.global_step} (epoch {self._epochs_done():g}): {' and '.join(what)} on rank(s) {ranks}"
        if ((failures & _NONFINITE).any() and o.on_nonfinite == "raise") or (
                (failures & _OOM).any() and o.on_oom == "raise"):
            raise TrainingError(
                f"phalanx.train.fit stopped at {where}. Every rank stops here (on_nonfinite/on_oom='raise'); "
                "with 'skip' the step is skipped on every rank instead. Lower the learning rate or the batch "
                "size, or use precision=None.")
        self.skipped += 1
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row > o.max_skipped:
            raise TrainingError(
                f"phalanx.train.fit stopped at {where}: {self.skipped_in_a_row} steps in a row were skipped "
                f"(max_skipped={o.max_skipped}). The run is not recovering: lower the learning rate or the "
                "batch size, or raise max_skipped.")
        if self.rank == 0:
            _message(self.bar, f"phalanx.train.fit: skipped {where} (the same on every rank)")

    def _apply_step(self) -> None:
        o = self.o
        if o.grad_clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.step_opt)
            params = [p for group in self.inner.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.step_opt)
            self.scaler.update()
        else:
            self.step_opt.step()
        if self.replicas is not None:
            self.replicas.synchronize()
        if self.scheduler is not None and o.scheduler_interval == "step":
            self.scheduler.step()

    # -- metrics, validation, checkpoints ---------------------------------------------
    def _lr(self) -> float:
        return float(self.inner.param_groups[0]["lr"])

    def _epochs_done(self) -> float:
        return round(self.epoch + self.start / (self.micro_per_epoch * self.global_batch), 4)

    def _record(self, metrics: dict[str, float]) -> None:
        record = {"step": self.global_step, "epoch": self._epochs_done(), **metrics}
        self.history.append(record)
        for lg in self.loggers:
            lg.log_metrics(metrics, self.global_step)

    def _log_train(self) -> None:
        w, self.window = self.window, np.zeros_like(self.window)
        if not w[1]:
            return
        elapsed = time.monotonic() - self.started
        metrics = {"train/loss": float(w[0] / w[1])}
        for k, hits in zip(self.o.topk, w[2:], strict=True):
            if not math.isnan(hits):  # NaN: the outputs are not class logits
                metrics[f"train/top{k}"] = float(hits / w[1])
        metrics.update({"lr": self._lr(), "samples_per_s": self.samples_done / elapsed if elapsed else 0.0})
        self._record(metrics)
        if self.bar is not None:
            self.bar.set_postfix({"loss": f"{metrics['train/loss']:.4g}", "lr": f"{metrics['lr']:.3g}"},
                                 refresh=False)

    def _validate_if(self) -> None:
        """Validate unless already done at this step."""
        if self.o.val_data is not None and self._validated_at != self.global_step:
            self._validate()

    def _validate(self) -> None:
        o = self.o
        if o.val_data is None:
            return
        model = self.replicas[0] if self.replicas is not None else self.model
        metrics = evaluate(model, o.loss_fn, o.val_data, batch_size=o.val_batch_size or o.batch_size,
                           topk=o.topk, num_workers=o.num_workers, collate_fn=o.collate_fn,
                           precision=o.precision)
        self._validated_at = self.global_step
        self._record(metrics)
        if self.rank == 0 and not any(type(lg).__name__ == "ConsoleLogger" for lg in self.loggers):
            shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if not k.endswith("/samples"))
            train = self.history.last("train/loss")
            head = f"epoch {self._epochs_done():g} step {self.global_step}:"
            _message(self.bar, f"{head} {'' if train is None else f'train/loss {train:.4g}  '}{shown}")

    def _checkpoint(self) -> None:
        """Write a checkpoint unless one was written at this step."""
        if self.manager is None or self._saved_at == self.global_step:
            return
        from ._checkpoint import capture_state

        progress = {"epoch": self.epoch, "samples_in_epoch": self.start, "global_step": self.global_step,
                    "world_size": self.size, "replicas": self.k, "batch_size": self.o.batch_size,
                    "accumulate": self.o.accumulate, "skipped": self.skipped}
        state = capture_state(model=self.model, optimizer=self.inner, scheduler=self.scheduler,
                              scaler=self.scaler, progress=progress,
                              extra={"history": self.history.to_json()})
        self.checkpoint = self.manager.save(state, self.global_step)
        self._saved_at = self.global_step

    def _resume(self) -> None:
        from ._checkpoint import CheckpointError, load_checkpoint, restore_state

        o = self.o
        if str(o.resume) == "latest":
            state = self.manager.load_latest()
            if state is None:
                return  # nothing to resume: a fresh start
        else:
            state = load_checkpoint(os.fspath(o.resume))
        progress = restore_state(state, model=self.model, optimizer=self.inner, scheduler=self.scheduler,
                                 scaler=self.scaler)
        try:
            self.epoch = int(progress["epoch"])
            self.start = int(progress["samples_in_epoch"])
            self.global_step = int(progress["global_step"])
            self.skipped = int(progress.get("skipped", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"phalanx.train.fit(resume={o.resume!r}): the checkpoint has no training "
                                  f"position (progress={progress!r}); was it written by fit?") from exc
        extra = state.get("extra") or {}
        if isinstance(extra.get("history"), str):
            previous = History.from_json(extra["history"])
            self.history.records = previous.records
        self._saved_at = self.global_step
        val_steps = self.history.steps("val/loss") if "val/loss" in self.history else []
        self._validated_at = val_steps[-1] if val_steps else -1

    def _stop_name(self) -> str:
        name = self.stop_signal.signal_name if self.stop_signal is not None else None
        return name or "signal on another rank"

    def _hparams(self, total: int) -> dict[str, Any]:
        o = self.o
        return {"batch_size": o.batch_size, "global_batch": self.global_batch * o.accumulate,
                "ranks": self.size, "replicas": self.k, "accumulate": o.accumulate, "steps": total,
                "epochs": o.epochs, "optimizer": type(self.inner).__name__, "lr": self._lr(),
                "precision": o.precision or "fp32", "backend": _world.backend(), "seed": o.seed}

    def _finish(self, total: int) -> None:
        o = self.o
        elapsed = time.monotonic() - self.started
        h = self.history
        summary: dict[str, Any] = {
            "steps": self.global_step, "epochs": round(self.global_step / self.steps_per_epoch, 3),
            "samples": self.samples_done, "time_s": round(elapsed, 3),
            "samples_per_s": round(self.samples_done / elapsed, 1) if elapsed else 0.0,
            "skipped_steps": self.skipped, "ranks": self.size, "replicas": self.k,
            "stopped": h.stopped}
        for key in h.keys():
            value = h.last(key)
            if key.startswith(("train/", "val/")) and isinstance(value, float):
                summary[key] = value
        if "val/top1" in h:
            summary["best val/top1"] = h.best("val/top1")
        if self.checkpoint is not None:
            summary["checkpoint"] = self.checkpoint
        curves = _curves_path(o.plot, o.checkpoint_dir)
        if curves is not None and self.rank == 0 and any(len(r) > 2 for r in h.records):
            from ._plot import plot_curves

            summary["curves"] = plot_curves(h.records, curves, title="phalanx.train.fit")
        h.summary = summary
        for lg in self.loggers:
            lg.finish(summary)
        if self.rank == 0 and o.progress:
            lines = [f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}" for k, v in summary.items()]
            end = f"stopped by {h.stopped}" if h.stopped else "done"
            print(f"phalanx.train.fit {end}:\n" + "\n".join(lines), file=sys.stderr, flush=True)


class _NonFinite(Exception):
    pass


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def _free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _scaler(device: torch.device, precision: str | None) -> Any:
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def _curves_path(plot: Any, checkpoint_dir: Any) -> str | None:
    if plot is False:
        return None
    if plot is None or plot is True:
        return os.path.join(os.fspath(checkpoint_dir), "curves.png") if checkpoint_dir is not None else None
    return os.fspath(plot)


def _progress_bar(show: bool, total: int, initial: int) -> Any:
    if not show:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=True,
                mininterval=0.2 if tty else 10.0, file=sys.stderr, desc="train")


def _message(bar: Any, text: str) -> None:
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)
