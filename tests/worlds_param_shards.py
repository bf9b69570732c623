"""``DataParallel(shard="parameters")`` (ZeRO-3) trains a small GPT exactly like one process, in ordinary code.

The GPT has what real ones have: an output layer tied to the token
embedding, a frozen position embedding, and one block called twice in a
forward. The training loop is the one nanoGPT and torch's tutorials write:
AdamW with weight-decay groups made from ``model.parameters()`` by
``p.dim() >= 2``, accumulation over two micro-batches with ``no_sync()``
and also with two plain backwards, ``torch.nn.utils.clip_grad_norm_`` on
``model.parameters()``, the position embedding unfrozen after the first
step, and an eval forward under ``no_grad``. Each rank trains on its slice
of a fixed global batch; a reference copy trains in one process on the
whole batch in the same body. Compared in float64: ``model.state_dict()``
(whole tensors, identical on every rank) and the eval loss.
"""

from __future__ import annotations

import re
from typing import Any

import phalanx
from behaviours import Behaviours
from helpers import raises
from worlds_training import _setup

PARAMS = Behaviours()
EXACT = 1e-10
VOCAB, SEQ, D = 11, 6, 8
PER_RANK = 2


def gpt(torch: Any, seed: int, dtype: Any = None) -> Any:
    """A small GPT: token and (frozen) position embeddings, blocks in a ModuleList (the second called
    twice), an untied final norm and an output layer tied to the token embedding."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(D)
            self.attn = nn.Linear(D, 3 * D)
            self.proj = nn.Linear(D, D)
            self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

        def forward(self, x: Any) -> Any:
            q, k, v = self.attn(self.ln(x)).split(D, dim=-1)
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att)
            return x + self.mlp(x)

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(VOCAB, D)
            self.wpe = nn.Embedding(SEQ, D)
            self.wpe.weight.requires_grad_(False)
            self.h = nn.ModuleList([Block(), Block()])
            self.ln_f = nn.LayerNorm(D)
            self.lm_head = nn.Linear(D, VOCAB, bias=False)
            self.lm_head.weight = self.wte.weight  # tied

        def forward(self, idx: Any) -> Any:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            x = self.h[0](x)
            x = self.h[1](self.h[1](x))  # one block called twice
            return self.lm_head(self.ln_f(x))

    torch.manual_seed(seed)
    return GPT().to(dtype or torch.float64), Block


def tokens(torch: Any, step: int, n: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(500 + step)
    data = torch.randint(0, VOCAB, (n * PER_RANK, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_of(torch: Any, model: Any, x: Any, y: Any) -> Any:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def adamw(torch: Any, model: Any, eps: float = 1e-8) -> Any:
    """nanoGPT's configure_optimizers: decay the matrices, not the biases and norms. (In float32 a larger
    ``eps``: the attention's key bias has a gradient of exactly 0 in exact arithmetic, so its float32
    rounding noise, which differs with the summation order, is all Adam would see of it.)"""
    params = list(model.parameters())  # the frozen position embedding too (unfrozen later)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=0.01, eps=eps)


def train(shard: str, accumulate: str, units: Any = "class", steps: int = 3, scaled: bool = False) -> None:
    """``steps`` steps of the GPT at this world's size against one process; raises on any difference.

    ``scaled``: in float32 under a GradScaler (``ShardedGradScaler`` on the ranks, torch's in the one
    process), unscaled before torch's ``clip_grad_norm_``, compared to 1e-5."""
    torch, pt, r, n = _setup()
    dtype, tol = (torch.float32, 1e-5) if scaled else (torch.float64, EXACT)
    model, Block = gpt(torch, 7 + r, dtype)  # every rank builds its own values: the wrapper broadcasts rank 0's
    ref, _ = gpt(torch, 7, dtype)
    options = {"units": [Block] if units == "class" else units} if shard == "parameters" else {}
    dp = pt.DataParallel(model, shard=shard, **options)
    opt, ref_opt = adamw(torch, dp, 1e-4 if scaled else 1e-8), adamw(torch, ref, 1e-4 if scaled else 1e-8)
    scaler = pt.ShardedGradScaler("cpu", init_scale=1024.0) if scaled else None
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in ref_opt.param_groups], \
        "the decay groups differ from one process's: the wrapped parameters lost their shapes"
    for step in range(steps):
        x, y = tokens(torch, step, n)
        halves = [(x, y)] if accumulate == "none" else [(x[i::2], y[i::2]) for i in range(2)]  # 2 micro-batches
        for j, (xs, ys) in enumerate(halves):
            mine = slice(r * len(xs) // n, (r + 1) * len(xs) // n)
            ctx = dp.no_sync() if accumulate == "no_sync" and j == 0 else _nothing()
            with ctx:
                loss = loss_of(torch, dp, xs[mine], ys[mine]) / len(halves)
                (scaler.scale(loss) if scaler else loss).backward()
            ref_loss = loss_of(torch, ref, xs, ys) / len(halves)
            (ref_scaler.scale(ref_loss) if ref_scaler else ref_loss).backward()
        if scaler and ref_scaler:
            scaler.unscale_(opt), ref_scaler.unscale_(ref_opt)
        norm = torch.nn.utils.clip_grad_norm_(dp.parameters(), 0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert abs(norm.item() - ref_norm.item()) <= tol * max(1.0, ref_norm.item()), \
            f"step {step}: clip_grad_norm_ returned {norm.item()}, one process {ref_norm.item()}"
        if scaler and ref_scaler:
            scaler.step(opt), ref_scaler.step(ref_opt)
            scaler.update(), ref_scaler.update()
        else:
            opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        # every shard group at rest after the step: a unit freed, a bucket whole again
        groups, rest = dp.shard_groups(), "free" if shard == "parameters" else "whole"
        states = {g.name: g.state.value for g in groups}
        assert set(states.values()) <= {rest}, f"step {step}: shard groups not at rest ({rest}): {states}"
        if step == 0:  # a fine-tuning schedule: unfreeze the position embedding
            dp.module.wpe.weight.requires_grad_(True)
            if shard == "parameters":  # followed
                ref.wpe.weight.requires_grad_(True)
            else:  # refused at the next step, on every rank; frozen again, training goes on
                with raises(phalanx.UsageError, f"shard={shard}: unfreezing was not refused", match="wpe.weight"):
                    dp(x[:1])
                dp.module.wpe.weight.requires_grad_(False)
    state = dp.state_dict()
    for name, q in ref.state_dict().items():
        p = state[f"module.{name}"]
        assert p.shape == q.shape and type(p) is torch.Tensor, f"{name}: state_dict gave {type(p)} {p.shape}"
        err = (p - q).abs().max().item()
        assert err <= tol, f"{name} differs from one process by {err:.3g}"
        rows = phalanx.allgather(p.contiguous())
        assert all(rows[q_].equal(rows[0]) for q_ in range(n)), f"{name} differs between ranks"
    dp.eval()
    with torch.no_grad():
        x, y = tokens(torch, 99, 1)
        got, want = loss_of(torch, dp, x, y).item(), loss_of(torch, ref, x, y).item()
    assert abs(got - want) <= tol, f"eval loss {got} against one process's {want}"
    dp.close()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


@PARAMS.behaviour("parameters-gpt-tied-frozen-twice-called-clip-unfreeze-equals-one-process")
def _(r: int, n: int) -> None:
    train("parameters", "none")


@PARAMS.behaviour("parameters-no-sync-accumulation-equals-one-process")
def _(r: int, n: int) -> None:
    train("parameters", "no_sync")


@PARAMS.behaviour("parameters-two-plain-backwards-per-step-equal-one-process")
def _(r: int, n: int) -> None:
    train("parameters", "passes")


def _train(r: int, n: int, *args: Any) -> None:
    train(*args)


for _shard in ("optimizer", "gradients"):  # the same ordinary code on the other two levels
    PARAMS.add(f"{_shard}-gpt-tied-frozen-twice-called-torch-clip-decay-groups-equals-one-process", _train,
               _shard, "none")
    PARAMS.add(f"{_shard}-no-sync-accumulation-equals-one-process", _train, _shard, "no_sync")
    PARAMS.add(f"{_shard}-two-plain-backwards-per-step-equal-one-process", _train, _shard, "passes")
for _shard in ("optimizer", "gradients", "parameters"):
    PARAMS.add(f"{_shard}-sharded-grad-scaler-unscale-then-torch-clip-equals-one-process-float32", _train,
               _shard, "none", "class", 3, True)


@PARAMS.behaviour("parameters-default-units-are-the-blocks-and-the-other-children-with-parameters")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    model, _ = gpt(torch, 3)
    dp = pt.DataParallel(model, shard="parameters")
    units = sorted({pt.shard_of(p).unit for p in dp.parameters()})
    assert units == ["", "h.0", "h.1", "ln_f", "wpe"], units  # wte and lm_head are tied: the root's
    train("parameters", "none", units=None, steps=2)


@PARAMS.behaviour("parameters-a-model-built-on-the-meta-device-is-materialized-unit-by-unit-the-same-at-every-n")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    torch.manual_seed(11 + r)  # rank 0's generator decides
    with torch.device("meta"):
        model, Block = gpt(torch, 0)  # gpt() seeds; under meta nothing is drawn
    torch.manual_seed(11 + r)
    dp = pt.DataParallel(model, shard="parameters", units=[Block])
    assert all(not p.is_meta for p in dp.parameters()), "a parameter is still on the meta device"
    alone = [phalanx.new_group([q]) for q in range(n)][r]  # every rank makes every group; each uses its own
    with torch.device("meta"):
        ref, RefBlock = gpt(torch, 0)  # (its own Block class)
    torch.manual_seed(11)  # what one process makes with rank 0's seed, unit by unit in the same order
    one = pt.DataParallel(ref, shard="parameters", units=[RefBlock], group=alone)
    state, want = dp.state_dict(), one.state_dict()
    for name, q in want.items():
        assert state[name].equal(q), f"{name}: materialized at {n} ranks differs from at one rank"
    x, y = tokens(torch, 0, 1)
    loss_of(torch, dp, x, y).backward()  # and it trains
    assert all(p.grad is not None for p in dp.parameters() if p.requires_grad)


@PARAMS.behaviour("parameters-keep-their-shapes-and-hold-this-ranks-elements-one-free-group-per-unit-no-engine-close-stops-reducing")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    model, Block = gpt(torch, 3)
    dp = pt.DataParallel(model, shard="parameters", units=[Block])
    groups = dp.shard_groups()
    assert [g.name for g in groups][:2] == ["h.0", "h.1"] and {g.state.value for g in groups} == {"free"}, groups
    assert dp.shards_parameters and dp.nonfinite is None and dp.nonfinite_ranks() == []
    with raises(phalanx.UsageError, "DataParallel(shard='parameters').engine", match="shard='gradients'"):
        dp.engine  # noqa: B018
    dp.close()  # the units still gather to run; backward reduces nothing into the shards
    x, y = tokens(torch, 0, 1)
    loss_of(torch, dp, x, y).backward()
    assert all(p.grad is None for p in dp.parameters()), "a closed wrapper reduced gradients"
    held = 0
    for name, p in dp.named_parameters():
        spec = pt.shard_of(p)
        assert spec is not None and p.shape == spec.shape, f"{name}: {p!r}"
        assert isinstance(p, torch.nn.Parameter), f"{name} is not a Parameter"
        held += p.to_local().numel()
    assert pt.shard_of(dp.module.h[0].attn.weight).unit == "h.0" and pt.shard_of(dp.module.wte.weight).unit == ""
    total = sum(p.numel() for p in dp.parameters())
    assert held <= total // n + 8, f"rank {r} holds {held} of {total} elements"
    assert pt.shard_of(dp.module.lm_head.weight) is pt.shard_of(dp.module.wte.weight), "tied weights were split"
    with raises(phalanx.UsageError, "a matrix product of a shard", match="only element-wise"):
        dp.module.lm_head.weight @ dp.module.lm_head.weight.t()


@PARAMS.behaviour("parameters-state-dict-loads-into-an-unwrapped-model-and-back")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    model, Block = gpt(torch, 4)
    plain, _ = gpt(torch, 5)
    dp = pt.DataParallel(model, shard="parameters", units=[Block])
    state = {k.removeprefix("module."): v for k, v in dp.state_dict().items()}
    plain.load_state_dict(state)
    fresh, _ = gpt(torch, 6)
    dp2 = pt.DataParallel(fresh, shard="parameters", units=[Block])
    dp2.load_state_dict({f"module.{k}": v for k, v in plain.state_dict().items()})
    x, _ = tokens(torch, 1, 1)
    with torch.no_grad():
        assert dp2(x).sub(plain(x)).abs().max().item() == 0, "a loaded state gives another output"


@PARAMS.behaviour("parameters-optimizer-state-round-trips-whole")
def _(r: int, n: int) -> None:
    from phalanx.torch._sharded import whole_state

    torch, pt, r, n = _setup()
    model, Block = gpt(torch, 4)
    ref, _ = gpt(torch, 4)
    dp = pt.DataParallel(model, shard="parameters", units=[Block])
    opt, ref_opt = adamw(torch, dp), adamw(torch, ref)
    x, y = tokens(torch, 0, n)
    loss_of(torch, dp, x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK]).backward()
    loss_of(torch, ref, x, y).backward()
    opt.step(), ref_opt.step()
    whole, want = whole_state(opt).state_dict(), ref_opt.state_dict()
    for j, entry in want["state"].items():
        for key, v in entry.items():
            assert (whole["state"][j][key] - v).abs().max().item() <= EXACT, f"state {j}.{key} differs"
    opt2 = adamw(torch, dp)
    whole_state(opt2).load_state_dict(want)
    again = whole_state(opt2).state_dict()
    for j, entry in want["state"].items():
        for key, v in entry.items():
            assert again["state"][j][key].equal(v), f"state {j}.{key} did not round-trip"


@PARAMS.behaviour("distributed-optimizer-refuses-shard-parameters-pointing-to-dataparallel")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    model, _ = gpt(torch, 1)
    with raises(phalanx.InvalidArgumentError, "DistributedOptimizer(shard='parameters')", match="DataParallel"):
        pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard="parameters")


@PARAMS.behaviour("unfreezing-after-wrapping-is-refused-at-the-next-step-without-parameter-sharding")
def _(r: int, n: int) -> None:
    for shard in (None, "optimizer", "gradients"):
        torch, pt, r, n = _setup()
        model, _ = gpt(torch, 1)
        dp = pt.DataParallel(model, shard=shard)
        x, y = tokens(torch, 0, 1)
        loss_of(torch, dp, x, y).backward()
        dp.module.wpe.weight.requires_grad_(True)
        with raises(phalanx.UsageError, f"shard={shard}: unfreezing", match=re.escape("wpe.weight (now requires_grad=True)")):
            dp(x)
        dp.close()


@PARAMS.behaviour("a-frozen-first-parameter-keeps-optimizer-sharding-exact")
def _(r: int, n: int) -> None:
    """The optimizer made on every parameter, the frozen first one included (it was taken for unsharded)."""
    torch, pt, r, n = _setup()
    for shard in ("optimizer", "gradients"):
        model, ref = (torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
                      for _ in range(2))
        ref.load_state_dict(model.state_dict())
        for m in (model, ref):
            m[0].weight.requires_grad_(False)
        dp = pt.DataParallel(model, shard=shard)
        opt = torch.optim.Adam(dp.parameters(), lr=0.05)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(2 * n, 4, generator=g, dtype=torch.float64), torch.randn(2 * n, 3, generator=g,
                                                                                          dtype=torch.float64)
            torch.nn.functional.mse_loss(dp(x[2 * r:2 * r + 2]), y[2 * r:2 * r + 2]).backward()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        for (name, p), q in zip(dp.module.state_dict().items(), ref.state_dict().values(), strict=True):
            assert (p - q).abs().max().item() <= EXACT, f"shard={shard}: {name} differs from one process"
        dp.close()


def param_shards() -> dict[str, str | None]:
    """The world body: every behaviour, on every rank."""
    return PARAMS.run(phalanx.rank(), phalanx.size())


@PARAMS.behaviour("parameters-mixed-precision-bf16-compute-float32-master-and-reduction-tracks-fsdp2")
def _(r: int, n: int) -> None:
    """param_dtype=bf16, reduce_dtype=float32: the gathered copies and their gradients are bf16, the
    shards, their gradients and Adam's state float32; the loss after 10 steps is within 1e-2 of FSDP2's
    with the same MixedPrecisionPolicy (on gloo, where torch.distributed runs), else of float32 training."""
    torch, pt, r, n = _setup()
    bf16, f32 = torch.bfloat16, torch.float32
    model, Block = gpt(torch, 21, f32)
    dp = pt.DataParallel(model, shard="parameters", units=[Block], param_dtype=bf16, reduce_dtype=f32)
    seen: dict[str, Any] = {}
    hook = dp.module.h[0].attn.register_forward_hook(lambda m, a, out: seen.update(weight=m.weight.dtype,
                                                                                  out=out.dtype))
    opt = adamw(torch, dp, 1e-6)

    def losses(net: Any, optimizer: Any) -> list[float]:
        out = []
        for step in range(10):
            x, y = tokens(torch, step, n)
            mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
            loss = loss_of(torch, net, x[mine], y[mine])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(float(phalanx.allreduce(loss.float().item(), op="avg")))
        return out

    got = losses(dp, opt)
    hook.remove()
    assert seen == {"weight": bf16, "out": bf16}, f"the gathered unit computed in {seen}"
    for p in dp.parameters():
        assert p.dtype == f32 and p.to_local().dtype == f32, f"master shard {pt.shard_of(p).name} is {p.dtype}"
    x, y = tokens(torch, 0, 1)
    loss_of(torch, dp, x, y).backward()
    grads = [p.grad for p in dp.parameters() if p.grad is not None]
    assert grads and all(g.dtype == f32 for g in grads), "sharded gradients are not float32"
    assert all(v.dtype == f32 for s in opt.state.values() for v in s.values() if v.dim() > 0), "Adam state dtype"
    ref_model, _ = gpt(torch, 21, f32)
    if phalanx.backend().name == "gloo":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (n,))
        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32)
        for block in ref_model.h:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        ref = fully_shard(ref_model, mesh=mesh, mp_policy=policy)
    else:
        ref = pt.DataParallel(ref_model, shard="parameters", units=[Block])  # float32 throughout
    want = losses(ref, adamw(torch, ref, 1e-6))
    assert abs(got[-1] - want[-1]) <= 1e-2 * abs(want[-1]), f"loss after 10 steps {got[-1]}, reference {want[-1]}"


@PARAMS.behaviour("parameters-buffers-in-a-unit-are-kept-and-broadcast-and-a-compiled-unit-is-refused-by-name")
def _(r: int, n: int) -> None:
    torch, pt, r, n = _setup()
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x: Any) -> Any:
            return self.bn(self.fc(x))

    torch.manual_seed(3)
    model = nn.Sequential(Block(), Block()).double()
    ref = nn.Sequential(Block(), Block()).double()
    ref.load_state_dict(model.state_dict())
    dp = pt.DataParallel(model, shard="parameters", units=[Block])
    x = torch.randn(2 * n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # each training forward starts from rank 0's statistics (broadcast), as DDP's
        dp(x[2 * r:2 * r + 2]).sum().backward()
        ref(x[:2]).sum().backward()  # what rank 0 computes
    state, want = dp.state_dict(), ref.state_dict()
    assert state["module.0.bn.num_batches_tracked"].item() == 2, state["module.0.bn.num_batches_tracked"]
    if r == 0:
        for name in ("0.bn.running_mean", "1.bn.running_var"):
            assert state[f"module.{name}"].equal(want[name]), f"{name}: {state[f'module.{name}']}, {want[name]}"
    torch.manual_seed(3)
    compiled = nn.Sequential(Block(), Block())
    compiled[1].compile()
    with raises(phalanx.UsageError, "a compiled unit was accepted", match="module 1 .*torch.compile"):
        pt.DataParallel(compiled, shard="parameters", units=[Block])
