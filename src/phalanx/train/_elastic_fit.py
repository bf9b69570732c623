"""``fit(elastic=True)``: a run that goes on through lost ranks, re-formed in place (:mod:`phalanx._epochs`).

What happens on every rank when a peer is lost (dies, stalls past the timeout,
is cut off) during a step:

1. the pending collective raises (within a quarter second of the launcher
   noticing: :meth:`TorchBackend._wait_interruptible`), and :func:`recover` runs;
2. the gradient engine is rebound to nothing and the step's gradients dropped:
   no rank applied the interrupted step, since an update needs every rank's
   reduced gradients (a rank that completed the step's last collective before
   the loss did apply it: then it holds the newer state, see 4);
3. :func:`phalanx.reform` forms the next epoch with the survivors (and the
   replacements waiting) and rebinds what follows the world
   (:mod:`phalanx._reconfigure`), the DistributedOptimizer among them
   (:meth:`~phalanx.torch.DistributedOptimizer.rebind`: a new engine over the
   same parameters); then :func:`rebind` makes everything of the run sized by
   the world (the per-rank share of ``global_batch_size``, the sampler's
   offset, the policy) again. A sharded optimizer does not follow: it is
   released before ``reform()`` and wrapped again after (its slices belong to
   the old world's split), and :func:`reload` brings its state back;
4. :func:`resync`: the ranks agree which of them has applied the most steps
   (they differ by at most one: a step completes everywhere or nowhere, except
   for a loss after its last collective). When all have applied as many (the
   usual case: replicas in lockstep hold the same state) nothing moves; else
   the lowest rank with the most sends its whole state (model, optimizer, scheduler, scaler, position, RNG, metrics) to
   every rank (:mod:`._state_transfer`: its structure as bytes loaded with
   ``torch.load(weights_only=True)``, so nothing a peer sends is unpickled
   beyond tensors and plain values; its tensors in buffers received in place).

So the step that was interrupted is done again by the new world on the same
global batch, and the run ends with the parameters of an uninterrupted one.
A replacement runs the same script from the start; its ``fit`` skips
``resume=`` and the initial broadcast, and takes part in :func:`resync` from
the survivors' next step boundary (the launcher's ``grow`` flag, agreed in the
step's own exchange: ``_run.Run._step``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sized
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from .. import _epochs, _reform
from .._collectives import allgather
from .._epochs import Epoch
from .._errors import InvalidArgumentError, UsageError
from ._history import History
from ._options import FitOptions
from ._policy import FailurePolicy
from ._progress import RunState
from ._state_transfer import broadcast_state

if TYPE_CHECKING:
    from ..torch._bucket import GradientBuckets
    from ..torch._optimizer import DistributedOptimizer

__all__ = ["ElasticRun", "GrowRequested", "check", "rebind", "recover", "resync", "train"]


class ElasticRun(RunState, Protocol):
    """What fit's recovery reads and makes again of a run (``_run.Run`` is one)."""

    size: int
    k: int  # in-process replicas per rank
    grow_now: bool  # the ranks agreed to admit a replacement before the next step
    train_data: Sized
    window: np.ndarray
    policy: FailurePolicy
    step_opt: torch.optim.Optimizer  # the optimizer fit steps: a DistributedOptimizer in a world with epochs
    dist_opt: DistributedOptimizer | None  # the DistributedOptimizer fit made, if it made one
    engine: GradientBuckets | None

    def wrap(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``step_opt`` (and ``dist_opt``) a new DistributedOptimizer over ``optimizer``."""
        ...

    def _train(self, total: int) -> None: ...

    def _checkpoint(self) -> None: ...


class GrowRequested(Exception):
    """Internal: the ranks agreed to admit a waiting replacement at this step boundary."""


def check(o: FitOptions) -> None:
    """Refuse what ``elastic=True`` cannot do yet (InvalidArgumentError naming the fix; nothing has run)."""
    if not o.elastic:
        return
    why = None
    if o.global_batch_size is None:
        why = ("give global_batch_size instead of batch_size: the steps stay the same when the world changes "
               "only when every step trains on the same global batch")
    elif o.replicas is not None:
        why = "in-process replicas do not re-form; use one process per device"
    elif o.shard == "parameters":
        why = ("shard='parameters': the sharded parameters cannot be re-split in place yet; use shard='gradients' "
               "(or 'optimizer'), or restart whole from sharded checkpoints (--max-restarts without elastic=True)")
    elif o.shard is not None and o.checkpoint_dir is None:
        why = (f"shard={o.shard!r} needs checkpoint_dir: a lost rank's optimizer shard exists nowhere else, so "
               "the survivors reload the last checkpoint in process (give checkpoint_every for how far back)")
    elif o.compression == "powersgd" or (o.compression is not None and not isinstance(o.compression, str)):
        why = "PowerSGD's error feedback is per rank and cannot be re-split; use compression=None/'bf16'/'fp16'"
    if why is not None:
        raise InvalidArgumentError(f"phalanx.train.fit(elastic=True): {why}.")


def start(run: ElasticRun) -> None:
    """At the start of an elastic run, on every rank of the world, a replacement's too (collective);
    a peer lost meanwhile is recovered from as in the loop."""
    _check_sizes(run)
    try:
        if run.o.shard is None:
            resync(run)
        else:
            reload(run)
    except Exception as exc:
        if not _epochs.recoverable(exc):
            raise
        _recover_until_done(run, exc)


def _check_sizes(run: ElasticRun) -> None:
    """Every world the job may shrink to (down to ``--min-ranks``) must split ``global_batch_size``:
    refused now, on every rank alike, rather than when a rank is lost."""
    from ._options import worker_batch

    floor = int(os.environ.get("PHALANX_MIN_RANKS", "1") or 1)
    for size in range(max(1, floor), run.size):
        try:
            worker_batch(run.o, size, run.k)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(
                f"phalanx.train.fit(elastic=True): this job of {run.size} ranks may shrink to {size} while it runs "
                f"(--min-ranks {floor}), and {str(exc).split(': ', 1)[1]} Or raise --min-ranks.") from None


def reload(run: ElasticRun) -> None:
    """Sharded: every rank takes the newest checkpoint written at a step no later than the newest rank's
    (collective). None yet (a fresh start): rank 0's model, then a checkpoint of it, to come back to."""
    from .._collectives import allreduce
    from .._sync import synchronize
    from ._resume import resume

    newest = int(allreduce(np.array([run.progress.global_step], np.int64), op="max")[0])
    if resume(run, until=newest):
        return
    with torch.no_grad():
        synchronize(run.model, root=0)
    run.progress.saved_at = -1
    run._checkpoint()


def resync(run: ElasticRun) -> dict[str, Any]:
    """Every rank ends with the state of the rank that has applied the most steps (collective); returns
    ``{"bytes", "seconds", "root"}``: the state's size and how long this rank took to hold it."""
    started = time.monotonic()
    joined = _epochs.joined_late()
    done = allgather(np.array([-1 if joined else run.progress.global_step], np.int64))
    root = int(np.argmax(done))
    if done[root] < 0:  # pragma: no cover - the launcher admits replacements only beside survivors
        raise InvalidArgumentError("phalanx.train.fit(elastic=True): no rank of the new world holds a state.")
    if run.size == 1 or (done == done[root]).all():  # replicas in lockstep hold the same state: nothing to send
        return {"bytes": 0, "seconds": time.monotonic() - started, "root": root}
    state, size = broadcast_state(_state(run) if run.rank == root else None, root, run.rank)
    if run.rank != root:
        _load(run, state)
    if joined:
        run.history.recoveries.append({"epoch": _epochs.epoch(), "size": run.size, "lost": 0, "joined": 1,
                                       "step": run.progress.global_step, "seconds": time.monotonic() - started,
                                       "cause": "joined a running job", "received_bytes": size})
    return {"bytes": size, "seconds": time.monotonic() - started, "root": root}


def _state(run: ElasticRun) -> dict[str, Any]:
    from ._rng import local_rng

    state = {
        "model": run.model.state_dict(),
        "optimizer": run.inner.state_dict(),
        "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
        "scaler": run.scaler.state_dict() if run.scaler is not None else None,
        "position": run.progress.position(),
        "validated_at": run.progress.validated_at,
        "saved_at": run.progress.saved_at,
        "skipped": run.policy.skipped,
        "skipped_in_a_row": run.policy.skipped_in_a_row,
        "samples_done": run.samples_done,
        "window": torch.from_numpy(run.window.copy()),
        "history": run.history.to_json(),
        "rng": local_rng(),
    }
    return state


def _load(run: ElasticRun, state: dict[str, Any]) -> None:
    from ._rng import restore_rng

    run.model.load_state_dict(state["model"])
    run.inner.load_state_dict(state["optimizer"])
    if run.scheduler is not None and state["scheduler"] is not None:
        run.scheduler.load_state_dict(state["scheduler"])
    if run.scaler is not None and state["scaler"] is not None:
        run.scaler.load_state_dict(state["scaler"])
    run.progress.restore(state["position"], validated_at=int(state["validated_at"]))
    run.progress.saved_at = int(state["saved_at"])  # as on the sender: a checkpoint is due alike everywhere
    run.policy.skipped = int(state["skipped"])
    run.policy.skipped_in_a_row = int(state["skipped_in_a_row"])
    run.samples_done = int(state["samples_done"])
    run.window = state["window"].numpy().copy()
    run.history.records = History.from_json(state["history"]).records
    restore_rng(state["rng"], "a live peer's RNG state")


def recover(run: ElasticRun, exc: BaseException) -> None:
    """After a lost peer (``exc``) or to admit a replacement: re-form, rebind, resync (module notes)."""
    started = time.monotonic()
    run.grow_now = False
    run.step_opt.zero_grad(set_to_none=True)
    why = "admitting a replacement" if isinstance(exc, GrowRequested) else _epochs.describe_loss(exc)
    sharded = run.o.shard is not None
    released = _optimizer(run).release() if sharded else None  # its slices' state belongs to the old split
    epoch = _reform.reform(why)  # rebinds what follows the world: an unsharded DistributedOptimizer too
    rebind(run, epoch, released)
    if sharded:
        reload(run)
    else:
        resync(run)
    run.history.recoveries.append({"epoch": epoch.number, "size": epoch.size, "lost": len(epoch.lost),
                           "joined": len(epoch.joined), "step": run.progress.global_step,
                           "seconds": time.monotonic() - started, "cause": why})


def _optimizer(run: ElasticRun) -> DistributedOptimizer:
    """The DistributedOptimizer ``run`` steps; UsageError when it steps another (nothing then follows
    a re-formed world)."""
    from ..torch import DistributedOptimizer

    opt = run.step_opt
    if not isinstance(opt, DistributedOptimizer):
        raise UsageError(
            f"phalanx.train.fit(elastic=True): the run steps a {type(opt).__name__}, which cannot follow a "
            "re-formed world; pass the plain model and optimizer, and fit wraps them in a DistributedOptimizer.")
    return opt


def rebind(run: ElasticRun, epoch: Epoch, released: torch.optim.Optimizer | None = None) -> None:
    """Everything of ``run`` that depends on the world, made again for ``epoch``'s, the current one
    (collective). ``released``: the optimizer a sharded DistributedOptimizer gave back before
    ``reform()``, wrapped again here (the recovery contract's path for what cannot follow in place);
    else ``reform()`` has rebound the DistributedOptimizer, and its ``rebind`` here, through the same
    contract, does nothing (or names why it cannot follow)."""
    from .. import _world
    from ._options import worker_batch
    from ._progress import Geometry

    o = run.o
    run.rank, run.size = _world.rank(), _world.size()
    old = run.policy
    run.policy = FailurePolicy(on_nonfinite=o.on_nonfinite, on_oom=o.on_oom, max_skipped=o.max_skipped,
                               rank=run.rank, size=run.size)
    run.policy.skipped, run.policy.skipped_in_a_row = old.skipped, old.skipped_in_a_row
    run.loggers = list(o.loggers) if run.rank == 0 else []
    run.geometry = Geometry.of(len(run.train_data), batch_size=worker_batch(o, run.size, run.k), ranks=run.size,
                               replicas=run.k, accumulate=o.accumulate)
    if released is not None:
        run.wrap(released)
    else:
        _optimizer(run).rebind(epoch)
    engine = _optimizer(run).engine
    engine.check_finite = True
    run.engine = engine


def train(run: ElasticRun, total: int) -> None:
    """``run``'s step loop, re-formed in place after each lost peer or admitted replacement until it ends;
    anything else is raised as it is."""
    while True:
        try:
            run._train(total)
            return
        except Exception as exc:
            if not (isinstance(exc, GrowRequested) or _epochs.recoverable(exc)):
                raise
            _recover_until_done(run, exc)


def _recover_until_done(run: ElasticRun, exc: BaseException) -> None:
    """:func:`recover` from ``exc``, again while a peer is lost during it."""
    pending: BaseException | None = exc
    while pending is not None:
        try:
            recover(run, pending)
            pending = None
        except Exception as again:
            if not _epochs.recoverable(again):
                raise
            pending = again
