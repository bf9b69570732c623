"""The gradient bucket engine behind DistributedOptimizer and DataParallel.

::

    buckets = GradientBuckets(params, names, call="torch.DataParallel")   # op="avg", 25 MB buckets
    loss.backward()       # reduced while backward runs; when it returns every .grad is reduced
    buckets.reduce()      # reduce now what backward did not (no_sync passes, a rank without backward)
    buckets.close()       # remove the hooks

Trainable parameters go, in reverse order, into flat buffers of one dtype
and device (allocated once; ``.grad`` is a view into them); a
``post_accumulate_grad`` hook launches each bucket's non-blocking allreduce,
in bucket order, and an autograd-engine callback waits for all at the end of
backward. Why each choice, and what was measured: ``docs/design.md``
("Gradient reduction").

Extension points (``torch/_engine_hooks.py`` has the cycle in order)::

    GradientBuckets(..., prescale=f)     # the factor on each rank's gradients before the sum
    engine.pass_hooks                    # [fn(engine)]: each backward pass, before it touches the cycle
    engine.reduction_hooks               # [fn(engine)]: once per reduction, before anything is sent
    engine.reducer                       # launch/flush/complete: how a bucket is reduced (allreduce)
    engine.bucket_hooks                  # [fn(engine, bucket)]: each bucket, once reduced

A reducer or hook reads ``engine.buckets`` (:class:`~._bucket_hot.Bucket`),
``engine.views`` (each parameter's gradient view), ``engine.params``,
``engine.world`` and ``engine.call``; the rest is private.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Variable
from torch.utils.weak import WeakIdKeyDictionary

from .. import _trace
from .._errors import UsageError
from .._groups import world_for
from ._bucket_hot import Bucket as _Bucket
from ._bucket_hot import adopt_scaled, scale_unscaled
from ._bucket_layout import lay_out
from ._common import Compression, GradientOp, check_options, verify_same_structure, wire_dtype
from ._ddp import refuse_ddp
from ._engine_contract import BucketHook, BucketReducer, EngineHook
from ._engine_hooks import reducer_for, reduces_nothing
from ._finite import NonFinitePolicy, any_set, check_and_scale, nonfinite_error, ranks_with

__all__ = ["GradientBuckets"]

FIRST_BUCKET_MB = 1.0
# parameter -> the engine reducing it (by identity: a Tensor's == is elementwise)
_OWNER = WeakIdKeyDictionary()


class GradientBuckets:
    """Reduces the gradients of ``params`` across ranks while backward runs.

    Arguments:
        params, names: the parameters (frozen ones are left out) and their
            labels in error messages.
        call: the public name used in messages (``"torch.DataParallel"``).
        op, bucket_cap_mb, compression: as for the wrappers.
        passes_per_reduction: backward passes that accumulate locally before
            one reduces (set :attr:`sync` to False for passes that must not
            count, as ``no_sync()`` does).
        group: a :class:`phalanx.Group` to reduce over (its members only; ``avg``
            is the mean over the group), or None for the whole world.
        prescale: the factor on each rank's own gradients before the sum
            (default ``1/size`` with ``avg``, else 1), fixed at construction.
        pad: lay each bucket out for a reduce-scatter over ``pad`` ranks
            (``lay_out``); its reducer then owns when the buckets' memory exists.

    The wrappers own one each (their ``engine`` property); the extension
    points (``reducer``, ``pass_hooks``, ``reduction_hooks``,
    ``bucket_hooks``) are in the module docstring.
    """

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], *, call: str, op: GradientOp = "avg",
                 bucket_cap_mb: float = 25, compression: Compression | None = None,
                 passes_per_reduction: int = 1, group: Any = None, prescale: float | None = None,
                 pad: int | None = None) -> None:
        check_options(call, op, bucket_cap_mb, compression)
        self.call = call
        self.world = world = world_for(group, call)  # public, as params, buckets, views: hooks read them
        self._guard = world.guard(call)  # _progress's, made once: it runs in every gradient hook
        pairs = [(p, n) for p, n in zip(params, names, strict=True) if p.requires_grad]
        self.params = [p for p, _ in pairs]
        self.names = [n for _, n in pairs]  # public too: sharded slices carry them
        verify_same_structure(call, [f"{n} {str(p.dtype)[6:]}{list(p.shape)} {p.device.type}"
                                     for p, n in pairs], group=group)
        self.prescale = float(prescale) if prescale is not None else 1.0 / world.size if op == "avg" else 1.0
        self.sync = True
        self.passes_per_reduction = passes_per_reduction
        self._build(bucket_cap_mb, wire_dtype(compression), pad)
        count = len(self.params)
        self._stamp = [-1] * count  # the cycle in which each parameter was marked ready
        self._scaled = [-1] * count  # the cycle in which _adopt wrote its gradient already scaled
        self._cycle = 0
        self._remaining = [len(b.params) for b in self.buckets]
        self._launched = 0  # buckets launched in the open cycle (always a prefix)
        self._tested = 0    # buckets known complete in the open cycle (a prefix)
        self._open = False  # a reduction cycle has started and not finished
        self._task = -1     # the autograd graph task of the current backward pass
        self._syncing = False
        self._alone = False  # this pass leaves the gradients where autograd put them (reduces_nothing)
        self._passes = 0    # backward passes accumulated since the last reduction
        self.reductions = 0
        self.unreduced = False  # local gradients changed by a pass that did not reduce
        self._check_finite = False
        self._local_bad: dict[torch.device, torch.Tensor] = {}  # this rank's flags since take_local_finite
        self.on_nonfinite: NonFinitePolicy | None = None  # what to do when the flags say "not finite"
        self.nonfinite_ranks: list[int] = []  # with on_nonfinite: the last reduction's non-finite ranks
        self.skipped = 0     # reductions whose gradients were dropped (on_nonfinite="skip")
        self.check_steps = False  # agree on step_label before each reduction
        self.step_label = 0  # the step the next reduction belongs to
        self.steps_by_reduction = True  # each reduction advances step_label (DistributedOptimizer: step())
        self.pass_hooks: list[EngineHook] = []
        self.reduction_hooks: list[EngineHook] = []
        self.bucket_hooks: list[BucketHook] = []
        self.shadows: list[torch.Tensor] = []  # tensors whose .grad is dropped with the parameters' (shards)
        refuse_ddp(call, self.params)  # DDP would average these gradients too
        self._claim()
        self.shard_plan: Any = None  # a Sharding's plan (ZeRO-1/2), for its reducer and hooks
        self.reducer: BucketReducer = reducer_for(compression, self)
        ref = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(functools.partial(_on_grad, ref, i))
                   for i, p in enumerate(self.params)]
        self._finalizer = weakref.finalize(self, _remove, handles)

    # -- layout ---------------------------------------------------------------
    def _build(self, cap_mb: float, wire_dtype: torch.dtype | None, pad: int | None) -> None:
        self.buckets, self._bucket_of, self.views = lay_out(self.params, cap_mb=cap_mb, first_mb=FIRST_BUCKET_MB,
                                                            wire_dtype=wire_dtype, pad=pad)
        self._factors = {device: (torch.full((1,), self.prescale, dtype=torch.float32, device=device),
                                  torch.ones(1, dtype=torch.float32, device=device))
                         for device in {b.flat.device for b in self.buckets}}

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes of gradients per bucket, in launch order (for tests and tuning)."""
        return [b.grads.numel() * b.flat.element_size() for b in self.buckets]

    def _claim(self) -> None:
        """Make this engine the only one reducing its parameters (a newer wrapper takes over)."""
        older = {id(e): e for p in self.params if (e := _OWNER.get(p)) is not None and not e.closed}
        for engine in older.values():
            mine = {id(p) for p in self.params}
            if any(id(p) not in mine for p in engine.params):
                raise UsageError(
                    f"phalanx.{self.call}: some of these parameters are already reduced by a "
                    f"phalanx.{engine.call} that also reduces others. Wrap either the model "
                    "(phalanx.torch.DataParallel) or its optimizer (phalanx.torch.DistributedOptimizer), "
                    "not both, or call .close() on the earlier wrapper first.")
            engine.close()
            warnings.warn(f"phalanx.{self.call} takes over the gradient reduction of parameters that an "
                          f"earlier phalanx.{engine.call} reduced; the earlier wrapper no longer reduces "
                          "them (wrap either the model or the optimizer, not both).", stacklevel=4)
        for p in self.params:
            _OWNER[p] = self

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the hooks: this engine reduces nothing any more."""
        self._finalizer()

    # -- the hook path (runs inside backward) ----------------------------------
    def _ready(self, i: int, p: torch.Tensor) -> None:
        if not self.sync:
            self.unreduced = True
            return
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._begin_pass(task)
        if not self._syncing or self._stamp[i] == self._cycle or self._alone:
            return
        if p.grad is not self.views[i]:
            self._adopt(i, p)
        self._stamp[i] = self._cycle
        b = self._bucket_of[i]
        left = self._remaining[b] - 1
        self._remaining[b] = left
        if left == 0 and b == self._launched:
            while self._launched < len(self.buckets) and self._remaining[self._launched] == 0:
                self._launch(self._launched)
        elif self._tested < self._launched:
            self._progress()

    def _begin_pass(self, task: int) -> None:
        for hook in self.pass_hooks:
            hook(self)
        if self._open:  # an earlier pass left its cycle open (a nested or aborted backward): close it
            self._finish()
        self._task = task
        self._syncing = self._passes + 1 >= self.passes_per_reduction
        self._alone = self._syncing and reduces_nothing(self)  # a world of one: no copy, no collective
        if not self._syncing:
            self.unreduced = True
        Variable._execution_engine.queue_callback(functools.partial(_on_backward_end, weakref.ref(self), task))

    def _end_pass(self) -> None:
        self._task = -1
        if self._syncing:
            self._finish()
        else:
            self._passes += 1

    def _adopt(self, i: int, p: torch.Tensor) -> None:
        """Copy a gradient autograd made into the bucket, scaled (one pass), and point ``.grad`` at the view."""
        b = self._bucket_of[i]
        if not self.buckets[b].live:
            self.reducer.prepare(self, b)
        adopt_scaled(self.views[i], p.grad, self.prescale)  # type: ignore[arg-type]
        self._scaled[i] = self._cycle
        p.grad = self.views[i]

    def _progress(self) -> None:
        """Note the buckets done so far, in order (a backend's test raises PeerLost where MPI saw a peer fail)."""
        t = self._tested
        try:
            with self._guard:  # a RankFailedError, as from the wait: fit(elastic=True) re-forms
                while t < self._launched and self.buckets[t].request.test():
                    if _trace.ON:
                        _trace.bucket_done(self.buckets[t])
                    t += 1
        finally:
            self._tested = t

    # -- launching and completing ----------------------------------------------
    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if not bucket.live:
            self.reducer.prepare(self, b)
        bucket.presence.fill_(1)
        if self._remaining[b]:
            self._fill_missing(bucket)
        if b == 0 and (self.check_steps or self.reduction_hooks):
            self._start_reduction()
        scale = scale_unscaled(bucket, self.views, self._scaled, self._cycle, self.prescale)
        if self._check_finite:  # this rank's own gradients, before they are mixed with the others'
            device = bucket.flat.device
            scale32, one32 = self._factors[device]
            check_and_scale(bucket.grads, bucket.found, scale, one32 if scale == 1.0 else scale32, one32)
            bucket.flag.copy_(bucket.found)
            bad = self._local_bad.get(device)
            if bad is None:
                self._local_bad[device] = bucket.found.clone()
            else:
                bad.add_(bucket.found)
        elif scale != 1.0:
            bucket.grads.mul_(scale)
        bucket.request = self.reducer.launch(self, b)
        self._launched = b + 1
        self._open = True

    def _fill_missing(self, bucket: _Bucket) -> None:
        """Parameters not marked ready: their current ``.grad`` if any (into the view), else zeros."""
        for j, i in enumerate(bucket.params):
            if self._stamp[i] == self._cycle:
                continue
            p = self.params[i]
            if p.grad is None:
                self.views[i].zero_()
                self._scaled[i] = self._cycle
                bucket.presence[j] = 0
                bucket.absent.append(j)
            elif p.grad is not self.views[i]:
                self._adopt(i, p)

    def _complete(self, bucket: _Bucket) -> None:
        self.reducer.complete(self, bucket)
        bucket.request = None
        if _trace.ON:
            _trace.bucket_done(bucket)
        if bucket.absent:
            seen = bucket.presence.tolist()
            for j in bucket.absent:
                if seen[j] > 0:  # another rank had a gradient: this rank gets the reduced one
                    i = bucket.params[j]
                    self.params[i].grad = self.views[i]
            bucket.absent = []
        for hook in self.bucket_hooks:
            hook(self, bucket)

    def _finish(self) -> None:
        """Launch what is not launched yet (in order), wait for everything, close the cycle."""
        alone = self._launched == 0 and reduces_nothing(self)  # a world of one: each gradient is its sum
        try:
            while not alone and self._launched < len(self.buckets):
                self._launch(self._launched)
            if not alone:
                self.reducer.flush(self)
            for bucket in self.buckets:
                if bucket.request is not None:
                    self._complete(bucket)
        finally:
            self._close_cycle()
        self.unreduced = False
        self.reductions += 1
        if self.steps_by_reduction:
            self.step_label += 1
        if self._check_finite and self.on_nonfinite is not None:
            self._act_on_nonfinite()

    def _close_cycle(self) -> None:
        self._cycle += 1
        self._remaining = [len(b.params) for b in self.buckets]
        self._launched = self._tested = 0
        self._open = False
        self._passes = 0

    def _start_reduction(self) -> None:
        """Before the first bucket of a reduction: with ``check_steps`` every rank reduces for the same
        step (else the same CollectiveMismatchError on every rank, naming each rank's step, before any
        gradient moves); then the reduction hooks."""
        try:
            if self.check_steps:
                self.world.enter(self.call, None, None, -1, self.step_label)
            for hook in self.reduction_hooks:
                hook(self)
        except BaseException:
            self._close_cycle()  # nothing was launched: the next backward starts afresh
            raise

    def _act_on_nonfinite(self) -> None:
        """After a reduction: if the summed flags say some rank's own gradients were not finite (the
        same on every rank), name those ranks and raise or drop the gradients, on every rank alike."""
        self.nonfinite_ranks = []
        if not any_set([b.flag for b in self.buckets]):
            return
        self.nonfinite_ranks = ranks_with(any_set([b.found for b in self.buckets]))
        if self.on_nonfinite == "raise":
            raise nonfinite_error(self.call, self.nonfinite_ranks)
        for p in (*self.params, *self.shadows):  # optimizers skip parameters without a gradient
            p.grad = None
        self.skipped += 1

    # -- what the wrappers call --------------------------------------------------
    @property
    def in_flight(self) -> bool:
        """True while a reduction cycle is open (between its first launch and its completion)."""
        return self._open

    @property
    def check_finite(self) -> bool:
        """Note, at each launch, whether this rank's own gradients were finite (read with
        :meth:`take_local_finite`), and carry the flag in the bucket (summed over ranks)."""
        return self._check_finite

    @check_finite.setter
    def check_finite(self, on: bool) -> None:
        if not on and self._check_finite and not self._open:
            for bucket in self.buckets:  # no stale flag travels while the check is off
                bucket.flag.zero_()
        self._check_finite = bool(on)

    def take_local_finite(self) -> bool:
        """With ``check_finite``: whether this rank's local gradients in every bucket launched since the
        last call were finite (NaN/Inf-free) before the reduction; resets. True when nothing was checked."""
        bad = any_set(list(self._local_bad.values())) if self._local_bad else False
        for flag in self._local_bad.values():
            flag.zero_()
        return not bad

    def reduce(self) -> None:
        """Complete the open reduction, or reduce the current gradients now if none is open.

        Collective: every rank must call it (the wrappers call it from step()
        only when backward did not already reduce on this rank).
        """
        if self.closed:
            return
        self._task = -1
        self._finish()


def _on_grad(ref: weakref.ref[GradientBuckets], index: int, param: torch.Tensor) -> None:
    engine = ref()
    if engine is not None:
        engine._ready(index, param)


def _on_backward_end(ref: weakref.ref[GradientBuckets], task: int) -> None:
    engine = ref()
    if engine is not None and engine._task == task and not engine.closed:
        engine._end_pass()


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
