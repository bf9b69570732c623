"""The exceptions of phalanx's Horovod layer, under Horovod's names.

Exported from :mod:`phalanx.horovod.common.exceptions` (as Horovod's
``horovod.common.exceptions``), not from ``phalanx``: they exist so that a Horovod
script's ``except`` clauses keep working. Each is a :class:`~phalanx.PhalanxError`
and subclasses the built-in Horovod raises for the same failure; the ones for a
failed collective also subclass phalanx's own (``HorovodMismatchError`` is a
``CollectiveMismatchError``), so ``except phalanx.CollectiveMismatchError`` catches
both. Only the Horovod layer raises them: the layers below raise phalanx's errors and
``phalanx.horovod`` converts them (``as_horovod_error``).
"""

from __future__ import annotations

from .._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    NotInitializedError,
    PhalanxError,
    RankFailedError,
    UsageError,
    WorldBrokenError,
)

__all__ = [
    "DuplicateNameError", "GradientSyncOrderError", "HorovodInternalError", "HorovodJoinedError",
    "HorovodMismatchError", "HorovodNotInitializedError", "HorovodRankFailedError", "HorovodTimeoutError",
    "HorovodUnsupportedError", "HorovodWorldBrokenError", "HostsUpdatedInterrupt",
]


class HorovodInternalError(PhalanxError, RuntimeError):
    """A Horovod collective failed (Horovod's ``horovod.common.exceptions.HorovodInternalError``).

    phalanx.horovod raises its subclasses: a mismatch, a timeout, a lost peer, a broken world,
    a collective made while ranks have joined.
    """


class HostsUpdatedInterrupt(PhalanxError, RuntimeError):
    """Horovod's elastic interrupt: the set of hosts changed (``skip_sync``: the state need not be
    synchronized before the reset). phalanx restarts jobs instead, so it never raises this itself;
    it exists for scripts that catch or raise it."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__(f"the set of hosts in the job changed (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


class HorovodNotInitializedError(NotInitializedError, ValueError):
    """A ``hvd`` function was called before ``hvd.init()`` (a ValueError, as in Horovod).

    ``what``: the function that was called, e.g. ``"size"``.
    """

    def __init__(self, what: str) -> None:
        PhalanxError.__init__(self, f"hvd.{what}() was called before hvd.init(). Call `hvd.init()` once "
                                    "at the start of your script.")


class HorovodMismatchError(CollectiveMismatchError, HorovodInternalError):
    """Ranks called a ``hvd`` collective with incompatible arguments (shape, dtype, op, name or call
    order): raised on every rank before anything was sent, so the world stays usable."""


class HorovodTimeoutError(CollectiveTimeoutError, HorovodInternalError):
    """A ``hvd`` collective did not complete within phalanx's timeout (Horovod would stall);
    ``missing_ranks`` and ``elsewhere`` as in :class:`CollectiveTimeoutError`."""


class HorovodRankFailedError(RankFailedError, HorovodInternalError):
    """A peer died or shut down during a ``hvd`` collective."""


class HorovodWorldBrokenError(WorldBrokenError, HorovodInternalError):
    """A ``hvd`` collective was called after an earlier failure left the world unusable."""


class HorovodJoinedError(HorovodInternalError):
    """A ``hvd`` collective other than allreduce was made while some ranks had called ``hvd.join()``
    (Horovod supports only allreduce then); raised on every rank that made it."""


class DuplicateNameError(PhalanxError, ValueError):
    """A ``hvd`` operation was submitted with the ``name`` of one still in flight (not yet
    synchronized), as Horovod refuses it."""


class HorovodUnsupportedError(PhalanxError, NotImplementedError):
    """A ``hvd`` feature Horovod itself does not support in this configuration (e.g. Adasum on a
    number of ranks that is not a power of two), or one phalanx does not provide; the message says
    which and what to use instead."""


class GradientSyncOrderError(UsageError, AssertionError):
    """A Horovod-style ``DistributedOptimizer`` was used out of order: ``zero_grad()`` after backward but
    before ``step()``/``synchronize()``, more backward passes than ``backward_passes_per_step`` before
    ``step()``, or ``skip_synchronize()`` with Adasum (an ``AssertionError`` too, as Horovod raises)."""
