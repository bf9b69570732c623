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
import warnings
from typing import Any

import phalanx
from behaviours import Behaviours
from helpers import nan_in_backward, raise_in_backward, raises

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
    """Whether ``a``'s parameters equal ``b``'s (a model fit sharded with shard="parameters" holds sharded
    ones: compared whole, which is collective, so every one is gathered before any is compared)."""
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in a.parameters()]
    return all(torch.allclose(p, q, rtol=0, atol=tol) for p, q in zip(whole, b.parameters(), strict=True))


class World:
    """What every behaviour of a world shares: torch, the data, rank 0's start, this rank's identity."""

    def __init__(self, tmp: str) -> None:
        self.torch = torch = _torch()
        import phalanx.train as pt

        self.pt, self.tmp = pt, tmp
        self.rank, self.size = phalanx.rank(), phalanx.size()
        self.ds, self.val = data(torch), data(torch, n=23, seed=1)
        self.start = model(torch, 0)
        self.ce = torch.nn.functional.cross_entropy

    def fresh(self, seed: int) -> Any:
        """A model that starts from rank 0's start only through fit's broadcast (others differ)."""
        m = model(self.torch, seed + self.rank)
        if self.rank == 0:
            m.load_state_dict(self.start.state_dict())
        return m

    def fit(self, m: Any, loss_fn: Any = None, opt: Any = None, **kwargs: Any) -> Any:
        opt = sgd(self.torch, m) if opt is None else opt
        kwargs.setdefault("progress", False)
        return self.pt.fit(m, loss_fn or self.ce, opt, self.ds, batch_size=GLOBAL // self.size, **kwargs)


# -- equivalence: processes (and processes x replicas) give one process's parameters ----------------

EQUIVALENCE = Behaviours()


def _same_as_one_process(w: World, make_opt: Any, acc: int, shard: str | None = None) -> None:
    torch = w.torch
    m = w.fresh(100)
    h = w.fit(m, opt=make_opt(torch, m), steps=7, accumulate=acc, val_data=w.val, val_every=3, shard=shard)
    ref = reference(torch, w.start, make_opt, w.ds, steps=7, accumulate=acc)
    assert same(torch, m, ref), f"fit on {w.size} ranks differs from one process"
    assert h["val/samples"] == [23.0] * 3, h["val/samples"]  # every sample once, at steps 3, 6, 7
    assert h.steps("val/loss") == [3, 6, 7], h.steps("val/loss")
    with torch.no_grad():
        want = w.ce(ref(w.val.tensors[0]), w.val.tensors[1]).item()
    assert abs(h.last("val/loss") - want) < 1e-9, (h.last("val/loss"), want)


for _name, _opt, _acc in (("sgd", sgd, 1), ("adam", adam, 1), ("sgd-accumulate", sgd, 2)):
    EQUIVALENCE.add(f"{_name}-equals-one-process", _same_as_one_process, _opt, _acc)
for _name, _opt, _acc, _shard in (("adam-shard=gradients", adam, 1, "gradients"),
                                  ("sgd-accumulate-shard=optimizer", sgd, 2, "optimizer"),
                                  ("adam-accumulate-shard=parameters", adam, 2, "parameters")):
    EQUIVALENCE.add(f"{_name}-equals-one-process", _same_as_one_process, _opt, _acc, _shard)


def _users_wrapper_is_used_as_it_is(w: World, kind: str) -> None:
    import phalanx.torch as ptorch

    m = w.fresh(200)
    if kind == "DataParallel":
        net, opt = ptorch.DataParallel(m), sgd(w.torch, m)
    else:
        net, opt = m, ptorch.DistributedOptimizer(sgd(w.torch, m))
    w.fit(net, opt=opt, steps=6, accumulate=2)
    net.close() if kind == "DataParallel" else opt.close()
    assert same(w.torch, m, reference(w.torch, w.start, sgd, w.ds, steps=6, accumulate=2)), kind


for _kind in ("DataParallel", "DistributedOptimizer"):
    EQUIVALENCE.add(f"users-{_kind}-is-used-as-it-is", _users_wrapper_is_used_as_it_is, _kind)


@EQUIVALENCE.behaviour("lr-schedule-is-applied-per-step")
def _(w: World) -> None:
    torch = w.torch

    def sched(opt: Any) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    m = w.fresh(7)
    h = w.fit(m, epochs=2, log_every=1, scheduler=sched)
    assert same(torch, m, reference(torch, w.start, sgd, w.ds, steps=10, make_sched=sched))
    assert h["lr"][:7] == [0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025], h["lr"]
    assert h.summary["steps"] == 10 and h.summary["epochs"] == 2.0, h.summary


@EQUIVALENCE.behaviour("replicas-times-processes-equal-one-process")
def _(w: World) -> None:
    m = w.fresh(50)
    h = w.pt.fit(m, w.ce, sgd(w.torch, m), w.ds, batch_size=GLOBAL // w.size // 2, steps=6, replicas=2,
                 progress=False)
    assert same(w.torch, m, reference(w.torch, w.start, sgd, w.ds, steps=6)), "replicas x processes differ"
    assert h.summary["replicas"] == 2


@EQUIVALENCE.behaviour("dropout-mid-epoch-resume-is-bitwise-exact")
def _(w: World) -> None:
    # 5 steps an epoch: stopped after step 3 (mid-epoch), resumed to 8; Dropout draws from each rank's
    # own generator, which must continue exactly where it was (the DataLoader must not draw from it).
    torch = w.torch

    def dropout_model() -> Any:
        torch.manual_seed(5)
        nn = torch.nn
        return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 3)).double()

    def run(steps: int, directory: str, resume: Any) -> tuple[Any, Any]:
        m = dropout_model()
        opt = sgd(torch, m)
        w.fit(m, opt=opt, steps=steps, checkpoint_dir=directory, resume=resume, plot=False)
        return m, opt

    torch.manual_seed(900 + w.rank)  # per-rank dropout streams
    straight, straight_opt = run(8, os.path.join(w.tmp, "dropout-straight"), None)
    torch.manual_seed(900 + w.rank)
    run(3, os.path.join(w.tmp, "dropout-resumed"), None)
    torch.manual_seed(12345)  # whatever happens in between, the checkpoint decides
    resumed, resumed_opt = run(8, os.path.join(w.tmp, "dropout-resumed"), "latest")
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs after a mid-epoch resume (max {float((p - q).abs().max()):.3g})"
    for a, b in zip(straight_opt.state.values(), resumed_opt.state.values(), strict=True):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"]), "momentum differs after a resume"


def equivalence(tmp: str) -> dict[str, str | None]:
    """Processes (and processes x replicas): the same parameters as one process on the global batch."""
    return EQUIVALENCE.run(World(tmp))


# -- the failure policy: the same decision on every rank, naming the ranks --------------------------

FAILURES = Behaviours()


def faulty(w: World, kind: str, at_step: int, on_rank: int) -> Any:
    """A loss function that fails once, at ``at_step``, on rank ``on_rank`` only."""
    torch, calls = w.torch, {"n": 0}

    def loss_fn(out: Any, y: Any) -> Any:
        step = calls["n"]
        calls["n"] += 1
        if step == at_step and w.rank == on_rank:
            if kind == "nan":
                return w.ce(out, y) * float("nan")
            if kind == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            if kind == "oom-backward":
                return w.ce(raise_in_backward(out, torch.OutOfMemoryError("CUDA out of memory (injected)")), y)
            if kind == "nan-gradient":
                return w.ce(nan_in_backward(out), y)  # the loss stays finite
        return w.ce(out, y)

    return loss_fn


def _skipped_on_every_rank(w: World, kind: str) -> None:
    m = w.fresh(30)
    h = w.fit(m, faulty(w, kind, 2, w.size - 1), steps=5)
    assert h.summary["skipped_steps"] == 1, h.summary
    assert same(w.torch, m, reference(w.torch, w.start, sgd, w.ds, steps=5, skip=(2,))), kind
    assert all(w.torch.isfinite(p).all() for p in m.parameters()), "a NaN gradient was applied"


for _kind in ("nan", "oom", "oom-backward", "nan-gradient"):
    FAILURES.add(f"{_kind}-on-the-last-rank-skips-the-step-everywhere", _skipped_on_every_rank, _kind)


def _raise_names_the_rank(w: World, kind: str, text: str) -> None:
    policy = {"on_oom": "raise"} if kind == "oom" else {"on_nonfinite": "raise"}
    culprit = w.size - 1
    m = w.fresh(30)
    with raises(w.pt.TrainingError, f"{kind}: fit did not raise TrainingError on rank {w.rank}") as raised:
        w.fit(m, faulty(w, kind, 1, culprit), steps=5, **policy)
    exc = raised.value
    assert f"{text} on rank(s) [{culprit}]" in str(exc) and "step 1" in str(exc), str(exc)
    assert all(w.torch.isfinite(p).all() for p in m.parameters()), "a NaN gradient was applied"


FAILURES.add("raise-on-nan-loss-names-the-rank", _raise_names_the_rank, "nan", "a NaN/Inf loss")
FAILURES.add("raise-on-oom-names-the-rank", _raise_names_the_rank, "oom", "an out-of-memory error")
FAILURES.add("raise-on-nan-gradient-names-the-rank", _raise_names_the_rank, "nan-gradient",
             "NaN/Inf local gradients (the loss was finite)")


@FAILURES.behaviour("too-many-skips-in-a-row-stop-every-rank")
def _(w: World) -> None:
    m = model(w.torch, 0)
    with raises(w.pt.TrainingError, "fit did not stop after 4 skipped steps") as raised:
        w.fit(m, lambda out, y: w.ce(out, y) * float("inf"), steps=20, max_skipped=3)
    exc = raised.value
    assert "4 steps in a row" in str(exc), str(exc)


def _damage(w: World, directory: str, how: str) -> None:
    """Rank 0 damages the newest checkpoint: 64 flipped weight bytes, or an out-of-range RNG word of
    the last rank (re-saved with a valid digest, so only restoring it on that rank can tell)."""
    pt = w.pt
    newest = pt.CheckpointManager(directory).latest()
    if how == "weights" and w.rank == 0:
        state = pt.load_checkpoint(newest)
        needle = state["model"]["0.weight"].numpy().tobytes()[:256]
        blob = bytearray(open(newest, "rb").read())
        at = blob.find(needle)
        assert at >= 0
        for i in range(at, at + 64):
            blob[i] ^= 0xFF
        with open(newest, "wb") as f:
            f.write(bytes(blob))
    if how == "rng":
        state = pt.load_checkpoint(newest)
        state["rng"][-1]["python"] = state["rng"][-1]["python"] + 2**40
        pt.save_checkpoint(newest, state)  # collective: rank 0 writes
    phalanx.barrier()


def _falls_back_to_the_previous_checkpoint(w: World, how: str) -> None:
    torch = w.torch
    directory = os.path.join(w.tmp, f"fallback-{how}")
    w.fit(w.fresh(40), steps=4, checkpoint_dir=directory, checkpoint_every=2, plot=False)  # steps 2, 4
    _damage(w, directory, how)
    m = model(torch, 77)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = w.fit(m, steps=4, checkpoint_dir=directory, resume="latest", plot=False)
    skipped = [str(c.message) for c in caught if "skipped" in str(c.message)]
    assert skipped and "checkpoint-000000004.pt" in skipped[0], [str(c.message) for c in caught]
    assert h.summary["steps"] == 4
    assert h.summary["samples"] == 2 * GLOBAL, f"rank {w.rank} did not resume from step 2: {h.summary}"
    assert same(w.torch, m, reference(torch, w.start, sgd, w.ds, steps=4)), "resumed from step 2 != straight"


FAILURES.add("damaged-weights-of-the-newest-checkpoint-fall-back-on-every-rank",
             _falls_back_to_the_previous_checkpoint, "weights")
FAILURES.add("bad-rng-state-on-one-rank-falls-back-on-every-rank", _falls_back_to_the_previous_checkpoint, "rng")


def failures(tmp: str) -> dict[str, str | None]:
    """NaN/Inf loss or gradients, out-of-memory, damaged checkpoints on one rank: the same decision on
    every rank, no hang."""
    return FAILURES.run(World(tmp))


# -- SIGTERM: a checkpoint, then a resume equal to an uninterrupted run ------------------------------

RESUME_WRITE, RESUME_READ = Behaviours(), Behaviours()


def _resume_run(w: World, loss_fn: Any, resume: Any, shard: str | None = None, sub: str = "") -> Any:
    torch = w.torch
    m = w.fresh(60) if resume is None else model(torch, 70 + w.rank)  # resumed: the checkpoint decides
    logger = w.pt.JSONLinesLogger(os.path.join(w.tmp, f"metrics{sub}.jsonl"))
    h = w.pt.fit(m, loss_fn, adam(torch, m), w.ds, batch_size=GLOBAL // w.size, steps=10, val_data=w.val,
                 scheduler=_step_lr, checkpoint_dir=os.path.join(w.tmp, f"ckpt{sub}"), checkpoint_every=3,
                 resume=resume, loggers=[logger], log_every=2, progress=False, shard=shard)
    return m, h


def _step_lr(opt: Any) -> Any:
    import torch

    return torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)


@RESUME_WRITE.behaviour("sigterm-on-rank-0-stops-every-rank-after-the-step-with-a-checkpoint")
def _(w: World) -> None:
    _stopped_by_sigterm(w, None, "")


@RESUME_WRITE.behaviour("sharded-run-stopped-by-sigterm-writes-a-whole-checkpoint")
def _(w: World) -> None:
    _stopped_by_sigterm(w, "gradients", "-sharded")


@RESUME_WRITE.behaviour("parameter-sharded-run-stopped-by-sigterm-writes-its-shards-beside-each-checkpoint")
def _(w: World) -> None:
    _stopped_by_sigterm(w, "parameters", "-params")
    if w.rank != 0:  # rank 0 prunes after each save: its listing is the settled one
        return
    names = sorted(os.listdir(os.path.join(w.tmp, "ckpt-params")))
    files = [n for n in names if n.endswith(".pt")]
    shards = [n for n in names if n.endswith(".pt.shards")]
    assert shards == [f + ".shards" for f in files] and files, f"checkpoint files and shard directories: {names}"
    inside = sorted(os.listdir(os.path.join(w.tmp, "ckpt-params", shards[-1])))
    assert inside == ["manifest.json"] + [f"rank-{q:05d}.pt" for q in range(w.size)], inside


def _stopped_by_sigterm(w: World, shard: str | None, sub: str) -> None:
    calls = {"n": 0}

    def stopping(out: Any, y: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 5 and w.rank == 0:  # during step 4 (0-based): like a scheduler's preemption
            os.kill(os.getpid(), signal.SIGTERM)
        return w.ce(out, y)

    _, h = _resume_run(w, stopping, None, shard, sub)
    assert h.stopped == ("SIGTERM" if w.rank == 0 else "signal on another rank"), h.stopped
    assert h.summary["steps"] == 5, h.summary
    names = sorted(os.listdir(os.path.join(w.tmp, f"ckpt{sub}")))
    assert any(n.endswith("000000005.pt") for n in names), names


@RESUME_READ.behaviour("resumed-run-equals-an-uninterrupted-one")
def _(w: World) -> None:
    m, h = _resume_run(w, w.ce, "latest")
    assert h.summary["steps"] == 10 and h.stopped is None, h.summary
    assert h.steps("val/loss")[-1] == 10
    ref = reference(w.torch, w.start, adam, w.ds, steps=10, make_sched=_step_lr)
    assert same(w.torch, m, ref, tol=1e-7), "resumed run differs from the uninterrupted one"
    if w.rank == 0:
        lines = [json.loads(line) for line in open(os.path.join(w.tmp, "metrics.jsonl"))]
        steps = [r["step"] for r in lines if "train/loss" in r]
        assert steps[:2] == [2, 4] and steps[-1] == 10, steps  # the first run's lines are kept
        assert os.path.getsize(os.path.join(w.tmp, "ckpt", "curves.png")) > 1000


def _resumed_equals_uninterrupted(w: World, shard: str, sub: str) -> None:
    m, h = _resume_run(w, w.ce, "latest", shard, sub)
    assert h.summary["steps"] == 10 and h.stopped is None, h.summary
    ref = reference(w.torch, w.start, adam, w.ds, steps=10, make_sched=_step_lr)
    assert same(w.torch, m, ref, tol=1e-7), f"resumed from ckpt{sub} with shard={shard}: differs from uninterrupted"


RESUME_READ.add("sharded-checkpoint-resumed-sharded-otherwise-equals-an-uninterrupted-run",
                _resumed_equals_uninterrupted, "optimizer", "-sharded")  # written with shard="gradients"
RESUME_READ.add("parameter-sharded-checkpoint-resumed-with-sharded-gradients-equals-an-uninterrupted-run",
                _resumed_equals_uninterrupted, "gradients", "-params")  # written with shard="parameters"


def resume(tmp: str, phase: str) -> dict[str, str | None]:
    """``phase="write"``: run A is stopped by a SIGTERM on rank 0 during step 4 (every rank stops after
    it, with a checkpoint). ``phase="resume"`` (possibly at another world size, same global batch):
    run A resumed to 10 steps equals an uninterrupted run."""
    return (RESUME_WRITE if phase == "write" else RESUME_READ).run(World(tmp))
