"""JAX training-step benchmark: phalanx's host path, its in-jit path, and jax.distributed + psum.

::

    python benchmarks/jax_step.py --rounds 5 --steps 15 --json benchmarks/results/jax-step-2.json

The MLP 512→1024→4×1024→10 of ``train_step.py`` (4.73M parameters, 18.9 MB of
float32 gradients), batch 64 per rank, cross-entropy, SGD. Each round the
driver starts, one after the other (order rotating per round), four short
worlds with the phalanx launcher:

* ``single``: one process, the whole step jitted, no communication (``T_1``);
* ``mpi`` and ``gloo`` (2 ranks): the same jitted step with no communication,
  the *host path* (``jax.grad`` jitted, ``phalanx.jax.allreduce_gradients`` on
  the concrete gradients, the optax update jitted) and the *in-jit path* (one
  jitted step: loss, grad, ``phalanx.jax.DistributedOptimizer`` reducing
  through an ordered ``io_callback``, update);
* ``psum`` (2 ranks): ``jax.distributed`` (set up by
  ``phalanx.jax.initialize_distributed``: XLA's gloo CPU collectives) and the
  step as a JAX user writes it: ``jax.shard_map`` over a one-axis mesh of the
  processes, ``jax.lax.pmean`` of the gradients, params replicated, the batch
  a global array made from each process's rows.

One XLA thread per rank (``--xla_cpu_multi_thread_eigen=false``,
``intra_op_parallelism_threads=1``). A figure is the median over rounds of the
slowest rank's mean step time (``--steps`` timed steps after 3 warm-up steps,
each ended by ``block_until_ready``); efficiency = T_1 / T_2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.abspath(__file__)
SIZES = [512, 1024, 1024, 1024, 1024, 1024, 10]
BATCH = 64
LR = 0.01
WORLDS = {"single": (1, None), "mpi": (2, "mpi"), "gloo": (2, "gloo"), "psum": (2, "mpi")}


# -- the model (what every world runs) ---------------------------------------------------------

def build(seed: int = 0) -> tuple[Any, Any, Any]:
    """(params, loss function, batch maker) of the benchmark MLP."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), len(SIZES) - 1)
    params = [(jax.random.normal(k, (a, b), jnp.float32) * (2.0 / a) ** 0.5, jnp.zeros(b, jnp.float32))
              for k, a, b in zip(keys, SIZES[:-1], SIZES[1:], strict=True)]

    def loss(p: Any, x: Any, y: Any) -> Any:
        h = x
        for i, (w, b) in enumerate(p):
            h = h @ w + b
            if i < len(p) - 1:
                h = jax.nn.relu(h)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h), y[:, None], axis=1))

    def batch(rank: int, rows: int = BATCH) -> tuple[Any, Any]:
        kx, ky = jax.random.split(jax.random.key(100 + rank))
        return jax.random.normal(kx, (rows, SIZES[0])), jax.random.randint(ky, (rows,), 0, SIZES[-1])

    return params, loss, batch


def timed(step: Any, state: Any, warmup: int, steps: int) -> tuple[float, Any]:
    """Mean seconds per step of ``state = step(state)`` after ``warmup`` steps, and the last state."""
    import jax

    for _ in range(warmup):
        state = step(state)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state = step(state)
        jax.block_until_ready(state)
    return (time.perf_counter() - start) / steps, state


def variants(kind: str, warmup: int, steps: int) -> dict[str, float]:
    """Time this world's variants; returns {variant: mean seconds per step} (this rank)."""
    import jax
    import optax

    import phalanx
    import phalanx.jax as px

    if kind == "psum":
        return {"jax.distributed + psum": psum_variant(warmup, steps)}
    phalanx.init()
    params, loss, batch = build()
    x, y = batch(phalanx.rank())
    sgd = optax.sgd(LR)
    grad = jax.jit(jax.grad(loss))

    @jax.jit
    def local(s: Any) -> Any:
        p, o = s
        u, o = sgd.update(jax.grad(loss)(p, x, y), o, p)
        return optax.apply_updates(p, u), o

    out = {"no communication": timed(local, (params, sgd.init(params)), warmup, steps)[0]}
    if kind == "single":
        return out
    apply = jax.jit(lambda g, s: (lambda u, o: (optax.apply_updates(s[0], u), o))(*sgd.update(g, s[1], s[0])))

    def host(s: Any) -> Any:
        return apply(px.allreduce_gradients(grad(s[0], x, y)), s)

    tx = px.DistributedOptimizer(sgd)

    @jax.jit
    def in_jit(s: Any) -> Any:
        p, o = s
        u, o = tx.update(jax.grad(loss)(p, x, y), o, p)
        return optax.apply_updates(p, u), o

    out["phalanx host path"] = timed(host, (params, sgd.init(params)), warmup, steps)[0]
    t, (p, _) = timed(in_jit, (params, tx.init(params)), warmup, steps)
    out["phalanx in-jit path"] = t
    same = phalanx.allgather(p[0][0])
    out["_replicas_equal"] = bool((same[0] == same[-1]).all())
    return out


def psum_variant(warmup: int, steps: int) -> float:
    """The step as a JAX user writes it on jax.distributed: shard_map + pmean over the processes."""
    import phalanx.jax as px

    px.initialize_distributed()
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = px.process_mesh()
    params, loss, batch = build()
    x, y = batch(jax.process_index())
    rows = NamedSharding(mesh, P("ranks"))
    gx = jax.make_array_from_process_local_data(rows, x)
    gy = jax.make_array_from_process_local_data(rows, y)
    replicated = NamedSharding(mesh, P())
    sgd = optax.sgd(LR)
    state = jax.device_put((params, sgd.init(params)), replicated)

    def body(s: Any, xb: Any, yb: Any) -> Any:
        p, o = s
        g = jax.lax.pmean(jax.grad(loss)(p, xb, yb), "ranks")
        u, o = sgd.update(g, o, p)
        return optax.apply_updates(p, u), o

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # jax < 0.7
        from jax.experimental.shard_map import shard_map
    sharded = jax.jit(shard_map(body, mesh=mesh, in_specs=(P(), P("ranks"), P("ranks")), out_specs=P()))
    return timed(lambda s: sharded(s, gx, gy), state, warmup, steps)[0]


def worker(kind: str, warmup: int, steps: int, out: str) -> None:
    result = variants(kind, warmup, steps)
    import phalanx

    rank = phalanx.rank()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


# -- the driver ---------------------------------------------------------------------------------

def run_world(kind: str, warmup: int, steps: int, tmp: str) -> list[dict[str, float]]:
    n, backend = WORLDS[kind]
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
               OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    out = os.path.join(tmp, kind)
    cmd = [sys.executable, HERE, "--worker", kind, "--warmup", str(warmup), "--steps", str(steps), "--out", out]
    if n > 1:
        cmd = [sys.executable, "-m", "phalanx", "run", "-n", str(n), "--backend", backend, *cmd[1:]]
    subprocess.run(cmd, env=env, check=True, timeout=600)
    results = []
    for r in range(n):
        with open(f"{out}.{r}") as f:
            results.append(json.load(f))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", choices=list(WORLDS), default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.warmup, args.steps, args.out)
        return
    import tempfile

    kinds = list(WORLDS)
    samples: dict[str, list[float]] = {}
    checks: list[bool] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for kind in kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]:
                ranks = run_world(kind, args.warmup, args.steps, tmp)
                for name in ranks[0]:
                    if name.startswith("_"):
                        checks += [r[name] for r in ranks]
                        continue
                    label = name if kind in ("single", "psum") else f"{name}, {kind}"
                    if kind == "single":
                        label = "1 process, no communication (T_1)"
                    samples.setdefault(label, []).append(max(r[name] for r in ranks))
    table(samples, args, checks)


def table(samples: dict[str, list[float]], args: Any, checks: list[bool]) -> None:
    t1 = statistics.median(samples["1 process, no communication (T_1)"])
    print("| variant | step ms | samples/s | efficiency |\n|---|---:|---:|---:|")
    rows = {}
    for label, times in samples.items():
        t = statistics.median(times)
        ranks = 1 if label.startswith("1 process") else 2
        rows[label] = {"ms": t * 1e3, "samples_s": ranks * BATCH / t, "efficiency": t1 / t, "rounds": times}
        print(f"| {label} | {t * 1e3:.1f} | {ranks * BATCH / t:.0f} | {t1 / t:.2f} |")
    print(f"replicas identical after the in-jit path: {all(checks)}")
    if args.json:
        import jax
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "jax": jax.__version__, "rounds": args.rounds, "steps": args.steps,
                       "replicas_equal": all(checks), "command": " ".join(sys.argv)}, f, indent=1)


if __name__ == "__main__":
    main()
