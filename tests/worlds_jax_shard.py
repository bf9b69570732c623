"""Rank bodies for sharded optax state: N ranks with shard= equal one process, refusals, checkpoints.

Every rank also trains the one-process reference (plain optax on the whole
global batch, float64), so one world checks "sharded N ranks equal one
process" to 1e-10. The parameters have 58 elements: 3 ranks hold unequal
shares (20, 20, 18 and 2 of padding).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np

import phalanx
from behaviours import Behaviours
from helpers import raises

SHARD = Behaviours()
GLOBAL_BATCH = 12
STEPS = 3
TOL = 1e-10
PARAMS = 5 * 7 + 7 + 7 * 2 + 2  # 58: not a multiple of 3


def _params() -> Any:
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    return {"l1": {"w": jnp.asarray(rng.normal(size=(5, 7))), "b": jnp.asarray(rng.normal(size=7))},
            "l2": {"w": jnp.asarray(rng.normal(size=(7, 2))), "b": jnp.asarray(rng.normal(size=2))}}


def _loss(p: Any, x: Any, y: Any) -> Any:
    import jax.numpy as jnp

    h = jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"])
    return jnp.mean((h @ p["l2"]["w"] + p["l2"]["b"] - y) ** 2)


def _batch(step: int, r: int | None = None, n: int = 1) -> tuple[Any, Any]:
    rng = np.random.default_rng(100 + step)
    x, y = rng.normal(size=(GLOBAL_BATCH, 5)), rng.normal(size=(GLOBAL_BATCH, 2))
    if r is None:
        return x, y
    k = GLOBAL_BATCH // n
    return x[r * k:(r + 1) * k], y[r * k:(r + 1) * k]


def _train(tx: Any, steps: int, r: int | None, n: int, jit: bool = True, params: Any = None,
           state: Any = None, first: int = 0) -> tuple[Any, Any]:
    import jax
    import optax

    params = _params() if params is None else params
    state = tx.init(params) if state is None else state

    def step(p: Any, s: Any, x: Any, y: Any) -> Any:
        updates, s = tx.update(jax.grad(_loss)(p, x, y), s, p)
        return optax.apply_updates(p, updates), s

    run = jax.jit(step) if jit else step
    for i in range(first, first + steps):
        params, state = run(params, state, *_batch(i, r, n))
    return params, state


def _close(got: Any, want: Any, what: str) -> None:
    import jax

    a, b = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want), f"{what}: structures differ"
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=TOL, atol=TOL, err_msg=what)


def _optimizers() -> dict[str, Any]:
    import optax

    schedule = optax.exponential_decay(0.05, 2, 0.5)
    return {
        "sgd-momentum": lambda: optax.sgd(0.1, momentum=0.9),
        "sgd-nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
        "adam": lambda: optax.adam(0.05),
        "adamw": lambda: optax.adamw(0.05, weight_decay=0.1),
        "chain-clip-decay-adam-schedule": lambda: optax.chain(
            optax.clip(0.5), optax.keep_params_nonnegative(), optax.add_decayed_weights(0.01),
            optax.adam(schedule)),
        "global-norm-clip-adamw": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(0.05)),
    }


_REFERENCE: dict[str, Any] = {}


def _one_process(name: str) -> Any:
    """The one-process run of optimizer ``name`` (trained once, compared with both shardings)."""
    if name not in _REFERENCE:
        _REFERENCE[name] = _train(_optimizers()[name](), STEPS, None, 1)
    return _REFERENCE[name]


def _equal_to_one_process(name: str, shard: str) -> Any:
    def check(r: int, n: int) -> None:
        import jax

        import phalanx.jax as px

        make = _optimizers()[name]
        want, want_state = _one_process(name)
        tx = px.DistributedOptimizer(make(), shard=shard)
        got, state = _train(tx, STEPS, r, n)
        _close(got, want, "parameters")
        k = -(-PARAMS // n)
        sizes = {int(np.size(x)) for x in jax.tree_util.tree_leaves(state) if np.ndim(x) == 1}
        assert sizes == {k}, f"the state's vectors hold {sizes} elements, not this rank's {k} of {PARAMS}"
        _close(tx.full_state(state), want_state, "full_state against the one-process state")
    return check


for _name in ("sgd-momentum", "sgd-nesterov", "adam", "adamw", "chain-clip-decay-adam-schedule",
              "global-norm-clip-adamw"):
    for _shard in ("optimizer", "gradients"):
        SHARD.add(f"{_name}-shard-{_shard}-jitted-equals-one-process-holding-1-nth-state",
                  _equal_to_one_process(_name, _shard))


@SHARD.behaviour("every-other-elementwise-optax-optimizer-eagerly-equals-one-process")
def _(r: int, n: int) -> None:
    import optax

    import phalanx.jax as px

    makers = {"adagrad": lambda: optax.adagrad(0.1), "rmsprop": lambda: optax.rmsprop(0.01, momentum=0.5),
              "adamax": lambda: optax.adamax(0.05), "nadam": lambda: optax.nadam(0.05),
              "adabelief": lambda: optax.adabelief(0.05), "lion": lambda: optax.lion(0.01),
              "radam": lambda: optax.radam(0.05), "amsgrad": lambda: optax.amsgrad(0.05),
              "yogi": lambda: optax.yogi(0.05), "sign_sgd": lambda: optax.sign_sgd(0.01),
              "adadelta": lambda: optax.adadelta(0.5), "rprop": lambda: optax.rprop(0.01),
              "adan": lambda: optax.adan(0.05), "ema": lambda: optax.chain(optax.ema(0.9), optax.sgd(0.1)),
              "nested-global-norm-clip": lambda: optax.chain(optax.chain(optax.clip_by_global_norm(0.02)),
                                                             optax.sgd(0.1, momentum=0.9))}
    for name, make in makers.items():
        want, want_state = _train(make(), 2, None, 1, jit=False)
        tx = px.DistributedOptimizer(make(), shard="optimizer")
        got, state = _train(tx, 2, r, n, jit=False)
        _close(got, want, name)
        _close(tx.full_state(state), want_state, f"{name}: full_state")


@SHARD.behaviour("checkpoint-full-state-loads-into-unsharded-optax-and-back-into-a-sharded-one")
def _(r: int, n: int) -> None:
    import optax

    import phalanx.jax as px

    want, want_state = _train(optax.adamw(0.05), 2 * STEPS, None, 1)
    tx = px.DistributedOptimizer(optax.adamw(0.05), shard="optimizer")
    params, state = _train(tx, STEPS, r, n)
    full = pickle.loads(pickle.dumps(tx.full_state(state)))  # what rank 0 would write to a file
    # into an unsharded distributed optimizer, and on:
    plain = px.DistributedOptimizer(optax.adamw(0.05))
    got, got_state = _train(plain, STEPS, r, n, params=params, state=full, first=STEPS)
    _close(got, want, "resumed unsharded from a sharded checkpoint")
    _close(got_state, want_state, "the unsharded state")
    # and from an unsharded state (any world size's) into a fresh sharded optimizer:
    _, mid_state = _train(optax.adamw(0.05), STEPS, None, 1)
    fresh = px.DistributedOptimizer(optax.adamw(0.05), shard="gradients")
    sharded = fresh.shard_state(mid_state, params)
    got, got_state = _train(fresh, STEPS, r, n, params=params, state=sharded, first=STEPS)
    _close(got, want, "resumed sharded from an unsharded checkpoint")
    _close(fresh.full_state(got_state), want_state, "the sharded state gathered")
    with raises(phalanx.InvalidArgumentError, "a state of another optimizer was accepted", match="shard_state"):
        fresh.shard_state(optax.sgd(0.1, momentum=0.9).init(params), params)
    with raises(phalanx.InvalidArgumentError, "an unsharded state went into update", match="ShardedState"):
        fresh.update(params, full, params)


@SHARD.behaviour("transformations-that-are-not-element-wise-are-refused-naming-the-part-and-shard-none")
def _(r: int, n: int) -> None:
    import optax

    import phalanx.jax as px

    custom = optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s))
    refused = {
        "lamb": (optax.lamb(0.1), "scale_by_trust_ratio"),
        "lars": (optax.lars(0.1), "masked"),
        "adafactor": (optax.adafactor(0.1), "scale_by_factored_rms"),
        "zero_nans": (optax.chain(optax.zero_nans(), optax.sgd(0.1)), "zero_nans"),  # a flag per leaf
        "novograd": (optax.novograd(0.1), "scale_by_novograd"),
        "adamw-with-a-mask": (optax.adamw(0.1, mask=lambda p: p), "masked"),
        "custom": (custom, "not from optax"),
    }
    for what, (tx, part) in refused.items():
        with raises(phalanx.InvalidArgumentError, f"{what} was accepted with shard=") as raised:
            px.DistributedOptimizer(tx, shard="optimizer")
        text = str(raised.value)
        assert "phalanx.jax.DistributedOptimizer(shard='optimizer')" in text and part in text, text
        assert "shard=None" in text, text
    for tx, kw, match in ((optax.MultiSteps(optax.sgd(0.1), 2), {}, "MultiSteps"),
                          (optax.sgd(0.1), {"compression": "fp16"}, "compression"),
                          (optax.sgd(0.1), {"shard": "stage2"}, "shard='stage2'")):
        with raises(phalanx.InvalidArgumentError, f"{match} was accepted", match=match) as raised:
            px.DistributedOptimizer(tx, **{"shard": "gradients", **kw})
        assert "phalanx.jax.DistributedOptimizer" in str(raised.value), raised.value


@SHARD.behaviour("ranks-that-disagree-on-shard-or-parameters-raise-at-init-on-every-rank")
def _(r: int, n: int) -> None:
    import jax.numpy as jnp
    import optax

    import phalanx.jax as px

    tx = px.DistributedOptimizer(optax.sgd(0.1), shard="optimizer" if r == 0 else "gradients")
    if n > 1:
        with raises(phalanx.CollectiveMismatchError, "ranks disagreeing on shard were not caught",
                    match="DistributedOptimizer.init"):
            tx.init(_params())
        half = px.DistributedOptimizer(optax.sgd(0.1), shard="optimizer" if r == 0 else None)
        with raises(phalanx.CollectiveMismatchError, "a sharded rank beside unsharded ones was not caught"):
            params = _params()
            half.update(params, half.init(params), params)  # rank 0 agrees in init, the others reduce
        ragged = {"w": jnp.ones(4 + r)}
        with raises(phalanx.CollectiveMismatchError, "a different parameter count was not caught"):
            px.DistributedOptimizer(optax.sgd(0.1), shard="optimizer").init(ragged)
    assert phalanx.allreduce(1) == n, "the world is usable after the mismatches"
    ok = px.DistributedOptimizer(optax.sgd(0.1), shard="optimizer")
    state = ok.init(_params())
    with raises(phalanx.InvalidArgumentError, "gradients of another structure were accepted", match="update"):
        ok.update({"w": jnp.ones(3)}, state)
    with raises(phalanx.InvalidArgumentError, "mixed dtypes were accepted", match="one floating dtype"):
        ok.init({"a": jnp.ones(2, jnp.float32), "b": jnp.ones(2, jnp.float64)})


def shard_world() -> dict[str, Any]:
    """World body: every sharded-optax behaviour, each reported on its own (float64)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_enable_x64", True)
    return SHARD.run(phalanx.rank(), phalanx.size())
