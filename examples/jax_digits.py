"""Train an equinox MLP with optax on scikit-learn's handwritten digits, on one process or many.

::

    python examples/jax_digits.py                      # one process
    phalanx run -n 2 examples/jax_digits.py            # two processes: the same test accuracy
    phalanx run -n 2 -m phalanx.examples.jax_digits --epochs 40 --json result.json

A JAX training loop as a JAX user writes it (a jitted step: loss, gradient,
optax update), with the phalanx lines marked ``# phalanx``. Every step trains
on one *global* batch of ``--batch-size`` images, drawn in the same order
whatever the number of processes; each process takes an equal share, and
``phalanx.jax.DistributedOptimizer`` averages the gradients inside the jitted
step, so every step applies the gradient of the whole global batch, as one
process would. float64 (``jax_enable_x64``) keeps rounding differences between
world sizes far below the printed digits.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import phalanx.jax as px  # noqa: E402  # phalanx


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train an equinox MLP on scikit-learn's digits, data-parallel.")
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set (default 20)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="global batch, split evenly over the processes (default 64)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="the split, the initial weights and the order")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH (from rank 0)")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be at least 1")
    return args


def load_data(seed: int) -> tuple[np.ndarray, ...]:
    """Pixels scaled to [0, 1] (float64); a fixed split: 1/5 of the images for testing."""
    digits = load_digits()
    x, y = digits.data / 16.0, digits.target
    order = np.random.default_rng(seed).permutation(len(x))
    test, train = order[:len(x) // 5], order[len(x) // 5:]
    return x[train], y[train], x[test], y[test]


def loss_fn(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    px.init()  # phalanx: mpi / gloo as launched by `phalanx run`; with plain `python`, a world of one
    rank, size = px.rank(), px.size()
    if args.batch_size % size:
        raise SystemExit(f"jax_digits.py: --batch-size {args.batch_size} does not split evenly over {size} "
                         f"processes; use a multiple of {size}, e.g. {size * max(1, args.batch_size // size)}.")
    x_train, y_train, x_test, y_test = load_data(args.seed)

    model = eqx.nn.MLP(64, 10, 128, 2, key=jax.random.key(args.seed + rank))  # different on purpose
    params, static = eqx.partition(model, eqx.is_array)
    params = px.synchronize(params)  # phalanx: rank 0's weights on every process
    tx = px.DistributedOptimizer(optax.sgd(args.lr, momentum=0.9))  # phalanx: gradients averaged first
    opt_state = tx.init(params)

    @jax.jit
    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)  # the cross-rank average runs here
        return optax.apply_updates(params, updates), opt_state, loss

    local = args.batch_size // size
    steps = len(x_train) // args.batch_size
    if rank == 0:
        print(f"{len(x_train)} training images, {len(x_test)} test images; global batch {args.batch_size} = "
              f"{size} x {local}, {steps} steps per epoch", flush=True)
    start = time.perf_counter()
    mean_loss = float("nan")
    for epoch in range(1, args.epochs + 1):
        order = np.random.default_rng(args.seed + epoch).permutation(len(x_train))  # the same everywhere
        total = 0.0
        for s in range(steps):
            mine = order[s * args.batch_size:(s + 1) * args.batch_size][rank * local:(rank + 1) * local]
            params, opt_state, loss = step(params, opt_state, x_train[mine], y_train[mine])
            total += float(loss)
        mean_loss = float(px.allreduce(total / steps, op="avg"))  # phalanx: the mean over processes
        if rank == 0:  # phalanx: log on rank 0
            print(f"epoch {epoch:3d}/{args.epochs}  train loss {mean_loss:.4f}  "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    seconds = time.perf_counter() - start

    model = eqx.combine(params, static)
    test_part = px.DistributedDataContainer((x_test, y_test), remainder="exact")  # phalanx: my test share
    mine = np.asarray(test_part.indices, dtype=np.int64)
    xs, ys = x_test[mine], y_test[mine]
    correct = int((jnp.argmax(jax.vmap(model)(xs), axis=1) == ys).sum()) if len(ys) else 0
    correct, count = px.allreduce(np.array([correct, len(ys)])).tolist()  # phalanx: summed over processes
    accuracy = correct / count
    if rank == 0:
        print(f"test accuracy {accuracy:.4f} ({correct} of {count} correct)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"accuracy": accuracy, "correct": correct, "total": count, "ranks": size,
                           "batch_size": args.batch_size, "epochs": args.epochs, "train_loss": mean_loss,
                           "seconds": round(seconds, 2)}, f)


if __name__ == "__main__":
    main()
