"""The phalanx exception hierarchy.

Every error phalanx raises for a user mistake or a distributed failure is a
:class:`PhalanxError`. Each also subclasses the closest built-in, so code that
already catches ``ValueError``/``TimeoutError``/``ImportError`` keeps working.
Messages name the call, what was received and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CheckpointError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ImageReadError",
    "InvalidSettingError",
    "InvalidArgumentError",
    "JobFailedError",
    "LaunchEnvironmentError",
    "LaunchError",
    "MissingDependencyError",
    "NonFiniteGradientError",
    "NotInGroupError",
    "NotInitializedError",
    "PhalanxError",
    "RankFailedError",
    "RendezvousError",
    "SimulatedHostsUnavailableError",
    "TrainingError",
    "UnknownMetricError",
    "UnsupportedArgumentError",
    "UsageError",
    "WorldBrokenError",
]


class PhalanxError(Exception):
    """Base class of every phalanx exception."""


class NotInitializedError(PhalanxError, RuntimeError):
    """A phalanx function was called before :func:`phalanx.init`.

    ``what``: the name of the function that was called, e.g. ``"allreduce"`` (the
    message names it and says to call ``phalanx.init()`` first).
    """

    def __init__(self, what: str) -> None:
        super().__init__(
            f"phalanx.{what}() was called before phalanx.init(). "
            "Call `phalanx.init()` once at the start of your script (it is a no-op "
            "when already initialized)."
        )


class BackendUnavailableError(PhalanxError, ImportError):
    """A backend's dependency is missing or not usable here."""


class LaunchEnvironmentError(PhalanxError, ValueError):
    """A variable the rendezvous needs (``RANK``, ``MASTER_PORT``, ...) is missing or malformed."""


class CollectiveMismatchError(PhalanxError, ValueError):
    """Ranks called a collective with incompatible arguments.

    Raised on *every* rank of the call, before any data is exchanged, so no
    buffer is corrupted and the world remains usable.
    """


class CollectiveTimeoutError(PhalanxError, TimeoutError):
    """A collective did not complete within the timeout.

    ``missing_ranks`` lists the ranks that never reached the call (as far as
    the waiting ranks could tell); ``elsewhere`` maps ranks that were waiting
    in a *different* call to a description of that call. After this error the
    world cannot be used any more (MPI cannot cancel a collective in flight).
    ``message``: the text ``str()`` shows (what timed out, after how long, the fix).
    """

    def __init__(
        self,
        message: str,
        *,
        missing_ranks: list[int] | None = None,
        elsewhere: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.missing_ranks = list(missing_ranks or [])
        self.elsewhere = dict(elsewhere or {})


class RankFailedError(PhalanxError, RuntimeError):
    """A peer rank died or closed its connection during a collective."""


class WorldBrokenError(PhalanxError, RuntimeError):
    """The world was left unusable by an earlier failure (a timeout or a dead rank)."""


class InvalidArgumentError(PhalanxError, ValueError):
    """An argument has a value phalanx cannot use (an unknown op, a negative bucket size, ...)."""


class UsageError(PhalanxError, RuntimeError):
    """A phalanx object was used out of order, e.g. ``zero_grad()`` while gradient reductions
    are in flight, or two gradient wrappers on the same parameters."""


class MissingDependencyError(PhalanxError, ImportError):
    """An optional package a feature needs (tensorboard, wandb, mlflow, ...) is not installed.

    The message names the pip package to install.
    """


class UnsupportedArgumentError(PhalanxError, TypeError):
    """A collective got an argument it cannot send (type, dtype, layout)."""


class LaunchError(PhalanxError, RuntimeError):
    """``phalanx run`` (or :func:`phalanx.testing.run_world`) could not start the job: bad arguments,
    no ``mpiexec``, ...; the message says why and what to change."""


class TrainingError(PhalanxError, RuntimeError):
    """Raised on every rank alike when the failure policy of :func:`phalanx.train.fit` says stop."""


class CheckpointError(PhalanxError, RuntimeError):
    """A checkpoint could not be written, read or restored; the message names the file and the cause."""


class ImageReadError(PhalanxError, OSError):
    """An image file of a dataset could not be read or decoded (the message names the file)."""


class RendezvousError(PhalanxError, ConnectionError):
    """The ranks of a gloo/nccl job could not all meet in :func:`phalanx.init`: the message says how
    many joined, which are missing, and what to check (every rank started, the same
    ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``)."""


class InvalidSettingError(PhalanxError, ValueError):
    """A ``PHALANX_*`` environment variable has a value phalanx cannot use (the message names the
    variable, the value and an example of a valid one)."""


class NonFiniteGradientError(PhalanxError, FloatingPointError):
    """Some rank's *local* gradients held NaN/Inf before they were reduced (raised on every rank alike).

    Raised with ``nonfinite="raise"`` on ``phalanx.torch.DistributedOptimizer``/``DataParallel``.
    ``message``: the text ``str()`` shows; ``ranks`` lists the ranks whose own
    gradients were not finite.
    """

    def __init__(self, message: str, *, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])


class UnknownMetricError(PhalanxError, KeyError):
    """A :class:`phalanx.train.History` was asked for a metric it never recorded (the message lists
    the recorded ones)."""

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return str(self.args[0]) if self.args else ""


class SimulatedHostsUnavailableError(PhalanxError, RuntimeError):
    """:func:`phalanx.testing.simulated_hosts` cannot build hosts here: not root, not Linux, a tool
    (``ip``, ``nsenter``, ``unshare``, ``tc``) missing, or the kernel refused a namespace; the
    message says which and what the system answered."""


class NotInGroupError(UsageError):
    """A collective was called with ``group=g`` on a rank that is not a member of ``g``."""


class GradientSyncOrderError(UsageError, AssertionError):
    """A Horovod-style ``DistributedOptimizer`` was used out of order: ``zero_grad()`` after backward but
    before ``step()``/``synchronize()``, more backward passes than ``backward_passes_per_step`` before
    ``step()``, or ``skip_synchronize()`` with Adasum (an ``AssertionError`` too, as Horovod raises)."""


class JobFailedError(PhalanxError, RuntimeError):
    """A job that :func:`phalanx.horovod.run` started failed: a rank raised, died or returned nothing.

    The message names the first failing rank and shows its traceback (a ``RuntimeError``, as
    ``horovod.run`` raises). ``returncode``: the launcher's exit status; ``report``: what the
    launcher said about the failure.
    """

    def __init__(self, message: str, *, returncode: int | None = None, report: str = "") -> None:
        super().__init__(message)
        self.returncode = returncode
        self.report = report


# -- Horovod's names (phalanx.horovod) ------------------------------------------------------------
# Exported from ``phalanx.horovod.common.exceptions`` (as Horovod's ``horovod.common.exceptions``),
# not from ``phalanx``: they exist so that a Horovod script's ``except`` clauses keep working.
# Each is a PhalanxError and subclasses the built-in Horovod raises for the same failure.


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
