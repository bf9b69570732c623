"""The script of tests/test_hosts_equivalence.py: ``python program_hosts_equal.py DIR`` on every rank.

Two trainings on the same global batch of 12 samples, float64, each compared
with the one-process run of ``worlds_fit.reference``:

* ``fit(global_batch_size=12)`` with Adam; every rank starts from another
  model, so only fit's broadcast makes them agree;
* a hand-written loop with ``phalanx.torch.DistributedOptimizer`` (SGD with
  momentum): rank r of N takes its 12/N samples of each global batch and the
  optimizer averages the gradients.

Each rank writes ``DIR/rank-<r>.json``: its host name, the world size and the
largest absolute parameter difference of each training from the reference.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import phalanx
import phalanx.torch
import phalanx.train
import worlds_fit as wf

STEPS = 8  # over a 60-sample epoch of 5 global batches: the second epoch's order is used too


def max_difference(a: object, b: object) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def with_fit(torch: object) -> float:
    rank = phalanx.rank()
    model = wf.model(torch, 0 if rank == 0 else 100 + rank)
    phalanx.train.fit(model, torch.nn.functional.cross_entropy, wf.adam(torch, model), wf.data(torch),
                      global_batch_size=wf.GLOBAL, steps=STEPS, progress=False, plot=False)
    return max_difference(model, wf.reference(torch, wf.model(torch, 0), wf.adam, wf.data(torch), steps=STEPS))


def with_optimizer(torch: object) -> float:
    from phalanx.train._batches import epoch_order

    rank, size = phalanx.rank(), phalanx.size()
    model = wf.model(torch, 0)
    opt = phalanx.torch.DistributedOptimizer(wf.sgd(torch, model))
    ds = wf.data(torch)
    x, y = ds.tensors
    per_rank, per_epoch = wf.GLOBAL // size, len(ds) // wf.GLOBAL
    for step in range(STEPS):
        epoch, s = divmod(step, per_epoch)
        batch = epoch_order(len(ds), epoch, 0, True)[s * wf.GLOBAL:(s + 1) * wf.GLOBAL]
        mine = batch[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
    return max_difference(model, wf.reference(torch, wf.model(torch, 0), wf.sgd, ds, steps=STEPS))


def main(directory: str) -> None:
    phalanx.init()
    torch = wf._torch()
    result = {"host": socket.gethostname(), "size": phalanx.size(), "backend": phalanx.backend().name,
              "fit": with_fit(torch), "optimizer": with_optimizer(torch)}
    with open(os.path.join(directory, f"rank-{phalanx.rank()}.json"), "w") as f:
        json.dump(result, f)
    phalanx.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
