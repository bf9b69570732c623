"""A training script for tests/test_recovery.py: ``fit(elastic=True)`` on an MLP with Adam in float64.

Run alone (``python program_recovery.py``: a world of one, the uninterrupted reference) or under
``phalanx run`` (each setting below may also be given as ``PHALANX_TEST_<NAME>``, which ``--hosts``
forwards). ``KILLS`` (JSON ``[[step, rank, signal], ...]``) makes the process that is rank
``rank`` when it computes the loss of step ``step`` (with ``FULL``: of the first step from ``step`` on
at which the world has ``FULL`` ranks again; steps on fewer ranks then take 0.1 s more) send itself ``signal`` (9: SIGKILL, 19: SIGSTOP), once per entry (a mark file in ``MARKS`` says it happened, and when). Every process appends
``step time rank size epoch`` per loss to ``MARKS/steps-<pid>`` and writes ``MARKS/final-<pid>.pt``
(its final parameters) and ``MARKS/done-<pid>.json`` when ``fit`` returns (with ``followed``: at each
re-formation, what followed the world through the recovery contract, ``phalanx._reconfigure``).
"""

from __future__ import annotations

import json
import os
import time

import torch

import phalanx
from phalanx._reconfigure import registered
from phalanx._world import current_or_none
from phalanx.torch import DistributedOptimizer, DistributedSampler
from phalanx.train import fit

phalanx.init()
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(480, 16, generator=g), torch.randn(480, 4, generator=g)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
def setting(name: str, default: str | None = None) -> str | None:
    """``NAME``, else ``PHALANX_TEST_NAME`` (what ``phalanx run --hosts`` forwards to every host)."""
    return os.environ.get(name, os.environ.get(f"PHALANX_TEST_{name}", default))


KILLS = json.loads(setting("KILLS", "[]"))
FULL = int(setting("FULL", "0"))
MARKS = setting("MARKS")
assert MARKS, "MARKS (or PHALANX_TEST_MARKS) names the folder this program writes its marks to"
steps_log = open(os.path.join(MARKS, f"steps-{os.getpid()}"), "a")
sampler = DistributedSampler(X)  # made without rank=/size=: it follows each re-formed world
followed: list[dict[str, object]] = []


def note(epoch: phalanx._epochs.Epoch) -> None:
    """After each re-formation, registered after fit's optimizer: what followed the world, in registration
    order, and whether the sampler and each registered DistributedOptimizer are already the new world's."""
    followed.append({"epoch": epoch.number, "order": [type(o).__name__ for o in registered()],
                     "sampler": [sampler.rank, sampler.size] == [epoch.rank, epoch.size],
                     "optimizers": [o.engine.world is current_or_none() for o in registered()
                                    if isinstance(o, DistributedOptimizer)]})


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    phalanx.on_reform(note)  # (registered once) inside fit: after the DistributedOptimizer fit made
    done = next(iter(opt.state.values()), {}).get("step")  # any parameter's (or shard's, when sharded)
    step = int(done) if done is not None else 0
    steps_log.write(f"{step} {time.time()} {phalanx.rank()} {phalanx.size()} {phalanx.epoch()}\n")
    steps_log.flush()
    if FULL and phalanx.size() < FULL:
        time.sleep(0.1)  # short-handed steps are slow (a model's real step time): a replacement joins in time
    for at, rank, sig in KILLS:
        mark = os.path.join(MARKS, f"kill-{at}-{rank}")
        # at step `at`, or the first step after it at which the world is whole again (FULL ranks)
        due = step == at if not FULL else step >= at and phalanx.size() == FULL
        if due and phalanx.rank() == rank and not os.path.exists(mark):
            with open(mark, "w") as f:
                json.dump({"time": time.time(), "pid": os.getpid()}, f)
            os.kill(os.getpid(), sig)
    return torch.nn.functional.mse_loss(out, y)


SHARD = setting("SHARD") or None  # "gradients": reloads its last checkpoint (CKPT) in process
history = fit(model, loss_fn, opt, (X, Y), global_batch_size=24, steps=int(setting("STEPS", "300")),
              elastic=True, progress=False, log_every=50, shard=SHARD,  # type: ignore[arg-type]
              checkpoint_dir=setting("CKPT") or None, checkpoint_every=int(setting("CKPT_EVERY", "0")) or None)
torch.save(torch.cat([p.detach().flatten() for p in model.parameters()]), os.path.join(MARKS, f"final-{os.getpid()}.pt"))
with open(os.path.join(MARKS, f"done-{os.getpid()}.json"), "w") as f:
    json.dump({"rank": phalanx.rank(), "size": phalanx.size(), "epoch": phalanx.epoch(),
               "joined": os.environ.get("PHALANX_JOINING") == "1", "slot": int(os.environ.get("RANK", "0")),
               "restart_count": os.environ.get("PHALANX_RESTART_COUNT"), "recoveries": history.recoveries,
               "followed": followed}, f)
