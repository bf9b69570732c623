"""Rank bodies for a world of one: training steps that copy no gradient and call no collective."""

from __future__ import annotations

import phalanx
from behaviours import Behaviours

ALONE = Behaviours()
_CALLS = ("allreduce", "iallreduce", "broadcast", "ibroadcast", "agree", "allgather", "reduce_scatter")


def _model(seed: int):  # noqa: ANN202 - torch is imported inside the world
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _counting(backend):  # noqa: ANN001, ANN202
    """Count the backend's collective calls (the real calls still run)."""
    counts = dict.fromkeys(_CALLS, 0)
    for name in _CALLS:
        real = getattr(backend, name, None)
        if real is None:
            continue

        def counted(*args, _real=real, _name=name):  # noqa: ANN002, ANN202
            counts[_name] += 1
            return _real(*args)

        setattr(backend, name, counted)
    return counts


def _train(wrap: str, steps: int = 3):  # noqa: ANN202
    """(final parameters, backend calls during the steps, gradients left where autograd put them)."""
    import torch

    import phalanx.torch as pt

    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if wrap == "DataParallel":
        model = pt.DataParallel(model)
        engine = model.engine
    else:
        opt = pt.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        engine = opt.engine
    counts = _counting(phalanx.backend())
    x, y = torch.randn(16, 6, generator=torch.Generator().manual_seed(1)), torch.randint(0, 3, (16,))
    own = True
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        own &= all(p.grad is not v for p, v in zip(engine.params, engine.views, strict=True))
    return [p.detach().clone() for p in model.parameters()], sum(counts.values()), own


def _plain(steps: int = 3):  # noqa: ANN202
    import torch

    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 6, generator=torch.Generator().manual_seed(1)), torch.randint(0, 3, (16,))
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


for _wrap in ("DataParallel", "DistributedOptimizer"):
    @ALONE.behaviour(f"{_wrap}-at-one-rank-calls-no-collective-in-the-step")
    def _(wrap: str = _wrap) -> None:
        import torch

        torch.manual_seed(2)
        _, calls, _own = _train(wrap)
        assert calls == 0, f"{calls} backend calls in 3 steps"

    @ALONE.behaviour(f"{_wrap}-at-one-rank-copies-no-gradient-into-a-bucket")
    def _(wrap: str = _wrap) -> None:
        import torch

        torch.manual_seed(2)
        assert _train(wrap)[2], "a .grad is a bucket view: the step copied it into the bucket"

    @ALONE.behaviour(f"{_wrap}-at-one-rank-trains-exactly-as-plain-torch")
    def _(wrap: str = _wrap) -> None:
        import torch

        torch.manual_seed(2)
        mine = _train(wrap)[0]
        torch.manual_seed(2)
        for a, b in zip(mine, _plain(), strict=True):
            assert torch.equal(a, b), (a - b).abs().max()


@ALONE.behaviour("a-world-of-one-with-bf16-compression-still-reduces-through-the-wire")
def _() -> None:
    import torch

    import phalanx.torch as pt

    model = pt.DataParallel(_model(0), compression="bf16")
    torch.nn.functional.mse_loss(model(torch.randn(4, 6)), torch.zeros(4, 3)).backward()
    assert all(p.grad is v for p, v in zip(model.engine.params, model.engine.views, strict=True))
    assert model.engine.reductions == 1


def alone() -> dict[str, str | None]:
    """The world-of-one behaviours (run on one rank)."""
    return ALONE.run()
