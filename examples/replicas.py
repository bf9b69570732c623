"""Train a small MLP on scikit-learn's digits with in-process replicas (one thread per replica).

    python examples/replicas.py                     # 2 replicas in one process
    phalanx run -n 2 examples/replicas.py           # 2 processes x 2 replicas: 4 replicas in all

Each step splits the batch among the replicas, runs their forward and backward
passes in parallel (withdevices), averages their gradients (over the processes
too), steps replica 0 (the model itself) and copies its weights into the others.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import phalanx
import phalanx.torch


def main() -> None:
    parser = argparse.ArgumentParser(description="MLP on digits with phalanx.torch.replicate")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--replicas", type=int, default=2, help="replicas per process (GPUs, or CPU copies)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per replica and step")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    phalanx.init()
    torch.set_num_threads(1)  # one core per replica thread
    X, Y = load_digits(return_X_y=True)
    X, Y = torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(Y)
    order = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    part = phalanx.DistributedDataContainer(train, remainder="drop")  # this process's part of the data
    mine = train[list(part.indices)]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    replicas = phalanx.torch.replicate(model, args.replicas)  # replicas[0] is model
    phalanx.synchronize(model)                                 # rank 0's weights in every process
    replicas.synchronize()                                     # ... and in every replica
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def forward_backward(i: int, device: torch.device) -> float:
        x, y = chunks[i]
        loss = F.cross_entropy(replicas[i](x), y)
        loss.backward()
        return loss.item()

    step_size = args.batch_size * replicas.count
    for epoch in range(args.epochs):
        shuffled = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(epoch))]
        losses: list[float] = []
        for start in range(0, len(shuffled) - step_size + 1, step_size):  # full steps only
            batch = shuffled[start:start + step_size]
            replicas.zero_grad()
            chunks = replicas.scatter((X[batch], Y[batch]))      # chunk i on replica i's device
            losses += phalanx.torch.withdevices(forward_backward, replicas)
            replicas.allreduce_gradients()                       # mean over all replicas
            opt.step()
            replicas.synchronize()
        mean_loss = phalanx.allreduce(sum(losses) / len(losses), op="avg")
        if phalanx.rank() == 0:
            print(f"epoch {epoch + 1}: loss {mean_loss:.4f}")

    with torch.no_grad():
        device = replicas.devices[0]
        predicted = model(X[test].to(device)).argmax(dim=1).cpu()
    accuracy = (predicted == Y[test]).float().mean().item()
    if phalanx.rank() == 0:
        print(f"test accuracy {accuracy:.3f} ({replicas} in each of {phalanx.size()} process(es))")


if __name__ == "__main__":
    main()
