"""Rank bodies for sparse gradients in Horovod's DistributedOptimizer (phalanx.horovod.torch): reduced
sparse (allgathers of indices and values) by default, dense with ``sparse_as_dense=True``."""

from __future__ import annotations

from typing import Any

import torch

import phalanx.horovod.torch as hvd
from behaviours import Behaviours

SPARSE = Behaviours()
PER_RANK = 4  # samples per rank and step


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embedding = torch.nn.Embedding(20, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1).double()
        self.embedding.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(x).sum(1))


def _batches(n: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return (torch.randint(0, 20, (steps, PER_RANK * n, 3), generator=g),
            torch.randn(steps, PER_RANK * n, 1, generator=g, dtype=torch.float64))


def _train(r: int, n: int, steps: int = 3, passes: int = 1, **options: Any) -> tuple[Any, Any, Any]:
    """(distributed model, its optimizer, one-process model on the combined batch) after ``steps``
    steps; the embedding's gradients are sparse (SparseAdam), the head's dense (SGD)."""
    xs, ys = _batches(n, steps)

    def make(model: _Net) -> list[torch.optim.Optimizer]:
        return [torch.optim.SparseAdam(list(model.embedding.parameters()), lr=0.05),
                torch.optim.SGD(model.head.parameters(), lr=0.1)]

    ref, model = _Net(), _Net()
    ref_opts = make(ref)
    sparse_opt, dense_opt = make(model)
    sparse_opt = hvd.DistributedOptimizer(sparse_opt, named_parameters=model.embedding.named_parameters(),
                                          backward_passes_per_step=passes, **options)
    dense_opt = hvd.DistributedOptimizer(dense_opt, named_parameters=model.head.named_parameters(),
                                         backward_passes_per_step=passes)
    for s in range(steps):
        for o in ref_opts:
            o.zero_grad()
        torch.nn.functional.mse_loss(ref(xs[s]), ys[s]).backward()
        for o in ref_opts:
            o.step()
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
        x, y = xs[s][mine], ys[s][mine]
        for part in range(passes):
            piece = slice(part * PER_RANK // passes, (part + 1) * PER_RANK // passes)
            (torch.nn.functional.mse_loss(model(x[piece]), y[piece]) / passes).backward()
        sparse_opt.step()
        dense_opt.step()
    return model, sparse_opt, ref


def _close(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        err = (p - q).abs().max().item()
        assert err <= 1e-12, f"{name}: differs from one process on the combined batch by {err:.3g}"


@SPARSE.behaviour("sparse-gradients-are-reduced-sparse-and-equal-one-process-on-the-combined-batch")
def _(r: int, n: int) -> None:
    model, opt, ref = _train(r, n)
    _close(model, ref)
    weight = model.embedding.weight
    assert weight.grad is not None and weight.grad.is_sparse, weight.grad
    assert opt._hvd_sparse == {id(weight)}, "the embedding was not taken out of the dense engine"


@SPARSE.behaviour("sparse-gradients-accumulate-over-backward-passes-per-step-2")
def _(r: int, n: int) -> None:
    model, _, ref = _train(r, n, passes=2)
    _close(model, ref)


@SPARSE.behaviour("sparse-as-dense-reduces-them-dense-with-the-same-result")
def _(r: int, n: int) -> None:
    model, opt, ref = _train(r, n, sparse_as_dense=True)
    _close(model, ref)
    assert not opt._hvd_sparse


def sparse() -> dict[str, str | None]:
    """The world body: hvd.init, then every behaviour."""
    hvd.init()
    return SPARSE.run(hvd.rank(), hvd.size())
