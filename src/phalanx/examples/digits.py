"""Train a small network on scikit-learn's handwritten digits, on one process or many.

::

    python examples/digits.py                          # one process
    phalanx run -n 2 examples/digits.py                # two processes: the same test accuracy
    phalanx run -n 2 -m phalanx.examples.digits --epochs 40 --json result.json

The 1797 8x8 digit images ship with scikit-learn, so nothing is downloaded.
Every step trains on one *global* batch of ``--batch-size`` images, drawn in
the same order whatever the number of processes; each process takes an equal
share of it, and ``DistributedOptimizer`` averages the gradients, so every step
applies the gradient of the whole global batch, exactly as one process would.
The test accuracy is the same on 1, 2 or 3 processes.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader

import phalanx
import phalanx.torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train an MLP on scikit-learn's digits, data-parallel.")
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


def load_data(seed: int) -> tuple[torch.Tensor, ...]:
    """Pixels scaled to [0, 1] (float64); a fixed split: 1/5 of the images for testing."""
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0)
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, train = order[:len(x) // 5], order[len(x) // 5:]
    return x[train], y[train], x[test], y[test]


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x_train: torch.Tensor, y_train: torch.Tensor,
          args: argparse.Namespace) -> tuple[float, float]:
    """``args.epochs`` passes of global batches; returns the last epoch's mean loss and the seconds taken."""
    rank, size = phalanx.rank(), phalanx.size()
    local_batch = args.batch_size // size
    steps = len(x_train) // args.batch_size  # full global batches per epoch (a partial last one is skipped)
    start = time.perf_counter()
    mean_loss = float("nan")
    for epoch in range(1, args.epochs + 1):
        # The same order on every process (and at every world size): a seeded permutation per epoch.
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(args.seed + epoch))
        total_loss = 0.0
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]  # the global batch
            mine = batch[rank * local_batch:(rank + 1) * local_batch]  # this process's share of it
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[mine]), y_train[mine])
            loss.backward()  # the gradients are averaged over the processes while backward runs
            optimizer.step()
            total_loss += loss.item()
        mean_loss = phalanx.allreduce(total_loss / steps, op="avg")  # over the global batches
        if rank == 0:
            print(f"epoch {epoch:3d}/{args.epochs}  train loss {mean_loss:.4f}  "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    return mean_loss, time.perf_counter() - start


def count_correct(model: torch.nn.Module, x_test: torch.Tensor, y_test: torch.Tensor) -> tuple[int, int]:
    """``(correct, total)`` over all test images: each is scored on exactly one process, the counts summed."""
    test_part = phalanx.DistributedDataContainer((x_test, y_test), remainder="exact")
    correct = 0
    with torch.no_grad():
        # any indexable sequence works as a map-style dataset; torch's annotation names its Dataset class
        for x, y in DataLoader(test_part, batch_size=256):  # type: ignore[arg-type]
            correct += int((model(x).argmax(dim=1) == y).sum())
    correct, total = phalanx.allreduce(np.array([correct, len(test_part)])).tolist()
    return correct, total


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    phalanx.init()  # mpi / gloo as launched by `phalanx run`; with plain `python`, a world of one
    size = phalanx.size()
    if args.batch_size % size:
        raise SystemExit(f"digits.py: --batch-size {args.batch_size} does not split evenly over {size} "
                         f"processes; use a multiple of {size}, e.g. {size * max(1, args.batch_size // size)}.")
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and results never depend on the cores

    x_train, y_train, x_test, y_test = load_data(args.seed)
    torch.manual_seed(args.seed)  # the same initial weights everywhere (the optimizer also sends rank 0's)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    ).double()  # float64: rounding differences between world sizes stay far below the printed digits
    optimizer = phalanx.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))

    if len(x_train) < args.batch_size:
        raise SystemExit(f"digits.py: --batch-size {args.batch_size} is more than the {len(x_train)} images")
    if phalanx.rank() == 0:
        print(f"{len(x_train)} training images, {len(x_test)} test images; global batch {args.batch_size}"
              f" = {size} x {args.batch_size // size}, {len(x_train) // args.batch_size} steps per epoch",
              flush=True)
    mean_loss, seconds = train(model, optimizer, x_train, y_train, args)
    correct, total = count_correct(model, x_test, y_test)
    accuracy = correct / total
    if phalanx.rank() == 0:
        print(f"test accuracy {accuracy:.4f} ({correct} of {total} correct)", flush=True)
        if args.json:
            result = {"accuracy": accuracy, "correct": correct, "total": total, "ranks": size,
                      "backend": phalanx.backend().name, "batch_size": args.batch_size, "epochs": args.epochs,
                      "train_loss": mean_loss, "seconds": round(seconds, 2)}
            with open(args.json, "w") as f:
                json.dump(result, f)
    phalanx.shutdown()


if __name__ == "__main__":
    main()
