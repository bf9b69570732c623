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
    "QuorumLostError",
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
    """Base class of every exception phalanx raises, for a user's mistake or a distributed failure.

    Never raised itself: each subclass also derives from the closest built-in exception, so
    ``except ValueError`` (or ``TimeoutError``, ``ImportError``, ...) written for plain Python
    keeps working, and ``except phalanx.PhalanxError`` catches every one of them. The message
    names the call, what it received and how to fix it. The subclasses, by cause:

    * a wrong call: ``InvalidArgumentError``, ``UnsupportedArgumentError``, ``UsageError`` (and
      its ``NotInGroupError``), ``NotInitializedError``, ``InvalidSettingError``;
    * ranks that disagree or fail: ``CollectiveMismatchError`` (raised on every rank before
      anything is sent; the world stays usable), ``CollectiveTimeoutError``, ``RankFailedError``,
      ``WorldBrokenError`` (after those the world cannot be used any more, unless it re-forms in
      place: ``phalanx.reform()``), ``QuorumLostError`` (a rank that cannot join the re-formed world);
    * starting a job: ``LaunchError``, ``LaunchEnvironmentError``, ``RendezvousError``,
      ``BackendUnavailableError``, ``MissingDependencyError``, ``SimulatedHostsUnavailableError``;
    * training: ``TrainingError``, ``NonFiniteGradientError``, ``CheckpointError``,
      ``ImageReadError``, ``UnknownMetricError``; ``JobFailedError`` (``phalanx.horovod.run``).

    Example::

        try:
            phalanx.allreduce(x, op="mean")
        except ValueError as exc:           # InvalidArgumentError: a PhalanxError and a ValueError
            print(exc)                      # phalanx.allreduce(op='mean'): unknown op; use one of ...
    """


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


class QuorumLostError(RankFailedError):
    """This rank cannot continue in a re-formed world: its side of a failure holds no strict majority
    of the last epoch (a partition), the survivors would be fewer than ``--min-ranks``, or the
    launcher declared this rank lost. ``str()`` names the epoch, the ranks on each side and the fix."""


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
