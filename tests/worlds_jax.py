"""Rank bodies for the JAX tests: collectives on JAX arrays, synchronize, allreduce_gradients, optax.

Equivalence: every rank also trains the 1-process reference itself (the same
model on the whole global batch, plain optax), so one world checks "N ranks
equal one process" without a second world.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import phalanx
from behaviours import Behaviours
from helpers import raises

JAX = Behaviours()
GLOBAL_BATCH = 12  # splits into 1, 2 and 3 equal shards
STEPS = 4
TOL = {None: (1e-5, 1e-6), "fp16": (2e-3, 2e-3), "bf16": (2e-2, 2e-2)}  # (rtol, atol) after STEPS steps


def _data(step: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(step)
    return (rng.normal(size=(GLOBAL_BATCH, 8)).astype(np.float32),
            rng.integers(0, 4, size=GLOBAL_BATCH))


def _shard(a: Any, r: int, n: int) -> Any:
    k = GLOBAL_BATCH // n
    return a[r * k:(r + 1) * k]


# -- collectives --------------------------------------------------------------------------------

@JAX.behaviour("every-collective-on-jax-arrays-matches-numpy-and-returns-jax-arrays")
def _(r: int, n: int) -> None:
    import jax
    import jax.numpy as jnp

    base = np.arange(6 * n, dtype=np.float32).reshape(2 * n, 3) + r
    x = jnp.asarray(base)
    calls = {
        "allreduce": lambda v: phalanx.allreduce(v, op="avg"),
        "broadcast": lambda v: phalanx.broadcast(v, root=n - 1),
        "reduce": lambda v: phalanx.reduce(v, op="max"),
        "allgather": phalanx.allgather,
        "gather": phalanx.gather,
        "reduce_scatter": phalanx.reduce_scatter,
        "alltoall": phalanx.alltoall,
        "iallreduce": lambda v: phalanx.iallreduce(v).wait(),
    }
    for name, call in calls.items():
        got, want = call(x), call(base.copy())
        if want is None:
            assert got is None, f"{name}: {got!r} off the root"
            continue
        assert isinstance(got, jax.Array), f"{name} returned {type(got)}"
        np.testing.assert_allclose(np.asarray(got), want, err_msg=name)
    assert np.asarray(x).tolist() == base.tolist(), "the input JAX array was changed"
    for dtype in (jnp.bfloat16, jnp.float16, jnp.int32, jnp.bool_):
        got = phalanx.allreduce(jnp.ones(5, dtype), op="max" if dtype == jnp.bool_ else "sum")
        assert got.dtype == dtype, f"{dtype}: came back as {got.dtype}"
        assert np.asarray(got, np.float32).tolist() == [1.0 if dtype == jnp.bool_ else n] * 5, got


@JAX.behaviour("jax-allreduce-inside-jit-matches-eager")
def _(r: int, n: int) -> None:
    import jax
    import jax.numpy as jnp

    import phalanx.jax as px

    x = jnp.arange(4.0) * (r + 1)
    got = jax.jit(lambda v: px.allreduce(v * 2, op="sum") + 1)(x)
    np.testing.assert_allclose(np.asarray(got), np.arange(4.0) * 2 * sum(range(1, n + 1)) + 1)


# -- synchronize ----------------------------------------------------------------------------------

def _same_everywhere(tree: Any) -> None:
    import jax

    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            stacked = np.asarray(phalanx.allgather(leaf))
            assert all(np.array_equal(stacked[0], s) for s in stacked), "ranks still differ"


@JAX.behaviour("synchronize-params-optax-state-nnx-state-and-equinox-module-to-roots")
def _(r: int, n: int) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    root = n - 1
    params = {"w": jnp.full((3, 2), float(r)), "b": jnp.arange(2.0) + r, "name": f"rank{r}", "lr": None}
    opt_state = optax.adam(1e-3).init({k: params[k] for k in ("w", "b")})
    opt_state = jax.tree_util.tree_map(lambda a: a + r if isinstance(a, jax.Array) else a, opt_state)
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(r))
    _, nnx_state = nnx.split(model)
    module = eqx.nn.MLP(3, 2, 5, 2, key=jax.random.key(r))
    out = phalanx.synchronize({"params": params, "opt": opt_state, "nnx": nnx_state, "eqx": module}, root=root)
    _same_everywhere(out)
    assert float(out["params"]["w"][0, 0]) == root and out["params"]["name"] == f"rank{r}", out["params"]
    assert isinstance(out["eqx"], eqx.nn.MLP) and out["eqx"].activation is module.activation
    assert type(out["opt"][0]).__name__ == "ScaleByAdamState" and int(out["opt"][0].count) == root
    nnx.update(model, out["nnx"])
    _same_everywhere(nnx.state(model))
    assert isinstance(out["params"]["w"], jax.Array)


@JAX.behaviour("synchronize-shape-dtype-or-structure-mismatch-raises-on-every-rank")
def _(r: int, n: int) -> None:
    import jax.numpy as jnp

    if n == 1:
        return
    cases = {
        "shape": {"w": jnp.ones(3 + (r == 1))},
        "dtype": {"w": jnp.ones(3, jnp.float32 if r != 1 else jnp.float16)},
        "structure": {"w": jnp.ones(3), **({"extra": jnp.ones(1)} if r == 1 else {})},
    }
    for what, tree in cases.items():
        with raises(phalanx.CollectiveMismatchError, f"a {what} mismatch was not caught") as raised:
            phalanx.synchronize(tree)
        exc = raised.value
        assert "obj[" in str(exc), f"{what}: {exc}"
    assert phalanx.allreduce(1) == n, "the world is usable after the mismatches"


@JAX.behaviour("allreduce-gradients-mismatch-raises-on-every-rank-and-leaves-non-arrays")
def _(r: int, n: int) -> None:
    import jax.numpy as jnp

    out = phalanx.allreduce_gradients({"g": jnp.ones(2) * r, "tag": "t", "none": None})
    assert out["tag"] == "t" and out["none"] is None
    np.testing.assert_allclose(np.asarray(out["g"]), [(n - 1) / 2] * 2)
    if n == 1:
        return
    with raises(phalanx.CollectiveMismatchError, "a shape mismatch was not caught") as raised:
        phalanx.allreduce_gradients({"g": jnp.ones((2, 2 + (r == 1)))})
    exc = raised.value
    assert "['g']" in str(exc) and "float32[2, 3]" in str(exc), str(exc)
    assert phalanx.allreduce(1) == n


# -- equivalence --------------------------------------------------------------------------------

def _flax_model() -> tuple[Any, Any]:
    """(params, apply(params, x)) of a flax nnx MLP, functional style."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l1 = nnx.Linear(8, 16, rngs=rngs)
            self.l2 = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.l2(nnx.relu(self.l1(x)))

    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    return params, lambda p, x: nnx.merge(graphdef, p)(x)


def _eqx_model() -> tuple[Any, Any]:
    import equinox as eqx
    import jax

    model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    return params, lambda p, x: jax.vmap(eqx.combine(p, static))(x)


def _train(model: str, tx: Any, distributed: bool, r: int, n: int, jit: bool = True) -> Any:
    import jax
    import optax

    params, apply = _flax_model() if model == "flax" else _eqx_model()

    def loss(p: Any, x: Any, y: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(apply(p, x), y).mean()

    def step(p: Any, s: Any, x: Any, y: Any) -> Any:
        updates, s = tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, updates), s

    grad = jax.jit(jax.grad(loss))

    @jax.jit
    def update(p: Any, s: Any, g: Any) -> Any:
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    def host_step(p: Any, s: Any, x: Any, y: Any) -> Any:  # the reduction outside jit: the eager host path
        g = grad(p, x, y)
        return update(p, s, phalanx.allreduce_gradients(g) if distributed else g)

    params = phalanx.synchronize(params) if distributed else params
    state = tx.init(params)
    run = jax.jit(step) if jit else host_step
    for i in range(STEPS):
        x, y = _data(i)
        if distributed:
            x, y = _shard(x, r, n), _shard(y, r, n)
        params, state = run(params, state, x, y)
    return params


def _equivalent(model: str, make_tx: Any, compression: str | None = None, jit: bool = True,
                accumulate: int = 0) -> Any:
    def check(r: int, n: int) -> None:
        import jax
        import optax

        import phalanx.jax as px

        def wrap(tx: Any, dist: bool) -> Any:
            tx = optax.MultiSteps(tx, every_k_schedule=accumulate) if accumulate else tx
            return px.DistributedOptimizer(tx, compression=compression) if dist and jit else tx

        want = _train(model, wrap(make_tx(), False), False, r, n, jit)
        got = _train(model, wrap(make_tx(), True), True, r, n, jit)
        rtol, atol = TOL[compression]
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)
        _same_everywhere(got)
    return check


def _sgd() -> Any:
    import optax
    return optax.sgd(0.1)


def _adam() -> Any:
    import optax
    return optax.adam(0.01)


for _model in ("flax", "eqx"):
    for _name, _tx in (("sgd", _sgd), ("adam", _adam)):
        JAX.add(f"{_model}-{_name}-jitted-step-equals-one-process", _equivalent(_model, _tx))
JAX.add("eqx-adam-allreduce-gradients-outside-jit-equals-one-process", _equivalent("eqx", _adam, jit=False))
JAX.add("eqx-sgd-multisteps-accumulation-equals-one-process", _equivalent("eqx", _sgd, accumulate=2))
JAX.add("flax-adam-fp16-compression-equals-one-process-within-2e-3", _equivalent("flax", _adam, "fp16"))
JAX.add("flax-sgd-bf16-compression-equals-one-process-within-2e-2", _equivalent("flax", _sgd, "bf16"))


@JAX.behaviour("multisteps-reduces-only-on-the-steps-that-apply-the-update")
def _(r: int, n: int) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    import phalanx.jax as px
    from phalanx.jax import _jit

    calls = []
    original = _jit.reduce_host

    def counting(*args: Any) -> Any:
        calls.append(1)
        return original(*args)

    tx = px.distributed(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=3))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: (lambda u, s2: (optax.apply_updates(p, u), s2))(*tx.update(g, s, p)))
    _jit.reduce_host = counting
    try:
        for _ in range(6):
            params, state = step(params, state, {"w": jnp.ones(2) * (r + 1)})
            jax.block_until_ready(params)
    finally:
        _jit.reduce_host = original
    assert len(calls) == 2, f"{len(calls)} reductions in 6 micro-steps with every_k_schedule=3"
    inside = optax.MultiSteps(px.distributed(optax.sgd(0.1)), every_k_schedule=3)  # correct, k x the traffic
    state2, params2 = inside.init({"w": jnp.zeros(2)}), {"w": jnp.zeros(2)}
    for _ in range(6):
        updates, state2 = inside.update({"w": jnp.ones(2) * (r + 1)}, state2, params2)
        params2 = optax.apply_updates(params2, updates)
    np.testing.assert_allclose(np.asarray(params2["w"]), np.asarray(params["w"]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(params["w"]), [-0.2 * (n + 1) / 2] * 2, rtol=1e-6)


@JAX.behaviour("jitted-reduction-of-a-mismatched-shape-raises-on-every-rank-naming-the-leaf")
def _(r: int, n: int) -> None:
    import jax
    import jax.numpy as jnp

    import phalanx.jax as px

    if n == 1:
        return
    tree = {"a": jnp.ones(4), "b": jnp.ones((2, 2 + (r == 1)))}  # sizes differ too: last, it may stall
    with raises(Exception, "a shape mismatch inside jit was not caught") as raised:  # XLA wraps the callback's error
        jax.block_until_ready(jax.jit(px.allreduce_gradients)(tree))
    exc = raised.value
    assert "CollectiveMismatchError" in str(exc) and "['b']" in str(exc), str(exc)[-800:]


def jax_world() -> dict[str, Any]:
    """World body: every JAX behaviour, each reported on its own."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return JAX.run(phalanx.rank(), phalanx.size())


def raises_in_jitted_step() -> None:
    """Rank 1 raises inside a jitted step (a host callback before the reduction); the others wait in it."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    import phalanx.jax as px

    def check(x: Any) -> Any:
        if phalanx.rank() == 1:
            raise ValueError("boom on rank 1 inside the jitted step")
        return x

    @jax.jit
    def step(w: Any) -> Any:
        g = io_callback(check, jax.ShapeDtypeStruct(w.shape, w.dtype), w * 2, ordered=True)
        return w - 0.1 * px.allreduce_gradients({"w": g})["w"]

    w = jnp.ones(3)
    for _ in range(3):
        w = jax.block_until_ready(step(w))


def psum_world() -> list[float]:
    """jax.distributed set up by phalanx.jax.initialize_distributed: pmean over processes in shard_map."""
    import phalanx.jax as px

    px.initialize_distributed()  # before any other JAX call
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = px.process_mesh()
    local = jnp.full((1, 3), float(px.rank() + 1))
    rows = jax.make_array_from_process_local_data(NamedSharding(mesh, P("ranks")), local)
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # jax < 0.7
        from jax.experimental.shard_map import shard_map
    mean = jax.jit(shard_map(lambda x: jax.lax.pmean(x, "ranks"), mesh=mesh, in_specs=P("ranks"),
                             out_specs=P()))(rows)
    return np.asarray(mean.addressable_data(0)).reshape(-1).tolist()
