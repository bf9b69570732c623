"""Sharded training bodies: ``shard="optimizer"`` and ``shard="gradients"`` train exactly like 1 process.

Each case trains a float64 model on this rank's slice of a fixed global
batch with a sharded optimizer and, in the same body, a reference copy in
one process on the whole batch with the plain optimizer (``worlds_training``
has the models and batches). Small buckets make many shards of unequal
size (3 ranks, odd parameter counts, empty slices).
"""

from __future__ import annotations

import contextlib
import copy
import re
from typing import Any

import phalanx
from behaviours import Behaviours
from helpers import raises
from worlds_training import COMPRESSED, MODELS, _setup, assert_close, batch, mlp, mse, piece, poisoned_losses

SHARDING = Behaviours()      # every world
SHARDING_ACROSS = Behaviours()  # worlds of 2 or more ranks (on one rank, shard= changes nothing)
EXACT = 1e-10
STEPS = 6
SHARDS = ("optimizer", "gradients")


def refused(kind: Any, fn: Any, match: str) -> None:
    with raises(kind, f"no {kind.__name__} (expected one matching {match!r})", match=re.escape(match)):
        fn()


def make(torch: Any, kind: str, params: Any) -> Any:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "nesterov":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    if kind == "groups":  # parameter groups with different hyper-parameters
        params = list(params)
        return torch.optim.Adam([{"params": params[:2], "lr": 0.02}, {"params": params[2:], "weight_decay": 0.01}],
                                lr=0.01)
    return torch.optim.Adam(params, lr=0.01)


CASES: list[dict[str, Any]] = [
    {"model": "mlp", "opt": "sgd"},
    {"model": "mlp", "opt": "nesterov", "cap": 1e-3},
    {"model": "mlp", "opt": "adam", "sched": True, "cap": 1e-3},
    {"model": "mlp", "opt": "adamw", "cap": 1e-3, "clip": 0.05},
    {"model": "mlp", "opt": "groups", "cap": 1e-3},
    {"model": "mlp", "opt": "adam", "micro": 2, "accum": "passes", "cap": 1e-3},
    {"model": "mlp", "opt": "sgd", "micro": 2, "accum": "no_sync", "cap": 1e-3},
    {"model": "mlp", "opt": "adam", "compression": "bf16", "cap": 1e-3},
    {"model": "cnn_bn", "opt": "adam", "cap": 1e-3},
    {"model": "wide", "opt": "adam", "compression": "bf16", "tol": 0.1},
    {"model": "mlp", "form": "dp", "opt": "adamw", "cap": 1e-3, "clip": 0.05, "sched": True},
    {"model": "mlp", "form": "dp", "opt": "sgd", "micro": 2, "accum": "no_sync", "cap": 1e-3},
    {"model": "cnn_bn", "form": "dp", "opt": "nesterov", "cap": 1e-3, "compression": "fp16"},
]


def wide(torch: Any, seed: int) -> Any:
    """An MLP whose 16-bit gradient buckets pass 64 KiB (MPI's 16-bit path)."""
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(6, 6000), nn.Tanh(), nn.Linear(6000, 3)).double()


def run_case(shard: str, case: dict[str, Any]) -> None:
    torch, pt, r, n = _setup()
    build, shape = {**MODELS, "wide": (wide, (6,))}[case["model"]]
    model, ref = build(torch, 100 + r), build(torch, 100)
    if case["model"] == "cnn_bn":
        model = pt.convert_sync_batchnorm(model)
    micro, accum = case.get("micro", 1), case.get("accum")
    options = {"shard": shard, "bucket_cap_mb": case.get("cap", 25), "compression": case.get("compression")}
    if case.get("form") == "dp":
        net = wrapper = pt.DataParallel(model, **options)
        opt = make(torch, case["opt"], net.parameters())
    else:
        net, wrapper = model, pt.DistributedOptimizer(make(torch, case["opt"], model.parameters()),
                                                      backward_passes_per_step=micro if accum == "passes" else 1,
                                                      **options)
        opt = wrapper
    ref_opt = make(torch, case["opt"], ref.parameters())
    scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (opt, ref_opt)] if case.get("sched") else []
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        for m in range(micro):
            x, y = batch(torch, step * micro + m, shape, n)
            quiet = m < micro - 1 and accum == "no_sync"
            with wrapper.no_sync() if quiet else contextlib.nullcontext():
                mse(torch, net(piece(x, r)), piece(y, r)).backward()
            mse(torch, ref(x), y).backward()
        if shard == "gradients" and accum is None and n > 1:
            # no whole gradient is kept: DataParallel leaves p.grad None (its parameters() are the slices),
            # DistributedOptimizer makes it the slice's sharded gradient (torch's clip on model.parameters())
            kept = [type(p.grad).__name__ for p in model.parameters()]
            assert all(k == ("ShardedTensor" if wrapper is opt else "NoneType") for k in kept), \
                f"shard='gradients' kept whole gradients: p.grad is {kept}"
        if case.get("clip"):
            norm = wrapper.clip_grad_norm_(case["clip"])
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), case["clip"])
            assert abs(norm.item() - ref_norm.item()) <= 1e-9 * ref_norm.item(), (norm, ref_norm)
        opt.step()
        ref_opt.step()
        for s in scheds:
            s.step()
        if n > 1:  # every bucket's group back at rest: reduced, updated, gathered whole again
            states = {g.name: g.state.value for g in wrapper.engine.shard_plan.groups}
            assert set(states.values()) == {"whole"}, f"step {step}: shard groups not whole: {states}"
    tol = case.get("tol", COMPRESSED if case.get("compression") else EXACT)  # Adam magnifies 16-bit noise
    assert_close(model, ref, f"shard={shard} {case} on {n} ranks", tol)


for _shard in SHARDS:
    for _case in CASES:
        _extras = "-".join(f"{k}={v}" for k, v in _case.items() if k not in ("model", "opt", "form"))
        _form = "DataParallel" if _case.get("form") == "dp" else "DistributedOptimizer"
        SHARDING.add(f"shard={_shard}-trains-like-one-process-{_form}-{_case['model']}-{_case['opt']}"
                     + (f"-{_extras}" if _extras else ""), run_case, _shard, _case)


def _train(torch: Any, model: Any, opt: Any, steps: range, n: int, r: int) -> None:
    for step in steps:
        opt.zero_grad()
        x, y = batch(torch, step, (6,), n)
        mse(torch, model(piece(x, r)), piece(y, r)).backward()
        opt.step()


def state_bytes(opt: Any) -> int:
    local = [v.to_local() if hasattr(v, "to_local") else v for s in opt.state.values() for v in s.values()]
    return sum(v.numel() * v.element_size() for v in local if hasattr(v, "numel") and v.dim() > 0)


@SHARDING.behaviour("the-optimizer-holds-sharded-slices-only-with-more-than-one-rank")
def one_rank_shards_nothing() -> None:
    """On one rank there is nothing to split: shard= leaves the optimizer's whole parameters in place."""
    torch, pt, r, n = _setup()
    for shard in SHARDS:
        model = mlp(torch, 3)
        opt = pt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), shard=shard)
        held = opt.param_groups[0]["params"]
        sharded = [isinstance(p, pt.ShardedTensor) for p in held]
        assert sharded == [n > 1] * len(held), f"shard={shard} on {n} ranks: sharded slices {sharded}"
        if n == 1:
            assert all(p is q for p, q in zip(held, model.parameters(), strict=True)), "the parameters were replaced"
        opt.release()


@SHARDING_ACROSS.behaviour("the-all-gather-in-pieces-smaller-than-a-slice-and-in-place-trains-like-one-process")
def pieces() -> None:
    from phalanx.torch import _shard_plan

    saved, _shard_plan.PIECE_BYTES = _shard_plan.PIECE_BYTES, 40  # 5 float64 per piece and rank
    direct = _shard_plan.DIRECT_BYTES
    try:
        for _shard_plan.DIRECT_BYTES in (direct, 24):  # gathering by broadcast (gloo): then parts of 3+ in place
            for shard in SHARDS:
                run_case(shard, {"model": "mlp", "opt": "adam"})
    finally:
        _shard_plan.PIECE_BYTES, _shard_plan.DIRECT_BYTES = saved, direct


@SHARDING_ACROSS.behaviour("buckets-completed-as-soon-as-posted-train-like-one-process")
def at_once() -> None:
    from phalanx.torch import _shard_reducer

    saved, _shard_reducer.AT_ONCE_BYTES = _shard_reducer.AT_ONCE_BYTES, 0  # every bucket, however small
    try:
        run_case("gradients", {"model": "mlp", "opt": "adam", "cap": 1e-3})
        run_case("gradients", {"model": "cnn_bn", "opt": "sgd", "cap": 1e-3, "compression": "bf16"})
    finally:
        _shard_reducer.AT_ONCE_BYTES = saved


@SHARDING_ACROSS.behaviour("each-rank-keeps-1/N-of-the-adam-state-and-the-shards-share-the-parameters-memory")
def memory() -> None:
    torch, pt, r, n = _setup()
    model = torch.nn.Sequential(torch.nn.Linear(31, 17), torch.nn.Linear(17, 5)).double()
    total = sum(p.numel() for p in model.parameters())
    opt = pt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), shard="optimizer")
    x = torch.randn(4, 31, dtype=torch.float64)
    model(x).sum().backward()
    opt.step()
    mine = state_bytes(opt)
    assert abs(mine - 2 * 8 * total / n) <= 2 * 8 * n, f"rank {r} keeps {mine} bytes of Adam state, {total} params"
    held = phalanx.allreduce(mine)
    assert held == 2 * 8 * total, f"the ranks' Adam states add up to {held} bytes, not {2 * 8 * total}"
    shard = opt.param_groups[0]["params"][0]  # a ShardedTensor: the parameter's shape, this rank's elements
    assert shard.shape == model[0].weight.shape and shard.to_local().untyped_storage().data_ptr() == \
        model[0].weight.untyped_storage().data_ptr()


@SHARDING.behaviour("sharded-state-dict-loads-unsharded-and-back-resuming-exactly")
def checkpoints() -> None:
    torch, pt, r, n = _setup()
    for shard in SHARDS:
        model = mlp(torch, 100 + r)
        opt = pt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), shard=shard,
                                      bucket_cap_mb=1e-3)
        _train(torch, model, opt, range(3), n, r)
        saved = copy.deepcopy(opt.state_dict())  # the whole state, on every rank
        assert len(saved["state"]) == 6 and saved["state"][0]["exp_avg"].shape == model[0].weight.shape
        plain = mlp(torch, 7)
        plain.load_state_dict(model.state_dict())
        plain_opt = pt.DistributedOptimizer(torch.optim.Adam(plain.parameters(), lr=0.5))
        plain_opt.load_state_dict(saved)  # sharded -> unsharded
        back = mlp(torch, 8)
        back.load_state_dict(model.state_dict())
        back_opt = pt.DistributedOptimizer(torch.optim.Adam(back.parameters(), lr=0.5), shard=shard,
                                           bucket_cap_mb=1e-3)
        back_opt.load_state_dict(copy.deepcopy(plain_opt.state_dict()))  # unsharded -> sharded
        for m, o in ((model, opt), (plain, plain_opt), (back, back_opt)):
            _train(torch, m, o, range(3, 6), n, r)
        assert_close(plain, model, f"shard={shard} checkpoint into an unsharded optimizer", EXACT)
        assert_close(back, model, f"shard={shard} checkpoint back into a sharded optimizer", EXACT)


@SHARDING_ACROSS.behaviour("sharded-grad-scaler-skips-an-inf-step-on-every-rank-and-torch-grad-scaler-is-refused")
def grad_scaler() -> None:
    torch, pt, r, n = _setup()
    for shard in SHARDS:
        model, ref = mlp(torch, 100 + r), mlp(torch, 100)
        opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), shard=shard,
                                      bucket_cap_mb=1e-3)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        scalers = [pt.ShardedGradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3),
                   torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)]
        skipped = 3
        for step in range(STEPS):
            opt.zero_grad()
            ref_opt.zero_grad()
            loss, ref_loss = poisoned_losses(torch, model, ref, step, skipped, r, n)
            scalers[0].scale(loss).backward()
            scalers[1].scale(ref_loss).backward()
            if step % 2:  # the explicit form: unscale, clip, step
                scalers[0].unscale_(opt)
                scalers[1].unscale_(ref_opt)
                opt.clip_grad_norm_(0.5)
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            before = scalers[0].get_scale()
            for s, o in zip(scalers, (opt, ref_opt), strict=True):
                s.step(o)
                s.update()
            if step == skipped:
                assert scalers[0].get_scale() == scalers[1].get_scale() == before / 2, "the inf step is skipped"
        assert_close(model, ref, f"ShardedGradScaler with shard={shard} on {n} ranks", EXACT)
        plain = torch.amp.GradScaler("cpu")
        opt.zero_grad()
        x, y = batch(torch, 0, (6,), n)
        plain.scale(mse(torch, model(piece(x, r)), piece(y, r))).backward()
        refused(phalanx.UsageError, lambda o=opt, s=plain: s.step(o), "ShardedGradScaler")


@SHARDING.behaviour("parameters-without-gradients-on-some-steps-are-skipped-as-unsharded")
def unused() -> None:
    torch, pt, r, n = _setup()
    for shard in SHARDS:
        torch.manual_seed(5)  # the same extra layer on every rank (its reference copy is local)
        extra = torch.nn.Linear(3, 3).double()
        model = mlp(torch, 100 + r)
        ref, ref_extra = mlp(torch, 100), copy.deepcopy(extra)
        params = [*model.parameters(), *extra.parameters()]
        opt = pt.DistributedOptimizer(torch.optim.Adam(params, lr=0.01), shard=shard, bucket_cap_mb=1e-3)
        ref_opt = torch.optim.Adam([*ref.parameters(), *ref_extra.parameters()], lr=0.01)
        for step in range(STEPS):
            opt.zero_grad()
            ref_opt.zero_grad()
            x, y = batch(torch, step, (6,), n)
            use = step % 2 == 0  # the extra layer gets gradients on even steps only, on every rank
            head = (lambda m, e: e(m)) if use else (lambda m, e: m)
            mse(torch, head(model(piece(x, r)), extra), piece(y, r)).backward()
            mse(torch, head(ref(x), ref_extra), y).backward()
            opt.step()
            ref_opt.step()
        assert_close(model, ref, f"shard={shard} with a layer unused on odd steps", EXACT)
        assert_close(extra, ref_extra, f"shard={shard}: the layer unused on odd steps", EXACT)


@SHARDING.behaviour("bad-shard-arguments-name-the-call-and-the-fix")
def bad_arguments() -> None:
    torch, pt, r, n = _setup()
    model = mlp(torch, 1)
    refused(phalanx.InvalidArgumentError, lambda: pt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), shard="stage2"), "shard='stage2'")
    refused(phalanx.InvalidArgumentError, lambda: pt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), shard="gradients", compression="powersgd"), "PowerSGD")
    refused(phalanx.InvalidArgumentError, lambda: pt.DistributedOptimizer(
        torch.optim.LBFGS(model.parameters()), shard="optimizer"), "LBFGS")
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard="optimizer")
    refused(phalanx.UsageError, lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]}),
           "add_param_group")
    opt.close()


@SHARDING_ACROSS.behaviour("ranks-that-disagree-on-shard-get-a-mismatch-error-on-every-rank")
def disagree() -> None:
    torch, pt, r, n = _setup()
    model = mlp(torch, 1)
    refused(phalanx.CollectiveMismatchError, lambda: pt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), shard="optimizer" if r == 0 else None), "shard=")


@SHARDING_ACROSS.behaviour("an-optimizer-that-is-not-element-wise-over-dataparallel-slices-is-refused-at-step")
def dp_refused() -> None:
    torch, pt, r, n = _setup()
    net = pt.DataParallel(mlp(torch, 1), shard="optimizer")
    opt = torch.optim.Adafactor(net.parameters(), lr=0.01) if hasattr(torch.optim, "Adafactor") else \
        torch.optim.LBFGS(net.parameters())
    x, y = batch(torch, 0, (6,), n)
    mse(torch, net(piece(x, r)), piece(y, r)).backward()
    refused(phalanx.InvalidArgumentError, lambda: opt.step(lambda: 0.0), type(opt).__name__)
    net.close()


def sharding() -> dict[str, str | None]:
    """Every behaviour above in one world (those across ranks on 2 or more)."""
    _, _, _, n = _setup()
    report = SHARDING.run()
    if n > 1:
        report.update(SHARDING_ACROSS.run())
    return report
