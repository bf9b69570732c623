"""``phalanx.reform()``: the world re-formed in place with the survivors (the epochs: :mod:`._epochs`)."""

from __future__ import annotations

from . import _world
from ._epochs import Epoch, rebinds, required
from ._errors import RankFailedError, RendezvousError

__all__ = ["reform"]


def reform(reason: str | None = None) -> Epoch:
    """Re-form the world with the ranks still alive (and replacements waiting to join); the new :class:`Epoch`.

    Call it on every surviving rank after a :class:`RankFailedError` or
    :class:`CollectiveTimeoutError` (or when :func:`grow_requested` says a
    replacement waits). The old world is released (its handles and groups are
    refused from now on), the launcher decides the new members, and a new world
    forms: ranks renumbered in their old order, replacements last. Then every
    :func:`on_reform` callback runs. Nothing of the model or optimizer moves:
    bring the state to the joined ranks yourself (``phalanx.synchronize`` or
    ``phalanx.broadcast_object`` from a survivor), or let ``fit(elastic=True)`` do it.

    ``reason`` (default: the old world's failure) is what the launcher reports as the cause.

    Raises QuorumLostError where this rank does not continue (no majority, fewer
    than ``--min-ranks``, or declared lost), and UsageError where worlds cannot re-form.
    """
    ms = required("reform")
    old = _world.current("reform")
    why = reason or old.broken or f"rank {old.rank} asked to re-form the world"
    old.mark_broken(f"the world was re-formed after epoch {getattr(old, 'epoch', 0)}: "
                    "this handle or group belongs to the old one")
    ms.announce(why)  # first: the old group's peers stop waiting, and its teardown need not wait for them
    old.release()
    new_epoch = ms.reform(why)
    try:
        _world.reformed(old, new_epoch)
    except RendezvousError as exc:  # a member of the new epoch was lost while it formed: again
        raise RankFailedError(f"phalanx.reform: epoch {new_epoch.number} could not form ({exc}). Call "
                              "phalanx.reform() again (fit(elastic=True) does).") from None
    for callback in rebinds():
        callback(new_epoch)
    return new_epoch
