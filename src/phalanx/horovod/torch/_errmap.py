"""The ``hvd`` boundary: phalanx errors leave as their Horovod twins (HorovodInternalError too)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ..._errors import PhalanxError
from ..common.exceptions import as_horovod_error
from . import _resync

__all__: list[str] = []

F = TypeVar("F", bound=Callable[..., Any])


def horovod_errors(fn: F) -> F:
    """Decorate a public ``hvd`` function: a PhalanxError it raises becomes its Horovod twin, and
    while it runs (outermost) it is the operation this rank names in a mismatch (:mod:`._resync`)."""
    call = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outer = _resync.current[0] is None
        if outer:  # the operation a mismatch names to the peers (_resync)
            _resync.current[0] = _resync.operation_key(call, kwargs)
        try:
            return fn(*args, **kwargs)
        except PhalanxError as exc:
            twin = as_horovod_error(exc, call)
            if twin is exc:
                raise
            raise twin from None
        finally:
            if outer:
                _resync.current[0] = None

    return wrapper  # type: ignore[return-value]
