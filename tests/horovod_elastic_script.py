"""A Horovod elastic training script (phalanx.horovod.torch) for tests/test_horovod_elastic.py.

Usage: ``phalanx run -n 2 [--max-restarts 1] horovod_elastic_script.py OUT_DIR FAIL`` with FAIL
``1`` (attempt 0 raises in epoch 1, after the commit at batch 2), ``kill`` (the last rank of a world
of ``$SIZE`` ranks, default 3, SIGKILLs itself there: ``horovodrun --gloo -np 3 --min-np 2`` resets
in place) or ``0``; rank 0 writes the final parameters to ``OUT_DIR/result.pt``, every rank appends
the samples it trained on to ``OUT_DIR/samples-rank<r>`` and, when done, writes ``OUT_DIR/done-<pid>``
(its rank, size and epoch).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import phalanx
import phalanx.horovod.torch as hvd

EPOCHS, BATCH, SAMPLES = 2, 4, 40


def main(out: str, fail: str) -> None:
    hvd.init()
    attempt = int(os.environ.get("PHALANX_RESTART_COUNT", "0"))
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(SAMPLES, 5, generator=g), torch.randn(SAMPLES, 1, generator=g)
    torch.manual_seed(hvd.rank() + 100 * attempt)  # ranks start apart: the elastic sync makes them agree
    model = torch.nn.Linear(5, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < EPOCHS:
            indices = list(iter(state.sampler))
            for start in range(0, len(indices), BATCH):
                idx = torch.tensor(indices[start:start + BATCH])
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(xs[idx]), ys[idx]).backward()
                opt.step()
                with open(os.path.join(out, f"samples-rank{hvd.rank()}"), "a") as f:
                    f.write(f"{attempt} {state.epoch} {' '.join(map(str, idx.tolist()))}\n")
                state.sampler.record_batch(start // BATCH, len(idx))
                state.batch += 1
                if state.batch % 2 == 0:
                    state.commit()
                if fail == "1" and attempt == 0 and state.epoch == 1 and state.batch == 3:
                    raise RuntimeError(f"injected failure on rank {hvd.rank()} in epoch 1, batch 3")
                if (fail == "kill" and hvd.rank() == hvd.size() - 1 and hvd.size() == SIZE and state.epoch == 1
                        and state.batch == 3 and not os.environ.get("PHALANX_JOINING")):
                    with open(os.path.join(out, "killed"), "w") as f:
                        f.write(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)  # in place: the others restore the commit and go on
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        torch.save({"params": [p.detach() for p in model.parameters()], "attempt": attempt},
                   os.path.join(out, "result.pt"))
    with open(os.path.join(out, f"done-{os.getpid()}"), "w") as f:
        f.write(f"{hvd.rank()} {hvd.size()} {phalanx.epoch()}\n")


if __name__ == "__main__":
    SIZE = int(os.environ.get("SIZE", "3"))
    main(sys.argv[1], sys.argv[2])
