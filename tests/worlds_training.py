"""Training test bodies: N ranks on slices of a batch train exactly like 1 process on the whole batch.

Each rank builds its model from a *different* seed (so only the initial
broadcast from rank 0 can make the ranks agree), trains on its slice of a
fixed global batch, and, in the same body, trains a reference copy of rank
0's initial model in one process on the whole batch. Losses are means and
slices are equal, so with op="avg" the gradients match; models are float64,
so the tolerance is tight (looser, and stated, for 16-bit compression).
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from typing import Any

import numpy as np

import phalanx
from behaviours import Behaviours
from helpers import raise_in_backward, raises

STEPS = 10
PER_RANK = 4
TIGHT = 1e-9     # float64 models: only summation order differs
COMPRESSED = 2e-2  # 16-bit gradients on the wire: ~3 significant digits per step

TRAINING = Behaviours()      # checked on every world
ACROSS_RANKS = Behaviours()  # checked on worlds of 2 or more ranks
COMPILED = Behaviours()      # torch.compile (aot_eager)
INDUCTOR = Behaviours()      # torch.compile (inductor; slow to compile cold)


def _setup() -> tuple[Any, Any, int, int]:
    import torch

    import phalanx.torch as pt

    torch.set_num_threads(1)
    return torch, pt, phalanx.rank(), phalanx.size()


# -- models and data ---------------------------------------------------------------------------

def mlp(torch: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def cnn(torch: Any, seed: int, batchnorm: bool = False) -> Any:
    torch.manual_seed(seed)
    nn = torch.nn
    norm = (lambda c: [nn.BatchNorm2d(c)]) if batchnorm else (lambda c: [])
    # No bias before a BatchNorm (it cancels): Adam would amplify that zero gradient's rounding noise.
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=not batchnorm), *norm(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, stride=2, padding=1, bias=not batchnorm), *norm(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(64, 3)).double()


MODELS = {"mlp": (mlp, (6,)), "cnn": (cnn, (2, 8, 8)),
          "cnn_bn": (lambda torch, seed: cnn(torch, seed, True), (2, 8, 8))}


def batch(torch: Any, step: int, shape: tuple[int, ...], n: int) -> tuple[Any, Any]:
    """The global batch of ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(n * PER_RANK, *shape, generator=g, dtype=torch.float64),
            torch.randn(n * PER_RANK, 3, generator=g, dtype=torch.float64))


def piece(t: Any, r: int) -> Any:
    return t[r * PER_RANK:(r + 1) * PER_RANK]


def mse(torch: Any, out: Any, y: Any) -> Any:
    return torch.nn.functional.mse_loss(out, y)


def assert_close(model: Any, ref: Any, what: str, tol: float) -> None:
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        if not p.is_floating_point():
            assert p.equal(q), f"{what}: {name} is {p.tolist()}, the 1-process run has {q.tolist()}"
            continue
        err = (p - q).abs().max().item()
        assert err <= tol * max(1.0, q.abs().max().item()), \
            f"{what}: {name} differs from the 1-process run by {err:.3g} (tolerance {tol:g})"


def same_on_every_rank(torch: Any, t: Any, what: str) -> None:
    rows = phalanx.allgather(t.detach().contiguous())
    for q in range(1, rows.shape[0]):
        assert torch.equal(rows[q], rows[0]), f"{what}: rank {q} has {rows[q].tolist()}, rank 0 {rows[0].tolist()}"


# -- equivalence -------------------------------------------------------------------------------

CASES: list[dict[str, Any]] = [
    {"model": "mlp", "form": "opt", "opt": "sgd"},
    {"model": "mlp", "form": "opt", "opt": "adam", "sched": True},
    {"model": "cnn", "form": "dp", "opt": "sgd"},
    {"model": "cnn_bn", "form": "dp", "opt": "adam"},
    {"model": "cnn_bn", "form": "opt", "opt": "sgd"},
    {"model": "mlp", "form": "opt", "opt": "sgd", "compression": "bf16"},
    {"model": "cnn", "form": "dp", "opt": "adam", "compression": "fp16"},
    {"model": "mlp", "form": "opt", "opt": "sgd", "micro": 2, "accum": "passes"},
    {"model": "mlp", "form": "opt", "opt": "adam", "micro": 2, "accum": "no_sync"},
    {"model": "mlp", "form": "dp", "opt": "sgd", "micro": 2, "accum": "no_sync"},
    {"model": "mlp", "form": "opt", "opt": "sgd", "clip": 0.05},
    {"model": "mlp", "form": "dp", "opt": "sgd", "clip": 0.05, "sched": True},
    {"model": "mlp", "form": "opt", "opt": "sgd", "bucket_cap_mb": 1e-4, "zero": "zeros"},
]


def make_optimizer(torch: Any, kind: str, params: Any) -> Any:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def run_case(case: dict[str, Any], compiled: str | None = None) -> None:
    torch, pt, r, n = _setup()
    build, shape = MODELS[case["model"]]
    model, ref = build(torch, 100 + r), build(torch, 100)
    if case["model"] == "cnn_bn":
        model = pt.convert_sync_batchnorm(model)
    micro, accum = case.get("micro", 1), case.get("accum")
    options = {"compression": case.get("compression"), "bucket_cap_mb": case.get("bucket_cap_mb", 25)}
    if case["form"] == "opt":
        opt = pt.DistributedOptimizer(make_optimizer(torch, case["opt"], model.parameters()),
                                      backward_passes_per_step=micro if accum == "passes" else 1, **options)
        net = model
    else:
        net = pt.DataParallel(model, **options)
        opt = make_optimizer(torch, case["opt"], net.parameters())
    if compiled:  # the torch.compile backend
        net = torch.compile(net, backend=compiled)
    ref_opt = make_optimizer(torch, case["opt"], ref.parameters())
    scheds = [torch.optim.lr_scheduler.StepLR(o, 3, 0.5) for o in (opt, ref_opt)] if case.get("sched") else []
    for step in range(STEPS):
        for o in (opt, ref_opt):
            o.zero_grad(set_to_none=case.get("zero") != "zeros")
        for m in range(micro):
            x, y = batch(torch, step * micro + m, shape, n)
            quiet = m < micro - 1 and accum == "no_sync"
            with (net.no_sync() if case["form"] == "dp" else opt.no_sync()) if quiet else contextlib.nullcontext():
                mse(torch, net(piece(x, r)), piece(y, r)).backward()
            mse(torch, ref(x), y).backward()
        if case.get("clip"):
            if case["form"] == "opt":
                opt.reduce_gradients()
            for mdl in (model, ref):
                torch.nn.utils.clip_grad_norm_(mdl.parameters(), case["clip"])
        opt.step()
        ref_opt.step()
        for s in scheds:
            s.step()
    if scheds:
        group = opt.param_groups[0]
        assert group["lr"] == ref_opt.param_groups[0]["lr"] == group["initial_lr"] * 0.5 ** 3
    if case.get("compression"):  # 16-bit buckets on every backend (MPI: phalanx's own 16-bit sum)
        engine = opt.engine if case["form"] == "opt" else net.engine
        assert all(b.wire is not None for b in engine.buckets)
    tol = COMPRESSED if case.get("compression") else TIGHT
    assert_close(model, ref, f"{case} on {n} ranks", tol)


def case_name(case: dict[str, Any]) -> str:
    """``mlp-DistributedOptimizer-sgd-bf16``: what the case varies, as a test id."""
    form = {"opt": "DistributedOptimizer", "dp": "DataParallel"}[case["form"]]
    extras = [f"{k}={v}" for k, v in case.items() if k not in ("model", "form", "opt")]
    return "-".join([case["model"], form, case["opt"], *extras])


for _case in CASES:
    TRAINING.add(f"trains-like-one-process-{case_name(_case)}", run_case, _case)


def unused_and_frozen(form: str) -> None:
    """A parameter used on rank 1 only, one used nowhere, one frozen; a rank without backward."""
    torch, pt, r, n = _setup()
    nn = torch.nn

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.frozen, self.extra = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)
            self.never, self.head = nn.Linear(8, 8), nn.Linear(8, 3)
            self.frozen.requires_grad_(False)

        def forward(self, x: Any, use_extra: bool) -> Any:
            h = torch.tanh(self.frozen(torch.tanh(self.body(x))))
            return self.head(h + torch.tanh(self.extra(h)) if use_extra else h)

    def build(seed: int) -> Any:
        torch.manual_seed(seed)
        return Branchy().double()

    model, ref = build(100 + r), build(100)
    if form == "opt":
        net, opt = model, pt.DistributedOptimizer(make_optimizer(torch, "sgd", model.parameters()))
    else:
        net = pt.DataParallel(model)
        opt = make_optimizer(torch, "sgd", [p for p in net.parameters() if p.requires_grad])
    ref_opt = make_optimizer(torch, "sgd", ref.parameters())
    skipping = 5  # at this step the last rank runs no backward at all (an empty batch, say)
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = batch(torch, step, (6,), n)
        ranks = [q for q in range(n) if not (step == skipping and q == n - 1)]
        if r in ranks:
            mse(torch, net(piece(x, r), r == 1), piece(y, r)).backward()
        if ranks:
            sum(mse(torch, ref(piece(x, q), q == 1), piece(y, q)) for q in ranks).div(n).backward()
        if r not in ranks and form == "dp":
            net.reduce_gradients()  # an unchanged optimizer cannot do it: releases the peers' backward
        opt.step()  # DistributedOptimizer: reduces here (zeros) on the rank without backward
        ref_opt.step()
    assert model.never.weight.grad is None, "a parameter no rank used must keep grad=None"
    assert model.frozen.weight.grad is None
    assert (model.extra.weight.grad is None) == (n == 1), "rank 1's gradient must reach every rank"
    assert_close(model, ref, f"unused/frozen ({form}) on {n} ranks", TIGHT)


TRAINING.add("unused-frozen-parameters-and-a-rank-without-backward-DistributedOptimizer", unused_and_frozen, "opt")
TRAINING.add("unused-frozen-parameters-and-a-rank-without-backward-DataParallel", unused_and_frozen, "dp")


def poisoned_losses(torch: Any, model: Any, ref: Any, step: int, skipped: int, r: int, n: int) -> tuple[Any, Any]:
    """This rank's loss and the 1-process reference's on the global batch of ``step``; at ``skipped``
    the last rank's loss (and its share of the reference's) is multiplied by inf."""
    x, y = batch(torch, step, (6,), n)
    poison = [math.inf if step == skipped and q == n - 1 else 1.0 for q in range(n)]
    loss = mse(torch, model(piece(x, r)), piece(y, r)) * poison[r]
    ref_loss = sum(mse(torch, ref(piece(x, q)), piece(y, q)) * poison[q] for q in range(n)) / n
    return loss, ref_loss


@TRAINING.behaviour("grad-scaler-sees-reduced-gradients-and-skips-an-inf-step-on-every-rank")
def grad_scaler() -> None:
    """GradScaler: unscale_ sees reduced gradients, and an inf on one rank skips the step everywhere."""
    torch, pt, r, n = _setup()
    model, ref = mlp(torch, 100 + r), mlp(torch, 100)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3) for _ in range(2)]
    skipped = 4
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss, ref_loss = poisoned_losses(torch, model, ref, step, skipped, r, n)
        scalers[0].scale(loss).backward()
        scalers[1].scale(ref_loss).backward()
        if step % 2:  # the explicit form: reduce, unscale, clip, step
            opt.reduce_gradients()
            for s, o, mdl in ((scalers[0], opt, model), (scalers[1], ref_opt, ref)):
                s.unscale_(o)
                torch.nn.utils.clip_grad_norm_(mdl.parameters(), 0.5)
        before = scalers[0].get_scale()
        for s, o in ((scalers[0], opt), (scalers[1], ref_opt)):
            s.step(o)
            s.update()
        if step == skipped:  # found on every rank (the reduced gradients carry the inf): skipped, scale halved
            assert scalers[0].get_scale() == scalers[1].get_scale() == before / 2, "the inf step must be skipped"
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert_close(model, ref, f"GradScaler on {n} ranks", TIGHT)


@TRAINING.behaviour("state-dict-round-trip-resumes-exactly-and-add-param-group-reduces")
def checkpoints() -> None:
    """state_dict()/load_state_dict() are the wrapped optimizer's: a round trip resumes exactly."""
    torch, pt, r, n = _setup()
    model = mlp(torch, 100 + r)
    opt = pt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    def train(mdl: Any, o: Any, steps: range) -> None:
        for step in steps:
            o.zero_grad()
            x, y = batch(torch, step, (6,), n)
            mse(torch, mdl(piece(x, r)), piece(y, r)).backward()
            o.step()

    train(model, opt, range(3))
    saved = copy.deepcopy(opt.state_dict())  # as torch.save would: state_dict() holds live tensors
    assert saved.keys() == opt.optimizer.state_dict().keys() and len(saved["state"]) == 6
    twin = mlp(torch, 999)
    twin.load_state_dict(model.state_dict())
    twin_opt = pt.DistributedOptimizer(torch.optim.Adam(twin.parameters(), lr=0.5))
    twin_opt.load_state_dict(saved)
    assert twin_opt.param_groups[0]["lr"] == 0.01 and twin_opt.param_groups is twin_opt.optimizer.param_groups
    assert twin_opt.state is twin_opt.optimizer.state  # still shared after the load replaced it
    train(model, opt, range(3, 6))
    train(twin, twin_opt, range(3, 6))
    assert_close(twin, model, f"resumed from state_dict on {n} ranks", 0.0)
    # add_param_group (fine-tuning unfreezes a layer): rank 0's values, reduced from then on.
    torch.manual_seed(r)
    extra = torch.nn.Linear(3, 3).double()
    opt.add_param_group({"params": extra.parameters(), "lr": 0.1})
    same_on_every_rank(torch, extra.weight, "a parameter group added later")
    for step in range(2):
        opt.zero_grad()
        x, y = batch(torch, step, (6,), n)
        mse(torch, extra(model(piece(x, r))), piece(y, r)).backward()
        opt.step()
    same_on_every_rank(torch, extra.weight, "a parameter group added later, after training")


@TRAINING.behaviour("zero-grad-while-reductions-are-in-flight-is-a-usage-error")
def zero_grad_in_flight() -> None:
    """A backward that raised after launching buckets: zero_grad() says to complete them first."""
    torch, pt, r, n = _setup()
    nn = torch.nn

    class BoomLayer(nn.Module):
        def forward(self, x: Any) -> Any:
            return raise_in_backward(x, RuntimeError("boom in backward"))

    torch.manual_seed(r)
    model = nn.Sequential(nn.Linear(4, 4), BoomLayer(), nn.Linear(4, 4)).double()
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb=1e-6)
    assert len(opt._engine.bucket_sizes) == 4  # one bucket per parameter, launched as each is ready
    with raises(RuntimeError, "backward should have raised") as raised:
        model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    exc = raised.value
    assert "boom in backward" in str(exc)
    if n > 1:  # a world of one launches nothing (it has nothing to reduce): nothing is in flight
        with raises(phalanx.UsageError, "zero_grad() with reductions in flight must raise") as raised:
            opt.zero_grad()
        exc = raised.value
        assert "in flight" in str(exc) and "reduce_gradients()" in str(exc), exc
    opt.reduce_gradients()  # completes what the aborted backward launched (and the rest, as zeros)
    opt.zero_grad()


@TRAINING.behaviour("bad-wrapper-arguments-are-invalid-argument-errors-naming-the-value")
def bad_arguments() -> None:
    torch, pt, r, n = _setup()
    model = torch.nn.Linear(4, 4).double()
    shared = ({"op": "mean"}, {"compression": "int8"}, {"bucket_cap_mb": 0})
    attempts = [("DistributedOptimizer", bad) for bad in (*shared, {"backward_passes_per_step": 0})]
    attempts += [("DataParallel", bad) for bad in shared]
    for wrapper, bad in attempts:
        with raises(phalanx.InvalidArgumentError, f"phalanx.torch.{wrapper}(**{bad}) was accepted") as raised:
            if wrapper == "DataParallel":
                pt.DataParallel(model, **bad)
            else:
                pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **bad)
        exc = raised.value
        assert f"phalanx.torch.{wrapper}" in str(exc) and repr(next(iter(bad.values()))) in str(exc), exc
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with raises(phalanx.InvalidArgumentError, "wrapping a DistributedOptimizer again was accepted") as raised:
        pt.DistributedOptimizer(opt)
    exc = raised.value
    assert "plain torch optimizer" in str(exc), exc
    opt.close()


@TRAINING.behaviour("wrapping-the-model-and-then-its-optimizer-the-newer-takes-over-with-a-warning")
def double_wrapping() -> None:
    torch, pt, r, n = _setup()
    torch.manual_seed(0)
    plain = torch.nn.Linear(3, 3).double()
    dp = pt.DataParallel(plain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pt.DistributedOptimizer(torch.optim.SGD(dp.parameters(), lr=0.1))
    assert any("takes over" in str(w.message) for w in caught) and dp.engine.closed


@ACROSS_RANKS.behaviour("different-models-are-the-same-mismatch-error-on-every-rank")
def mismatched_models() -> None:
    """Different models on different ranks: the same CollectiveMismatchError on every rank."""
    torch, pt, r, n = _setup()
    nn = torch.nn
    torch.manual_seed(0)
    shapes = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5 if r == 0 else 6))
    counts = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2 if r == 0 else 3)])
    for model, expect in ((shapes, "1.weight"), (counts, "(none: it has only 4)")):
        for wrap in (lambda m: pt.DataParallel(m),
                     lambda m: pt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                                       named_parameters=m.named_parameters())):
            with raises(phalanx.CollectiveMismatchError, "different models must not be wrapped silently") as raised:
                wrap(model)
            exc = raised.value
            assert expect in str(exc) and "rank 1" in str(exc), exc
    assert phalanx.allreduce(1) == n  # the world is still usable


@TRAINING.behaviour("data-parallel-broadcasts-rank-0-buffers-in-training-forward-and-not-in-eval")
def buffers() -> None:
    """DataParallel broadcasts rank 0's buffers at each training forward; eval communicates nothing."""
    torch, pt, r, n = _setup()
    nn = torch.nn
    nets = {}
    for broadcast in (True, False):
        torch.manual_seed(200 + r)
        model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()
        net = nets[broadcast] = pt.DataParallel(model, broadcast_buffers=broadcast)
        bn = model[1]
        same_on_every_rank(torch, bn.running_mean, "buffers after construction")
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):  # different local batches: local statistics drift apart
            opt.zero_grad()
            x, y = batch(torch, step, (6,), n)
            mse(torch, net(piece(x, r)), piece(y, r)).backward()
            opt.step()
        x, _ = batch(torch, 99, (6,), 1)
        net(x)  # the same batch everywhere: equal afterwards iff they were equal before
        rows = phalanx.allgather(bn.running_mean.detach().clone())
        equal = all(torch.equal(rows[q], rows[0]) for q in range(n))
        assert equal == (broadcast or n == 1), f"broadcast_buffers={broadcast}: equal={equal}"
    if r == 0:  # evaluation on one rank only: no collective may happen (else the barrier mismatches)
        nets[True].eval()
        nets[True](x)
        synced = pt.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(6))).double().eval()
        synced(x)
    phalanx.barrier()


@TRAINING.behaviour("sync-batchnorm-on-uneven-batches-equals-batchnorm-on-the-whole-batch")
def sync_batchnorm() -> None:
    """SyncBatchNorm on uneven per-rank batches equals BatchNorm on the concatenated batch."""
    torch, pt, r, n = _setup()
    for shape in ((3,), (3, 5), (3, 4, 4), (3, 2, 2, 2)):
        sizes = [q + 2 for q in range(n)]  # uneven: rank q holds q + 2 samples (rank 1 none, once)
        if n > 1 and len(shape) == 2:
            sizes[1] = 0
        g = torch.Generator().manual_seed(7)
        x = torch.randn(sum(sizes), *shape, generator=g, dtype=torch.float64) * 3 + 5
        w = torch.randn(sum(sizes), *shape, generator=g, dtype=torch.float64)
        lo, hi = sum(sizes[:r]), sum(sizes[:r + 1])
        ref = torch.nn.BatchNorm1d(3) if len(shape) < 3 else (
            torch.nn.BatchNorm2d(3) if len(shape) == 3 else torch.nn.BatchNorm3d(3))
        ref = ref.double()
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5, generator=g)
            ref.bias.uniform_(-1, 1, generator=g)
        sync = pt.convert_sync_batchnorm(torch.nn.Sequential(type(ref)(3).double()))[0]
        sync.load_state_dict(ref.state_dict())
        assert isinstance(sync, pt.SyncBatchNorm)
        xr, xs = x.clone().requires_grad_(), x[lo:hi].clone().requires_grad_()
        for _ in range(2):  # twice: the running statistics are updated twice, the gradients accumulate
            ref_out = ref(xr)
            (ref_out * w).sum().backward()
            out = sync(xs)
            (out * w[lo:hi]).sum().backward()
        assert torch.allclose(out, ref_out[lo:hi], atol=1e-10, rtol=0)
        assert torch.allclose(xs.grad, xr.grad[lo:hi], atol=1e-10, rtol=0)
        for a, b in ((sync.weight.grad, ref.weight.grad), (sync.bias.grad, ref.bias.grad)):
            assert torch.allclose(phalanx.allreduce(a.clone()), b, atol=1e-9, rtol=0)
        for a, b in ((sync.running_mean, ref.running_mean), (sync.running_var, ref.running_var)):
            assert torch.allclose(a, b, atol=1e-12, rtol=0), (a, b)
        assert sync.num_batches_tracked.item() == ref.num_batches_tracked.item() == 2


@TRAINING.behaviour("allreduce-gradients-of-a-module-and-of-lists-of-arrays")
def gradients_helper() -> None:
    """phalanx.allreduce_gradients: a module (with a missing gradient) and lists of arrays/tensors."""
    torch, pt, r, n = _setup()
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.full((2, 3), float(r + 1))
    model.bias.grad = None if r == 0 else torch.full((2,), 3.0)
    assert phalanx.allreduce_gradients(model) is model
    assert torch.allclose(model.weight.grad, torch.full((2, 3), (n + 1) / 2))
    assert (model.bias.grad is None) == (n == 1)
    if n > 1:
        assert torch.allclose(model.bias.grad, torch.full((2,), 3.0 * (n - 1) / n))
    grads = [np.full(4, r, np.float32), torch.full((2, 2), float(r), dtype=torch.float64), np.full(2, 1.0)]
    out = phalanx.allreduce_gradients(grads, op="sum")
    assert out[0] is grads[0] and np.all(grads[0] == n * (n - 1) / 2) and grads[0].dtype == np.float32
    assert torch.all(grads[1] == n * (n - 1) / 2) and np.all(grads[2] == n)
    named = {"w": torch.full((3,), float(r))}
    assert phalanx.allreduce_gradients(named)["w"][0].item() == (n - 1) / 2


def checkpointed(reentrant: bool) -> None:
    """Activation checkpointing; the reentrant kind runs a nested backward inside backward."""
    torch, pt, r, n = _setup()
    nn = torch.nn

    class Checkpointed(nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=reentrant)

    model, ref = mlp(torch, 100 + r), mlp(torch, 100)
    model[2] = Checkpointed(model[2])
    net = pt.DataParallel(model)
    opt, ref_opt = (make_optimizer(torch, "sgd", m.parameters()) for m in (net, ref))
    for step in range(4):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = batch(torch, step, (6,), n)
        mse(torch, net(piece(x, r).requires_grad_()), piece(y, r)).backward()
        mse(torch, ref(x), y).backward()
        opt.step()
        ref_opt.step()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert (p - q).abs().max().item() < TIGHT, f"checkpointing (reentrant={reentrant}) on {n} ranks"


TRAINING.add("activation-checkpointing-trains-the-same", checkpointed, False)
TRAINING.add("reentrant-activation-checkpointing-nested-backward-trains-the-same", checkpointed, True)


def training() -> dict[str, str | None]:
    """Every behaviour above, in one world (those across ranks on 2 or more)."""
    import worlds_training_faults as faults  # it imports this module's helpers

    torch, pt, r, n = _setup()
    report = TRAINING.run()
    report.update(faults.FAULTS.run())
    if n > 1:
        report.update(ACROSS_RANKS.run())
        report.update(faults.FAULTS_ACROSS.run())
    return report


_MLP_OPT = {"model": "mlp", "form": "opt", "opt": "sgd"}
_CNN_DP = {"model": "cnn", "form": "dp", "opt": "adam"}
for _case in (_MLP_OPT, _CNN_DP):
    COMPILED.add(f"compiled-aot-eager-trains-like-one-process-{case_name(_case)}", run_case, _case, "aot_eager")
    INDUCTOR.add(f"compiled-inductor-trains-like-one-process-{case_name(_case)}", run_case, _case, "inductor")


def compiled() -> dict[str, str | None]:
    """A torch.compile'd model (aot_eager: dynamo + AOTAutograd, no code generation) trains the same."""
    _setup()
    return COMPILED.run()


def compiled_inductor() -> dict[str, str | None]:
    """The same with inductor (slow to compile cold on CPU: not in the default test run)."""
    _setup()
    return INDUCTOR.run()
