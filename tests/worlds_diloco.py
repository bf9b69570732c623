"""DiLoCo, Streaming DiLoCo and LocalSGD on every rank, against one process that plays every worker, in float64.

The reference (:class:`Reference`) runs the ``k`` workers' inner loops one
after another in one process (each with its own data shard and its own inner
optimizer) and applies the outer step as ``docs/slow-links.md`` defines it; a
world's rank ``r`` must hold worker ``r``'s parameters after every inner step
(to 1e-10). Compressed exchanges must also leave every rank with bitwise the
same parameters after each outer step, and error feedback's residual must be
``(Δ + r_prev) − decode(encode(Δ + r_prev))``.
"""

from __future__ import annotations

import io
from typing import Any

import phalanx
from behaviours import Behaviours
from helpers import raises
from worlds_training import _setup, mlp

DILOCO = Behaviours()
EXACT = 1e-10


def _train_step(torch: Any, model: Any, opt: Any, t: int, worker: int) -> None:
    """Inner step ``t`` of ``worker`` on its own shard (8 samples drawn from ``(t, worker)``)."""
    g = torch.Generator().manual_seed(1000 * t + worker)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    y = torch.randn(8, 3, generator=g, dtype=torch.float64)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _adamw(torch: Any, model: Any) -> Any:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _nesterov(torch: Any) -> Any:
    return lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)


def _flat(torch: Any, tensors: Any) -> Any:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


class Reference:
    """``k`` workers in one process, the outer copy and the outer step: the semantics written out plainly."""

    def __init__(self, torch: Any, k: int, seed: int, inner: Any, outer: Any, H: int, F: int = 1, tau: int = 0,
                 mix: float = 1.0, quantize: Any = None) -> None:
        self.torch, self.k, self.H, self.F, self.tau, self.mix, self.quantize = torch, k, H, F, tau, mix, quantize
        self.models = [mlp(torch, seed) for _ in range(k)]
        self.inners = [inner(torch, m) for m in self.models]
        self.outer = [p.detach().clone() for p in self.models[0].parameters()]
        self.outer_opt = outer(self.outer)
        sizes = [p.numel() for p in self.outer]
        before = [sum(sizes[:j]) for j in range(len(sizes) + 1)]
        # fragments: contiguous, each cut at the parameter boundary nearest to its share of the elements
        self.bounds = [0] + [min(range(1, len(sizes)), key=lambda j: abs(before[j] - f * before[-1] / F))
                             for f in range(1, F)] + [len(sizes)]
        self.residuals: list[list[Any]] = [[None] * F for _ in range(k)]
        self.pending: Any = None
        self.last_locals: list[Any] = []  # the workers' parameters of the last exchange, as it started
        self.t = 0

    def params(self, worker: int) -> list[Any]:
        return list(self.models[worker].parameters())

    def step(self) -> None:
        torch = self.torch
        self.t += 1
        t = self.t
        for i in range(self.k):
            _train_step(torch, self.models[i], self.inners[i], t, i)
        if self.pending is not None and self.pending[1] == t:
            self._apply()
        s = self.H // self.F
        if t % s == 0:
            f = (t % self.H) // s
            lo, hi = self.bounds[f], self.bounds[f + 1]
            sent = []
            self.last_locals = [_flat(torch, self.params(i)[lo:hi]) for i in range(self.k)]
            for i in range(self.k):
                delta = _flat(torch, self.outer[lo:hi]) - _flat(torch, self.params(i)[lo:hi])
                if self.quantize is not None:
                    x = delta if self.residuals[i][f] is None else delta + self.residuals[i][f]
                    delta = self.quantize.roundtrip(x)
                    if self.quantize.error_feedback:
                        self.residuals[i][f] = x - delta
                sent.append(delta)
            total = sent[0]
            for d in sent[1:]:
                total = total + d
            self.pending = (f, t + self.tau, total / self.k)
            if self.tau == 0:
                self._apply()

    def _apply(self) -> None:
        torch = self.torch
        f, _, mean = self.pending
        self.pending = None
        lo, hi = self.bounds[f], self.bounds[f + 1]
        at = 0
        for j, o in enumerate(self.outer):
            o.grad = None
            if lo <= j < hi:
                o.grad = mean[at:at + o.numel()].view_as(o).clone()
                at += o.numel()
        self.outer_opt.step()
        with torch.no_grad():
            for m in self.models:
                for p, o in zip(list(m.parameters())[lo:hi], self.outer[lo:hi], strict=True):
                    p.copy_(o if self.mix == 1.0 else self.mix * o + (1 - self.mix) * p)


def _same(torch: Any, model: Any, ref: Reference, r: int, what: str) -> None:
    err = (_flat(torch, model.parameters()) - _flat(torch, ref.params(r))).abs().max().item()
    assert err <= EXACT, f"{what}, after inner step {ref.t}: rank {r} differs from its worker in one process by {err:.3g}"


def _run(torch: Any, pt: Any, r: int, n: int, steps: int, what: str, **options: Any) -> tuple[Any, Any, Any]:
    """DiLoCo on this rank (its own initial parameters: construction gives it rank 0's) and the reference,
    in lockstep, compared after every inner step."""
    outer = options.pop("outer", None)
    ref = Reference(torch, n, 5, lambda torch, m: _adamw(torch, m), outer or _nesterov(torch), options["sync_every"],
                    options.get("fragments", 1), options.get("delay", 0), options.get("mix", 1.0))
    model = mlp(torch, 5 + r)
    inner = _adamw(torch, model)
    diloco = pt.DiLoCo(model, inner, outer, **options)
    for _ in range(steps):
        _train_step(torch, model, inner, ref.t + 1, r)
        ref.step()
        _same(torch, model, ref, r, what)
    return model, diloco, ref


@DILOCO.behaviour("diloco-h3-two-outer-rounds-default-nesterov-outer-equals-k-workers-in-one-process")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    model, diloco, ref = _run(torch, pt, r, n, 6, "DiLoCo H=3", sync_every=3)
    assert diloco.inner_steps == 6, diloco.inner_steps
    everyone = phalanx.allgather(_flat(torch, model.parameters()))  # the allreduce's mean: the same bits too
    assert all(torch.equal(everyone[j], everyone[0]) for j in range(n)), "the ranks' parameters differ in bits"
    outer = _flat(torch, diloco.outer_parameters())
    assert all(o.device.type == "cpu" and o.dtype == torch.float64 for o in diloco.outer_parameters())
    assert (outer - _flat(torch, ref.outer)).abs().max().item() <= EXACT, "the outer copy is not one process's"
    assert (outer - _flat(torch, model.parameters())).abs().max().item() == 0, "after an outer step params = outer"
    sgd = diloco.outer_optimizer
    assert type(sgd) is torch.optim.SGD and sgd.defaults["lr"] == 0.7 and sgd.defaults["momentum"] == 0.9 \
        and sgd.defaults["nesterov"], sgd.defaults


@DILOCO.behaviour("streaming-diloco-f2-delay1-mix-half-equals-k-workers-in-one-process")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    _run(torch, pt, r, n, 10, "Streaming DiLoCo H=4 F=2 delay=1 mix=0.5", sync_every=4, fragments=2, delay=1, mix=0.5)


@DILOCO.behaviour("streaming-diloco-f2-delay0-in-a-context-manager-closes-and-equals-one-process")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    ref = Reference(torch, n, 7, lambda torch, m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5),
                    _nesterov(torch), 4, 2)
    model = mlp(torch, 7)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    with pt.DiLoCo(model, inner, sync_every=4, fragments=2) as diloco:
        for _ in range(8):
            _train_step(torch, model, diloco, ref.t + 1, r)  # diloco.step() / zero_grad() are the inner's
            ref.step()
            _same(torch, model, ref, r, "Streaming DiLoCo H=4 F=2 delay=0")
    _train_step(torch, model, inner, 9, r)  # closed: no exchange follows any more
    assert diloco.inner_steps == 8, diloco.inner_steps


@DILOCO.behaviour("localsgd-averages-the-parameters-every-h-steps-and-equals-one-process")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    inner_of = lambda torch, m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    ref = Reference(torch, n, 9, inner_of, lambda ps: torch.optim.SGD(ps, lr=1.0), 2)
    model = mlp(torch, 9)
    inner = inner_of(torch, model)
    pt.LocalSGD(model, inner, sync_every=2)
    for t in range(1, 7):
        _train_step(torch, model, inner, t, r)
        ref.step()
        _same(torch, model, ref, r, "LocalSGD H=2")
        if t % 2 == 0:  # the plain average of the workers' parameters as they were before the exchange
            mean = sum(ref.last_locals) / n
            err = (_flat(torch, model.parameters()) - mean).abs().max().item()
            assert err <= EXACT, f"LocalSGD step {t}: not the mean of the workers' parameters ({err:.3g})"


def _saved(torch: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` through torch.save and torch.load(weights_only=True), as a checkpoint file would take it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _resume(r: int, n: int, save_at: int, steps: int, what: str, **options: Any) -> None:
    torch, pt, r, n = _setup()
    model, diloco, ref = _run(torch, pt, r, n, save_at, what, **options)
    checkpoint = _saved(torch, {"model": model.state_dict(), "inner": diloco.inner_optimizer.state_dict(),
                                "diloco": diloco.state_dict()})  # this rank's own: mid-window they differ
    diloco.close()
    again = mlp(torch, 77 + r)  # a fresh model, inner optimizer and DiLoCo, then the checkpoint
    inner = _adamw(torch, again)
    resumed = pt.DiLoCo(again, inner, **options)
    again.load_state_dict(checkpoint["model"])
    inner.load_state_dict(checkpoint["inner"])
    resumed.load_state_dict(checkpoint["diloco"])
    assert resumed.inner_steps == save_at, resumed.inner_steps
    for _ in range(save_at, steps):
        _train_step(torch, again, inner, ref.t + 1, r)
        ref.step()
        _same(torch, again, ref, r, f"{what}, resumed from inner step {save_at}")


@DILOCO.behaviour("resume-mid-second-window-from-state-dict-into-a-fresh-diloco-equals-the-uninterrupted-run")
def _(r: int, n: int) -> None:
    _resume(r, n, 4, 9, "DiLoCo H=3", sync_every=3)


@DILOCO.behaviour("resume-with-an-exchange-in-flight-streaming-f2-delay1-equals-the-uninterrupted-run")
def _(r: int, n: int) -> None:
    _resume(r, n, 6, 12, "Streaming DiLoCo H=4 F=2 delay=1", sync_every=4, fragments=2, delay=1, mix=0.5)


def _compressed(r: int, n: int, compression: Any, kind: str) -> None:
    torch, pt, r, n = _setup()
    quantize = compression if isinstance(compression, pt.Quantize) else pt.Quantize(kind, error_feedback=False)
    ref = Reference(torch, n, 11, lambda torch, m: _adamw(torch, m), _nesterov(torch), 2, quantize=quantize)
    model = mlp(torch, 11 + r)
    inner = _adamw(torch, model)
    diloco = pt.DiLoCo(model, inner, sync_every=2, compression=compression)
    for t in range(1, 9):
        _train_step(torch, model, inner, t, r)
        ref.step()
        _same(torch, model, ref, r, f"compression={compression!r}")
        if t % 2 == 0:
            mine = _flat(torch, model.parameters())
            everyone = phalanx.allgather(mine)
            for j in range(n):
                assert torch.equal(everyone[j], everyone[0]), \
                    f"compression={compression!r}, outer step at {t}: rank {j}'s parameters are not rank 0's bits"
            assert torch.equal(mine, _flat(torch, diloco.outer_parameters()))
            residual = diloco.state_dict()["residuals"][0]
            if quantize.error_feedback:  # (Δ + r_prev) − decode(encode(Δ + r_prev)), Δ = outer − local
                assert residual is not None and torch.equal(residual, ref.residuals[r][0]), \
                    f"step {t}: the residual is not (Δ + r_prev) − roundtrip(Δ + r_prev)"
            else:
                assert residual is None, residual


for _kind in ("int8", "int4", "bf16"):
    DILOCO.add(f"compression-{_kind}-every-rank-holds-bitwise-the-same-parameters-after-each-outer-step",
               _compressed, _kind, _kind)


@DILOCO.behaviour("error-feedback-int4-residual-equals-its-definition-and-quantize-error-is-within-half-a-step")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    q = pt.Quantize("int4", block=64, error_feedback=True)
    x = torch.randn(300, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert q.encode(x).numel() == q.payload_bytes(300) == 5 * 32 + 5 * 4, q.encode(x).numel()
    padded = torch.cat([x, x.new_zeros(20)]).view(5, 64)
    half_step = (padded.abs().amax(1) / 7 / 2).repeat_interleave(64)[:300]
    assert ((q.roundtrip(x) - x).abs() <= half_step * (1 + 1e-6)).all(), "int4 is off by more than half a step"
    assert torch.equal(q.roundtrip(torch.zeros(70, dtype=torch.float64)), torch.zeros(70, dtype=torch.float64))
    _compressed(r, n, q, "int4")


@DILOCO.behaviour("diloco-within-a-group-runs-among-its-members-only-and-equals-one-process")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    members = list(range(0, n, 2))  # [0] on 1 and 2 ranks, [0, 2] on 3
    group = phalanx.new_group(members)
    if group.member:
        ref = Reference(torch, group.size, 13, lambda torch, m: _adamw(torch, m), _nesterov(torch), 2)
        model = mlp(torch, 13 + r)
        inner = _adamw(torch, model)
        diloco = pt.DiLoCo(model, inner, sync_every=2, group=group)
        for _ in range(4):
            _train_step(torch, model, inner, ref.t + 1, group.rank)
            ref.step()
            _same(torch, model, ref, group.rank, f"DiLoCo in group {members}")
        diloco.close()
    phalanx.destroy_group(group)


@DILOCO.behaviour("outer-copy-lives-on-the-cpu-float64-stays-float64-float32-and-bf16-get-float32")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    model = mlp(torch, 1).float()
    diloco = pt.LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1)
    assert all(o.dtype == torch.float32 and o.device.type == "cpu" for o in diloco.outer_parameters())
    assert len(diloco.outer_parameters()) == len(list(model.parameters()))
    diloco.close()
    half = mlp(torch, 2)
    half[0].to(torch.bfloat16)  # one bf16 layer, the rest float64: two outer dtypes in one fragment
    half.forward = lambda x: half[1:](half[0](x.to(torch.bfloat16)).double())
    inner = torch.optim.SGD(half.parameters(), lr=0.1)
    diloco = pt.DiLoCo(half, inner, sync_every=2, compression="int8")
    assert [o.dtype for o in diloco.outer_parameters()] == [torch.float32] * 2 + [torch.float64] * 4
    for t in range(1, 5):
        _train_step(torch, half, inner, t, r)
    for p, o in zip(half.parameters(), diloco.outer_parameters(), strict=True):
        assert torch.equal(p.detach(), o.to(p.dtype)), "after an outer step the parameters are the outer copy"
    diloco.close()


@DILOCO.behaviour("bad-arguments-raise-phalanx-errors-naming-the-argument-and-the-fix")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    model = mlp(torch, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    bad = [({"sync_every": 0}, phalanx.InvalidArgumentError, r"sync_every=0\).*>= 1"),
           ({"sync_every": 2.5}, phalanx.InvalidArgumentError, r"sync_every=2\.5"),
           ({"sync_every": 3, "fragments": 2}, phalanx.InvalidArgumentError, r"fragments must divide"),
           ({"sync_every": 4, "fragments": 2, "delay": 2}, phalanx.InvalidArgumentError, r"delay=2.*delay <= 1"),
           ({"sync_every": 4, "delay": -1}, phalanx.InvalidArgumentError, r"delay=-1"),
           ({"sync_every": 4, "mix": 0}, phalanx.InvalidArgumentError, r"mix=0\).*\(0, 1\]"),
           ({"sync_every": 4, "mix": 1.5}, phalanx.InvalidArgumentError, r"mix=1\.5"),
           ({"sync_every": 4, "compression": "int2"}, phalanx.InvalidArgumentError, r"compression='int2'.*'int8'"),
           ({"sync_every": 12, "fragments": 12}, phalanx.InvalidArgumentError, r"6 trainable parameters"),
           ({"sync_every": 4, "outer_optimizer": torch.optim.SGD(model.parameters(), lr=1.0)}, phalanx.UsageError,
            r"outer_optimizer=lambda params"),
           ({"sync_every": 4, "outer_optimizer": lambda ps: None}, phalanx.InvalidArgumentError, r"not a torch optim"),
           ({"sync_every": 4, "group": "hosts"}, phalanx.UnsupportedArgumentError, r"phalanx.Group.*Hierarchical")]
    for kwargs, kind, match in bad:
        with raises(kind, f"DiLoCo({kwargs}) was accepted", match=match) as raised:
            pt.DiLoCo(model, inner, **kwargs)
        assert "phalanx.torch.DiLoCo(" in str(raised.value), raised.value
    with raises(phalanx.InvalidArgumentError, "block=32 was accepted", match="64 to 256"):
        pt.Quantize("int8", block=32)
    wrapped = mlp(torch, 2)
    dopt = pt.DistributedOptimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1))  # collective, on every rank
    with raises(phalanx.UsageError, "a DistributedOptimizer inner optimizer was accepted", match="own gradients"):
        pt.DiLoCo(wrapped, dopt, sync_every=2)
    first = pt.DiLoCo(model, inner, sync_every=2)
    saved = first.state_dict()
    with raises(phalanx.UsageError, "a second DiLoCo on the same inner optimizer was accepted", match="close"):
        pt.DiLoCo(model, inner, sync_every=2)
    first.close()
    other = pt.DiLoCo(model, inner, sync_every=3)
    with raises(phalanx.InvalidArgumentError, "a state of another sync_every was loaded", match="same sync_every"):
        other.load_state_dict(saved)
    other.close()


@DILOCO.behaviour("unfreezing-a-parameter-after-making-it-raises-usage-error-at-the-next-exchange-naming-it")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    model = mlp(torch, 1)
    frozen = next(iter(model.parameters()))
    frozen.requires_grad_(False)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = pt.DiLoCo(model, inner, sync_every=2)
    _train_step(torch, model, inner, 1, r)
    frozen.requires_grad_(True)  # a freezing schedule: its outer copy was never made, nothing would average it
    with raises(phalanx.UsageError, "an unfrozen parameter was left out of the exchange silently",
                match=r"requires_grad changed.*now requires_grad=True.*DiLoCo again"):
        _train_step(torch, model, inner, 2, r)
    diloco.close()


@DILOCO.behaviour("ranks-that-disagree-on-sync-every-raise-collective-mismatch-on-every-rank-naming-it")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    model = mlp(torch, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    if n == 1:
        pt.DiLoCo(model, inner, sync_every=3).close()  # nothing to disagree with
        return
    with raises(phalanx.CollectiveMismatchError, "different sync_every was accepted", match="sync_every=4") as raised:
        pt.DiLoCo(model, inner, sync_every=4 if r == n - 1 else 3)
    assert "sync_every=3" in str(raised.value), raised.value
    pt.DiLoCo(model, inner, sync_every=3).close()  # the world is still usable


def diloco() -> dict[str, str | None]:
    """The world body: every behaviour, on every rank."""
    return DILOCO.run(phalanx.rank(), phalanx.size())
