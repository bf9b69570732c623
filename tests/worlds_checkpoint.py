"""Checkpoint test bodies for worlds of 1, 2 and 3 ranks (see ``test_checkpoint``), as named behaviours.

:func:`checks` runs them in one world: capture / save / load / restore with
per-rank RNG states and exact continued training (a model with Dropout and
BatchNorm under DataParallel + SGD momentum, and with SyncBatchNorm under
DistributedOptimizer + Adam); rank 0's write failing (parent is a file,
target is a directory, an unstorable object, a read-only directory when not
root) raising CheckpointError on every rank with the world still usable;
CheckpointManager pruning, and falling back on every rank alike when the
newest checkpoint is damaged. ``mode="save3"`` also saves a checkpoint for a
later 2-rank world and restores a 2-rank view of it (rank 2 takes saved rank
0's RNG); ``mode="restore3"`` restores that 3-rank checkpoint on 2 ranks.
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any

import numpy as np

import phalanx
from behaviours import Behaviours
from helpers import raises

PER_RANK = 4


def _setup() -> tuple[Any, Any, Any, int, int]:
    import torch

    import phalanx.torch as ptorch
    import phalanx.train as pt

    torch.set_num_threads(1)
    return torch, ptorch, pt, phalanx.rank(), phalanx.size()


def _seed(torch: Any, r: int) -> None:
    torch.manual_seed(1000 + r)
    np.random.seed(2000 + r)
    random.seed(3000 + r)
    random.gauss(0, 1)  # leave cached gaussians in both generators: they are state too
    np.random.standard_normal()


def _scramble(torch: Any) -> None:
    torch.manual_seed(987654)
    np.random.seed(987654)
    random.seed(987654)


def draws(torch: Any) -> list[float]:
    """The next numbers every generator gives (torch, numpy, numpy gauss, python, python gauss)."""
    return [*torch.rand(3, dtype=torch.float64).tolist(), *np.random.rand(3).tolist(),
            float(np.random.standard_normal()), *(random.random() for _ in range(3)), random.gauss(0, 1)]


def _model(torch: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 2)).double()


def _train(torch: Any, net: Any, opt: Any, sched: Any, steps: range, r: int, n: int) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(500 + step)
        x = torch.randn(n * PER_RANK, 5, generator=g, dtype=torch.float64)[r * PER_RANK:(r + 1) * PER_RANK]
        y = torch.randn(n * PER_RANK, 2, generator=g, dtype=torch.float64)[r * PER_RANK:(r + 1) * PER_RANK]
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()  # Dropout draws from this rank's torch RNG
        opt.step()
        sched.step()


def _build(torch: Any, ptorch: Any, kind: str, seed: int) -> tuple[Any, Any, Any, Any]:
    model = _model(torch, seed)
    if kind == "dp":
        net = ptorch.DataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    else:  # SyncBatchNorm: without it each rank keeps its own statistics, and a checkpoint holds rank 0's
        model = net = ptorch.convert_sync_batchnorm(model)
        opt = ptorch.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    return model, net, opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


def _equal_models(torch: Any, a: Any, b: Any, what: str) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), f"{what}: {name} differs after resuming"


def round_trip(directory: str, kind: str) -> None:
    """Capture, save, continue; load, restore into fresh objects, continue: bitwise the same."""
    torch, ptorch, pt, r, n = _setup()
    model, net, opt, sched = _build(torch, ptorch, kind, 7)
    _train(torch, net, opt, sched, range(3), r, n)
    _seed(torch, r)
    state = pt.capture_state(model=net, optimizer=opt, scheduler=sched,
                             progress={"epoch": 1, "global_step": 3, "samples_in_epoch": np.int64(3 * n * PER_RANK)})
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"]), list(state["model"])
    assert state["world_size"] == n and len(state["rng"]) == n
    assert (state["rng"][r] is not None) and all(e is not None for e in state["rng"]) == (r == 0 or n == 1)
    path = pt.save_checkpoint(os.path.join(directory, f"{kind}.pt"), state if r == 0 else None)
    expected = draws(torch)
    _train(torch, net, opt, sched, range(3, 6), r, n)

    _scramble(torch)
    fresh_model, fresh_net, fresh_opt, fresh_sched = _build(torch, ptorch, kind, 99)
    loaded = pt.load_checkpoint(path)
    assert loaded["world_size"] == n and len(loaded["rng"]) == n and all(e is not None for e in loaded["rng"])
    assert loaded["progress"] == {"epoch": 1, "global_step": 3, "samples_in_epoch": 3 * n * PER_RANK}
    progress = pt.restore_state(loaded, model=fresh_net, optimizer=fresh_opt, scheduler=fresh_sched)
    assert progress["global_step"] == 3
    got = draws(torch)
    assert got == expected, f"rank {r}: RNG after restore {got} != {expected}"
    rows = phalanx.allgather(np.array(got))  # the ranks' generators differ: per-rank states were kept
    assert len({tuple(row) for row in rows}) == n, "every rank should continue its own random stream"
    _train(torch, fresh_net, fresh_opt, fresh_sched, range(3, 6), r, n)
    _equal_models(torch, fresh_model, model, f"{kind} on {n} ranks")
    assert fresh_sched.get_last_lr() == sched.get_last_lr()


def failures(directory: str) -> None:
    """Rank 0's write fails: CheckpointError on every rank, nothing left behind, the world usable."""
    torch, ptorch, pt, r, n = _setup()
    model = _model(torch, 3)
    state = pt.capture_state(model=model, progress={"step": 1})
    good = pt.save_checkpoint(os.path.join(directory, "good.pt"), state)
    blocker = os.path.join(directory, "blocker")
    if r == 0:
        with open(blocker, "w") as f:
            f.write("a file, not a directory")
        os.makedirs(os.path.join(directory, "a-directory.pt"))
    phalanx.barrier()

    targets = [os.path.join(blocker, "c.pt"),           # the parent is a file
               os.path.join(directory, "a-directory.pt"),  # os.replace onto a directory
               good]                                    # an unstorable object (below)
    states = [state, state, {**state, "extra": {"fn": len}}]
    read_only = os.path.join(directory, "read-only")
    if os.geteuid() != 0:  # root writes anywhere
        if r == 0:
            os.makedirs(read_only)
            os.chmod(read_only, 0o500)
        phalanx.barrier()
        targets.append(os.path.join(read_only, "c.pt"))
        states.append(state)
    for target, st in zip(targets, states, strict=True):
        with raises(pt.CheckpointError, f"rank {r}: save_checkpoint({target!r}) should have failed on every rank") as raised:
            pt.save_checkpoint(target, st)
        exc = raised.value
        text = str(exc)
        assert r == 0 or "rank 0" in text, text
        if st is not state:
            assert "state['extra']['fn']" in text and "builtin_function_or_method" in text, text
    phalanx.barrier()
    leftovers = [name for _, _, names in os.walk(directory) for name in names if ".tmp-" in name]
    assert not leftovers, f"temporary files left behind: {leftovers}"
    assert pt.load_checkpoint(good)["progress"] == {"step": 1}  # the previous file is intact
    assert os.path.isdir(os.path.join(directory, "a-directory.pt"))
    pt.save_checkpoint(good, pt.capture_state(model=model, progress={"step": 2}))  # the world still works
    assert pt.load_checkpoint(good)["progress"] == {"step": 2}
    if r == 0 and os.geteuid() != 0:
        os.chmod(read_only, 0o700)


def manager(directory: str) -> None:
    """CheckpointManager.save is collective; rank 0 prunes; every rank sees the same checkpoints."""
    torch, ptorch, pt, r, n = _setup()
    model = _model(torch, 5)
    mgr = pt.CheckpointManager(os.path.join(directory, "managed"), keep=2)
    assert mgr.load_latest() is None
    for step in (10, 20, 30, 40):
        mgr.save(pt.capture_state(model=model, progress={"global_step": step}), step)
    phalanx.barrier()  # rank 0 pruned before it reached the barrier
    assert [os.path.basename(p) for p in mgr.paths()] == ["checkpoint-000000030.pt", "checkpoint-000000040.pt"]
    assert mgr.load_latest()["progress"]["global_step"] == 40


def manager_fallback(directory: str) -> None:
    """64 flipped bytes in the newest checkpoint's weights: every rank falls back to the previous one."""
    torch, ptorch, pt, r, n = _setup()
    model = _model(torch, 6)
    mgr = pt.CheckpointManager(os.path.join(directory, "damaged"), keep=3)
    for step in (1, 2):
        with torch.no_grad():
            model[0].weight.fill_(float(step))
        mgr.save(pt.capture_state(model=model, progress={"global_step": step}), step)
    if r == 0:
        newest = mgr.latest()
        blob = bytearray(open(newest, "rb").read())
        at = blob.find(torch.full((8, 5), 2.0, dtype=torch.float64).numpy().tobytes()[:64])
        assert at >= 0
        for i in range(at, at + 64):
            blob[i] ^= 0xFF
        with open(newest, "wb") as f:
            f.write(bytes(blob))
    phalanx.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = mgr.load_latest()
    assert state["progress"]["global_step"] == 1, state["progress"]
    assert any("checkpoint-000000002.pt" in str(w.message) and "digest" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    steps = phalanx.allgather(np.array([state["progress"]["global_step"]]))
    assert steps.ravel().tolist() == [1] * n, steps


def _cross_path(directory: str) -> str:
    return os.path.join(directory, "saved-by-3.pt")


def save_three(directory: str) -> list[float]:
    """Save a checkpoint at 3 ranks for a 2-rank world; restore a 2-rank view of it here (r % 2)."""
    torch, ptorch, pt, r, n = _setup()
    model = _model(torch, 11)
    _seed(torch, r)
    path = pt.save_checkpoint(_cross_path(directory),
                              pt.capture_state(model=model, progress={"epoch": 4, "step_in_epoch": 7}))
    expected = draws(torch)
    every = phalanx.allgather(np.array(expected))
    # the same file as if 2 ranks had saved it: rank r takes saved rank r % 2 (rank 2 -> 0)
    two = pt.load_checkpoint(path)
    two["rng"], two["world_size"] = two["rng"][:2], 2
    _scramble(torch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pt.restore_state(two, model=_model(torch, 12))
    assert (r == 0) == any("r % 2" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert draws(torch) == every[r % 2].tolist()
    return expected


def restore_three(directory: str, expected: list[list[float]]) -> None:
    """Restore the 3-rank checkpoint on 2 ranks: rank r takes saved rank r % 3."""
    torch, ptorch, pt, r, n = _setup()
    state = pt.load_checkpoint(_cross_path(directory))
    assert state["world_size"] == 3 and len(state["rng"]) == 3
    model = _model(torch, 13)
    _scramble(torch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        progress = pt.restore_state(state, model=model)
    assert (r == 0) == any("saved by 3 rank(s)" in str(w.message) for w in caught)
    assert progress == {"epoch": 4, "step_in_epoch": 7}
    assert draws(torch) == expected[r % 3]
    _equal_models(torch, model, _model(torch, 11), "the model saved at 3 ranks")


CHECKS = Behaviours()
CHECKS.add("round-trip-dataparallel-sgd-resumes-bitwise", lambda d: round_trip(os.path.join(d, "rt"), "dp"))
CHECKS.add("round-trip-syncbn-distributedoptimizer-adam-resumes-bitwise",
           lambda d: round_trip(os.path.join(d, "rt"), "opt"))
CHECKS.add("failed-write-raises-on-every-rank-and-keeps-the-old-file", lambda d: failures(os.path.join(d, "fail")))
CHECKS.add("manager-saves-collectively-and-prunes-on-rank-0", manager)
CHECKS.add("manager-falls-back-from-a-damaged-checkpoint-on-every-rank", manager_fallback)

SAVED_AT_THREE = Behaviours()
_SAVED: dict[str, list[float]] = {}


@SAVED_AT_THREE.behaviour("saved-at-3-restores-a-2-rank-view-here")
def _(directory: str) -> None:
    _SAVED["expected"] = save_three(directory)


def checks(directory: str, mode: str = "plain", expected: tuple[tuple[float, ...], ...] | None = None) \
        -> dict[str, Any]:
    """Every behaviour in one world; ``directory`` is shared by the ranks (each world gets its own)."""
    n = phalanx.size()
    report: dict[str, Any] = {}
    if mode == "restore3":
        assert expected is not None
        restored = Behaviours()
        restored.add("saved-at-3-restored-at-2-takes-rank-r-mod-3", restore_three, [list(e) for e in expected])
        report.update(restored.run(directory))
    report.update(CHECKS.run(os.path.join(directory, f"world-{n}")))
    if mode == "save3":
        report.update(SAVED_AT_THREE.run(directory))
        report["expected"] = _SAVED.get("expected")
    return report
