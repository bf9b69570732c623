"""Sharded training as nanoGPT and torchtitan users write it, against one process in float64.

The small GPT of ``worlds_param_shards`` (tied output layer, a block called
twice), trained in the orders and with the lines those scripts use:
``configure_optimizers`` *before* the model is wrapped (at every ``shard``
level, also with state the optimizer already had); ranks that pass
different ``units``; and nanoGPT's checkpoint line, ``torch.save({"model":
model.state_dict(), "optimizer": optimizer.state_dict()})`` (every rank
builds the dicts, rank 0 writes), loaded into one plain process and into a
fresh wrapper, each continuing exactly as one process would.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import phalanx
from behaviours import Behaviours
from helpers import raises
from worlds_param_shards import EXACT, PER_RANK, adamw, gpt, loss_of, tokens
from worlds_training import _setup

IDIOMS = Behaviours()
LEVELS = ("parameters", "gradients", "optimizer")


def _step(torch: Any, model: Any, opt: Any, step: int, r: int, n: int) -> None:
    """One training step on this rank's slice of the global batch of ``step`` (the whole batch at n=1)."""
    x, y = tokens(torch, step, n)
    mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
    loss_of(torch, model, x[mine], y[mine]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()


def _same(torch: Any, got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    for (name, p), q in zip(got.items(), want.values(), strict=True):
        err = (p - q).abs().max().item()
        assert err <= EXACT, f"{what}: {name} differs from one process by {err:.3g}"


@IDIOMS.behaviour("optimizer-made-before-wrapping-is-repointed-at-every-shard-level-with-its-state-equals-one-process")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    for shard in LEVELS:
        for prestep in (False, True):
            model, Block = gpt(torch, 11)
            ref, _ = gpt(torch, 11)
            opt, ref_opt = adamw(torch, model), adamw(torch, ref)  # nanoGPT: configure_optimizers, then wrap
            if prestep:  # state the optimizer already had (a step in one process before wrapping, every rank alike)
                _step(torch, model, opt, 9, 0, 1)
                _step(torch, ref, ref_opt, 9, 0, 1)
            options = {"units": [Block]} if shard == "parameters" else {}
            dp = pt.DataParallel(model, shard=shard, **options)
            for step in range(3):
                _step(torch, dp, opt, step, r, n)
                _ref_step(torch, ref, ref_opt, step, n)
            _same(torch, dp.module.state_dict(), ref.state_dict(), f"shard={shard}, prestep={prestep}")


def _ref_step(torch: Any, ref: Any, opt: Any, step: int, n: int) -> None:
    x, y = tokens(torch, step, n)
    loss_of(torch, ref, x, y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    opt.step()
    opt.zero_grad()


@IDIOMS.behaviour("different-units-on-one-rank-raise-a-collective-mismatch-at-wrapping-naming-each-ranks-units")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    model, Block = gpt(torch, 3)
    if n == 1:
        pt.DataParallel(model, shard="parameters", units=[Block])  # nothing to disagree with
        return
    units = None if r == n - 1 else [Block]  # the last rank's default units add the embeddings and the norm
    with raises(phalanx.CollectiveMismatchError, "different units were accepted", match="unit") as raised:
        pt.DataParallel(model, shard="parameters", units=units)
    assert "units=" in str(raised.value) and "h.0 (Block)" in str(raised.value), raised.value


@IDIOMS.behaviour("nanogpt-checkpoint-line-torch-save-of-both-state-dicts-pickles-whole-and-resumes-in-one-process-and-wrapped")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    folder = phalanx.broadcast_object(tempfile.mkdtemp(prefix="phalanx-ckpt-") if r == 0 else None, root=0,
                                      allow_pickle=True)
    path = os.path.join(folder, "ckpt.pt")
    for shard in LEVELS:
        model, Block = gpt(torch, 21)
        ref, _ = gpt(torch, 21)
        options = {"units": [Block]} if shard == "parameters" else {}
        dp = pt.DataParallel(model, shard=shard, **options)
        opt, ref_opt = adamw(torch, dp), adamw(torch, ref)
        for step in range(2):
            _step(torch, dp, opt, step, r, n)
            _ref_step(torch, ref, ref_opt, step, n)
        checkpoint = {"model": dp.state_dict(), "optimizer": opt.state_dict(), "iter_num": 2}  # on every rank
        if shard == "parameters":  # the user's own module says the same: whole tensors (after fit, too)
            plain = dp.module.state_dict()
            assert all(type(v) is torch.Tensor for v in plain.values()), {k: type(v) for k, v in plain.items()}
            with raises(phalanx.UsageError, "a sharded tensor was pickled", match="full_tensor"):
                torch.save(next(iter(dp.parameters())), os.path.join(folder, f"shard-{r}.pt"))
        failed = None
        if r == 0:  # nanoGPT's master process writes
            try:
                torch.save(checkpoint, path)
            except Exception as exc:  # reported after the barrier, so the peers are not left in it
                failed = exc
        phalanx.barrier()
        if failed is not None:
            raise failed
        loaded = torch.load(path, weights_only=True)
        want = ref_opt.state_dict()
        for j, entry in want["state"].items():
            for key, v in entry.items():
                got = loaded["optimizer"]["state"][j][key]
                assert type(got) is torch.Tensor and (got - v).abs().max().item() <= EXACT, \
                    f"shard={shard}: saved optimizer state {j}.{key} is not one process's"
        # resumed in one plain process (another N) and in a fresh wrapper at this N: each continues exactly
        alone, _ = gpt(torch, 99)
        alone.load_state_dict({k.removeprefix("module."): v for k, v in loaded["model"].items()})
        alone_opt = adamw(torch, alone)
        alone_opt.load_state_dict(loaded["optimizer"])
        again, _ = gpt(torch, 98)
        dp2 = pt.DataParallel(again, shard=shard, **options)
        dp2.load_state_dict(loaded["model"])
        opt2 = adamw(torch, dp2)
        # (a load of its own: torch's load_state_dict keeps the loaded "step" tensors, which AdamW counts in place)
        opt2.load_state_dict(torch.load(path, weights_only=True)["optimizer"])  # before its first step: cut to this rank's part there
        for step in range(2, 4):
            _step(torch, dp2, opt2, step, r, n)
            _ref_step(torch, alone, alone_opt, step, n)
            _ref_step(torch, ref, ref_opt, step, n)
        _same(torch, alone.state_dict(), ref.state_dict(), f"shard={shard}: resumed in one process")
        _same(torch, dp2.module.state_dict(), ref.state_dict(), f"shard={shard}: resumed wrapped at N={n}")
        phalanx.barrier()
    if r == 0:
        import shutil

        shutil.rmtree(folder)


@IDIOMS.behaviour("fsdp2-names-set-requires-gradient-sync-accumulates-unshard-reshard-and-an-int-reshard-refused")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    model, Block = gpt(torch, 31)
    with raises(phalanx.InvalidArgumentError, "reshard_after_forward=2 was accepted", match="smaller group"):
        pt.DataParallel(model, shard="parameters", units=[Block], reshard_after_forward=2)
    ref, _ = gpt(torch, 31)
    dp = pt.DataParallel(model, shard="parameters", units=[Block], reshard_after_forward=False)
    opt, ref_opt = adamw(torch, dp), adamw(torch, ref)
    for step in range(2):  # torchtitan's accumulation: sync off for every micro-batch but the last
        x, y = tokens(torch, step, n)
        for j in range(2):
            xs, ys = x[j::2], y[j::2]
            mine = slice(r * len(xs) // n, (r + 1) * len(xs) // n)
            dp.set_requires_gradient_sync(j == 1)
            (loss_of(torch, dp, xs[mine], ys[mine]) / 2).backward()
            (loss_of(torch, ref, xs, ys) / 2).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    _same(torch, dp.module.state_dict(), ref.state_dict(), "set_requires_gradient_sync")
    handle = dp.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    x, y = tokens(torch, 7, 1)
    with torch.no_grad():  # generation while unsharded: the module's parameters are whole, no hooks run
        assert type(dp.module.h[0].attn.weight) is torch.nn.Parameter, type(dp.module.h[0].attn.weight)
        assert (dp(x) - ref(x)).abs().max().item() <= EXACT
    with raises(phalanx.UsageError, "a training forward while unsharded was accepted", match="reshard"):
        dp(x)
    dp.reshard()
    assert all(g.state.value == "free" for g in dp.shard_groups()), dp.shard_groups()
    _step(torch, dp, opt, 8, r, n)
    _ref_step(torch, ref, ref_opt, 8, n)
    _same(torch, dp.module.state_dict(), ref.state_dict(), "training after reshard")
    whole = pt.DataParallel(gpt(torch, 32)[0])  # unsharded: unshard() does nothing, training goes on
    whole.unshard()
    loss_of(torch, whole, x, y).backward()
    whole.reshard()


def _checkpointed(torch: Any, seed: int, form: str, reentrant: bool) -> tuple[Any, Any]:
    """The GPT (each block called once, as nanoGPT's) with activation checkpointing in one of torch's
    three forms: inside each block's forward (its attention), around each block in the model's forward,
    or each block wrapped by torch's ``checkpoint_wrapper``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    from worlds_param_shards import D

    model, Block = gpt(torch, seed)
    if form == "inside":
        for b in model.h:
            def forward(x: Any, b: Any = b) -> Any:
                def attention(x: Any) -> Any:
                    q, k, v = b.attn(b.ln(x)).split(D, dim=-1)
                    return b.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
                x = x + checkpoint(attention, x, use_reentrant=reentrant)
                return x + b.mlp(x)
            b.forward = forward
    elif form == "wrapper":
        impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
        model.h = torch.nn.ModuleList([checkpoint_wrapper(b, checkpoint_impl=impl) for b in model.h])

    def forward(idx: Any) -> Any:
        x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
        for b in model.h:
            x = checkpoint(b, x, use_reentrant=reentrant) if form == "around" else b(x)
        return model.lm_head(model.ln_f(x))
    model.forward = forward
    return model, Block


@IDIOMS.behaviour("activation-checkpointing-inside-a-unit-around-a-unit-and-checkpoint-wrapper-reentrant-or-not-equal-one-process")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    for form in ("inside", "around", "wrapper"):
        for reentrant in (False, True):
            model, Block = _checkpointed(torch, 41, form, reentrant)
            ref, _ = _checkpointed(torch, 41, form, reentrant)
            dp = pt.DataParallel(model, shard="parameters", units=[Block])
            opt, ref_opt = adamw(torch, dp), adamw(torch, ref)
            for step in range(2):
                _step(torch, dp, opt, step, r, n)
                _ref_step(torch, ref, ref_opt, step, n)
                assert all(g.state.value == "free" for g in dp.shard_groups()), (form, reentrant, dp.shard_groups())
            plain = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in ref.state_dict().items()}
            got = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in dp.module.state_dict().items()}
            _same(torch, got, plain, f"checkpoint {form}, use_reentrant={reentrant}")


def zero3_idioms() -> dict[str, str | None]:
    """The world body: every behaviour, on every rank."""
    return IDIOMS.run(phalanx.rank(), phalanx.size())
