"""Replica test bodies: k in-process replicas (on each of N processes) train like 1 model on the whole batch.

:func:`train` is the core check, used in-process by ``test_replicas.py`` and
inside worlds by :func:`processes_and_replicas`: every replica gets an equal
chunk of a fixed global batch (rank r holds the r-th part, its replicas split
that part), and a reference model trains on the whole batch in the same
process. Losses are means and chunks are equal, so the mean of the replicas'
gradients is the whole batch's gradient; models are float64, so the tolerance
is tight.
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Iterator
from typing import Any

import phalanx
from behaviours import Behaviours
from helpers import raises

STEPS = 10
PER_REPLICA = 3
TIGHT = 1e-10  # float64: only the summation order differs

REPLICAS = Behaviours()      # checked on every world
ACROSS_RANKS = Behaviours()  # checked on worlds of 2 or more ranks


def mlp(torch: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)).double()


def global_batch(torch: Any, step: int, total: int) -> tuple[Any, Any]:
    """The batch of ``step``, the same in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(total, 5, generator=g, dtype=torch.float64),
            torch.randn(total, 3, generator=g, dtype=torch.float64))


def make_optimizer(torch: Any, kind: str, params: Any) -> Any:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def assert_close(torch: Any, model: Any, ref: Any, what: str, tol: float) -> None:
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        err = (p.cpu() - q).abs().max().item()
        assert err <= tol * max(1.0, q.abs().max().item()), \
            f"{what}: {name} differs from the 1-model run by {err:.3g} (tolerance {tol:g})"


def train(k: int, kind: str, pattern: str, *, devices: Any = None, tol: float = TIGHT) -> None:
    """k replicas (per process) for STEPS steps against one model on the whole batch.

    ``pattern`` "a": one optimizer over replica 0 (the user's model), then
    ``synchronize()``; "b" (Conflux's): one optimizer per replica, no
    synchronize, the replicas must stay exactly equal.
    """
    import torch

    import phalanx.torch as pt

    r, n = (phalanx.rank(), phalanx.size()) if phalanx.initialized() else (0, 1)
    model, ref = mlp(torch, 100 + r), mlp(torch, 100)  # only rank 0's start matches the reference
    replicas = pt.replicate(model, devices if devices is not None else k)
    assert replicas[0] is model and replicas.count == k
    if n > 1:
        phalanx.synchronize(replicas[0])
    replicas.synchronize()
    opts = ([make_optimizer(torch, kind, model.parameters())] if pattern == "a"
            else [make_optimizer(torch, kind, m.parameters()) for m in replicas])
    ref_opt = make_optimizer(torch, kind, ref.parameters())
    per_rank = k * PER_REPLICA
    for step in range(STEPS):
        x, y = global_batch(torch, step, n * per_rank)
        mine = slice(r * per_rank, (r + 1) * per_rank)
        replicas.zero_grad()
        chunks = replicas.scatter((x[mine], y[mine]))

        def forward_backward(i: int, device: Any, chunks: list[Any] = chunks) -> float:
            xi, yi = chunks[i]
            assert xi.device == device and xi.shape[0] == PER_REPLICA
            loss = torch.nn.functional.mse_loss(replicas[i](xi), yi)
            loss.backward()
            return loss.item()

        losses = pt.withdevices(forward_backward, replicas)
        assert len(losses) == k
        replicas.allreduce_gradients("avg")
        for opt in opts:
            opt.step()
        if pattern == "a":
            replicas.synchronize()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    what = f"{k} replicas x {n} processes, {kind}, pattern {pattern}"
    assert replicas.in_sync(), f"{what}: the replicas differ from each other"
    for i, m in enumerate(replicas):
        assert_close(torch, m, ref, f"{what}, replica {i}", tol)


@contextlib.contextmanager
def fake_nccl() -> Iterator[None]:
    """Route the reduction through its NCCL branch, with torch.cuda.nccl's semantics done on the CPU
    (real NCCL needs several GPUs in one process)."""
    import torch

    from phalanx.torch import _replica_grads

    def all_reduce(inputs: list[Any]) -> None:
        total = torch.stack(inputs).sum(0)
        for t in inputs:
            t.copy_(total)

    def reduce(inputs: list[Any], root: int = 0) -> None:
        inputs[root].copy_(torch.stack(inputs).sum(0))

    def broadcast(inputs: list[Any], root: int = 0) -> None:
        for t in inputs:
            t.copy_(inputs[root])

    saved = _replica_grads.nccl, _replica_grads._nccl_usable
    _replica_grads.nccl = types.SimpleNamespace(all_reduce=all_reduce, reduce=reduce, broadcast=broadcast)
    _replica_grads._nccl_usable = lambda flats: True
    try:
        yield
    finally:
        _replica_grads.nccl, _replica_grads._nccl_usable = saved


# -- worlds ------------------------------------------------------------------------------------

for _kind in ("sgd", "adam"):
    REPLICAS.add(f"processes-x-2-replicas-train-like-one-model-{_kind}-one-optimizer-and-synchronize",
                 train, 2, _kind, "a")
    REPLICAS.add(f"processes-x-2-replicas-train-like-one-model-{_kind}-one-optimizer-per-replica",
                 train, 2, _kind, "b")


@REPLICAS.behaviour("the-nccl-branch-reduces-like-the-host-branch-across-processes")
def _nccl_branch() -> None:
    with fake_nccl():
        train(2, "adam", "a")


@REPLICAS.behaviour("op-sum-and-avg-over-all-replicas-with-missing-gradients-and-within-a-process")
def _sum_and_presence() -> None:
    """op="sum"/"avg" over all n*k replicas, gradients missing on some replicas or ranks, and
    across_processes=False (this rank's replicas only)."""
    import torch

    import phalanx.torch as pt

    r, n = phalanx.rank(), phalanx.size()
    k = 2
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "c": nn.Linear(2, 2)}).double()
    replicas = pt.replicate(model, k)

    def full(value: float) -> Any:
        return torch.full((2, 2), value, dtype=torch.float64)

    for op in ("sum", "avg"):
        for across in (True, False):
            replicas.zero_grad()
            for i, m in enumerate(replicas):
                m["a"].weight.grad = full(r * k + i + 1)      # replica i of rank r: r*k + i + 1
                if i == 0:
                    m["a"].bias.grad = torch.full((2,), 2.0, dtype=torch.float64)  # replica 0 only
                if r == n - 1:
                    m["b"].weight.grad = full(1.0)              # the last rank's replicas only
            replicas.allreduce_gradients(op, across_processes=across)
            ranks = range(n) if across else [r]
            count = len(ranks) * k
            sums = {"a.weight": sum(q * k + i + 1 for q in ranks for i in range(k)),
                    "a.bias": 2.0 * len(ranks),
                    "b.weight": float(k) if (n - 1) in ranks else None}
            for i, m in enumerate(replicas):
                where = f"op={op}, across_processes={across}, rank {r} of {n}, replica {i}"
                for name, total in sums.items():
                    grad = m.get_parameter(name).grad
                    if total is None:
                        assert grad is None, f"{where}: {name}.grad is {grad}, expected None"
                        continue
                    expect = total / count if op == "avg" else total
                    got = None if grad is None else grad.tolist()
                    assert grad is not None and torch.allclose(grad, torch.full_like(grad, expect),
                                                               rtol=0, atol=1e-12), \
                        f"{where}: {name}.grad is {got}, expected {expect}"
                assert m["b"].bias.grad is None and m["c"].weight.grad is None, where  # no gradient anywhere


@ACROSS_RANKS.behaviour("unequal-replica-counts-or-models-are-the-same-mismatch-error-on-every-rank")
def _mismatches() -> None:
    """Unequal replica counts, then unequal models: the same clear error on every rank."""
    import torch

    import phalanx.torch as pt

    r = phalanx.rank()
    model = mlp(torch, 1)
    replicas = pt.replicate(model, 1 if r == 0 else 2)
    for m in replicas:
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    with raises(phalanx.CollectiveMismatchError, f"rank {r}: unequal replica counts were not detected") as raised:
        replicas.allreduce_gradients()
    exc = raised.value
    assert "different numbers of replicas" in str(exc) and "between 1 and 2" in str(exc), str(exc)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for m in replicas for p in m.parameters()), \
        "the gradients changed although the check failed"
    torch.manual_seed(1)
    nn = torch.nn
    other = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 4)).double() if r == 0 else mlp(torch, 1)
    replicas = pt.replicate(other, 2)
    for m in replicas:
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    with raises(phalanx.CollectiveMismatchError, f"rank {r}: different models were not detected") as raised:
        replicas.allreduce_gradients()
    exc = raised.value
    assert "parameter #2" in str(exc), str(exc)
    phalanx.barrier()  # the world is still usable


@REPLICAS.behaviour("an-optimizer-built-before-replicate-keeps-stepping-replica-0")
def _optimizer_kept() -> None:
    import torch

    import phalanx.torch as pt

    model = mlp(torch, 7)
    before = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    replicas = pt.replicate(model, 2)
    for p in replicas[0].parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    moved = [(p - q).abs().max().item() for p, q in zip(model.parameters(), before.parameters(), strict=True)]
    assert all(abs(d - 0.5) < 1e-12 for d in moved), moved


def processes_and_replicas() -> dict[str, str | None]:
    """Every behaviour of N processes x 2 replicas, in one world (those across ranks on 2 or more)."""
    import torch

    torch.set_num_threads(1)
    report = REPLICAS.run()
    if phalanx.size() > 1:
        report.update(ACROSS_RANKS.run())
    return report
