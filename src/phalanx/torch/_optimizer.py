"""``phalanx.torch.DistributedOptimizer``: any torch optimizer, with gradients averaged across ranks.

(One class, the whole optimizer API a user calls; its engine, sharding, step agreement and what it
shares with the wrapped optimizer live in their own modules.)

::

    opt = phalanx.torch.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()     # gradients are reduced while backward runs
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # sees reduced gradients
        opt.step()

Gradients are reduced in buckets while backward runs (``_bucket.py``;
the design is in ``docs/design.md``, "Gradient reduction").
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch

from .. import _reconfigure
from .._epochs import Epoch
from .._errors import InvalidArgumentError, UsageError
from .._groups import Group, world_for
from .._sync import synchronize
from ._bucket import GradientBuckets
from ._common import Compression, GradientOp, check_options
from ._engine_owner import EngineOwner
from ._finite import NonFinitePolicy, check_policy
from ._shard_plan import check_elementwise
from ._sharded import Sharding, check_shard
from ._trainable import Trainable
from ._wrapped import SharedWithWrapped

__all__ = ["DistributedOptimizer"]

_CALL = "torch.DistributedOptimizer"


class DistributedOptimizer(EngineOwner, SharedWithWrapped, torch.optim.Optimizer):
    """``optimizer``, with gradients averaged across ranks while backward runs, before every ``step()``.

    ::

        opt = phalanx.torch.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

    A real ``torch.optim.Optimizer`` (``isinstance`` checks, LR schedulers and
    ``GradScaler`` work) sharing ``param_groups``, ``state`` and ``defaults``
    with ``optimizer``; ``state_dict()``/``load_state_dict()`` are the wrapped
    optimizer's, so checkpoints are interchangeable with plain torch ones.
    ``isinstance(opt, torch.optim.Adam)`` is False (it is True for
    ``phalanx.horovod.torch``'s): this class is not built at run time as a
    subclass of the wrapped one; test the wrapped optimizer,
    ``isinstance(opt.optimizer, torch.optim.Adam)``. There is no
    ``synchronize()``: the gradients are already reduced when ``backward()``
    returns (accumulate under :meth:`no_sync`).
    When ``backward()`` returns, the gradients are reduced: clipping,
    ``scaler.unscale_`` and logging between backward and ``step()`` see the
    reduced values. ``step()`` reduces first only what backward did not
    (passes under :meth:`no_sync`, fewer than ``backward_passes_per_step``
    passes, or a rank that ran no backward: it sends zeros, releasing its
    peers). Every rank must call ``step()`` (or :meth:`reduce_gradients`)
    the same number of times. :attr:`engine` is the gradient engine, for code
    that changes how gradients are reduced.

    Arguments:
        optimizer: any plain torch optimizer over the model's parameters.

    Reduction:
        op: ``"avg"`` (default: the mean over ranks, as if one process saw the
            whole batch) or ``"sum"``.
        bucket_cap_mb: bucket size in MB (default 25, as DDP; the first
            bucket is at most 1 MB so communication starts early).
        compression: ``"bf16"``/``"fp16"`` send 16-bit gradients (after the
            ``1/size`` scaling); ``"powersgd"`` or :class:`PowerSGD` send
            low-rank factors with error feedback (lossy; reduced at the end of
            backward; ``docs/compression.md``); ``None`` (default) full precision.
        backward_passes_per_step: ``k`` backward passes accumulate locally
            and the ``k``-th reduces (or use :meth:`no_sync`).
        group: a :class:`phalanx.Group` (``phalanx.new_group``): reduce and
            broadcast among its members only (``"avg"`` is the mean over the
            group, the broadcast is from its group rank 0); None (default) is
            the whole world. Only members may make it.

    Sharding (``docs/sharding.md``; exact, for element-wise optimizers: SGD, Adam,
    AdamW, Adagrad, Adadelta, Adamax, ASGD, NAdam, RAdam, RMSprop, Rprop):
        shard: None (default): every rank keeps the whole optimizer state.
            ``"optimizer"`` (ZeRO stage 1): each rank keeps the optimizer state
            of, and updates, about 1/N of every bucket of parameters; the
            updated parameters are all-gathered after each ``step()``.
            Gradients are allreduced as without sharding: ``p.grad`` holds
            the whole reduced gradient after ``backward()``.
            ``"gradients"`` (ZeRO stage 2): also the gradients are
            reduce-scattered bucket by bucket while backward runs and each
            rank keeps only its slice; after ``backward()`` the model's
            ``p.grad`` is that slice as a sharded tensor (``p.grad.to_local()``
            its elements), the same object as its slice's ``.grad``. Either way
            ``opt.param_groups`` (and ``opt.state``) hold this rank's slices:
            sharded tensors shaped like the model's parameters, sharing their
            memory. torch's ``clip_grad_norm_(model.parameters(), c)`` (or
            :meth:`clip_grad_norm_`) clips by the norm over every rank's
            slices; with ``GradScaler`` use :class:`ShardedGradScaler`.
            ``state_dict()`` is the whole, unsharded state (collective), so
            checkpoints load with or without sharding, at any number of ranks.

    Set-up:
        broadcast_parameters: start from rank 0's parameters and optimizer
            state (default True).
        named_parameters: e.g. ``model.named_parameters()``, to name
            parameters in error messages.

    Failures (both off by default, at no cost):
        nonfinite: check each rank's *own* gradients for NaN/Inf as they are
            scaled for the reduction (one fused pass) and carry the flag in
            the buckets. ``"raise"``: the reducing backward (or ``step()``)
            raises NonFiniteGradientError on every rank, naming the ranks;
            ``"skip"``: every rank drops the gradients and ``step()`` applies
            no update. :meth:`nonfinite_ranks` names the ranks either way.
            Leave it off with ``GradScaler``, whose skipped inf steps are
            expected (it already skips them on every rank alike).
        check_steps: before each reduction the ranks agree on this
            optimizer's step count (one small agreement per step), so a rank
            that skipped ``step()`` is named in a CollectiveMismatchError on
            every rank before any gradient moves. Default: on when
            ``PHALANX_DEBUG=1``. ``step(step=s)`` also checks your own label.

    Raises:
        InvalidArgumentError: a bad argument (not a plain optimizer, an
            unknown ``op``/``compression``, a bucket size or pass count <= 0).
        CollectiveMismatchError: the ranks wrap different parameters (names,
            shapes, dtypes, order), on every rank alike, naming the first one.
        UsageError: ``zero_grad()`` while reductions are in flight, or
            another wrapper reduces some of these parameters and others too;
            at ``step()``, a parameter whose ``requires_grad`` changed since
            wrapping (it is named; nothing is updated).
        NonFiniteGradientError: with ``nonfinite="raise"``, on every rank.
        CollectiveTimeoutError, RankFailedError: a peer stopped reducing.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, op: GradientOp = "avg", bucket_cap_mb: float = 25,
                 compression: Compression | None = None, backward_passes_per_step: int = 1,
                 broadcast_parameters: bool = True,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 nonfinite: NonFinitePolicy | None = None, check_steps: bool | None = None,
                 group: Group | None = None, shard: Literal["optimizer", "gradients"] | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, DistributedOptimizer):
            raise InvalidArgumentError(
                f"phalanx.{_CALL}(optimizer={type(optimizer).__name__}): pass a plain torch optimizer, "
                "e.g. `DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))`.")
        check_options(_CALL, op, bucket_cap_mb, compression)
        k = backward_passes_per_step
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidArgumentError(f"phalanx.{_CALL}(backward_passes_per_step={k!r}): give the number "
                                       "of backward passes per step as an int >= 1.")
        # Optimizer.__init__ is not called: it would make param_groups and state of its own.
        self.optimizer = optimizer
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._warned_capturable_if_run_uncaptured = True
        self._patch_step_function()
        self._options: dict[str, Any] = {"op": op, "bucket_cap_mb": bucket_cap_mb, "compression": compression}
        self._passes = k
        self._names = {id(p): n for n, p in named_parameters} if named_parameters is not None else {}
        check_policy(_CALL, nonfinite)
        self._group = group
        self._check_steps = world_for(group, _CALL).debug if check_steps is None else bool(check_steps)
        check_shard(_CALL, shard, compression, group, modules=False)
        if shard is not None:
            check_elementwise(_CALL, optimizer, shard)
        self._shard = shard
        self._sharding: Sharding | None = None
        self._full_groups = [list(g["params"]) for g in optimizer.param_groups]  # what the user passed
        self._engine = self._make_engine()  # first: it checks that the ranks wrap the same parameters
        self.nonfinite = nonfinite
        if broadcast_parameters:
            self._broadcast(self._all_params())
        if self._sharding is not None:
            self._sharding.adopt(optimizer)  # after the broadcast: the whole state, then this rank's part
            self._step_supports_amp_scaling = True  # GradScaler calls step() and tells it found_inf
        self._reduced_at_step = self._engine.reductions
        if shard is None and group is None:
            _reconfigure.register(self)  # it follows a re-formed world: phalanx.reform() calls rebind()

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
        return f"DistributedOptimizer({self.optimizer!r}, {options}, backward_passes_per_step={self._passes})"

    # -- setup ------------------------------------------------------------------
    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self._full_groups for p in group]

    def _broadcast(self, params: list[torch.Tensor]) -> None:
        with torch.no_grad():
            synchronize({"parameters": params, "optimizer": self.optimizer}, root=0, group=self._group)

    def _make_engine(self) -> GradientBuckets:
        named = self._named()
        names, params = [n for n, _ in named], [p for _, p in named]
        size = world_for(self._group, _CALL).size
        shard = self._shard if size > 1 else None  # one rank has nothing to split: shard= changes nothing
        engine = GradientBuckets(params, names, call=_CALL, passes_per_reduction=self._passes, group=self._group,
                                 pad=size if shard == "gradients" else None, **self._options)
        self._trainable = Trainable(zip(names, params, strict=True))  # what the engine reduces
        if shard is not None:  # the model's own p.grad shows the reduced slices (torch's clip_grad_norm_)
            self._sharding = Sharding(engine, shard, _CALL, self._group, mirror_grads=True)
        engine.check_steps = self._check_steps
        engine.steps_by_reduction = False  # step() advances the label: a rank that skips step() is named
        return engine

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer (collective: every rank must add the same)."""
        engine = getattr(self, "_engine", None)
        if engine is not None and engine.in_flight:
            raise self._in_flight("add_param_group")
        if getattr(self, "_shard", None) is not None:
            raise UsageError(
                f"phalanx.{_CALL}(shard={self._shard!r}).add_param_group: a sharded optimizer's groups are "
                "fixed when it is wrapped. Pass every parameter group to the optimizer before wrapping it "
                "(groups with different hyper-parameters are fine), or use shard=None.")
        self.optimizer.add_param_group(param_group)
        if engine is None:
            return
        self._full_groups.append(list(self.optimizer.param_groups[-1]["params"]))
        engine.close()
        self._engine = self._make_engine()
        self._engine.step_label = engine.step_label
        self.nonfinite = engine.on_nonfinite
        self._broadcast(list(self.optimizer.param_groups[-1]["params"]))
        self._reduced_at_step = self._engine.reductions

    def rebind(self, epoch: Epoch | None = None) -> None:
        """Reduce over the current world from now on: :func:`phalanx.reform` calls it (with the new
        ``epoch``) for each optimizer with ``shard=None`` over the whole world; a call of your own then does
        nothing. Collective: a new engine over the same parameters, agreed as a replacement's construction
        agrees (``broadcast_parameters=False``); the optimizer's state is kept, the gradients dropped.
        UsageError for a sharded or group optimizer (``reform()`` leaves it alone): its state is split by
        the old world's ranks."""
        if self._shard is not None or self._group is not None:
            raise UsageError(f"phalanx.{_CALL}.rebind: a {'sharded' if self._shard else 'group'} optimizer cannot "
                             "follow a re-formed world: its state is split by the old world's ranks. Call release() "
                             "before phalanx.reform(), wrap it again after and load its state from a checkpoint "
                             "(fit(elastic=True) does), or use shard=None over the whole world.")
        old = self._engine
        if not old.closed and old.world is world_for(None, _CALL):
            return  # already reducing over the current world (reform() rebound it)
        old.close()
        for p in self._all_params():
            p.grad = None
        # The collectives of __init__ (without its broadcast), in its order: a replacement makes them there.
        check_shard(_CALL, self._shard, self._options["compression"], self._group, modules=False)
        self._engine = self._make_engine()  # its step label starts at 0, as a replacement's new one does
        self.nonfinite = old.on_nonfinite
        self._reduced_at_step = self._engine.reductions

    # -- the training loop --------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Make sure the gradients are reduced across ranks; ``step()`` will not reduce again.

        Backward normally reduces them already (then this does nothing); this
        reduces what it did not (``no_sync()`` passes, fewer than
        ``backward_passes_per_step`` passes, a rank without backward).
        Collective when it reduces: call it on every rank or on none.
        """
        if self._needs_reduction():
            self._engine.reduce()  # reductions now exceeds _reduced_at_step: step() will not reduce

    def step(self, closure: Callable[[], Any] | None = None, *,
             step: int | None = None) -> Any:
        """Reduce what backward did not (see :meth:`reduce_gradients`), then step the wrapped optimizer.

        Arguments:
            closure: as torch's (LBFGS); every backward inside it reduces, so nothing is reduced before.
            step: an optional int label, e.g. the loop's step counter, the same on every rank. The
                ranks agree on it before the update is applied (one small agreement), so a rank that
                skipped an iteration raises the same CollectiveMismatchError on every rank, naming each
                rank's step, instead of mixing steps; from then on ``check_steps`` is on.

        Returns what the wrapped optimizer's ``step`` returns (None when ``nonfinite="skip"`` dropped
        this step's gradients: then no update is applied, on every rank).
        """
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise InvalidArgumentError(f"phalanx.{_CALL}.step(step={step!r}): the step label must be an "
                                       "int (e.g. the loop's step counter), the same on every rank, or None.")
        engine = self._engine
        self._check_trainable()
        if closure is None and self._needs_reduction():
            engine.reduce()
        if step is not None:
            engine.world.enter(f"{_CALL}.step", None, None, -1, step)
            engine.check_steps = self._check_steps = True  # agreements pair with agreements from now on
        sharding = self._sharding
        if engine.on_nonfinite == "skip" and engine.nonfinite_ranks or (
                sharding is not None and self._scaler_found_inf()):
            result = None  # the gradients were dropped on every rank alike
        elif sharding is None:
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        else:
            sharding.before_step()
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            sharding.gather()
        self._reduced_at_step = engine.reductions
        engine.step_label += 1
        return result

    def _check_trainable(self) -> None:
        """UsageError when a parameter's requires_grad changed since wrapping (``_trainable.py``): before
        the update, so a parameter unfrozen on local gradients never moves."""
        self._trainable.check(_CALL, "wrap again after changing it, on every rank: "
                              "`opt = phalanx.torch.DistributedOptimizer(opt.release(), ...)`")

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters the user passed, with their names (``named_parameters`` or their place)."""
        return [(self._names.get(id(p), f"param_groups[{g}]['params'][{k}]"), p)
                for g, group in enumerate(self._full_groups) for k, p in enumerate(group)]

    def _scaler_found_inf(self) -> bool:
        """Sharded, under a GradScaler (it set ``found_inf``): whether every rank skips this step."""
        found, sharding = getattr(self, "found_inf", None), self._sharding
        return (found is not None and sharding is not None
                and sharding.scaler_found_inf(found, getattr(self, "grad_scale", None)))

    def _needs_reduction(self) -> bool:
        # Reduced by backward since the last step, and no local-only pass since: nothing to do.
        engine = self._engine
        return engine.in_flight or engine.unreduced or engine.reductions == self._reduced_at_step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; an error while a reduction is in flight, unless its world
        broke (a lost peer, e.g. raised from a backward hook): those reductions can never complete, and the
        next backward, or :meth:`rebind` after :func:`phalanx.reform`, starts afresh."""
        if self._engine.in_flight and self._engine.world.broken is None:
            raise self._in_flight("zero_grad")
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._sharding is not None:
            self._sharding.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the parameters passed to the optimizer: clip the
        reduced gradients to a total norm of ``max_norm`` and return that norm, the same on every rank.

        Sharded, torch's own line over the model's parameters does the same (call it on every rank,
        between ``backward()`` and ``step()``): with ``"gradients"`` their ``.grad`` is this rank's
        slice as a sharded tensor, whose norm is over every rank's slices (one small allreduce).
        """
        if self._sharding is not None and self._needs_reduction():
            self._engine.reduce()
        return torch.nn.utils.clip_grad_norm_(self._all_params(), max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside reduces them all."""
        engine = self._engine
        previous, engine.sync = engine.sync, False
        try:
            yield
        finally:
            engine.sync = previous

    def _in_flight(self, what: str) -> UsageError:
        return UsageError(
            f"phalanx.{_CALL}.{what}() was called while gradient reductions are in flight: a backward "
            "pass started reducing and has not finished (it raised an exception, or this is called "
            "from inside backward). Call `optimizer.reduce_gradients()` on every rank to complete "
            f"them first, then {what}().")

    # -- checkpoints: the wrapped optimizer's own ---------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` (the same on every rank after a step).

        Sharded: the whole state as the unsharded optimizer's would be, assembled from every rank's
        slices (collective: call it on every rank; each holds the whole state until it is dropped).
        """
        if self._sharding is not None:
            return self._sharding.state_dict(self.optimizer)
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict()``: a plain torch optimizer's state fits (sharded,
        too: each rank keeps its slices of it)."""
        if self._sharding is not None:
            self._sharding.load_state_dict(self.optimizer, state_dict)
        else:
            self.optimizer.load_state_dict(state_dict)

    def release(self) -> torch.optim.Optimizer:
        """Give the wrapped optimizer back as it was before wrapping (its whole parameters in its groups)
        and stop reducing; a sharded optimizer's state is dropped (its slices belong to this world's
        split). For a world that changed: wrap it again, then load its state. Local (no collective)."""
        _reconfigure.unregister(self)
        self._engine.close()
        if self._sharding is not None:
            self._sharding.release(self.optimizer)
            self._sharding = None
        for p in self._all_params():
            p.grad = None
        return self.optimizer

    def close(self) -> None:
        """Stop reducing gradients (removes the hooks) and following re-formed worlds; the optimizer is unchanged."""
        _reconfigure.unregister(self)
        self._engine.close()
