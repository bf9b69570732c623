"""``DistributedOptimizer`` at every ``shard`` value in the code users write around it, against one process.

The seeds' own API (an optimizer wrapped, the model left as it is) on the
small GPT of ``worlds_param_shards`` (tied output layer, frozen position
embedding, a block called twice), with nanoGPT's decay groups made from
``model.parameters()``:

- the step users write under mixed precision: two plain backwards per step
  (each reduces), ``scaler.unscale_(opt)``, then torch's own
  ``clip_grad_norm_(model.parameters(), c)`` on the *model's* parameters
  (with ``shard="gradients"`` their ``.grad`` is the sharded reduced
  gradient, so the norm is global and the clip reaches the slices the
  optimizer updates), ``scaler.step(opt)``; the norms and the weights equal
  one process's (float32, 1e-5);
- a parameter unfrozen after wrapping (a fine-tuning schedule): refused at
  the next ``step()`` on every rank with a UsageError naming it, before
  anything moved; frozen again, training goes on and equals one process
  (float64, 1e-10).

Each rank builds its own initial values; the wrapper broadcasts rank 0's.
"""

from __future__ import annotations

import re
from typing import Any

import phalanx
from behaviours import Behaviours
from helpers import raises
from worlds_param_shards import adamw, gpt, loss_of, tokens
from worlds_training import _setup

IDIOMS = Behaviours()
SHARDS = (None, "optimizer", "gradients")


def _same_on_every_rank(torch: Any, model: Any, what: str) -> None:
    for name, p in model.state_dict().items():
        rows = phalanx.allgather(p.detach().contiguous())
        assert all(rows[q].equal(rows[0]) for q in range(len(rows))), f"{what}: {name} differs between ranks"


def _close_to(torch: Any, model: Any, ref: Any, tol: float, what: str) -> None:
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        err = (p - q).abs().max().item()
        assert err <= tol, f"{what}: {name} differs from one process by {err:.3g}"


def scaled_clip(shard: str | None) -> None:
    """3 steps of two plain backwards, unscale_, torch's clip on model.parameters(), scaler.step."""
    torch, pt, r, n = _setup()
    f32, tol = torch.float32, 1e-5
    model, _ = gpt(torch, 7 + r, f32)
    ref, _ = gpt(torch, 7, f32)
    opt = pt.DistributedOptimizer(adamw(torch, model, 1e-4), shard=shard, named_parameters=model.named_parameters())
    ref_opt = adamw(torch, ref, 1e-4)
    scaler, ref_scaler = pt.ShardedGradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(3):
        x, y = tokens(torch, step, n)
        for xs, ys in [(x[i::2], y[i::2]) for i in range(2)]:  # two micro-batches, each backward reduces
            mine = slice(r * len(xs) // n, (r + 1) * len(xs) // n)
            scaler.scale(loss_of(torch, model, xs[mine], ys[mine]) / 2).backward()
            ref_scaler.scale(loss_of(torch, ref, xs, ys) / 2).backward()
        scaler.unscale_(opt), ref_scaler.unscale_(ref_opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert abs(norm.item() - ref_norm.item()) <= tol * max(1.0, ref_norm.item()), \
            f"shard={shard} step {step}: clip_grad_norm_(model.parameters()) gave {norm.item()}, one process " \
            f"{ref_norm.item()}"
        scaler.step(opt), ref_scaler.step(ref_opt)
        scaler.update(), ref_scaler.update()
        opt.zero_grad(), ref_opt.zero_grad()
    _close_to(torch, model, ref, tol, f"shard={shard}")
    _same_on_every_rank(torch, model, f"shard={shard}")
    opt.release()


def unfreeze_refused(shard: str | None) -> None:
    """The position embedding unfrozen after step 0: step 1's step() raises before any update; frozen
    again, steps 1 and 2 are done and equal one process that never unfroze it."""
    torch, pt, r, n = _setup()
    model, _ = gpt(torch, 7 + r)
    ref, _ = gpt(torch, 7)
    opt = pt.DistributedOptimizer(adamw(torch, model), shard=shard, named_parameters=model.named_parameters())
    ref_opt = adamw(torch, ref)
    step = 0
    while step < 3:
        x, y = tokens(torch, step, n)
        mine = slice(r * len(x) // n, (r + 1) * len(x) // n)
        loss_of(torch, model, x[mine], y[mine]).backward()
        if step == 1 and model.wpe.weight.requires_grad:
            before = {k: v.clone() for k, v in model.state_dict().items()}
            with raises(phalanx.UsageError, f"shard={shard}: unfreezing after wrapping was not refused",
                        match=re.escape("wpe.weight (now requires_grad=True)")) as raised:
                opt.step()
            assert "DistributedOptimizer(opt.release()" in str(raised.value), raised.value
            assert all(v.equal(before[k]) for k, v in model.state_dict().items()), \
                f"shard={shard}: the refused step changed a parameter"
            _same_on_every_rank(torch, model, f"shard={shard} after the refused step")
            model.wpe.weight.requires_grad_(False)
            opt.zero_grad()
            continue  # the step again, frozen
        loss_of(torch, ref, x, y).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        if step == 0:
            model.wpe.weight.requires_grad_(True)  # a fine-tuning schedule, after wrapping
        step += 1
    _close_to(torch, model, ref, 1e-10, f"shard={shard}")
    opt.release()


def _label(shard: str | None) -> str:
    return "unsharded" if shard is None else shard


def _run(r: int, n: int, fn: Any, shard: str | None) -> None:
    fn(shard)


for _shard in SHARDS:
    IDIOMS.add(f"distributed-optimizer-{_label(_shard)}-two-backwards-unscale-then-torch-clip-on-model-parameters-"
               "equals-one-process", _run, scaled_clip, _shard)
    IDIOMS.add(f"distributed-optimizer-{_label(_shard)}-unfreezing-after-wrapping-is-refused-at-the-next-step-"
               "naming-the-parameter", _run, unfreeze_refused, _shard)


def optimizer_idioms() -> dict[str, str | None]:
    """The world body: every behaviour, on every rank."""
    return IDIOMS.run(phalanx.rank(), phalanx.size())
