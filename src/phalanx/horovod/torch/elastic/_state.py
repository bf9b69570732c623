"""``hvd.elastic.TorchState`` (and Horovod's ``State``/``ObjectState``): training state that is
committed to disk and restored by a restarted job.

``commit()`` keeps a copy in memory (``restore()`` goes back to it, as in
Horovod) and writes every tracked object to one checkpoint file through
:func:`phalanx.train.save_checkpoint` (rank 0 writes, atomically, with a
SHA-256 footer; collective). :func:`load_commit` reads it back in a
restarted job.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

import phalanx

from .._functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ._sampler import ElasticSampler

__all__ = ["ObjectState", "State", "TorchState", "commit_path"]

_KEY = "horovod_elastic"


def commit_path(index: int) -> str:
    """The file of the ``index``-th TorchState of this script: ``$PHALANX_ELASTIC_DIR/state[-k].pt``
    (default directory ``./.phalanx-elastic/<script name>``)."""
    directory = os.environ.get("PHALANX_ELASTIC_DIR")
    if not directory:
        script = os.path.splitext(os.path.basename(sys.argv[0] or "python"))[0] or "python"
        directory = os.path.join(os.getcwd(), ".phalanx-elastic", script)
    return os.path.join(directory, "state.pt" if index == 0 else f"state-{index}.pt")


class State:
    """Horovod's base of elastic state: ``commit()`` = ``save()`` + ``check_host_updates()``."""

    def __init__(self, bcast_object: Callable[..., Any] = broadcast_object,
                 get_rank: Callable[[], int] = phalanx.rank) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Functions to call when a restarted job resumes (e.g. to rescale the learning rate by size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Call the reset callbacks (``hvd.elastic.run`` does, in a restarted job, before ``sync()``)."""
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: Any, update_res: Any = None) -> None:
        """Horovod's host notification; phalanx changes hosts only by restarting the job, so nothing."""

    def commit(self) -> None:
        """Save the state (collective: every rank calls it), then check for host updates."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank when a replacement waits to join a job that resets
        in place (rank 0 asks the launcher, and tells the others: collective); else nothing."""
        from .... import _epochs

        if not _epochs.available() or phalanx.size() < 1 or _epochs.membership() is None:
            return
        waiting = _epochs.grow_requested() if phalanx.rank() == 0 else False
        if phalanx.size() > 1:
            waiting = bool(self._bcast_object(waiting))
        if waiting:
            from ..._errors import HostsUpdatedInterrupt

            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Save the state (in memory, and for :class:`TorchState` to disk)."""
        raise NotImplementedError("State.save is abstract: use TorchState or ObjectState")

    def restore(self) -> None:
        """Go back to the last saved state."""
        raise NotImplementedError("State.restore is abstract: use TorchState or ObjectState")

    def sync(self) -> None:
        """Make every rank hold rank 0's state."""
        raise NotImplementedError("State.sync is abstract: use TorchState or ObjectState")


class ObjectState(State):
    """Plain Python attributes (``ObjectState(epoch=0, batch=0)`` gives ``state.epoch``, ``state.batch``)."""

    def __init__(self, bcast_object: Callable[..., Any] = broadcast_object,
                 get_rank: Callable[[], int] = phalanx.rank, **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        """Remember the attributes' current values."""
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        """Set the attributes back to their saved values."""
        self._set_attrs()

    def sync(self) -> None:
        """Every rank takes rank 0's saved values (collective)."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


class _Handler:
    """Saves, restores and syncs one tracked object through its ``state_dict()``."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0))


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


_HANDLERS: list[tuple[type, type[_Handler]]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (torch.optim.lr_scheduler.LRScheduler, _Handler),
    (ElasticSampler, _Handler),
]
_COUNT = [0]  # TorchStates made in this process: each commits to its own file


class TorchState(ObjectState):
    """The state of a PyTorch training run: models, optimizers, LR schedulers, ``ElasticSampler``s and
    plain attributes, committed to disk and restored by a restarted job.

    Arguments:
        model, optimizer: optional; tracked through their ``state_dict()``.
        kwargs: more tracked objects (modules, optimizers, schedulers, samplers) or plain values
            (``epoch=0``), all exposed as attributes (``state.epoch``). Plain values must be what a
            checkpoint holds: numbers, strings, tensors and plain containers.

    ``commit()`` is collective; it raises CheckpointError on every rank when rank 0 could not write.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        self._handlers: dict[str, _Handler] = {}
        plain = {}
        for name, value in kwargs.items():
            kind = next((h for t, h in _HANDLERS if isinstance(value, t)), None)
            if kind is None:
                plain[name] = value
            else:
                self._handlers[name] = kind(value)
        for name, handler in self._handlers.items():
            object.__setattr__(self, name, handler.value)
        self._path = commit_path(_COUNT[0])
        _COUNT[0] += 1
        super().__init__(bcast_object=broadcast_object, get_rank=phalanx.rank, **plain)

    def save(self) -> None:
        """Copy every tracked object's state in memory and write them all to the commit file."""
        for handler in self._handlers.values():
            handler.save()
        super().save()
        from phalanx.train import save_checkpoint

        save_checkpoint(self._path, self._checkpoint())

    def restore(self) -> None:
        """Set every tracked object back to the last commit (in memory)."""
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        """Every rank takes rank 0's state (collective)."""
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].value = value
            handlers[name].save()
        super().__setattr__(name, value)

    @property
    def commit_file(self) -> str:
        """The file ``commit()`` writes and a restarted job reads."""
        return self._path

    def _checkpoint(self) -> dict[str, Any]:
        from phalanx.train._state import FORMAT, VERSION

        saved = {"handlers": {k: h.saved for k, h in self._handlers.items()}, "objects": self._saved_state}
        return {"format": FORMAT, "version": VERSION, "model": {}, "optimizer": None, "scheduler": None,
                "scaler": None, "progress": {}, "rng": None, "world_size": phalanx.size(),
                "extra": {_KEY: saved}}

    def load_commit(self) -> bool:
        """Load the last commit from disk, if rank 0 sees one, and restore it; collective. Returns
        whether one was loaded."""
        from phalanx.train import load_checkpoint

        exists = os.path.exists(self._path) if phalanx.rank() == 0 else None
        if phalanx.size() > 1:
            exists = broadcast_object(exists, 0)
        if not exists:
            return False
        saved = load_checkpoint(self._path)["extra"][_KEY]
        for name, handler in self._handlers.items():
            if name in saved["handlers"]:
                handler.saved = saved["handlers"][name]
        self._saved_state = {**self._saved_state, **saved["objects"]}
        self.restore()
        return True
