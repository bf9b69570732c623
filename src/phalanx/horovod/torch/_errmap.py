"""The ``hvd`` boundary: phalanx errors leave as their Horovod twins (HorovodInternalError too)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ..._errors import PhalanxError
from ..common.exceptions import as_horovod_error

__all__: list[str] = []

F = TypeVar("F", bound=Callable[..., Any])


def horovod_errors(fn: F) -> F:
    """Decorate a public ``hvd`` function: a PhalanxError it raises becomes its Horovod twin."""
    call = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PhalanxError as exc:
            twin = as_horovod_error(exc, call)
            if twin is exc:
                raise
            raise twin from None

    return wrapper  # type: ignore[return-value]
