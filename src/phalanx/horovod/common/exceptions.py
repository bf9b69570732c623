"""Horovod's exception names (``horovod.common.exceptions``), as phalanx errors.

``except HorovodInternalError:`` and ``except RuntimeError:`` in a Horovod script
still catch what ``hvd`` collectives raise: a mismatch (:class:`HorovodMismatchError`,
also phalanx's ``CollectiveMismatchError``), a timeout where Horovod would stall
(:class:`HorovodTimeoutError`), a lost peer (:class:`HorovodRankFailedError`).
The classes live in :mod:`phalanx.horovod._errors`.
"""

from __future__ import annotations

from ..._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    NotInitializedError,
    PhalanxError,
    RankFailedError,
    WorldBrokenError,
)
from .._errors import (
    DuplicateNameError,
    HorovodInternalError,
    HorovodJoinedError,
    HorovodMismatchError,
    HorovodNotInitializedError,
    HorovodRankFailedError,
    HorovodTimeoutError,
    HorovodUnsupportedError,
    HorovodWorldBrokenError,
    HostsUpdatedInterrupt,
)

__all__ = [
    "DuplicateNameError", "HorovodInternalError", "HorovodJoinedError", "HorovodMismatchError",
    "HorovodNotInitializedError", "HorovodRankFailedError", "HorovodTimeoutError",
    "HorovodUnsupportedError", "HorovodWorldBrokenError", "HostsUpdatedInterrupt",
]


def as_horovod_error(exc: PhalanxError, call: str) -> PhalanxError:
    """The Horovod-flavoured twin of phalanx error ``exc`` raised inside ``hvd.<call>`` (``exc``
    itself when it has none): same message and fields, also a HorovodInternalError.

    For the ``hvd`` layers (collectives, DistributedOptimizer):
    ``except PhalanxError as e: raise as_horovod_error(e, "allreduce") from None``.
    """
    kind = type(exc)
    if isinstance(exc, HorovodInternalError) or kind not in _TWINS and not isinstance(exc, NotInitializedError):
        return exc
    text = f"hvd.{call}: {exc}"
    if isinstance(exc, NotInitializedError):
        twin: PhalanxError = HorovodNotInitializedError(call)
    elif isinstance(exc, CollectiveTimeoutError):
        twin = HorovodTimeoutError(text, missing_ranks=exc.missing_ranks, elsewhere=exc.elsewhere)
    else:
        twin = _TWINS[kind](text)
    twin.__traceback__ = exc.__traceback__
    return twin


_TWINS: dict[type, type] = {
    CollectiveMismatchError: HorovodMismatchError,
    CollectiveTimeoutError: HorovodTimeoutError,
    RankFailedError: HorovodRankFailedError,
    WorldBrokenError: HorovodWorldBrokenError,
}
