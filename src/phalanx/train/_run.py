"""One call of :func:`phalanx.train.fit`: set-up, the step loop, validation and checkpoints.

A step, on every rank alike: each worker runs forward and backward on its
part of the global batch (``accumulate`` times, the first ones without
communication); gradients are averaged while backward runs (the
DistributedOptimizer's or DataParallel's bucket engine, which also notes
whether this rank's own gradients were finite) or across replicas and then
processes; the failure policy (:mod:`._policy`) agrees on the outcome; then
clip, step, schedule.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from .. import _epochs, _world
from .._errors import InvalidArgumentError
from .._sync import synchronize
from . import _elastic_fit, _report
from ._batches import GlobalBatches, SeededSamples, sized
from ._history import History
from ._metrics import autocast, batch_sums, evaluate, loader_options, model_device, split_batch, to_device
from ._options import FitOptions, worker_batch
from ._policy import (
    NONFINITE_GRAD,
    NONFINITE_LOSS,
    OOM,
    FailurePolicy,
    NonFiniteLoss,
    free_memory,
    grads_finite,
    is_oom,
)
from ._progress import Geometry, Progress

if TYPE_CHECKING:
    from ..torch._bucket import GradientBuckets
    from ..torch._optimizer import DistributedOptimizer

__all__ = ["Run"]


class Run:
    """The state of one fit loop."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any, optimizer: Any, train_data: Any,
                 o: FitOptions) -> None:
        self.o, self.model, self.loss_fn = o, model, loss_fn
        _elastic_fit.check(o)
        self.elastic = o.elastic and _epochs.available()  # the world re-forms in place (_elastic_fit)
        self.grow_now = False
        self.train_data = sized("fit", "train_data", train_data)
        self.val_data = None if o.val_data is None else sized("fit", "val_data", o.val_data)
        self.rank, self.size = _world.rank(), _world.size()
        self.history = History()
        self.loggers = list(o.loggers) if self.rank == 0 else []
        self.policy = FailurePolicy(on_nonfinite=o.on_nonfinite, on_oom=o.on_oom, max_skipped=o.max_skipped,
                                    rank=self.rank, size=self.size)
        if o.shard == "parameters":
            from ._sharded_fit import shard_parameters

            self.model = model = shard_parameters(model, optimizer, o.units)
        self._wrappers(optimizer)
        self.device = model_device(model)
        from ..torch import ShardedGradScaler  # torch's GradScaler, agreeing across ranks when sharded

        self.scaler = ShardedGradScaler(self.device.type) if o.precision == "fp16" else None
        self.scheduler = o.scheduler(self.inner) if callable(o.scheduler) and not hasattr(
            o.scheduler, "step") else o.scheduler
        self.manager: Any = None
        if o.checkpoint_dir is not None:
            from ._manager import CheckpointManager

            self.manager = CheckpointManager(os.fspath(o.checkpoint_dir), keep=o.keep)
        self.geometry = Geometry.of(len(self.train_data), batch_size=worker_batch(o, self.size, self.k),
                                    ranks=self.size, replicas=self.k, accumulate=o.accumulate)
        self.progress = Progress()
        self.window = np.zeros(2 + len(o.topk))
        self.stop_signal: Any = None
        self.checkpoint: str | None = None
        self.bar: Any = None
        self.started = time.monotonic()
        self.samples_done = 0
        if self.elastic:
            _epochs.declare()
        if o.resume is not None and not _epochs.joined_late():  # a replacement's state comes from its peers
            from ._resume import resume

            resume(self)
        self._start_reduction(optimizer)

    def _wrappers(self, optimizer: Any) -> None:
        """The optimizer fit steps (the user's, or a DistributedOptimizer later), and replicas."""
        from ..torch import DataParallel, DistributedOptimizer

        self.dist_opt: DistributedOptimizer | None = None  # a DistributedOptimizer fit made (closed at the end)
        self.replicas: Any = None
        self.inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
        self.step_opt = optimizer
        self.engine: GradientBuckets | None = None  # the gradient engine: local finiteness, completion after a failed pass
        if self.o.replicas is not None:
            if isinstance(optimizer, DistributedOptimizer) or isinstance(self.model, DataParallel):
                raise InvalidArgumentError(
                    "phalanx.train.fit(replicas=...): pass the plain model and optimizer; with replicas, "
                    "fit averages gradients over the replicas and then across processes itself.")
            from ..torch import replicate

            self.replicas = replicate(self.model, self.o.replicas)
        self.k = self.replicas.count if self.replicas is not None else 1

    def _start_reduction(self, optimizer: Any) -> None:
        """Make every rank start from rank 0's state, and set up the gradient reduction."""
        from ..torch import DataParallel, DistributedOptimizer

        if self.replicas is not None:
            if self.size > 1:
                with torch.no_grad():
                    synchronize({"model": self.model, "optimizer": self.inner}, root=0)
            self.replicas.synchronize()
        elif (self.size > 1 or self.elastic) and not isinstance(self.model, DataParallel):
            if not isinstance(optimizer, DistributedOptimizer):
                self.wrap(optimizer)
            self.engine = self.step_opt.engine
        elif isinstance(self.model, DataParallel) and not self.model.shards_parameters:  # ZeRO-3 has none
            self.engine = self.model.engine
        self._engine_checked = self.engine is not None and self.engine.check_finite
        if self.engine is not None:
            self.engine.check_finite = True
        if self.elastic:
            _elastic_fit.start(self)

    def wrap(self, optimizer: Any) -> None:
        """The DistributedOptimizer fit steps (made at the start, and again by a sharded elastic run)."""
        from ..torch import DistributedOptimizer

        o = self.o
        self.dist_opt = self.step_opt = DistributedOptimizer(
            optimizer, compression=o.compression, bucket_cap_mb=o.bucket_cap_mb,
            broadcast_parameters=not self.elastic,  # elastic: _elastic_fit.start brings the newest state
            shard=None if o.shard == "parameters" else o.shard,  # "parameters": wrapped in DataParallel
            named_parameters=self.model.named_parameters())

    # -- the loop -------------------------------------------------------------------
    def total_steps(self) -> int:
        o = self.o
        limits = [s for s in (o.steps, o.epochs * self.geometry.steps_per_epoch if o.epochs else None) if s]
        return min(limits)

    def run(self) -> History:
        total = self.total_steps()
        for lg in self.loggers:
            lg.log_hparams(_report.hparams(self, total))
        self.bar = _report.progress_bar(self.o.progress and self.rank == 0, total, self.progress.global_step)
        from ._signals import StopSignal

        stop_ctx = StopSignal() if threading.current_thread() is threading.main_thread() else None
        try:
            with stop_ctx if stop_ctx is not None else contextlib.nullcontext():
                self.stop_signal = stop_ctx
                if self.elastic:
                    _elastic_fit.train(self, total)
                else:
                    self._train(total)
            self._log_train()
            if self.history.stopped is None:
                self._validate_if()
            self._checkpoint()
        finally:
            if self.bar is not None:
                self.bar.close()
            if self.engine is not None:
                self.engine.check_finite = self._engine_checked
            if self.dist_opt is not None:
                self.dist_opt.close()
        _report.finish(self, total)
        return self.history

    def _loader(self) -> tuple[DataLoader, GlobalBatches]:
        o, g = self.o, self.geometry
        batches = GlobalBatches(len(self.train_data), local=g.local, parts_before=self.rank * g.local,
                                total=g.global_batch, epoch=self.progress.epoch, seed=o.seed,
                                shuffle=o.shuffle)
        # One loader for the whole run: its workers persist across epochs; the batch sampler runs in this
        # process, so setting its epoch and start before each iter() is enough. Its own generator: each
        # iter() draws a worker base seed, which from the global generator would shift the RNG stream
        # of a run resumed mid-epoch (dropout would then differ from the uninterrupted run).
        loader = DataLoader(SeededSamples(self.train_data, o.seed), batch_sampler=batches,
                            num_workers=o.num_workers, collate_fn=o.collate_fn,
                            persistent_workers=o.num_workers > 0, generator=torch.Generator().manual_seed(o.seed),
                            **loader_options(o.num_workers))
        return loader, batches

    def _train(self, total: int) -> None:
        o, at = self.o, self.progress
        per_step = self.geometry.step_samples
        loader, batches = self._loader()
        while at.global_step < total:
            steps_left = (self.geometry.epoch_samples - at.start) // per_step
            limit = min(steps_left, total - at.global_step)
            done = 0
            if limit > 0:
                batches.epoch, batches.start = at.epoch, at.start
                micro: list[Any] = []
                for batch in loader:
                    if self.grow_now:  # every rank agreed in the last step's exchange: admit the replacement
                        raise _elastic_fit.GrowRequested  # before this step (after the last one's epoch end)
                    micro.append(batch)
                    if len(micro) < o.accumulate:
                        continue
                    stop = self._step(micro)
                    micro = []
                    done += 1
                    if stop:
                        break
                    if o.val_every and at.global_step % o.val_every == 0:
                        self._validate()
                    if o.checkpoint_every and at.global_step % o.checkpoint_every == 0:
                        self._checkpoint()
                    if done == limit:
                        break
            if self.history.stopped is not None:
                self._checkpoint()
                return
            if done == steps_left:  # the epoch is complete
                self._end_epoch(total)

    def _end_epoch(self, total: int) -> None:
        self.progress.epoch, self.progress.start = self.progress.epoch + 1, 0
        if self.scheduler is not None and self.o.scheduler_interval == "epoch":
            self.scheduler.step()
        if self.progress.global_step < total:
            if not self.o.val_every:
                self._validate_if()
            if not self.o.checkpoint_every:
                self._checkpoint()

    def _step(self, micro: list[Any]) -> bool:
        """One optimizer step over the micro-batches; returns whether to stop (a signal)."""
        o = self.o
        self.step_opt.zero_grad(set_to_none=True)
        if self.replicas is not None:
            self.replicas.zero_grad(set_to_none=True)
        sums, failure = self._passes(micro)
        if self.replicas is not None:
            if not failure and not grads_finite(p for rep in self.replicas for p in rep.parameters()):
                failure |= NONFINITE_GRAD
            self.replicas.allreduce_gradients("avg")
        stop = self.stop_signal is not None and self.stop_signal.requested
        grow = self.elastic and self.rank == 0 and _epochs.grow_requested()  # rank 0 asks, all learn it here
        view = self.policy.agree(failure, float(stop) + 2.0 * grow, sums)
        self.grow_now = bool((view[:, 1] >= 2).any())
        where = f"step {self.progress.global_step} (epoch {self.epochs_done():g})"
        if self.policy.decide(view[:, 0].astype(int), where, lambda text: _report.message(self.bar, text)):
            self._apply_step()
        else:
            self.step_opt.zero_grad(set_to_none=True)
        self.samples_done += self.geometry.step_samples
        self.window += view[:, 2:].sum(axis=0)
        self.progress.global_step += 1
        self.progress.start += self.geometry.step_samples  # with the step: a resync reads both
        if self.bar is not None:
            self.bar.update(1)
        if self.progress.global_step % o.log_every == 0:
            self._log_train()
        if (view[:, 1] % 2).any():
            self.history.stopped = self._stop_name()
            return True
        return False

    def _passes(self, micro: list[Any]) -> tuple[np.ndarray, int]:
        """Forward and backward over the micro-batches: metric sums and this rank's failure bits."""
        sums = np.zeros(2 + len(self.o.topk))
        failure = 0
        for j, batch in enumerate(micro):
            last = j == len(micro) - 1
            try:
                if self.replicas is not None:
                    sums += self._replica_pass(batch)
                else:
                    with self._no_sync(last):
                        sums += self._pass(batch)
            except NonFiniteLoss:
                failure |= NONFINITE_LOSS
            except Exception as exc:
                if not is_oom(exc):
                    raise
                failure |= OOM
                free_memory(self.device)
                if last and self.engine is not None:
                    self.engine.reduce()  # peers wait for this rank's buckets: send what there is
        grads_ok = self.replicas is not None or self._local_grads_finite()  # always: it resets the note
        if not failure and not grads_ok:
            failure |= NONFINITE_GRAD
        return sums, failure

    def _local_grads_finite(self) -> bool:
        """Whether this rank's own gradients were finite: noted by the engine before it reduced them,
        or checked here when nothing reduces them (one process)."""
        if self.engine is not None:
            return bool(self.engine.take_local_finite())
        return grads_finite(self.model.parameters())

    def _pass(self, batch: Any) -> np.ndarray:
        o = self.o
        inputs, targets = split_batch("fit", to_device(batch, self.device))
        with autocast(self.device, o.precision):
            outputs = self.model(inputs)
            loss = self.loss_fn(outputs, targets)
        sums = np.array(batch_sums(outputs, targets, loss, o.topk))
        finite = math.isfinite(sums[0])
        scaled = loss / o.accumulate
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        if not finite:
            raise NonFiniteLoss
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
                loss = self.loss_fn(outputs, y)
            sums = batch_sums(outputs, y, loss, o.topk)
            scaled = loss / o.accumulate
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            return sums

        results = np.array(withdevices(work, reps))
        if not np.isfinite(results[:, 0]).all():
            raise NonFiniteLoss
        return results.sum(axis=0)

    def _no_sync(self, last: bool) -> Any:
        if last or self.size == 1:
            return contextlib.nullcontext()
        owner: Any = self.step_opt if hasattr(self.step_opt, "no_sync") else self.model  # DataParallel
        return owner.no_sync()

    def _apply_step(self) -> None:
        o = self.o
        if o.grad_clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.step_opt)
            params = [p for group in self.inner.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)  # sharded slices: norms over every rank's
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
    def epochs_done(self) -> float:
        return self.progress.epochs_done(self.geometry)

    def _record(self, metrics: dict[str, float]) -> None:
        record = {"step": self.progress.global_step, "epoch": self.epochs_done(), **metrics}
        self.history.append(record)
        for lg in self.loggers:
            lg.log_metrics(metrics, self.progress.global_step)

    def _log_train(self) -> None:
        w, self.window = self.window, np.zeros_like(self.window)
        metrics = _report.train_metrics(self, w)
        if metrics is not None:
            self._record(metrics)

    def _validate_if(self) -> None:
        """Validate unless already done at this step."""
        if self.val_data is not None and self.progress.validated_at != self.progress.global_step:
            self._validate()

    def _validate(self) -> None:
        o = self.o
        if self.val_data is None:
            return
        model = self.replicas[0] if self.replicas is not None else self.model
        metrics = evaluate(model, self.loss_fn, self.val_data,
                           batch_size=o.val_batch_size or self.geometry.batch_size, topk=o.topk,
                           num_workers=o.num_workers, collate_fn=o.collate_fn, precision=o.precision)
        self.progress.validated_at = self.progress.global_step
        self._record(metrics)
        _report.validation(self, metrics)

    def _checkpoint(self) -> None:
        """Write a checkpoint unless one was written at this step."""
        at = self.progress
        if self.manager is None or at.saved_at == at.global_step:
            return
        from ._resume import capture

        self.checkpoint = self.manager.save(capture(self, self.manager.path(at.global_step)), at.global_step)
        at.saved_at = at.global_step

    def _stop_name(self) -> str:
        name = self.stop_signal.signal_name if self.stop_signal is not None else None
        return name or "signal on another rank"

