"""Sharded checkpoints: each rank writes its own elements; a checkpoint loads at another N and ``shard`` level.

``phase="write"`` (at N ranks): a small GPT (tied output layer, frozen
position embedding) trains 2 steps with ``shard="parameters"`` and AdamW,
is saved with ``save_sharded``, exported with ``export_safetensors``, and
trains 2 more steps: rank 0 keeps that uninterrupted result. Also: a save
that fails on one rank leaves the previous checkpoint loadable, and a
damaged file is named. ``phase="read"`` (at another N): the checkpoint
loads into ``shard="gradients"``, ``"parameters"`` and unwrapped models;
2 more steps equal the uninterrupted run (float64, 1e-10).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import phalanx
from behaviours import Behaviours
from helpers import raises
from worlds_param_shards import adamw, gpt, loss_of
from worlds_training import _setup

WRITE, READ = Behaviours(), Behaviours()
GLOBAL = 6  # rows per step at every N (1, 2 and 3 ranks split it evenly)
EXACT = 1e-10


def batch(torch: Any, step: int, r: int, n: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(900 + step)
    data = torch.randint(0, 11, (GLOBAL, 7), generator=g)
    mine = data[r * GLOBAL // n:(r + 1) * GLOBAL // n]
    return mine[:, :-1], mine[:, 1:]


def train(torch: Any, dp: Any, opt: Any, steps: range) -> None:
    r, n = phalanx.rank(), phalanx.size()
    for step in steps:
        x, y = batch(torch, step, r, n)
        loss_of(torch, dp, x, y).backward()
        torch.nn.utils.clip_grad_norm_(dp.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def made(shard: str | None) -> tuple[Any, Any, Any]:
    torch, pt, r, n = _setup()
    model, Block = gpt(torch, 40 + r)
    options = {"units": [Block]} if shard == "parameters" else {}
    dp = pt.DataParallel(model, shard=shard, **options)
    return torch, dp, adamw(torch, dp)


@WRITE.behaviour("a-parameter-sharded-run-saves-its-shards-and-exports-one-file")
def _(tmp: str) -> None:
    torch, dp, opt = made("parameters")
    pt = phalanx.torch
    train(torch, dp, opt, range(2))
    path = pt.save_sharded(os.path.join(tmp, "ckpt"), dp, opt)
    names = sorted(os.listdir(path))
    assert names == ["manifest.json"] + [f"rank-{q:05d}.pt" for q in range(phalanx.size())], names
    pt.export_safetensors(os.path.join(tmp, "model.safetensors"), dp)
    whole = dp.state_dict()
    plain, _ = gpt(torch, 99)
    plain.load_state_dict(pt.load_safetensors(os.path.join(tmp, "model.safetensors")))
    for name, q in plain.state_dict().items():
        assert q.equal(whole[f"module.{name}"]), f"the export's {name} differs from the model's"
    train(torch, dp, opt, range(2, 4))
    state = dp.state_dict()  # collective: every rank
    if phalanx.rank() == 0:
        torch.save(state, os.path.join(tmp, "uninterrupted.pt"))
    phalanx.barrier()


@WRITE.behaviour("a-save-failing-on-one-rank-raises-everywhere-and-leaves-the-previous-checkpoint")
def _(tmp: str) -> None:
    from phalanx.torch import _sharded_checkpoint

    torch, dp, opt = made("parameters")
    pt = phalanx.torch
    path = os.path.join(tmp, "again")
    pt.save_sharded(path, dp, opt)
    before = {k: v.clone() for k, v in dp.state_dict().items()}
    train(torch, dp, opt, range(1))
    last = phalanx.size() - 1
    real = _sharded_checkpoint.torch.save

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    if phalanx.rank() == last:
        _sharded_checkpoint.torch.save = disk_full  # type: ignore[assignment]
    try:
        with raises(phalanx.CheckpointError, "a failed save raised nothing", match=f"rank {last}: .*No space"):
            pt.save_sharded(path, dp, opt)
    finally:
        _sharded_checkpoint.torch.save = real
    leftovers = [f for f in os.listdir(tmp) if f.startswith("again.")]
    assert not leftovers, f"a failed save left {leftovers}"
    pt.load_sharded(path, dp, opt)
    for k, v in dp.state_dict().items():
        assert v.equal(before[k]), f"{k}: the previous checkpoint did not load whole"


@WRITE.behaviour("a-damaged-rank-file-is-named-on-load")
def _(tmp: str) -> None:
    torch, dp, opt = made("parameters")
    pt = phalanx.torch
    path = pt.save_sharded(os.path.join(tmp, "damaged"), dp, opt)
    phalanx.barrier()
    if phalanx.rank() == 0:
        shutil.copytree(path, path + "-copy")
        with open(os.path.join(path + "-copy", "rank-00000.pt"), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    phalanx.barrier()
    with raises(phalanx.CheckpointError, "a damaged file loaded", match="rank-00000.pt is missing or damaged"):
        pt.load_sharded(path + "-copy", dp, opt)


def _resumed(tmp: str, shard: str | None) -> None:
    torch, dp, opt = made(shard)
    phalanx.torch.load_sharded(os.path.join(tmp, "ckpt"), dp, opt)
    train(torch, dp, opt, range(2, 4))
    want = torch.load(os.path.join(tmp, "uninterrupted.pt"))
    for name, p in dp.state_dict().items():
        err = (p - want[name]).abs().max().item()
        assert err <= EXACT, f"shard={shard}: {name} differs from the uninterrupted run by {err:.3g}"
    dp.close()


for _shard in ("gradients", "parameters", None):
    READ.add(f"resumed-with-shard={_shard}-at-another-n-equals-the-uninterrupted-run",
             lambda tmp, s=_shard: _resumed(tmp, s))


@READ.behaviour("the-model-loads-into-an-unwrapped-model")
def _(tmp: str) -> None:
    torch, pt, r, n = _setup()
    plain, _ = gpt(torch, 5)
    pt.load_sharded(os.path.join(tmp, "ckpt"), plain)
    x, y = batch(torch, 0, 0, 1)
    assert loss_of(torch, plain, x, y).isfinite(), "the loaded model computes nothing"


def checkpoints(tmp: str, phase: str) -> dict[str, str | None]:
    """The world body: the write or read phase's behaviours, on every rank."""
    return (WRITE if phase == "write" else READ).run(tmp)
