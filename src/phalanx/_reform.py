"""``phalanx.reform()``: the world re-formed in place with the survivors (the epochs: :mod:`._epochs`)."""

from __future__ import annotations

import atexit

import numpy as np

from . import _epochs, _reconfigure, _world
from ._epochs import Epoch, required
from ._errors import RankFailedError, RendezvousError

__all__ = ["reform", "reformed", "replacement_waiting"]


def replacement_waiting() -> bool:
    """Whether a replacement waits to join the running job: then call :func:`reform` on every rank to
    admit it (collective: call it on every rank at the same point of the loop, e.g. each step boundary).

    Rank 0 asks the launcher (at most every 0.2 s) and broadcasts its answer, so every rank decides
    alike. False where the world cannot grow (no launcher that re-forms, or ``--min-ranks`` alone); in
    a world of one no collective is made.
    """
    world = _world.current("replacement_waiting")
    if _epochs.membership() is None:
        return False
    waiting = _epochs.grow_requested() if world.rank == 0 else False
    if world.size > 1:
        from ._collectives import broadcast

        waiting = bool(broadcast(np.array([waiting], dtype=np.uint8), root=0)[0])
    return waiting


def reform(reason: str | None = None) -> Epoch:
    """Re-form the world with the ranks still alive (and replacements waiting to join); the new :class:`Epoch`.

    Call it on every surviving rank after a :class:`RankFailedError` or
    :class:`CollectiveTimeoutError` (or when :func:`replacement_waiting` says a
    replacement waits). The old world is released (its handles and groups are
    refused from now on), the launcher decides the new members, and a new world
    forms: ranks renumbered in their old order, replacements last. Then everything
    that follows the world is rebound to it, in the order it was registered
    (:mod:`phalanx._reconfigure`): each ``DistributedOptimizer`` with ``shard=None``
    over the whole world (a new gradient engine, collective), each
    ``DistributedSampler`` made without ``rank=``/``size=``, the ``"phalanx"``
    torch process group, Horovod's state, and every :func:`on_reform` callback.
    A sharded optimizer does not follow: ``release()`` it before, wrap it again
    after. Nothing of the model or optimizer state moves: bring it to the joined
    ranks yourself (``phalanx.synchronize`` or ``phalanx.broadcast_object`` from a
    survivor), or let ``fit(elastic=True)`` do it.

    ``reason`` (default: the old world's failure) is what the launcher reports as the cause.

    Raises QuorumLostError where this rank does not continue (no majority, fewer
    than ``--min-ranks``, or declared lost), and UsageError where worlds cannot re-form.
    """
    ms = required("reform")
    old = _world.current("reform")
    why = reason or old.broken or f"rank {old.rank} asked to re-form the world"
    old.mark_broken(f"the world was re-formed after epoch {old.epoch}: "
                    "this handle or group belongs to the old one")
    ms.announce(why)  # first: the old group's peers stop waiting, and its teardown need not wait for them
    old.backend.revoke()  # and their calls on its communicators (MPI under ULFM) fail at once
    old.release()
    try:
        new_epoch = ms.reform(why)
    except RendezvousError as exc:  # (ULFM) a shrink or a replacement's start failed: shrink again
        raise RankFailedError(f"phalanx.reform: epoch {old.epoch} could not re-form ({exc}). "
                              "Call phalanx.reform() again (fit(elastic=True) does).") from None
    try:
        reformed(old, new_epoch)
    except RendezvousError as exc:  # a member of the new epoch was lost while it formed: again
        raise RankFailedError(f"phalanx.reform: epoch {new_epoch.number} could not form ({exc}). Call "
                              "phalanx.reform() again (fit(elastic=True) does).") from None
    _reconfigure.rebind_all(new_epoch)  # a peer lost meanwhile raises here: reform() again rebinds them all
    return new_epoch


def reformed(old: _world.World, epoch: Epoch) -> _world.World:
    """The world of ``epoch``, made and installed in place of ``old`` (released already): the same
    backend kind and settings, this process's new rank and size (:func:`reform`)."""
    impl = _world.make_backend(old.backend.name, timeout=old.timeout, gpu_aware_mpi=getattr(old.backend, "gpu_aware", None),
                         devices=old.devices, epoch=epoch)
    world = _world.World(impl, timeout=old.timeout, check=old.checks, debug=old.debug, devices=old.devices,
                         epoch=epoch.number)
    old.supersede(world)
    _world.swap(world)
    for hook in _world.AT_EXIT:
        atexit.register(hook, world)
    return world
