"""Rank bodies for the Horovod training API: DistributedOptimizer, the broadcasts, Compression,
SyncBatchNorm (phalanx.horovod.torch)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

import phalanx
import phalanx.horovod.torch as hvd
from behaviours import Behaviours
from helpers import raises
from phalanx.horovod.torch import _ops

TRAINING = Behaviours()
PER_RANK = 4  # samples per rank and step


def _data(n: int, steps: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, PER_RANK * n, 5, generator=g), torch.randn(steps, PER_RANK * n, 3, generator=g)


def _model(seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _train(r: int, n: int, make: Any, steps: int = 3, passes: int = 1, **options: Any) -> tuple[Any, Any]:
    """(distributed model after `steps` steps on this rank's shard, one-process model on the combined batch)."""
    xs, ys = _data(n, steps)
    xs, ys = xs.double(), ys.double()
    ref = _model()
    ref_opt = make(ref.parameters())
    model = _model()
    opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **options)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    hvd.broadcast_optimizer_state(ref_opt, root_rank=0)  # the same state (Adam's step 1) as in a 1-rank job
    for s in range(steps):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(xs[s]), ys[s]).backward()
        ref_opt.step()
        opt.zero_grad()
        mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
        x, y = xs[s][mine], ys[s][mine]
        for part in range(passes):  # the shard in `passes` micro-batches, loss scaled to the shard's mean
            piece = slice(part * PER_RANK // passes, (part + 1) * PER_RANK // passes)
            (torch.nn.functional.mse_loss(model(x[piece]), y[piece]) / passes).backward()
        opt.step()
    return model, ref


def _close(model: torch.nn.Module, ref: torch.nn.Module, tol: float) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        err = (p - q).abs().max().item()
        assert err <= tol, f"{name}: differs from one process on the combined batch by {err:.3g} (> {tol})"


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


@TRAINING.behaviour("sgd-n-ranks-equal-one-process-on-the-combined-batch")
def _(r: int, n: int) -> None:
    _close(*_train(r, n, _sgd), 1e-12)


@TRAINING.behaviour("adam-n-ranks-equal-one-process-on-the-combined-batch")
def _(r: int, n: int) -> None:
    _close(*_train(r, n, _adam), 1e-12)


@TRAINING.behaviour("backward-passes-per-step-2-equals-one-process-on-the-combined-batch")
def _(r: int, n: int) -> None:
    _close(*_train(r, n, _sgd, passes=2), 1e-12)


@TRAINING.behaviour("fp16-compression-within-2e-3-of-one-process-on-the-combined-batch")
def _(r: int, n: int) -> None:
    model, ref = _train(r, n, _sgd, compression=hvd.Compression.fp16)
    _close(model, ref, 2e-3)  # float16 carries ~3 significant digits; 3 steps of lr 0.1


@TRAINING.behaviour("gradient-predivide-factor-still-averages")
def _(r: int, n: int) -> None:
    _close(*_train(r, n, _sgd, gradient_predivide_factor=4.0), 1e-12)


@TRAINING.behaviour("op-sum-gives-the-sum-and-synchronize-reduces-before-clipping")
def _(r: int, n: int) -> None:
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), op=_op("Sum"))
    (p * (r + 1)).sum().backward()
    opt.synchronize()
    total = n * (n + 1) / 2
    assert torch.equal(p.grad, torch.full((3,), total, dtype=torch.float64)), p.grad
    p.grad.mul_(0.5)  # "clipping" between synchronize and step
    with opt.skip_synchronize():
        opt.step()
    assert torch.equal(p.detach(), torch.full((3,), -total / 2, dtype=torch.float64)), p
    opt.zero_grad()
    (p * 0 + p).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()  # after synchronize() without skip_synchronize(): Horovod's warning, no second reduction
    assert any("skip_synchronize" in str(w.message) for w in seen), [str(w.message) for w in seen]


def _op(name: str) -> Any:
    return getattr(_ops, name, {"Average": 0, "Sum": 1, "Adasum": 2}[name])


@TRAINING.behaviour("is-an-instance-of-the-optimizers-own-class-and-works-with-schedulers-and-gradscaler")
def _(r: int, n: int) -> None:
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(base)
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD", type(opt).__mro__
    assert opt.param_groups is base.param_groups and opt.state is base.state
    adam = hvd.DistributedOptimizer(torch.optim.Adam(_model().parameters()))
    assert isinstance(adam, torch.optim.Adam) and hasattr(adam, "synchronize")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x = torch.ones(2, 5, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        sched.step()
    assert abs(opt.param_groups[0]["lr"] - 0.025) < 1e-12, opt.param_groups[0]["lr"]
    assert hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)) is not None


@TRAINING.behaviour("zero-grad-after-backward-before-step-raises-horovods-assertion-on-several-ranks")
def _(r: int, n: int) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1))
    p.sum().backward()
    if n == 1:  # Horovod registers no hooks in a job of one rank: nothing is pending
        opt.zero_grad()
        return
    with raises(AssertionError, "zero_grad() after backward did not raise") as raised:
        opt.zero_grad()
    exc = raised.value
    assert isinstance(exc, phalanx.UsageError), type(exc).__mro__
    assert "zero_grad() was called after loss.backward() but before optimizer.step()" in str(exc), exc
    opt.step()
    opt.zero_grad()  # fine after step()


@TRAINING.behaviour("more-backward-passes-than-backward-passes-per-step-raise-on-several-ranks")
def _(r: int, n: int) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), backward_passes_per_step=2)
    p.sum().backward()
    p.sum().backward()
    if n > 1:
        with raises(AssertionError, "a third backward pass with backward_passes_per_step=2 did not raise") as raised:
            p.sum().backward()
        exc = raised.value
        assert "more than backward_passes_per_step times" in str(exc), exc
    opt.step()  # two passes accumulated and averaged (plus, on several ranks, the refused third one's 1)
    assert torch.equal(p.grad, torch.full((2,), 2.0 if n == 1 else 3.0)), p.grad
    opt.zero_grad()


@TRAINING.behaviour("named-parameters-not-tuples-duplicated-or-missing-raise-valueerror")
def _(r: int, n: int) -> None:
    model = _model()
    params = list(model.named_parameters())
    cases = {
        "should be a sequence of tuples": [p for _, p in params],
        "Found duplicates: w": [("w", p) for _, p in params],
        "were not named": params[:-1],
    }
    for text, named in cases.items():
        with raises(ValueError, f"no error for {text!r}") as raised:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named)
        exc = raised.value
        assert isinstance(exc, phalanx.InvalidArgumentError) and text in str(exc), (text, str(exc))
    bad_predivide = {"gradient_predivide_factor": 2.0, "op": _op("Sum")}
    for kwargs in (bad_predivide, {"groups": -1}, {"backward_passes_per_step": 0}):
        with raises(ValueError, f"no error for {kwargs}"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


@TRAINING.behaviour("compression-keeps-horovods-interface-and-a-compressor-of-ones-own-is-refused")
def _(r: int, n: int) -> None:
    t = torch.linspace(0, 1, 5, dtype=torch.float64)
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == torch.float16 and hvd.Compression.fp16.decompress(c, ctx).dtype == torch.float64
    same, ctx = hvd.Compression.none.compress(t)
    assert same is t and hvd.Compression.none.decompress(same, ctx) is t

    class Mine(hvd.Compressor):
        pass

    with raises(TypeError, "a compressor of one's own was accepted") as raised:
        hvd.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), compression=Mine)
    exc = raised.value
    assert "Mine" in str(exc) and "Compression.fp16" in str(exc), exc


@TRAINING.behaviour("broadcast-parameters-takes-a-state-dict-or-named-parameters-from-the-root")
def _(r: int, n: int) -> None:
    root = n - 1
    model = _model(seed=10 + r)
    expected = [p.detach().clone() for p in _model(seed=10 + root).state_dict().values()]
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    for got, want in zip(model.state_dict().values(), expected, strict=True):
        assert torch.equal(got, want)
    other = _model(seed=20 + r)
    hvd.broadcast_parameters(other.named_parameters(), root_rank=0)
    for got, want in zip(other.parameters(), _model(seed=20).parameters(), strict=True):
        assert torch.equal(got, want)
    with raises(ValueError, "params=3 was accepted") as raised:
        hvd.broadcast_parameters(3, root_rank=0)
    exc = raised.value
    assert "invalid params of type" in str(exc), exc


@TRAINING.behaviour("broadcast-optimizer-state-creates-empty-state-and-takes-roots-options")
def _(r: int, n: int) -> None:
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1), betas=(0.9, 0.99 - r / 100)))
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=n - 1)
    group = opt.param_groups[0]
    assert abs(group["lr"] - 0.01 * n) < 1e-15 and group["betas"] == (0.9, 0.99 - (n - 1) / 100), group
    assert len(opt.state) == len(before) and all("exp_avg" in s for s in opt.state.values())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    plain = torch.optim.SGD(_model().parameters(), lr=0.1 * (r + 1), momentum=0.5)
    hvd.broadcast_optimizer_state(plain, root_rank=0)
    assert plain.param_groups[0]["lr"] == 0.1 and all("momentum_buffer" in s for s in plain.state.values())
    with raises(ValueError, "LBFGS was accepted") as raised:
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(_model().parameters()), root_rank=0)
    exc = raised.value
    assert "LBFGS" in str(exc)


@TRAINING.behaviour("broadcast-object-and-allgather-object-move-python-objects")
def _(r: int, n: int) -> None:
    got = hvd.broadcast_object({"rank": r, "data": [r] * 3} if r == n - 1 else None, root_rank=n - 1)
    assert got == {"rank": n - 1, "data": [n - 1] * 3}, got
    assert hvd.broadcast_object(("default", r))[1] == 0
    assert hvd.allgather_object({"r": r, "pad": "x" * r}) == [{"r": q, "pad": "x" * q} for q in range(n)]


@TRAINING.behaviour("sync-batch-norm-equals-batch-norm-on-the-combined-batch")
def _(r: int, n: int) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3 * n, 4, 2, generator=g, dtype=torch.float64)
    bn = hvd.SyncBatchNorm(4).double()
    ref = torch.nn.BatchNorm1d(4).double()
    mine = x[3 * r:3 * (r + 1)].clone().requires_grad_()
    out = bn(mine)
    full = x.clone().requires_grad_()
    expected = ref(full)
    assert torch.allclose(out, expected[3 * r:3 * (r + 1)], atol=1e-12)
    (out * out).sum().backward()
    (expected * expected).sum().backward()
    assert torch.allclose(mine.grad, full.grad[3 * r:3 * (r + 1)], atol=1e-10)
    assert torch.allclose(bn.running_var, ref.running_var, atol=1e-12)


@TRAINING.behaviour("adasum-combines-the-parameter-changes")
def _(r: int, n: int) -> None:
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), op=_op("Adasum"))
    grad = torch.tensor([1.0, 2.0, 0.0, -1.0], dtype=torch.float64) * (r + 1) + r
    p.grad = grad.clone()
    if n == 1:  # Horovod: a plain step at size 1
        opt.step()
        assert torch.equal(p.detach(), -grad)
        return
    if n & (n - 1):  # not a power of two: refused, as in Horovod
        with raises(phalanx.PhalanxError, f"Adasum on {n} ranks was accepted") as raised:
            opt.step()
        exc = raised.value
        assert "Adasum" in str(exc) and "power-of-two" in str(exc), exc
        return
    opt.step()
    if n == 2:  # the deltas are -g0, -g1: Adasum(a, b) = (1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b
        a = -(torch.tensor([1.0, 2.0, 0.0, -1.0], dtype=torch.float64))
        b = -(torch.tensor([1.0, 2.0, 0.0, -1.0], dtype=torch.float64) * 2 + 1)
        dot = float(a @ b)
        want = (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b
        assert torch.allclose(p.detach(), want, atol=1e-12), (p, want)


@TRAINING.behaviour("process-set-reduces-and-broadcasts-among-its-members-only")
def _(r: int, n: int) -> None:
    if n == 1:
        return
    ps = hvd.add_process_set([0, 1])
    try:
        p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), op=_op("Sum"), process_set=ps)
        (p * (r + 1)).sum().backward()
        opt.step()  # members: the sum over ranks 0 and 1 (1 + 2); rank 2, not a member: its own gradient
        assert torch.equal(p.detach(), torch.full((2,), -3.0 if r < 2 else -(r + 1.0), dtype=torch.float64)), p
        if r < 2:
            model = _model(seed=30 + r)
            hvd.broadcast_parameters(model.state_dict(), root_rank=1, process_set=ps)
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), _model(seed=31).parameters(), strict=True))
            assert hvd.broadcast_object(r * 10, root_rank=1, process_set=ps) == 10
            assert hvd.allgather_object(r, process_set=ps) == [0, 1]
    finally:
        hvd.remove_process_set(ps)


@TRAINING.behaviour("elastic-sampler-splits-the-epoch-and-resumes-after-the-recorded-batches")
def _(r: int, n: int) -> None:
    sampler = hvd.elastic.ElasticSampler(list(range(30)), shuffle=False)
    mine = list(sampler)
    assert len(sampler) == len(mine) == -(-30 // n), len(sampler)
    everyone = hvd.allgather_object(mine)
    assert {i for part in everyone for i in part} == set(range(30)), everyone
    sampler.record_batch(0, 2)  # each rank did a batch of 2
    sampler.reset()
    assert list(sampler)[:1] == [2 * n + r], list(sampler)
    shuffled = hvd.elastic.ElasticSampler(list(range(12)), seed=4)
    shuffled.load_state_dict({"epoch": 1, "processed_num": 6})
    first = list(shuffled)
    shuffled.set_epoch(2)
    assert shuffled.state_dict() == {"epoch": 2, "processed_num": 0} and len(first) == -(-6 // n)


@TRAINING.behaviour("torch-state-commits-restores-in-memory-and-syncs-from-rank-0")
def _(r: int, n: int) -> None:
    model = _model(seed=40 + r)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1))
    state = hvd.elastic.TorchState(model, opt, epoch=r, note="x")
    state.sync()  # every rank takes rank 0's model, optimizer and attributes
    assert state.epoch == 0 and opt.param_groups[0]["lr"] == 0.1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), _model(seed=40).parameters(), strict=True))
    state.epoch = 5
    state.commit()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    state.epoch = 6
    state.restore()
    assert state.epoch == 5
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), _model(seed=40).parameters(), strict=True))
    assert state.load_commit() and state.epoch == 5  # what a restarted job reads from disk


def training() -> dict[str, str | None]:
    """The world body: every behaviour above."""
    np.random.seed(0)
    hvd.init()
    return TRAINING.run(phalanx.rank(), phalanx.size())


@TRAINING.behaviour("a-step-while-a-rank-has-joined-is-a-mismatch-on-the-active-ranks-then-join-completes")
def _(r: int, n: int) -> None:
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()), named_parameters=model.named_parameters())
    x, y = (t.double()[0] for t in _data(n, 1))
    if n == 1:  # nobody else: the step runs, join returns this rank
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        assert hvd.join() == 0
        return
    # Rank n-1 joins first; the others join together after their refused step, so join() returns the
    # highest of them, never the first joiner (as Horovod's own test demands; _join.py documents it).
    if r == n - 1:  # out of data first: waits in join while the others try a step
        assert hvd.join() == n - 2
        return
    before = [p.detach().clone() for p in model.parameters()]
    with raises(phalanx.CollectiveMismatchError, "a gradient reduction ran while a rank was joined"):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for p, q in zip(model.parameters(), before, strict=True):  # no gradient moved into the weights
        assert torch.equal(p.detach(), q)
    opt.zero_grad()
    assert hvd.join() == n - 2
