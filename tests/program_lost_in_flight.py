"""A peer lost while a rank's own operation is in flight: polled, it raises RankFailedError, never the
transport's own error (under Open MPI 5's ULFM).

Each rank writes what it saw to ``MARKS/in-flight-<pid>.json``.

1. **A gradient bucket** (``DistributedOptimizer``). The model's last layer fills the first gradient
   bucket, the first layer the next. Every rank runs backward, except the last rank of epoch 0, which exits instead. So the first
   bucket's allreduce is in flight. Rank 1 then sleeps in backward (``Sleep``) while rank 0 waits,
   fails, re-forms and revokes the communicator. Rank 1's next gradient hook polls the bucket in flight,
   and that poll sees the failure. Then ``opt.zero_grad()`` (as ``fit`` does before re-forming) must not
   refuse the reduction left open: its world broke, so it can never complete.
2. **A handle** (``phalanx.iallreduce``, with ``PHALANX_CHECK=0``: no agreement first, the data moves at
   once). In epoch 1 the last rank exits instead of calling it. Rank 1 sleeps, then polls
   ``handle.test()``, while rank 0's ``wait()`` fails first.
3. **A group's collective** (``phalanx.new_group([0, 1])``). In epoch 2 the last rank is lost; rank 0
   waits in the group's allreduce on rank 1, which fails in a world allreduce and re-forms the world.
   Re-forming revokes the group's communicators too, so rank 0 stops waiting at once, not after the
   timeout (``group-seconds``).

After each, the survivors re-form and go on (2 ranks at the end). ``tests/test_recovery_mpi.py`` runs it
on 5 ranks with ``--min-ranks 2``.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback

import torch

import phalanx
import phalanx.torch

phalanx.init(elastic=True)
MARKS = os.environ["MARKS"]
seen: dict[str, object] = {}


class Sleep(torch.autograd.Function):
    """Identity; its backward sleeps 2 s on rank 1 (the slow rank), after the first bucket has gone out."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        if phalanx.rank() == 1:
            time.sleep(2.0)
        return g


def failure(what: str, call: object) -> None:
    """Run ``call()``; note which exception it raised (its type's module and name, its first line), then
    recover as ``fit(elastic=True)`` does: drop the gradients, re-form, rebind the optimizer."""
    try:
        call()
        seen[what] = "no error"
    except Exception as exc:  # noqa: BLE001 - the point: which kind of error reaches the user
        seen[what] = f"{type(exc).__module__}.{type(exc).__name__}: {str(exc).splitlines()[0]}"
        seen[what + "-trace"] = traceback.format_exc()[-1500:]
    try:
        opt.zero_grad(set_to_none=True)  # refused mid-flight on a healthy world, not on a broken one
        seen[what + "-zero_grad"] = "ok"
    except Exception as exc:  # noqa: BLE001
        seen[what + "-zero_grad"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    with open(os.path.join(MARKS, f"in-flight-{os.getpid()}.json"), "w") as f:
        json.dump(seen, f)  # so far, should re-forming not end
    phalanx.reform(f"after {what}")
    opt.rebind()


class SlowPad(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(Sleep.apply(h), (0, 512 - 16))


torch.manual_seed(0)
# the last layer's 1 MB of gradient fills the first bucket alone; the first layer's is the second bucket
model = torch.nn.Sequential(torch.nn.Linear(16, 16), SlowPad(), torch.nn.Linear(512, 512))
opt = phalanx.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
x = torch.randn(4, 16)


def backward() -> None:
    model(x).sum().backward()


def bucket_in_flight() -> None:
    phalanx.barrier()
    if phalanx.rank() == phalanx.size() - 1:
        time.sleep(0.5)  # after the others posted the first bucket
        os.kill(os.getpid(), signal.SIGKILL)
    backward()


def handle_in_flight() -> None:
    phalanx.barrier()
    if phalanx.rank() == phalanx.size() - 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    handle = phalanx.iallreduce(torch.ones(8))
    if phalanx.rank() == 1:
        time.sleep(2.0)
        while not handle.test():
            time.sleep(0.01)
    else:
        handle.wait()


def group_in_flight() -> None:
    group = phalanx.new_group([0, 1])
    phalanx.barrier()
    if phalanx.rank() == phalanx.size() - 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        if phalanx.rank() == 0:
            phalanx.allreduce(torch.ones(8), group=group)  # waits on rank 1, which never calls it
        else:
            time.sleep(1.0)
            phalanx.allreduce(torch.ones(8))  # fails: its peer is lost; rank 1 re-forms, revoking the group too
    finally:
        seen["group-seconds"] = time.monotonic() - start


failure("bucket", bucket_in_flight)
failure("handle", handle_in_flight)
failure("group", group_in_flight)
seen["end"] = [phalanx.epoch(), phalanx.size(), float(phalanx.allreduce(torch.ones(1), op="sum")[0])]
backward()  # the rebound optimizer reduces on the new world: every rank's gradient is the same mean
opt.step()
seen["same-after-step"] = bool(phalanx.allreduce(model[2].weight.detach().clone(), op="max").equal(model[2].weight))
with open(os.path.join(MARKS, f"in-flight-{os.getpid()}.json"), "w") as f:
    json.dump(seen, f)
