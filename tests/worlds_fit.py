"""Bodies for tests/test_fit.py: ``phalanx.train.fit`` on N ranks equals a hand-written 1-process loop.

Every rank starts from a model built with a *different* seed (only fit's
broadcast from rank 0 can make them agree). The reference is plain torch in
one process, visiting the same global batches in the same order
(``epoch_order``), so any difference in partitioning, averaging, accumulation,
scheduling, skipping or resuming shows up as different parameters. float64
models: the tolerance only allows for summation order.
"""

from __future__ import annotations

import copy
import json
import os
import signal
from typing import Any

import phalanx
from helpers import raise_in_backward

GLOBAL = 12  # samples per global micro-batch: divisible by 1, 2, 3 ranks and by 2 replicas
TOL = 1e-9


def _torch() -> Any:
    import torch

    torch.set_num_threads(1)
    return torch


def data(torch: Any, n: int = 60, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return torch.utils.data.TensorDataset(x, y)


def model(torch: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()


def sgd(torch: Any, m: Any) -> Any:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def adam(torch: Any, m: Any) -> Any:
    return torch.optim.Adam(m.parameters(), lr=0.01)


def reference(torch: Any, start: Any, make_opt: Any, ds: Any, *, steps: int, accumulate: int = 1,
              skip: tuple[int, ...] = (), make_sched: Any = None) -> Any:
    """Plain torch, one process, the whole global batch: what fit must reproduce."""
    from phalanx.train._batches import epoch_order

    m = copy.deepcopy(start)
    opt = make_opt(torch, m)
    sched = make_sched(opt) if make_sched else None
    x, y = ds.tensors
    per_epoch = len(ds) // GLOBAL // accumulate
    step, epoch = 0, 0
    while step < steps:
        order = epoch_order(len(ds), epoch, 0, True)
        for s in range(per_epoch):
            if step >= steps:
                break
            opt.zero_grad()
            for j in range(accumulate):
                idx = order[(s * accumulate + j) * GLOBAL:(s * accumulate + j + 1) * GLOBAL]
                (torch.nn.functional.cross_entropy(m(x[idx]), y[idx]) / accumulate).backward()
            if step not in skip:
                opt.step()
                if sched:
                    sched.step()
            step += 1
        epoch += 1
    return m


def same(torch: Any, a: Any, b: Any, tol: float = TOL) -> bool:
    return all(torch.allclose(p, q, rtol=0, atol=tol) for p, q in zip(a.parameters(), b.parameters(),
                                                                       strict=True))


def equivalence(tmp: str) -> dict[str, Any]:
    """Processes (and processes x replicas): the same parameters as one process on the global batch."""
    torch = _torch()
    import phalanx.train as pt

    rank, size = phalanx.rank(), phalanx.size()
    ds, val = data(torch), data(torch, n=23, seed=1)
    start = model(torch, 0)
    checks: dict[str, Any] = {}
    ce = torch.nn.functional.cross_entropy

    for name, make_opt, acc in (("sgd", sgd, 1), ("adam", adam, 1), ("sgd-accumulate", sgd, 2)):
        m = model(torch, 100 + rank)  # rank 0's start is broadcast by fit; others differ on purpose
        m.load_state_dict(start.state_dict()) if rank == 0 else None
        h = pt.fit(m, ce, make_opt(torch, m), ds, batch_size=GLOBAL // size, steps=7, accumulate=acc,
                   val_data=val, val_every=3, progress=False)
        ref = reference(torch, start, make_opt, ds, steps=7, accumulate=acc)
        assert same(torch, m, ref), f"{name}: fit on {size} ranks differs from one process"
        assert h["val/samples"] == [23.0] * 3, h["val/samples"]  # every sample once, at steps 3, 6, 7
        assert h.steps("val/loss") == [3, 6, 7], h.steps("val/loss")
        with torch.no_grad():
            want = ce(ref(val.tensors[0]), val.tensors[1]).item()
        assert abs(h.last("val/loss") - want) < 1e-9, (h.last("val/loss"), want)
        checks[name] = True

    # The user's own wrappers are used as they are: a DataParallel model, or a DistributedOptimizer.
    import phalanx.torch as ptorch

    for name in ("DataParallel", "DistributedOptimizer"):
        m = model(torch, 200 + rank)
        m.load_state_dict(start.state_dict()) if rank == 0 else None
        if name == "DataParallel":
            net, opt = ptorch.DataParallel(m), sgd(torch, m)
        else:
            net, opt = m, ptorch.DistributedOptimizer(sgd(torch, m))
        pt.fit(net, ce, opt, ds, batch_size=GLOBAL // size, steps=6, accumulate=2, progress=False)
        assert same(torch, m, reference(torch, start, sgd, ds, steps=6, accumulate=2)), name
        net.close() if name == "DataParallel" else opt.close()
        checks[name] = True

    # An LR schedule is really applied, per step.
    m = model(torch, 7 + rank)
    m.load_state_dict(start.state_dict()) if rank == 0 else None
    h = pt.fit(m, ce, sgd(torch, m), ds, batch_size=GLOBAL // size, epochs=2, log_every=1, progress=False,
               scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5))
    ref = reference(torch, start, sgd, ds, steps=10,
                    make_sched=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5))
    assert same(torch, m, ref)
    assert h["lr"][:7] == [0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025], h["lr"]
    assert h.summary["steps"] == 10 and h.summary["epochs"] == 2.0, h.summary
    checks["scheduler"] = True

    # Replicas inside each process: size x 2 workers.
    m = model(torch, 50 + rank)
    m.load_state_dict(start.state_dict()) if rank == 0 else None
    h = pt.fit(m, ce, sgd(torch, m), ds, batch_size=GLOBAL // size // 2, steps=6, replicas=2, progress=False)
    assert same(torch, m, reference(torch, start, sgd, ds, steps=6)), "replicas x processes differ"
    assert h.summary["replicas"] == 2
    checks["replicas"] = True
    return checks


def failures(tmp: str) -> dict[str, Any]:
    """NaN/Inf loss and out-of-memory on one rank: the same decision on every rank, no hang."""
    torch = _torch()
    import phalanx.train as pt

    rank, size = phalanx.rank(), phalanx.size()
    ds = data(torch)
    start = model(torch, 0)
    ce = torch.nn.functional.cross_entropy
    last = size - 1
    checks: dict[str, Any] = {}

    def faulty(kind: str, at_step: int) -> Any:
        calls = {"n": 0}

        def loss_fn(out: Any, y: Any) -> Any:
            step = calls["n"]
            calls["n"] += 1
            if step == at_step and rank == last:
                if kind == "nan":
                    return ce(out, y) * float("nan")
                if kind == "oom":
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                if kind == "oom-backward":
                    return ce(raise_in_backward(out, torch.OutOfMemoryError("CUDA out of memory (injected in backward)")), y)
            return ce(out, y)

        return loss_fn

    for kind in ("nan", "oom", "oom-backward"):
        m = model(torch, 30 + rank)
        m.load_state_dict(start.state_dict()) if rank == 0 else None
        h = pt.fit(m, faulty(kind, 2), sgd(torch, m), ds, batch_size=GLOBAL // size, steps=5, progress=False)
        assert h.summary["skipped_steps"] == 1, (kind, h.summary)
        assert same(torch, m, reference(torch, start, sgd, ds, steps=5, skip=(2,))), kind
        checks[kind] = True

    for kind in ("nan", "oom"):
        m = model(torch, 30 + rank)
        policy = {"on_nonfinite": "raise"} if kind == "nan" else {"on_oom": "raise"}
        try:
            pt.fit(m, faulty(kind, 1), sgd(torch, m), ds, batch_size=GLOBAL // size, steps=5, progress=False,
                   **policy)
        except pt.TrainingError as exc:
            assert f"rank(s) [{last}]" in str(exc) and "step 1" in str(exc), str(exc)
            checks[f"raise-{kind}"] = True
        else:
            raise AssertionError(f"{kind}: fit did not raise TrainingError on rank {rank}")

    # Too many skips in a row: a clear stop, on every rank.
    m = model(torch, 0)
    try:
        pt.fit(m, lambda out, y: ce(out, y) * float("inf"), sgd(torch, m), ds, batch_size=GLOBAL // size,
               steps=20, max_skipped=3, progress=False)
    except pt.TrainingError as exc:
        assert "4 steps in a row" in str(exc), str(exc)
        checks["max_skipped"] = True
    return checks


def resume(tmp: str, phase: str) -> dict[str, Any]:
    """Checkpoints: interrupted (by SIGTERM) + resumed equals uninterrupted; also across world sizes.

    ``phase="write"``: run A is stopped by a SIGTERM on rank 0 after step 4 (every rank stops there,
    a checkpoint is written). ``phase="resume"`` (possibly at another world size, same global batch):
    resume run A to 10 steps, compare with an uninterrupted run B.
    """
    torch = _torch()
    import phalanx.train as pt

    rank, size = phalanx.rank(), phalanx.size()
    ds, val = data(torch), data(torch, n=23, seed=1)
    start = model(torch, 0)
    ce = torch.nn.functional.cross_entropy
    ckpt = os.path.join(tmp, "ckpt")
    checks: dict[str, Any] = {}

    def make_sched(opt: Any) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)

    def run(m: Any, loss_fn: Any, resume: Any) -> Any:
        logger = pt.JSONLinesLogger(os.path.join(tmp, "metrics.jsonl"))
        return pt.fit(m, loss_fn, adam(torch, m), ds, batch_size=GLOBAL // size, steps=10, val_data=val,
                      scheduler=make_sched, checkpoint_dir=ckpt, checkpoint_every=3, resume=resume,
                      loggers=[logger], log_every=2, progress=False)

    if phase == "write":
        calls = {"n": 0}

        def stopping(out: Any, y: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 5 and rank == 0:  # during step 4 (0-based): like a scheduler's preemption
                os.kill(os.getpid(), signal.SIGTERM)
            return ce(out, y)

        m = model(torch, 60 + rank)
        m.load_state_dict(start.state_dict()) if rank == 0 else None
        h = run(m, stopping, None)
        assert h.stopped in ("SIGTERM", "signal on another rank"), h.stopped
        assert h.summary["steps"] == 5, h.summary
        names = sorted(os.listdir(ckpt))
        assert any(n.endswith("000000005.pt") for n in names), names
        checks["stopped"] = h.stopped
        return checks

    m = model(torch, 70 + rank)  # whatever it starts from, the checkpoint decides
    h = run(m, ce, "latest")
    assert h.summary["steps"] == 10 and h.stopped is None, h.summary
    assert h.steps("val/loss")[-1] == 10
    ref = reference(torch, start, adam, ds, steps=10, make_sched=make_sched)
    assert same(torch, m, ref, tol=1e-7), "resumed run differs from the uninterrupted one"
    if rank == 0:
        lines = [json.loads(line) for line in open(os.path.join(tmp, "metrics.jsonl"))]
        steps = [r["step"] for r in lines if "train/loss" in r]
        assert steps[:2] == [2, 4] and steps[-1] == 10, steps  # the first run's lines are kept
        assert os.path.getsize(os.path.join(ckpt, "curves.png")) > 1000
    checks["resumed"] = True
    return checks
