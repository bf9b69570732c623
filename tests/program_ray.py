"""Training functions for tests/test_ray.py, run by Ray Train's ``TorchTrainer`` on each worker.

Ray makes the torch process group (gloo, ``MASTER_ADDR``/``RANK``/... set by Ray) before
``train_fn`` runs; phalanx adopts it. Each function writes ``<out>/<name>-<rank>.json``:

* ``train``: ``phalanx.rank()``/``size()``/``local_rank()`` against ``ray.train.get_context()``
  (and what ``phalanx info`` would call the environment);
  a ``phalanx.torch.DistributedOptimizer`` loop and ``phalanx.train.fit`` (4 of 8 steps,
  checkpointed and reported with ``ray.train.report(checkpoint=...)``), both measured against
  one process on the global batch (``program_hosts_equal``); then the same loop written
  against ``phalanx.horovod.torch`` as a Horovod script is.
* ``resume_then_wrap_twice``: restores ``fit`` from Ray's checkpoint (``ray.train.get_checkpoint()``)
  for the remaining 4 steps (equal to 8 uninterrupted steps of one process), then wraps a
  ``ray.train.torch.prepare_model`` (DDP) model's optimizer in ``DistributedOptimizer``, which
  raises: the run fails with phalanx's error.

``ddp_refused`` is a ``run_world`` body (a plain gloo world, no Ray): the same refusal for every
phalanx wrapper.
"""

from __future__ import annotations

import json
import os
from typing import Any

import program_hosts_equal as phe
import worlds_fit as wf

HALF = 4  # fit trains 4 steps, is checkpointed, and is resumed for the other 4


def _write(out: str, name: str, rank: int, data: dict[str, Any]) -> None:
    with open(os.path.join(out, f"{name}-{rank}.json"), "w") as f:
        json.dump(data, f)


def _fit(torch: Any, steps: int, checkpoint_dir: str, resume: str | None = None) -> Any:
    import phalanx
    import phalanx.train

    model = wf.model(torch, 0 if phalanx.rank() == 0 else 100 + phalanx.rank())
    phalanx.train.fit(model, torch.nn.functional.cross_entropy, wf.adam(torch, model), wf.data(torch),
                      global_batch_size=wf.GLOBAL, steps=steps, progress=False, plot=False,
                      checkpoint_dir=checkpoint_dir, checkpoint_every=HALF, resume=resume)
    return model


def _horovod(torch: Any) -> float:
    """A Horovod-style script: hvd.init, broadcast, hvd.DistributedOptimizer, each rank its shard."""
    import phalanx.horovod.torch as hvd
    from phalanx.train._batches import epoch_order

    hvd.init()
    model = wf.model(torch, hvd.rank())  # different on every rank until the broadcast
    opt = hvd.DistributedOptimizer(wf.sgd(torch, model), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    ds = wf.data(torch)
    x, y = ds.tensors
    per_rank, per_epoch = wf.GLOBAL // hvd.size(), len(ds) // wf.GLOBAL
    for step in range(phe.STEPS):
        epoch, s = divmod(step, per_epoch)
        batch = epoch_order(len(ds), epoch, 0, True)[s * wf.GLOBAL:(s + 1) * wf.GLOBAL]
        mine = batch[hvd.rank() * per_rank:(hvd.rank() + 1) * per_rank]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
    hvd.shutdown()
    return phe.max_difference(model, wf.reference(torch, wf.model(torch, 0), wf.sgd, ds, steps=phe.STEPS))


def train(config: dict[str, Any]) -> None:
    """Ray Train's train_fn: see the module docstring."""
    import ray.train

    import phalanx
    from phalanx.launch._environment import describe_environment

    torch = wf._torch()
    ctx = ray.train.get_context()
    phalanx.init()
    rank = phalanx.rank()
    result: dict[str, Any] = {
        "phalanx": [rank, phalanx.size(), phalanx.local_rank(), phalanx.backend().name],
        "ray": [ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank()],
        "environment": describe_environment(),
        "optimizer": phe.with_optimizer(torch)}
    directory = os.path.join(config["out"], "fit-checkpoints")
    _fit(torch, HALF, directory)
    checkpoint = ray.train.Checkpoint.from_directory(directory) if rank == 0 else None
    ray.train.report({"step": HALF}, checkpoint=checkpoint)  # rank 0's checkpoint: the others have the same
    phalanx.shutdown()
    result["horovod"] = _horovod(torch)
    _write(config["out"], "train", rank, result)


def resume_then_wrap_twice(config: dict[str, Any]) -> None:
    """Ray Train's train_fn for the second run: see the module docstring."""
    import ray.train
    import ray.train.torch

    import phalanx
    import phalanx.torch

    torch = wf._torch()
    phalanx.init()
    rank = phalanx.rank()
    checkpoint = ray.train.get_checkpoint()
    with checkpoint.as_directory() as restored:
        files = sorted(f for f in os.listdir(restored) if f.startswith("checkpoint-"))
        model = _fit(torch, phe.STEPS, os.path.join(config["out"], "fit-resumed"),
                     resume=os.path.join(restored, files[-1]))
    reference = wf.reference(torch, wf.model(torch, 0), wf.adam, wf.data(torch), steps=phe.STEPS)
    _write(config["out"], "resume", rank, {"files": files, "fit": phe.max_difference(model, reference)})
    ddp = ray.train.torch.prepare_model(wf.model(torch, 0))
    phalanx.torch.DistributedOptimizer(wf.sgd(torch, ddp))  # raises: DDP already averages the gradients


def ddp_refused() -> dict[str, Any]:
    """A ``run_world`` body (no Ray): each phalanx wrapper over a torch DDP model's parameters raises
    UsageError; once the DDP model is gone, the same parameters are accepted. Returns what each did
    and how long the check took."""
    import gc
    import time

    import phalanx
    import phalanx.horovod.torch as hvd
    import phalanx.torch
    from phalanx.torch._ddp import refuse_ddp

    torch = wf._torch()
    model = wf.model(torch, 0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    found: dict[str, Any] = {}
    wrappers = {"DistributedOptimizer": lambda: phalanx.torch.DistributedOptimizer(wf.sgd(torch, model)),
                "DataParallel": lambda: phalanx.torch.DataParallel(model),
                "hvd.DistributedOptimizer": lambda: hvd.DistributedOptimizer(
                    wf.sgd(torch, model), named_parameters=model.named_parameters())}
    for name, make in wrappers.items():
        try:
            make()
            found[name] = "accepted"
        except phalanx.UsageError as exc:
            found[name] = str(exc)
    start = time.perf_counter()
    for _ in range(5):
        try:
            refuse_ddp("check", list(model.parameters()))
        except phalanx.UsageError:
            pass
    found["check_s"] = (time.perf_counter() - start) / 5
    del ddp
    gc.collect()
    opt = phalanx.torch.DistributedOptimizer(wf.sgd(torch, model))  # no DDP any more: accepted
    found["after"] = type(opt).__name__
    return found
