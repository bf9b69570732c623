"""PowerSGD: low-rank gradient compression with error feedback (Vogels et al., 2019), for the bucket engine.

::

    psgd = phalanx.torch.PowerSGD(rank=4)                   # or compression="powersgd" (the defaults)
    opt = phalanx.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=psgd)
    ...
    psgd.bytes_per_step, psgd.uncompressed_bytes            # what one reduction sends, with and without

Each gradient matrix ``M`` (a parameter with ``ndim >= 2``, viewed as
``(shape[0], -1)``) that compression makes smaller travels as two thin
factors: ``P = M Q`` (summed over ranks, then orthonormalised) and
``Q = Mᵀ P`` (summed), and every rank applies ``P Qᵀ``. What the low rank
leaves out stays on the rank (error feedback) and is added to the next
gradient. Everything else (vectors, small matrices, the engine's presence and
non-finite slots) travels in one plain allreduce posted with the ``P`` one, so
a reduction is three collective calls per (dtype, device). The engine
prepares the buckets (the ``1/size`` scale, the finite check) as usual and
its reducer (``_engine_hooks.PowerSGDReducer``) hands them to
:meth:`PowerSGD.reduce` at the end of backward. The user's
manual: ``docs/compression.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._errors import InvalidArgumentError, UsageError
from ._engine_contract import Engine

__all__ = ["PowerSGD", "attach_powersgd", "is_powersgd"]

_CALL = "torch.PowerSGD"


class _Deferred:
    """The request of a bucket PowerSGD reduces with the others: never complete before ``reduce``,
    nothing to wait for after it (the engine's completion then only handles absent gradients)."""

    def test(self) -> bool:
        return False

    def wait(self, timeout: float | None = None) -> None:
        return None


DEFERRED = _Deferred()


def _call(world: Any, call: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the world's backend with its failures as phalanx errors (as ``_common.backend_call``)."""
    world.ready(call)
    with world.guard(call):
        return fn(*args)


class _Matrix:
    __slots__ = ("m", "p", "q", "q_next", "q_local", "error")

    def __init__(self, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor, q_next: torch.Tensor,
                 q_local: torch.Tensor, error: torch.Tensor) -> None:
        self.m, self.p, self.q, self.q_next, self.q_local, self.error = m, p, q, q_next, q_local, error


class _Layout:
    """The compressed matrices and the plain rest of the buckets of one dtype and device."""

    def __init__(self) -> None:
        self.shapes: list[tuple[torch.Tensor, int]] = []  # (gradient view as n x m, rank)
        self.segments: list[torch.Tensor] = []  # 1-D slices of the bucket buffers sent as they are
        self.matrices: list[_Matrix] = []

    def allocate(self, generator: torch.Generator) -> None:
        first = (self.shapes[0][0] if self.shapes else self.segments[0])
        dtype, device = first.dtype, first.device
        sizes = [(m.shape[0] * r, m.shape[1] * r, m.numel()) for m, r in self.shapes]
        self.p = torch.zeros(sum(s[0] for s in sizes), dtype=dtype, device=device)
        self.q, self.q_next, self.q_local = (torch.zeros(sum(s[1] for s in sizes), dtype=dtype, device=device)
                                             for _ in range(3))
        self.error = torch.zeros(sum(s[2] for s in sizes), dtype=dtype, device=device)
        self.rest = torch.zeros(sum(s.numel() for s in self.segments), dtype=dtype, device=device)
        self.rest_sizes = [s.numel() for s in self.segments]
        a = b = c = 0
        for (m, r), (np_, mq, nm) in zip(self.shapes, sizes, strict=True):
            n, k = m.shape
            q, q_next, q_local = (buf[b:b + mq].view(r, k) for buf in (self.q, self.q_next, self.q_local))  # Qᵀ
            self.matrices.append(_Matrix(m, self.p[a:a + np_].view(n, r), q, q_next, q_local,
                                         self.error[c:c + nm].view(n, k)))
            start = torch.randn(k, r, generator=generator, dtype=torch.float64)  # the same on every rank
            q.copy_(torch.linalg.qr(start).Q.t())
            a, b, c = a + np_, b + mq, c + nm


class PowerSGD:
    """Low-rank gradient compression with error feedback, for ``compression=`` of the torch wrappers.

    ::

        psgd = phalanx.torch.PowerSGD(rank=4, warmup_steps=10)
        opt = phalanx.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=psgd)

    Each gradient matrix whose compression saves bytes travels as two factors
    of ``rank`` columns (Vogels et al., 2019; DDP's ``powerSGD_hook``); what
    they leave out is kept on the rank and added to the next gradient. The
    first ``warmup_steps`` reductions are plain allreduces. Lossy: check
    convergence. One object serves one wrapper; it holds the state (``Q``
    factors, error buffers) and the byte counts. ``docs/compression.md``
    says when it pays and what it costs.

    Arguments:
        rank: columns of the factors (default 4; capped at each matrix's smaller side).
        warmup_steps: reductions sent uncompressed first (default 10).
        min_compression_rate: compress a ``n x m`` matrix only if ``n*m > rate * rank*(n+m)`` (default 2;
            0 compresses every matrix).
        error_feedback: keep what compression leaves out and add it to the next gradient (default True).
        seed: the random start of the ``Q`` factors (the same on every rank).

    Raises:
        InvalidArgumentError: a rank that is not a positive int, a negative warmup or rate, a non-int seed.
    """

    def __init__(self, rank: int = 4, *, warmup_steps: int = 10, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, seed: int = 0) -> None:
        def bad(name: str, value: Any, want: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"phalanx.{_CALL}({name}={value!r}): give {want}.")

        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise bad("rank", rank, "the number of columns of the low-rank factors as an int >= 1, e.g. 4")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise bad("warmup_steps", warmup_steps, "the number of uncompressed reductions first, an int >= 0")
        rate = min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
            raise bad("min_compression_rate", rate, "a number >= 0 (default 2; 0 compresses every matrix)")
        if not isinstance(error_feedback, bool):
            raise bad("error_feedback", error_feedback, "True or False")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise bad("seed", seed, "an int, the same on every rank")
        self.rank, self.warmup_steps, self.min_compression_rate = rank, warmup_steps, float(rate)
        self.error_feedback, self.seed = error_feedback, seed
        self.steps = 0  # reductions so far (warm-up ones included)
        self._layouts: list[_Layout] = []
        self._engine: weakref.ref[Any] | None = None
        self._plain_bytes = self._compressed_bytes = 0

    def __repr__(self) -> str:
        return (f"PowerSGD(rank={self.rank}, warmup_steps={self.warmup_steps}, "
                f"min_compression_rate={self.min_compression_rate:g}, error_feedback={self.error_feedback}, "
                f"seed={self.seed})")

    @property
    def bytes_per_step(self) -> int:
        """Bytes this rank hands to the allreduces per compressed reduction (``P``, ``Q`` and the rest)."""
        return self._compressed_bytes

    @property
    def uncompressed_bytes(self) -> int:
        """Bytes this rank would hand to the allreduces per reduction without compression (warm-up steps)."""
        return self._plain_bytes

    @property
    def compressing(self) -> bool:
        """True once warm-up is over and some matrix is compressed: the next reduction is low-rank."""
        return self.steps >= self.warmup_steps and any(lay.matrices for lay in self._layouts)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the step count, the ``Q`` factors (the same on every rank) and its own
        error buffers (each rank's differ: save them per rank), as CPU tensors."""
        return {"steps": self.steps, "q": [lay.q.cpu().clone() for lay in self._layouts],
                "error": [lay.error.cpu().clone() for lay in self._layouts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result, taken with the same model and settings.

        Raises InvalidArgumentError when its tensors do not fit this wrapper's layout.
        """
        shapes = [[t.numel() for t in state.get(k, [])] for k in ("q", "error")]
        mine = [[lay.q.numel() for lay in self._layouts], [lay.error.numel() for lay in self._layouts]]
        if shapes != mine or not isinstance(state.get("steps"), int):
            raise InvalidArgumentError(
                f"phalanx.{_CALL}.load_state_dict: the state holds factors and errors of sizes {shapes}, this "
                f"wrapper's are {mine}: load a state saved with the same model, rank and min_compression_rate "
                "(after wrapping).")
        self.steps = state["steps"]
        for lay, q, error in zip(self._layouts, state["q"], state["error"], strict=True):
            lay.q.copy_(q)
            lay.error.copy_(error)

    # -- the engine's side -------------------------------------------------------------------------
    def _attach(self, engine: Engine) -> None:
        """Lay out the state for ``engine``'s buckets (a new engine starts afresh)."""
        other = self._engine() if self._engine is not None else None
        if other is not None and other is not engine and not other.closed:
            raise UsageError(
                f"phalanx.{engine.call}(compression={self!r}): this PowerSGD object already compresses the "
                f"gradients of a phalanx.{other.call}; it holds that wrapper's state. Give each wrapper its "
                "own phalanx.torch.PowerSGD(...), or call .close() on the other wrapper first.")
        self._engine = weakref.ref(engine)
        self.steps = 0
        layouts: dict[tuple[torch.dtype, torch.device], _Layout] = {}
        for bucket in engine.buckets:
            lay = layouts.setdefault((bucket.flat.dtype, bucket.flat.device), _Layout())
            base, done = int(bucket.flat.storage_offset()), 0
            for i in bucket.params:
                view = engine.views[i]
                shape = view.shape
                if view.dim() < 2:
                    continue
                n, m = shape[0], view.numel() // max(shape[0], 1)
                r = min(self.rank, n, m)
                if n * m == 0 or not n * m > self.min_compression_rate * r * (n + m):
                    continue
                start = int(view.storage_offset()) - base
                if start > done:
                    lay.segments.append(bucket.flat[done:start])
                lay.shapes.append((view.view(n, m), r))
                done = start + view.numel()
            lay.segments.append(bucket.flat[done:])  # presence and flag slots at least
        generator = torch.Generator().manual_seed(self.seed)
        for lay in layouts.values():
            lay.allocate(generator)
        self._layouts = list(layouts.values())
        self._plain_bytes = sum(b.flat.numel() * b.flat.element_size() for b in engine.buckets)
        self._compressed_bytes = sum((lay.p.numel() + lay.q.numel() + lay.rest.numel()) * lay.rest.element_size()
                                     for lay in self._layouts)

    def reduce(self, engine: Engine) -> None:
        """Sum the engine's prepared buckets over its ranks: plainly in warm-up (each bucket's request
        posted), else low-rank (done here; every bucket's request is left as DEFERRED)."""
        world, call = engine.world, engine.call
        if not self.compressing:
            for bucket in engine.buckets:
                bucket.request = _call(world, call, world.backend.iallreduce, bucket.flat, "sum", True)
            self.steps += 1
            return
        post = world.backend.iallreduce
        rests, ps = [], []
        for lay in self._layouts:
            torch.cat(lay.segments, out=lay.rest)
            rests.append(_call(world, call, post, lay.rest, "sum", True))
            for x in lay.matrices:
                _project(x, self.error_feedback)
            ps.append(_call(world, call, post, lay.p, "sum", True))
        qs = []
        for lay, request in zip(self._layouts, ps, strict=True):
            _call(world, call, request.wait, world.timeout)
            for x in lay.matrices:
                _second_factor(x, self.error_feedback)
            lay.q_next.copy_(lay.q_local)
            qs.append(_call(world, call, post, lay.q_next, "sum", True))
        for lay, rest, request in zip(self._layouts, rests, qs, strict=True):
            _call(world, call, request.wait, world.timeout)
            self._adopt_factors(lay)
            for x in lay.matrices:
                _decompress(x)
            _call(world, call, rest.wait, world.timeout)
            torch._foreach_copy_(lay.segments, list(lay.rest.split(lay.rest_sizes)))
        for bucket in engine.buckets:
            bucket.request = DEFERRED
        self.steps += 1

    def _adopt_factors(self, lay: _Layout) -> None:
        """Warm-start the next reduction from the summed ``Q``, unless some rank's gradients were not
        finite: then keep the previous ``Q`` and drop the error buffers (the step's gradients are not
        finite on every rank, so optimizers and GradScaler skip it; nothing NaN is carried on)."""
        if bool(torch.isfinite(lay.q_next).all()):
            lay.q.copy_(lay.q_next)
        else:
            lay.error.zero_()


def _project(x: _Matrix, error_feedback: bool) -> None:
    """``M += error`` (error feedback), then ``P = M Q``: this rank's part of the first factor."""
    if error_feedback:
        x.m.add_(x.error)
    torch.matmul(x.m, x.q.t(), out=x.p)


def _second_factor(x: _Matrix, error_feedback: bool) -> None:
    """With ``P`` summed: orthonormalise it, ``Qᵀ = Pᵀ M`` (``Mᵀ P`` is 5x slower in MKL on one core)
    and, right after (``M`` still in cache), what this rank's projection leaves out."""
    x.p.copy_(_orthonormal(x.p))
    torch.matmul(x.p.t(), x.m, out=x.q_local)
    if error_feedback:
        torch.addmm(x.m, x.p, x.q_local, alpha=-1, out=x.error)


def _decompress(x: _Matrix) -> None:
    """With ``Q`` summed: the reduced gradient ``M = P Qᵀ``."""
    torch.matmul(x.p, x.q_next, out=x.m)


def codec_seconds(shapes: list[tuple[int, int]], rank: int = 4, repeats: int = 5) -> float:
    """Seconds one reduction's local work takes for gradient matrices of ``shapes`` (rows, cols) at
    ``rank``: the same three passes :meth:`PowerSGD.reduce` makes, on random float32 data, in this
    thread with torch's current thread count; the median of ``repeats``. For ``phalanx bench predict
    --gflops measure``."""
    import statistics
    import time

    lay = _Layout()
    lay.shapes = [(torch.randn(n, k), min(rank, n, k)) for n, k in shapes]
    lay.segments = [torch.zeros(1)]
    lay.allocate(torch.Generator().manual_seed(0))
    lay.error.normal_(0, 0.01)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        for x in lay.matrices:
            _project(x, True)
        for x in lay.matrices:
            _second_factor(x, True)
        lay.q_next.copy_(lay.q_local)
        for x in lay.matrices:
            _decompress(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p``'s (QR, in float32 at least)."""
    wide = p if p.dtype in (torch.float32, torch.float64) else p.float()
    return torch.linalg.qr(wide).Q


def is_powersgd(compression: Any) -> bool:
    """Whether ``compression`` asks for PowerSGD (``"powersgd"`` or a :class:`PowerSGD`)."""
    return isinstance(compression, PowerSGD) or (isinstance(compression, str) and compression == "powersgd")


def attach_powersgd(compression: Any, engine: Engine) -> PowerSGD | None:
    """The PowerSGD state laid out for ``engine`` (a new one for ``"powersgd"``), or None for other compressions."""
    if not is_powersgd(compression):
        return None
    state = compression if isinstance(compression, PowerSGD) else PowerSGD()
    state._attach(engine)
    return state
