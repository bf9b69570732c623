"""Rank bodies for the PowerSGD tests: exactness where nothing is left out, error feedback, the wrappers, digits.

Gradients are compared with the exact average of the ranks' local gradients,
computed by a second backward on the same batch and a plain allreduce.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

import phalanx
import phalanx.torch as pt
from behaviours import Behaviours
from helpers import raises

POWERSGD = Behaviours()


def _mlp(seed: int = 0, widths: tuple[int, ...] = (16, 24, 12, 5), dtype: torch.dtype = torch.float64) -> Any:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).to(dtype)


def _batch(step: int, model: Any, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + phalanx.rank())  # each rank its own batch
    x = torch.randn(6, model[0].in_features, generator=g, dtype=dtype)
    return x, torch.randn(6, model[-1].out_features, generator=g, dtype=dtype)


def _loss(model: Any, step: int) -> torch.Tensor:
    x, y = _batch(step, model)
    return (model(x) - y).square().mean()


def _exact(model: Any, step: int, op: str = "avg", passes: int = 1) -> list[torch.Tensor]:
    """The exact reduction of this step's local gradients (``passes`` backward passes summed)."""
    params = list(model.parameters())
    local = [torch.zeros_like(p) for p in params]
    for _ in range(passes):
        for acc, g in zip(local, torch.autograd.grad(_loss(model, step), params), strict=True):
            acc += g
    return [torch.from_numpy(phalanx.allreduce(g.numpy(), op=op)) for g in local]


def _gap(grads: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    return max(float((g - e).abs().max() / (e.abs().max() + 1e-30)) for g, e in zip(grads, exact, strict=True))


def _identical(tensors: list[torch.Tensor]) -> bool:
    digest = hashlib.blake2b(b"".join(t.detach().numpy().tobytes() for t in tensors), digest_size=7).digest()
    mine = int.from_bytes(digest, "little")
    return phalanx.allreduce(np.array([mine, -mine], np.int64), op="max").tolist() == [mine, -mine]


def _train_exactness(op: str, rank: int, rate: float) -> float:
    """Largest relative gap between the reduced and the exact gradients over 4 steps."""
    model = _mlp()
    psgd = pt.PowerSGD(rank=rank, warmup_steps=0, min_compression_rate=rate)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), op=op, compression=psgd)
    worst = 0.0
    for step in range(4):
        exact = _exact(model, step, op)
        opt.zero_grad()
        _loss(model, step).backward()
        worst = max(worst, _gap([p.grad for p in model.parameters()], exact))
        opt.step()
    assert psgd.steps == 4 and psgd.compressing
    return worst


@POWERSGD.behaviour("full-rank-equals-the-exact-average")
def _() -> None:
    gap = _train_exactness("avg", 64, 0)
    assert gap < 1e-9, f"full-rank PowerSGD differs from the exact average by {gap:.3g} (relative)"


@POWERSGD.behaviour("op-sum-full-rank-equals-the-exact-sum")
def _() -> None:
    gap = _train_exactness("sum", 64, 0)
    assert gap < 1e-9, f"full-rank PowerSGD differs from the exact sum by {gap:.3g} (relative)"


@POWERSGD.behaviour("vectors-and-small-matrices-are-exact-large-matrices-are-compressed")
def _() -> None:
    model = _mlp(widths=(16, 40, 2))  # 40x16 compressed at rank 1; 2x40 too small to pay (rate 2); biases
    psgd = pt.PowerSGD(rank=1, warmup_steps=0)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compression=psgd)
    for step in range(3):
        exact = _exact(model, step)
        opt.zero_grad()
        _loss(model, step).backward()
        grads = [p.grad for p in model.parameters()]
        big, rest = _gap(grads[:1], exact[:1]), _gap(grads[1:], exact[1:])
        assert rest < 1e-12, f"step {step}: a vector or small matrix is not the exact average ({rest:.3g})"
        assert torch.linalg.matrix_rank(grads[0]) == 1, "the compressed matrix is not rank 1"
        assert big > 1e-6, f"step {step}: the 40x16 matrix was not compressed (gap {big:.3g})"
        opt.step()
    # bytes: P 40x1 and Q 16x1, the rest: biases 40 + 2, the 2x40 weight, 4 presence slots and the flag
    assert psgd.bytes_per_step == (40 + 16 + 42 + 80 + 4 + 1) * 8, psgd.bytes_per_step
    assert psgd.uncompressed_bytes == (640 + 42 + 80 + 4 + 1) * 8, psgd.uncompressed_bytes


@POWERSGD.behaviour("error-feedback-carries-the-residual-applied-plus-errors-equals-the-exact-sum")
def _() -> None:
    model = _mlp(widths=(16, 40))  # one 40x16 weight (compressed at rank 1) and a bias
    psgd = pt.PowerSGD(rank=1, warmup_steps=0)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), compression=psgd)
    applied = torch.zeros(40, 16, dtype=torch.float64)
    truth = torch.zeros(40, 16, dtype=torch.float64)
    for step in range(5):
        truth += _exact(model, step)[0]
        opt.zero_grad()
        _loss(model, step).backward()
        applied += model[0].weight.grad
        opt.step()
        (error,) = psgd.state_dict()["error"]
        errors = torch.from_numpy(phalanx.allreduce(error.numpy(), op="sum")).view(40, 16)
        gap = float((applied + errors - truth).abs().max() / truth.abs().max())
        assert gap < 1e-9, f"step {step}: applied + carried errors differ from the exact sum by {gap:.3g}"
        assert float((applied - truth).abs().max()) > 1e-6, "nothing was left out: not compressed?"
    assert float(error.abs().max()) > 0, "no residual is carried"


@POWERSGD.behaviour("warmup-steps-are-exact-then-compression-starts")
def _() -> None:
    model = _mlp(widths=(16, 40))
    psgd = pt.PowerSGD(rank=1, warmup_steps=2)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compression=psgd)
    gaps = []
    for step in range(4):
        assert psgd.compressing == (step >= 2), (step, psgd.compressing)
        exact = _exact(model, step)
        opt.zero_grad()
        _loss(model, step).backward()
        gaps.append(_gap([p.grad for p in model.parameters()], exact))
        opt.step()
    assert gaps[0] < 1e-12 and gaps[1] < 1e-12, f"warm-up steps are not exact: {gaps}"
    assert gaps[2] > 1e-6 and gaps[3] > 1e-6, f"compression did not start after warm-up: {gaps}"


@POWERSGD.behaviour("replicas-stay-identical-after-compressed-steps")
def _() -> None:
    model = _mlp(seed=phalanx.rank(), dtype=torch.float32)  # different starts: the wrapper sends rank 0's
    psgd = pt.PowerSGD(rank=2, warmup_steps=1)
    opt = pt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), compression=psgd)
    for step in range(6):
        x, y = _batch(step, model, torch.float32)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
    assert psgd.steps == 6
    assert _identical(list(model.parameters())), "the ranks' parameters differ after PowerSGD steps"


@POWERSGD.behaviour("data-parallel-no-sync-accumulation-equals-the-exact-average")
def _() -> None:
    model = _mlp()
    dp = pt.DataParallel(model, compression=pt.PowerSGD(rank=64, warmup_steps=0, min_compression_rate=0))
    opt = torch.optim.SGD(dp.parameters(), lr=0.05)
    for step in range(3):
        exact = _exact(model, step, passes=2)
        opt.zero_grad()
        with dp.no_sync():
            _loss(dp.module, step).backward()
        _loss(dp.module, step).backward()
        gap = _gap([p.grad for p in model.parameters()], exact)
        assert gap < 1e-9, f"step {step}: DataParallel + no_sync + PowerSGD differs by {gap:.3g}"
        opt.step()
    assert _identical(list(model.parameters()))


@POWERSGD.behaviour("backward-passes-per-step-accumulates-then-reduces-exactly-at-full-rank")
def _() -> None:
    model = _mlp()
    psgd = pt.PowerSGD(rank=64, warmup_steps=0, min_compression_rate=0)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compression=psgd,
                                  backward_passes_per_step=2)
    for step in range(2):
        exact = _exact(model, step, passes=2)
        opt.zero_grad()
        _loss(model, step).backward()
        _loss(model, step).backward()
        gap = _gap([p.grad for p in model.parameters()], exact)
        assert gap < 1e-9, f"step {step}: two passes per step differ by {gap:.3g}"
        opt.step()
    assert psgd.steps == 2, psgd.steps


@POWERSGD.behaviour("nonfinite-skip-names-the-rank-and-the-state-stays-finite")
def _() -> None:
    model = _mlp(widths=(16, 40, 5))
    psgd = pt.PowerSGD(rank=2, warmup_steps=0)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compression=psgd, nonfinite="skip")
    for step in range(4):
        opt.zero_grad()
        loss = _loss(model, step)
        if step == 1 and phalanx.rank() == 0:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        assert opt.nonfinite_ranks() == ([0] if step == 1 else []), (step, opt.nonfinite_ranks())
    state = psgd.state_dict()
    assert all(bool(torch.isfinite(t).all()) for t in state["q"] + state["error"]), "NaN carried in the state"
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert _identical(list(model.parameters()))


@POWERSGD.behaviour("state-dict-round-trips-and-a-wrong-one-is-refused")
def _() -> None:
    model = _mlp()
    psgd = pt.PowerSGD(rank=2, warmup_steps=0)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compression=psgd)
    for step in range(2):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    saved = psgd.state_dict()
    opt.close()
    again = pt.PowerSGD(rank=2, warmup_steps=0)
    pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compression=again)
    again.load_state_dict(saved)
    assert again.steps == 2 and all(torch.equal(a, b) for a, b in zip(again.state_dict()["q"], saved["q"],
                                                                       strict=True))
    other = pt.PowerSGD(rank=3)
    pt.DataParallel(_mlp(), compression=other)
    with raises(phalanx.InvalidArgumentError, "a state of another layout was loaded") as raised:
        other.load_state_dict(saved)
    exc = raised.value
    assert "load_state_dict" in str(exc) and "same model, rank" in str(exc), exc


@POWERSGD.behaviour("bad-arguments-raise-naming-the-call")
def _() -> None:
    cases = [({"rank": 0}, "PowerSGD(rank=0)"), ({"rank": True}, "PowerSGD(rank=True)"),
             ({"rank": 1.5}, "PowerSGD(rank=1.5)"), ({"warmup_steps": -1}, "warmup_steps=-1"),
             ({"min_compression_rate": -1}, "min_compression_rate=-1"), ({"seed": "x"}, "seed='x'"),
             ({"error_feedback": 1}, "error_feedback=1")]
    for kwargs, text in cases:
        with raises(phalanx.InvalidArgumentError, f"PowerSGD({kwargs}) was accepted") as raised:
            pt.PowerSGD(**kwargs)
        exc = raised.value
        assert "phalanx.torch.PowerSGD(" in str(exc) and text in str(exc), exc
    with raises(phalanx.InvalidArgumentError, "an unknown compression was accepted") as raised:
        pt.DataParallel(_mlp(), compression="powersgd2")
    exc = raised.value
    assert "phalanx.torch.DataParallel(compression='powersgd2')" in str(exc) and "'powersgd'" in str(exc), exc
    shared = pt.PowerSGD()
    first = pt.DataParallel(_mlp(), compression=shared)
    with raises(phalanx.UsageError, "one PowerSGD object was accepted by two live wrappers") as raised:
        pt.DataParallel(_mlp(1), compression=shared)
    exc = raised.value
    assert "already compresses" in str(exc) and "own phalanx.torch.PowerSGD" in str(exc), exc
    first.close()
    pt.DataParallel(_mlp(1), compression=shared).close()  # free again once the first wrapper is closed


@POWERSGD.behaviour("fit-trains-with-powersgd")
def _() -> None:
    import phalanx.train

    model = _mlp(seed=phalanx.rank(), widths=(16, 40, 5), dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(96, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, :5] * 3).argmax(dim=1))
    psgd = pt.PowerSGD(rank=2, warmup_steps=2)
    history = phalanx.train.fit(model, torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.2),
                                data, batch_size=8 if phalanx.size() < 3 else 6, steps=10, compression=psgd,
                                progress=False, log_every=1)
    if phalanx.size() > 1:  # a world of one trains without a wrapper: nothing to compress
        assert psgd.steps == 10 and psgd.compressing, psgd.steps
    losses = [r["train/loss"] for r in history.records if "train/loss" in r]
    assert losses[-1] < losses[0], losses
    assert _identical(list(model.parameters()))


def powersgd() -> dict[str, str | None]:
    torch.set_num_threads(1)
    return POWERSGD.run()


# -- convergence on scikit-learn's digits --------------------------------------------------------------

def _digits_accuracy(compression: Any, epochs: int, seed: int = 0) -> float:
    """Test accuracy (%) of the digits MLP after ``epochs`` of SGD with momentum, global batch 64."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, train = order[:len(x) // 5], order[len(x) // 5:]
    rank, size = phalanx.rank(), phalanx.size()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  compression=compression)
    batch, local = 64, 64 // size
    for epoch in range(epochs):
        perm = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(seed + 1 + epoch))]
        for s in range(len(perm) // batch):
            mine = perm[s * batch:(s + 1) * batch][rank * local:(rank + 1) * local]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()
    opt.close()
    with torch.no_grad():
        return 100.0 * float((model(x[test]).argmax(dim=1) == y[test]).float().mean())


def digits_convergence(epochs: int = 20) -> dict[str, float]:
    """Accuracies with and without PowerSGD (rank 4, 10 warm-up steps), the same seeds and epochs."""
    torch.set_num_threads(1)
    plain = _digits_accuracy(None, epochs)
    psgd = pt.PowerSGD(rank=4, warmup_steps=10)
    compressed = _digits_accuracy(psgd, epochs)
    return {"plain": plain, "powersgd": compressed, "steps": psgd.steps,
            "bytes": psgd.bytes_per_step, "uncompressed": psgd.uncompressed_bytes}
