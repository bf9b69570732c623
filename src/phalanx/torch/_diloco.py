"""``phalanx.torch.DiLoCo`` and ``LocalSGD``: H local steps per worker, then one outer step on the mean change.

::

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    diloco = phalanx.torch.DiLoCo(model, inner, sync_every=100)   # outer: Nesterov SGD, lr 0.7, momentum 0.9
    for x, y in loader:                                           # each rank its own data; nothing is averaged
        inner.zero_grad()
        loss_fn(model(x), y).backward()
        inner.step()                                              # every 100th: the outer step, on every rank

The outer loop hangs off the inner optimizer's step (a post-step hook, as
torchft's), so the training loop stays a plain one; ``diloco.step()`` is the
same as ``inner.step()``. The manual, with the exact semantics and when to
choose what: ``docs/slow-links.md``. The outer copy and its exchange live in
``_diloco_layout.py`` and ``_outer_compress.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._agreement import agree, first_difference
from .._errors import CollectiveMismatchError, InvalidArgumentError, UnsupportedArgumentError, UsageError
from .._groups import Group, world_for
from .._nonblocking import Handle, iallreduce
from .._sync import synchronize
from ._diloco_layout import Slice, build_slices, split_fragments
from ._outer_compress import OuterCompression, Quantize, average, outer_compression
from ._trainable import Trainable

__all__ = ["DiLoCo", "LocalSGD"]

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
_FOLLOWING: weakref.WeakKeyDictionary[torch.optim.Optimizer, str] = weakref.WeakKeyDictionary()
"""The inner optimizers a DiLoCo follows (until its close()), and that DiLoCo's call name."""


def _nesterov(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _int(call: str, name: str, value: Any, low: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgumentError(f"phalanx.{call}({name}={value!r}): {fix}")
    return value


class _Exchange:
    """One fragment's outer gradient in flight: started after inner step ``started``, applied after ``due``."""

    __slots__ = ("fragment", "started", "due", "handles", "means")

    def __init__(self, fragment: int, started: int, due: int, handles: list[Handle] | None,
                 means: list[torch.Tensor] | None) -> None:
        self.fragment, self.started, self.due = fragment, started, due
        self.handles, self.means = handles, means

    def result(self) -> list[torch.Tensor]:
        if self.means is None:
            assert self.handles is not None  # internal invariant: one of the two is set
            self.means = [h.wait() for h in self.handles]
            self.handles = None
        return self.means


class DiLoCo:
    """Each rank takes ``sync_every`` steps of its own; then the mean change over the ranks drives an outer step.

    ::

        diloco = phalanx.torch.DiLoCo(model, inner, sync_every=H)   # then train as usual: inner.step()

    With ``t`` the number of inner steps taken so far (``inner.step()`` or
    ``diloco.step()`` calls on this rank), ``k`` the number of workers and
    ``s = sync_every // fragments``, after every inner step:

    1. if an exchange started at ``t - delay``: the outer optimizer steps on that
       fragment's outer copy with ``grad = Δ`` (only that fragment's copies have a
       gradient), then the fragment's parameters become ``mix * outer + (1 - mix) *
       local`` (exactly ``outer`` for ``mix=1``);
    2. if ``t % s == 0``: fragment ``f = (t % sync_every) // s`` starts its exchange:
       ``Δ = mean over the k workers of (outer − local)``, computed from the
       parameters as they are now; with ``delay=0`` it is applied at once (1.).

    So fragment ``f`` is exchanged after inner steps ``t ≡ f·s (mod sync_every)``
    and applied ``delay`` steps later; with ``fragments=1, delay=0, mix=1`` this is
    DiLoCo (Douillard et al., 2023): every ``sync_every`` steps the parameters of
    every rank become the new outer copy. Inner gradients are never averaged, and
    the inner optimizer's state stays each rank's own. Buffers (BatchNorm's
    statistics) are not exchanged. Every rank must take the same number of inner
    steps: the exchange of step ``t`` carries ``t`` as its label, so a rank that
    skipped one raises CollectiveMismatchError on every rank instead of pairing
    wrongly. At construction every rank gets rank 0's parameters and inner
    optimizer state (``broadcast_parameters=False`` skips that, for ranks that
    already hold the same parameters: the outer copy is taken from each rank's
    own, and copies that differ would never agree).

    Arguments:
        model: the ``torch.nn.Module`` each rank trains (not wrapped in
            ``DataParallel``); its parameters with ``requires_grad`` are exchanged.
        inner_optimizer: the plain torch optimizer every rank steps on its own
            (not a ``DistributedOptimizer``).
        outer_optimizer: None (default: ``torch.optim.SGD(params, lr=0.7,
            momentum=0.9, nesterov=True)``) or a callable ``params -> Optimizer``
            (e.g. ``lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9)``) that is
            given the outer copies (CPU tensors, in the model's parameter order). A
            ready optimizer is refused: it would be over the model's parameters.
        sync_every: ``H``, inner steps between two exchanges of a fragment (>= 1).
        fragments: ``F`` (default 1): Streaming DiLoCo's fragments, contiguous runs
            of parameters (in the model's order) balanced by element count, exchanged
            in turn every ``H / F`` steps; ``H`` must be a multiple of ``F``.
        delay: ``τ`` (default 0): inner steps between the start of an exchange
            (non-blocking) and its application, ``0 <= τ < H / F``.
        mix: ``α`` in ``(0, 1]`` (default 1): the weight of the new outer copy
            when a fragment is applied.
        compression: None (full precision: an allreduce), ``"bf16"``, ``"fp16"``,
            ``"int8"``, ``"int4"`` or a :class:`Quantize` (with error feedback): each
            rank encodes its ``outer − local`` (plus its residual), the payloads are
            all-gathered, and every rank decodes and adds them in rank order, so Δ
            is bitwise the same on every rank. Compressed exchanges are made when
            they start (blocking); ``delay`` still delays their application.
        group: a :class:`phalanx.Group`: the workers are its members; None
            (default) is the whole world.
        broadcast_parameters: start every rank from rank 0's parameters and inner
            optimizer state (default True); False only where every rank already
            holds the same parameters (e.g. loaded from one file).

    The outer copies and the outer optimizer's state live on the CPU (float64
    for float64 parameters, float32 otherwise): :meth:`outer_parameters`,
    :attr:`outer_optimizer`. :meth:`state_dict` holds them, the inner step count,
    this rank's residuals and an exchange in flight, so a resume mid-window with
    each rank's own model, inner optimizer and DiLoCo state continues exactly.

    Raises:
        InvalidArgumentError: a bad ``sync_every``, ``fragments`` (not dividing
            ``sync_every``, or more than the parameters), ``delay``, ``mix``,
            ``compression`` or ``outer_optimizer`` (each named with the fix).
        UsageError: a ready optimizer as ``outer_optimizer``, a ``DataParallel``
            model, a ``DistributedOptimizer`` inner optimizer, or an inner optimizer
            another DiLoCo still follows (``close()`` it first).
        UnsupportedArgumentError: a ``group`` that is not a :class:`phalanx.Group`.
        CollectiveMismatchError: the ranks made DiLoCo with different settings,
            outer optimizers or parameters (on every rank, naming the first one),
            or are at different inner steps when they exchange.
        CollectiveTimeoutError, RankFailedError: a peer stopped exchanging.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: OuterFactory | None = None, *, sync_every: int, fragments: int = 1,
                 delay: int = 0, mix: float = 1.0, compression: OuterCompression | None = None,
                 group: Group | None = None, broadcast_parameters: bool = True) -> None:
        call = self._call = f"torch.{type(self).__name__}"
        self._check_objects(call, model, inner_optimizer, outer_optimizer, group)
        H = _int(call, "sync_every", sync_every, 1, "give the inner steps between exchanges as an int >= 1, "
                 "e.g. sync_every=100.")
        F = _int(call, "fragments", fragments, 1, "give the number of fragments as an int >= 1 (1: DiLoCo).")
        if H % F:
            raise InvalidArgumentError(f"phalanx.{call}(sync_every={H}, fragments={F}): fragments must divide "
                                       f"sync_every (each fragment is exchanged every sync_every / fragments "
                                       f"steps), e.g. fragments={max(d for d in range(1, F + 1) if H % d == 0)}.")
        tau = _int(call, "delay", delay, 0, "give the inner steps an exchange overlaps as an int >= 0.")
        if tau >= H // F:
            raise InvalidArgumentError(f"phalanx.{call}(delay={tau}): an exchange must be applied before the next "
                                       f"fragment's starts, so delay must be below sync_every / fragments = "
                                       f"{H // F}; use delay <= {H // F - 1} (or more steps per fragment).")
        if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0 < mix <= 1:
            raise InvalidArgumentError(f"phalanx.{call}(mix={mix!r}): give the weight of the new outer copy as "
                                       "a number in (0, 1], e.g. mix=1.0 (DiLoCo) or mix=0.5.")
        self._quantize: Quantize | None = outer_compression(call, compression)
        self._trainable = Trainable(model.named_parameters())  # the outer copy holds those trainable now
        named: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if len(named) < F:
            raise InvalidArgumentError(f"phalanx.{call}(fragments={F}): the model has {len(named)} trainable "
                                       f"parameters, fewer than fragments; use fragments <= {max(len(named), 1)}.")
        self.model, self.inner_optimizer = model, inner_optimizer
        self.sync_every, self.fragments, self.delay, self.mix = H, F, tau, float(mix)
        self.group = group
        self._world = world_for(group, call)
        self._settings = {"sync_every": H, "fragments": F, "delay": tau, "mix": float(mix),
                          "compression": repr(self._quantize)}
        bounds = split_fragments([p.numel() for _, p in named], F)
        params = [p for _, p in named]
        self._slices: list[list[Slice]] = [build_slices(params[bounds[f]:bounds[f + 1]]) for f in range(F)]
        by_param = {id(p): v for s in self._all_slices() for p, v in zip(s.params, s.views, strict=True)}
        self._outer = [by_param[id(p)] for p in params]  # the outer copies, in the model's order
        factory = _nesterov if outer_optimizer is None else outer_optimizer
        made = factory(self._outer)
        if not isinstance(made, torch.optim.Optimizer):
            raise InvalidArgumentError(f"phalanx.{call}(outer_optimizer={outer_optimizer!r}): the callable "
                                       f"returned {type(made).__name__}, not a torch optimizer; pass e.g. "
                                       "`lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, "
                                       "nesterov=True)`.")
        self.outer_optimizer = made
        self._agree(named)  # before anything moves: a rank with other settings must not take part
        if broadcast_parameters:
            synchronize({"model": model, "inner_optimizer": inner_optimizer}, group=group)
            for s in self._all_slices():
                s.flat.copy_(s.local())
        self._t = 0
        self._pending: _Exchange | None = None
        self._hook: Any = inner_optimizer.register_step_post_hook(self._after_inner_step)
        _FOLLOWING[inner_optimizer] = call

    # -- construction -----------------------------------------------------------

    @staticmethod
    def _check_objects(call: str, model: Any, inner: Any, outer: Any, group: Any) -> None:
        from ._optimizer import DistributedOptimizer
        from ._parallel import DataParallel

        if isinstance(model, DataParallel):
            raise UsageError(f"phalanx.{call}(model=DataParallel(...)): DiLoCo's workers do not average their "
                             "gradients; pass the plain module (model.module). Synchronous data parallelism "
                             "inside a group with DiLoCo between groups is not available yet.")
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(f"phalanx.{call}(model={type(model).__name__}): pass the torch.nn.Module "
                                       "each rank trains.")
        if isinstance(inner, DistributedOptimizer):
            raise UsageError(f"phalanx.{call}(inner_optimizer=DistributedOptimizer(...)): DiLoCo's inner steps "
                             "use each rank's own gradients; pass the plain optimizer (inner_optimizer.optimizer).")
        if not isinstance(inner, torch.optim.Optimizer):
            raise InvalidArgumentError(f"phalanx.{call}(inner_optimizer={type(inner).__name__}): pass a torch "
                                       "optimizer over the model's parameters, e.g. torch.optim.AdamW(...).")
        if isinstance(inner, torch.optim.Optimizer) and inner in _FOLLOWING:
            raise UsageError(f"phalanx.{call}(inner_optimizer=...): a phalanx.{_FOLLOWING[inner]} already "
                             "follows this optimizer's steps, and two would each take an outer step; call "
                             "close() on that one first (or make this one over another optimizer).")
        if isinstance(outer, torch.optim.Optimizer):
            raise UsageError(
                f"phalanx.{call}(outer_optimizer={type(outer).__name__}(...)): a ready optimizer steps the "
                "tensors it was made over, but the outer step is taken on DiLoCo's own outer copy (on the "
                "CPU). Pass a callable that makes it from the outer copy, e.g. `outer_optimizer=lambda params: "
                f"torch.optim.{type(outer).__name__}(params, lr=0.7)`, or None for Nesterov SGD "
                "(lr=0.7, momentum=0.9).")
        if outer is not None and not callable(outer):
            raise InvalidArgumentError(f"phalanx.{call}(outer_optimizer={outer!r}): pass None or a callable "
                                       "params -> torch.optim.Optimizer.")
        if group is not None and not isinstance(group, Group):
            raise UnsupportedArgumentError(
                f"phalanx.{call}(group={group!r}): pass a phalanx.Group (phalanx.new_group(ranks)) "
                "whose members are the workers, or None for the whole world. "
                "Hierarchical DiLoCo (data parallel inside a group, DiLoCo between groups) is not available yet.")

    def _all_slices(self) -> list[Slice]:
        return [s for f in self._slices for s in f]

    def _agree(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Every rank made the same DiLoCo: settings, outer optimizer and parameters (one agreement)."""
        opt = self.outer_optimizer
        hyper = [f"{k}={v!r}" for g in opt.param_groups for k, v in sorted(g.items())
                 if k != "params" and isinstance(v, (bool, int, float, str, type(None)))]
        entries = [f"{k}={v!r}" for k, v in self._settings.items()]
        entries.append(f"outer_optimizer={type(opt).__name__}({', '.join(hyper)})")
        entries += [f"parameter {n} {str(p.dtype).removeprefix('torch.')}{list(p.shape)}" for n, p in named]
        lists = agree(self._world, self._call, entries)
        if lists is None:
            return
        found = first_difference(lists, lambda r, e: e if e is not None else "(none)")
        lines = found[2] if found is not None else ""
        raise CollectiveMismatchError(
            f"phalanx.{self._call}: the ranks made it with different settings or parameters, so their outer "
            f"gradients cannot be averaged; nothing was sent. The first difference:\n{lines}\nPass the same "
            "sync_every, fragments, delay, mix, compression and outer optimizer on every rank, and build the "
            "same model there.")

    # -- the training loop ---------------------------------------------------------

    @property
    def inner_steps(self) -> int:
        """The inner steps this rank has taken since the start (a resumed count after load_state_dict)."""
        return self._t

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``inner_optimizer.step(closure)`` (the outer loop follows from its hook); returns its loss."""
        return self.inner_optimizer.step(closure) if closure is not None else self.inner_optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``inner_optimizer.zero_grad(set_to_none)``."""
        self.inner_optimizer.zero_grad(set_to_none)

    def outer_parameters(self) -> list[torch.Tensor]:
        """The outer copies (CPU tensors), in the model's order of trainable parameters."""
        return list(self._outer)

    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._t += 1
        t = self._t
        if self._pending is not None and self._pending.due <= t:
            self._complete()
        s = self.sync_every // self.fragments
        if t % s == 0:
            self._start((t % self.sync_every) // s, t)
            if self.delay == 0:
                self._complete()

    def _start(self, fragment: int, t: int) -> None:
        self._trainable.check(self._call, "make the DiLoCo again after the change (close() this one first); "
                              "its outer copy holds the parameters trainable when it was made")
        slices = self._slices[fragment]
        deltas = [s.delta() for s in slices]
        if self._quantize is None:
            handles = [iallreduce(d, "avg", step=t, group=self.group) for d in deltas]
            self._pending = _Exchange(fragment, t, t + self.delay, handles, None)
            return
        means = []
        for s, d in zip(slices, deltas, strict=True):
            mean, s.residual = average(d, self._quantize, s.residual, self.group, t)
            means.append(mean)
        self._pending = _Exchange(fragment, t, t + self.delay, None, means)

    @torch.no_grad()
    def _complete(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None  # internal invariant: called with an exchange in flight
        slices = self._slices[pending.fragment]
        for s, mean in zip(slices, pending.result(), strict=True):
            s.set_grads(mean)
        self.outer_optimizer.step()
        for s in slices:
            s.clear_grads()
            s.apply(self.mix)

    # -- ending, saving, resuming -------------------------------------------------------

    def close(self) -> None:
        """Apply an exchange still in flight now, and stop following the inner optimizer's steps."""
        if self._pending is not None:
            self._complete()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
            _FOLLOWING.pop(self.inner_optimizer, None)

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """This rank's outer state: settings, inner step count, outer copies, outer optimizer, residuals and
        an exchange in flight (waited for: every rank already started it). Save it with the model's and the
        inner optimizer's state dicts of the same rank."""
        pending = None
        if self._pending is not None:
            p = self._pending
            pending = {"fragment": p.fragment, "started": p.started, "due": p.due,
                       "means": [m.clone() for m in p.result()]}
        return {"settings": dict(self._settings), "inner_steps": self._t,
                "outer": [s.flat.clone() for s in self._all_slices()],
                "outer_optimizer": self.outer_optimizer.state_dict(),
                "residuals": [None if s.residual is None else s.residual.clone() for s in self._all_slices()],
                "pending": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s ``state`` (after loading the model's and inner optimizer's states);
        InvalidArgumentError when it was saved with other settings or another model."""
        slices = self._all_slices()
        saved = state.get("settings") if isinstance(state, dict) else None
        outer = state.get("outer") if isinstance(state, dict) else None
        if saved != self._settings or not isinstance(outer, list) or len(outer) != len(slices) \
                or any(o.shape != s.flat.shape or o.dtype != s.flat.dtype for o, s in zip(outer, slices, strict=True)):
            raise InvalidArgumentError(
                f"phalanx.{self._call}.load_state_dict: the state was saved by a DiLoCo with settings {saved} "
                f"(or another model), this one has {self._settings}; make it with the same sync_every, "
                "fragments, delay, mix and compression, over the same model.")
        for s, o, r in zip(slices, outer, state["residuals"], strict=True):
            s.flat.copy_(o)
            s.residual = None if r is None else r.clone()
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self._t = int(state["inner_steps"])
        p = state["pending"]
        self._pending = None if p is None else _Exchange(int(p["fragment"]), int(p["started"]), int(p["due"]),
                                                        None, [m.clone() for m in p["means"]])


class LocalSGD(DiLoCo):
    """Parameter averaging every ``sync_every`` steps: DiLoCo whose outer step is SGD with lr 1, no momentum.

    ::

        local = phalanx.torch.LocalSGD(model, inner, sync_every=8)   # train with inner.step() as usual

    After every ``sync_every``-th inner step each rank's parameters become the
    mean of the ranks' parameters (``outer − mean(outer − local)``, the outer
    copy kept on the CPU); between them nothing is exchanged and each rank steps
    its own inner optimizer on its own gradients. Every rank must take the same
    number of inner steps. ``state_dict()``/``load_state_dict()`` save and restore
    the outer copy and the inner step count, ``close()`` (or leaving a ``with``
    block) stops following the inner optimizer.

    Arguments:
        model: the ``torch.nn.Module`` each rank trains (not a ``DataParallel``).
        inner_optimizer: the plain torch optimizer each rank steps on its own.
        sync_every: inner steps between two averagings (>= 1).
        compression: None (full precision), ``"bf16"``, ``"fp16"``, ``"int8"``,
            ``"int4"`` or a :class:`Quantize` (with error feedback): the changes are
            all-gathered compressed and added in rank order, the same bits on every rank.
        group: a :class:`phalanx.Group` of the workers; None is the whole world.
        broadcast_parameters: start from rank 0's parameters (default True).

    Raises:
        InvalidArgumentError: a bad ``sync_every`` or ``compression``.
        UsageError: a ``DataParallel`` model or a ``DistributedOptimizer``.
        CollectiveMismatchError: the ranks passed different settings or models.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, sync_every: int,
                 compression: OuterCompression | None = None, group: Group | None = None,
                 broadcast_parameters: bool = True) -> None:
        super().__init__(model, inner_optimizer, lambda params: torch.optim.SGD(params, lr=1.0),
                         sync_every=sync_every, compression=compression, group=group,
                         broadcast_parameters=broadcast_parameters)
