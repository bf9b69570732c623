"""Horovod's ``DistributedOptimizer`` on phalanx's gradient buckets.

::

    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    isinstance(opt, torch.optim.SGD)   # True: an instance of a subclass of the optimizer's own class

As in Horovod, the returned object is an instance of a class made on the fly
that derives from the optimizer's class, sharing its ``param_groups``, ``state``
and ``defaults``. Gradients are reduced by :class:`phalanx.torch._bucket.GradientBuckets`
while backward runs (fused buckets, non-blocking), not per tensor; the
differences from Horovod are in ``docs/horovod.md``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

import phalanx

from ... import _reconfigure
from ..._epochs import Epoch
from ..._errors import InvalidArgumentError, UnsupportedArgumentError
from ...torch._bucket import GradientBuckets
from ...torch._engine_contract import Engine
from .._errors import GradientSyncOrderError
from . import _sparse_grads
from ._basics import _on_shutdown, followed
from ._compression import Compression, wire_compression
from ._functions import group_of
from ._ops import Adasum, Average, Sum
from ._optimizer_args import CALL as _CALL
from ._optimizer_args import check_groups, check_passes, names_of

__all__ = ["DistributedOptimizer"]

_live: weakref.WeakSet[Any] = weakref.WeakSet()  # Horovod optimizers whose engine hvd.shutdown() must close


def _close_engines() -> None:
    """``hvd.shutdown()``: every optimizer lets go of its engine (and, through it, of the world, whose
    rendezvous port a later ``hvd.init()`` needs again); its next step after ``hvd.init()`` makes a new one."""
    for opt in list(_live):
        engine = opt.__dict__.get("_hvd_engine")
        if engine is not None:
            engine.close()
        opt._hvd_engine, opt._hvd_stale = None, True


_on_shutdown.append(_close_engines)


_ZERO_GRAD = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
              "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
_TOO_MANY = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
             "Increase backward_passes_per_step to accumulate gradients locally.")
_CLASSES: weakref.WeakKeyDictionary[type, dict[bool, type[_HorovodOptimizer]]] = weakref.WeakKeyDictionary()


class _Buckets(GradientBuckets):
    """GradientBuckets with Horovod's post-scaling and its "too many backward passes" check, through
    the engine's hooks (the pre-scaling is its ``prescale``)."""

    def __init__(self, params: list[torch.Tensor], names: list[str], *, postscale: float, guard: bool,
                 **options: Any) -> None:
        self.guard = guard  # raise Horovod's errors (a job of more than one rank, as Horovod)
        self.synced_at = 0  # `reductions` when step()/synchronize() last consumed the gradients
        super().__init__(params, names, **options)
        self.pass_hooks.append(_check_pass)
        if postscale != 1.0:
            self.bucket_hooks.append(functools.partial(_postscale, postscale))

    @property
    def pending(self) -> bool:
        """Backward touched the gradients since step()/synchronize() last consumed them."""
        return self.in_flight or self.unreduced or self.reductions > self.synced_at


def _check_pass(engine: Engine) -> None:
    """Each backward pass: none may follow a reduction that step()/synchronize() has not consumed."""
    assert isinstance(engine, _Buckets), engine  # its own pass hook, installed by _Buckets
    if engine.guard and engine.reductions > engine.synced_at:
        raise GradientSyncOrderError(
            f"{_CALL}: {_TOO_MANY} (This backward pass came after the gradients were already reduced "
            "for this step; call optimizer.step() or optimizer.synchronize() first.)")


def _postscale(factor: float, engine: Engine, bucket: Any) -> None:
    """Each reduced bucket: Horovod's scaling after the sum (``f/size`` with gradient_predivide_factor)."""
    bucket.grads.mul_(factor)


class _HorovodOptimizer(torch.optim.Optimizer):
    """The methods Horovod adds to the user's optimizer class (placed before it in the MRO)."""

    _hvd_engine: _Buckets | None
    _hvd_sparse: set[int]  # parameters whose gradients are reduced sparse (_sparse_grads)

    def _hvd_setup(self, names: dict[int, str], compression: Any, passes: int, op: Any, predivide: float,
                   groups: Any, sparse_as_dense: bool, process_set: Any) -> None:
        self._compression = compression
        self._hvd_names = names
        self.backward_passes_per_step = passes
        self.op = op
        self.gradient_predivide_factor = predivide
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._groups = groups
        self._hvd_group = group_of(process_set)
        self._hvd_synchronized = False
        self._hvd_should_sync = True
        self._hvd_engine = None
        self._hvd_stale = False
        _sparse_grads.install(self)  # its hooks run before the engine's
        if self._hvd_group is None or self._hvd_group.member:
            self._hvd_engine = self._hvd_make_engine()
        _live.add(self)
        _reconfigure.register(self)  # after hvd's own state (registered at import): rebind() follows it

    def rebind(self, epoch: Epoch) -> None:
        """After a reset in place (``phalanx.reform`` calls it): this optimizer's engine made for the new world
        now, where a replacement's optimizer makes its own (its structure agreement), before the state's sync."""
        if not followed():  # hvd.init() was not called in this process: nothing of Horovod's to rebind
            return
        engine = self.__dict__.get("_hvd_engine")
        if engine is not None:
            engine.close()
        self._hvd_engine, self._hvd_stale = None, True
        self._hvd_current()

    def _hvd_current(self) -> _Buckets | None:
        """The engine; after hvd.shutdown() and a new hvd.init(), a new one for the new world."""
        if self._hvd_stale and phalanx.initialized():
            self._hvd_stale = False
            self._hvd_group = group_of(self.process_set)
            if self._hvd_group is None or self._hvd_group.member:
                self._hvd_engine = self._hvd_make_engine()
        return self._hvd_engine

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Horovod's map of each parameter to the name its gradient is reduced under."""
        return {p: self._hvd_names.get(id(p), f"allreduce.noname.{g}.{k}")
                for g, group in enumerate(self.param_groups) for k, p in enumerate(group["params"])}

    def _hvd_size(self) -> int:
        return phalanx.size() if self._hvd_group is None else int(self._hvd_group.size)

    def _hvd_make_engine(self) -> _Buckets | None:
        params, names = [], []
        for g, group in enumerate(self.param_groups):
            for k, p in enumerate(group["params"]):
                if id(p) in self._hvd_sparse:  # reduced sparse (_sparse_grads)
                    continue
                params.append(p)
                names.append(self._hvd_names.get(id(p), f"allreduce.noname.{g}.{k}"))
        size = self._hvd_size()
        prescale, postscale, op = None, 1.0, "avg" if self.op == Average else "sum"
        if self.op == Average and self.gradient_predivide_factor != 1.0:
            f = float(self.gradient_predivide_factor)
            prescale, postscale, op = 1.0 / f, f / size, "sum"
        options: dict[str, Any] = {"call": "horovod.torch.DistributedOptimizer", "op": op,
                                   "compression": wire_compression("DistributedOptimizer", self._compression),
                                   "passes_per_reduction": self.backward_passes_per_step}
        options["group"] = self._hvd_group
        engine = _Buckets(params, names, prescale=prescale, postscale=postscale, guard=size > 1, **options)
        # One tiny agreement before each reduction (as Horovod negotiates each step): a rank that called
        # hvd.join() makes it a mismatch on the active ranks, never a gradient paired with its exchange.
        engine.check_steps = size > 1
        return engine

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes locally before reducing (as the constructor's argument)."""
        self.backward_passes_per_step = check_passes(passes)
        if self._hvd_engine is not None:
            self._hvd_engine.passes_per_reduction = passes

    def synchronize(self) -> None:
        """Complete the reduction of every gradient now (reducing what backward did not).

        Collective over the process set. Use it before changing gradients in place (clipping),
        then step inside :meth:`skip_synchronize`.
        """
        engine = self._hvd_current()
        if engine is not None:
            if engine.in_flight or engine.unreduced or engine.reductions == engine.synced_at:
                engine.reduce()
            engine.synced_at = engine.reductions
            if not self.sparse_as_dense and _sparse_grads.reduce(self):  # new sparse parameters: out of the engine
                engine.close()
                self._hvd_engine = self._hvd_make_engine()
                if self._hvd_engine is not None:
                    self._hvd_engine.synced_at = self._hvd_engine.reductions
            self._hvd_restore_sparse()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside it, ``step()`` applies the gradients as they are (after your own :meth:`synchronize`)."""
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize the gradients (unless inside :meth:`skip_synchronize`), then step the optimizer.

        With a ``closure`` (LBFGS), every backward inside it reduces its gradients itself.
        Returns what the optimizer's own ``step`` returns.
        """
        engine = self._hvd_current()
        if self._hvd_should_sync and closure is None:
            if self._hvd_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            else:
                self.synchronize()
        self._hvd_synchronized = False
        if closure is None:
            result = super().step()
        else:
            guard = engine.guard if engine is not None else False
            if engine is not None:
                engine.guard = False
            try:
                result = super().step(closure)
            finally:
                if engine is not None:
                    engine.guard = guard
        if engine is not None:
            engine.synced_at = engine.reductions
        return result

    step.hooked = True  # type: ignore[attr-defined]  # torch must not wrap it: the base class's step runs the hooks

    def _hvd_local_step(self) -> None:
        """The optimizer's own step, with no reduction (``broadcast_optimizer_state`` makes state with it)."""
        super().step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``; an error after backward but before ``step()``/``synchronize()``.

        Raises GradientSyncOrderError (also an AssertionError, as Horovod raises) in that case.
        """
        engine = self._hvd_engine
        if engine is not None and engine.guard and engine.pending:
            raise GradientSyncOrderError(
                f"{_CALL}: {_ZERO_GRAD} Call optimizer.step() (or optimizer.synchronize()) on every rank "
                "after the backward passes, then zero_grad().")
        super().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group; its gradients are reduced too (collective: every rank adds the same)."""
        super().add_param_group(param_group)
        engine = self.__dict__.get("_hvd_engine")
        if engine is not None:
            engine.close()
            new = self._hvd_make_engine()
            if new is not None:
                new.synced_at = new.reductions
            self._hvd_engine = new

    def _hvd_restore_sparse(self) -> None:
        if isinstance(self, torch.optim.SparseAdam):  # it takes sparse gradients only; they travel dense
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and not p.grad.is_sparse:
                        p.grad = p.grad.to_sparse()


class _AdasumOptimizer(_HorovodOptimizer):
    """Horovod's Adasum optimizer: each rank steps on its own gradients, then the ranks combine the
    parameter *changes* with Adasum (``start + Adasum(delta)``)."""

    def _hvd_make_engine(self) -> _Buckets | None:
        return None  # gradients stay local: the deltas are reduced in step()

    def synchronize(self) -> None:
        """Nothing to do: with Adasum the reduction happens in ``step()``."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Not supported with Adasum: raises GradientSyncOrderError (an AssertionError, as Horovod)."""
        raise GradientSyncOrderError(f"{_CALL}(op=Adasum): skipping synchronization is not supported when "
                                     "using Adasum optimizer; call optimizer.step() alone.")
        yield  # pragma: no cover

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Evaluate ``closure`` if given, step locally, then set each parameter to its start plus the
        Adasum combination of every rank's change. Collective. Returns the closure's loss (or None)."""
        loss = closure() if closure is not None else None
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        starts = [p.detach().clone() for p in params]
        self._hvd_local_step()
        compressor = self._compression or Compression.none
        with torch.no_grad():
            packed = [compressor.compress(p.detach() - s) for p, s in zip(params, starts, strict=True)]
            reduced = _adasum([t for t, _ in packed], self.process_set)
            for p, s, r, (_, ctx) in zip(params, starts, reduced, packed, strict=True):
                p.copy_(s + compressor.decompress(r, ctx).to(p.dtype))
        return loss

    step.hooked = True  # type: ignore[attr-defined]


def _adasum(tensors: list[torch.Tensor], process_set: Any) -> list[torch.Tensor]:
    from . import _ops

    grouped = getattr(_ops, "grouped_allreduce", None)
    if grouped is None:
        raise UnsupportedArgumentError(f"{_CALL}(op=Adasum): this phalanx has no Adasum reduction "
                                       "(hvd.grouped_allreduce with op=hvd.Adasum) yet.")
    kwargs = {} if process_set is None else {"process_set": process_set}
    return list(grouped(tensors, op=Adasum, **kwargs))


def _subclass(base: type, adasum: bool) -> type[_HorovodOptimizer]:
    made = _CLASSES.setdefault(base, {})
    if adasum not in made:
        mixin = _AdasumOptimizer if adasum else _HorovodOptimizer
        made[adasum] = cast("type[_HorovodOptimizer]", type(base.__name__, (mixin, base), {
            "__module__": base.__module__, "__qualname__": base.__qualname__}))
    return made[adasum]


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,  # noqa: N802
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = None) -> torch.optim.Optimizer:
    """``optimizer``, as an instance of a subclass of its own class, whose gradients are combined across
    ranks before every ``step()``.

    Gradients are reduced in fused buckets while backward runs; ``step()`` (or
    ``synchronize()``) completes what is left. The result shares ``param_groups``
    and ``state`` with ``optimizer``; ``isinstance(result, type(optimizer))`` holds.

    Arguments:
        optimizer: any torch optimizer.
        named_parameters: ``model.named_parameters()``: names for messages; every parameter of the
            optimizer must be named, each name once.
        compression: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16`` (float16 on the wire).
        backward_passes_per_step: backward passes accumulated locally per ``step()``.
        op: ``hvd.Average`` (default), ``hvd.Sum``, or ``hvd.Adasum`` (each rank steps on its own
            gradients and the parameter changes are combined with Adasum).
        gradient_predivide_factor: with Average, gradients are scaled by ``1/f`` before the sum
            and by ``f/size`` after it.
        num_groups, groups: Horovod's explicit fusion groups: checked and accepted; phalanx's buckets
            fuse every gradient anyway.
        sparse_as_dense: sparse gradients travel dense (``SparseAdam`` gets them back sparse);
            by default they are reduced sparse, as allgathers of indices and values (``_sparse_grads``).
        process_set: reduce over its ranks only (default: every rank).

    Returns the wrapped optimizer. Raises InvalidArgumentError (bad named_parameters or groups,
    ``gradient_predivide_factor`` with an op other than Average, an op other than Average, Sum
    or Adasum), UnsupportedArgumentError (a compressor other than none/fp16),
    CollectiveMismatchError (the ranks wrap different parameters).
    """
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, _HorovodOptimizer):
        raise InvalidArgumentError(f"{_CALL}(optimizer={type(optimizer).__name__}): pass a plain torch "
                                   "optimizer, e.g. torch.optim.SGD(model.parameters(), lr=0.1).")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise InvalidArgumentError(f"{_CALL}(gradient_predivide_factor={gradient_predivide_factor!r}, "
                                   f"op={op!r}): gradient_predivide_factor not supported with op != Average.")
    if op not in (Average, Sum, Adasum):
        raise InvalidArgumentError(f"{_CALL}(op={op!r}): gradients are combined with hvd.Average (default), "
                                   "hvd.Sum or hvd.Adasum.")
    wire_compression("DistributedOptimizer", compression)
    passes = check_passes(backward_passes_per_step)
    groups = check_groups(groups, num_groups)
    names = names_of(optimizer, named_parameters)
    group = group_of(process_set)
    size = phalanx.size() if group is None else int(group.size)
    cls = _subclass(type(optimizer), op == Adasum and size > 1)
    wrapped = cls.__new__(cls)
    # Share everything with the optimizer but an instance-level step/zero_grad (an LR scheduler's wrapper).
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in ("step", "zero_grad")})
    wrapped._hvd_setup(names, compression, passes, op, gradient_predivide_factor, groups, sparse_as_dense,
                       process_set)
    return wrapped
