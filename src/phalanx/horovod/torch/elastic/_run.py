"""``hvd.elastic.run``: resume a restarted job from its last commit, then run the training function."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import phalanx

from .... import _epochs
from ...._errors import PhalanxError
from ..._errors import HostsUpdatedInterrupt
from ._state import State, TorchState

__all__ = ["restarted", "run"]

_F = TypeVar("_F", bound=Callable[..., Any])
_log = logging.getLogger("phalanx.horovod.elastic")
_SAID = [False]


def restarted() -> int:
    """This job's restart count (``PHALANX_RESTART_COUNT``; 0 in the first attempt or outside ``phalanx run``)."""
    try:
        return max(0, int(os.environ.get("PHALANX_RESTART_COUNT", "0")))
    except ValueError:
        return 0


def _restarts_enabled() -> bool:
    try:
        return int(os.environ.get("PHALANX_MAX_RESTARTS", "0")) > 0
    except ValueError:
        return False


def _say_once(text: str) -> None:
    if not _SAID[0] and (not phalanx.initialized() or phalanx.rank() == 0):
        _SAID[0] = True
        _log.warning(text)


def run(func: _F) -> _F:
    """Decorate the training function ``func(state, *args, **kwargs)`` for elastic training.

    Before calling ``func``, a restarted job (``PHALANX_RESTART_COUNT`` > 0, under
    ``phalanx run --max-restarts K``) loads the last ``state.commit()`` from disk, calls the
    state's reset callbacks, and every rank takes rank 0's state (``state.sync()``); a first
    attempt removes an earlier job's commit file (rank 0; as in Horovod, a commit lives as long as
    its job) and syncs. A failure is not caught: the job ends and the launcher starts it again.
    Without ``--max-restarts``, the job runs as an ordinary one and says so once (rank 0).

    Arguments:
        func: its first argument is a ``hvd.elastic.TorchState`` (or another ``State``).

    Returns the wrapped function (collective: every rank calls it), which returns ``func``'s result.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if _epochs.available() and phalanx.initialized() and _epochs.membership() is not None:
            return _in_place(func, state, args, kwargs)
        count = restarted()
        if not _restarts_enabled() and count == 0:
            _say_once("phalanx.horovod.torch.elastic: this job runs without restarts, as an ordinary job: a "
                      "failure ends it. Start it with `phalanx run --max-restarts K ...` to restart it from the "
                      "last state.commit() after a failure.")
        if count == 0 and isinstance(state, TorchState) and (not phalanx.initialized() or phalanx.rank() == 0):
            with contextlib.suppress(FileNotFoundError):  # an earlier job's: a commit lives as long as its job
                os.remove(state.commit_file)
        if count > 0:
            if isinstance(state, TorchState) and state.load_commit():
                _say_once(f"phalanx.horovod.torch.elastic: restart {count}: resuming from the commit in "
                          f"{state.commit_file}.")
            else:
                _say_once(f"phalanx.horovod.torch.elastic: restart {count}: no commit was found; starting "
                          "from the initial state.")
            state.on_reset()
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _in_place(func: Callable[..., Any], state: State, args: Any, kwargs: Any) -> Any:
    """Horovod's own loop, reset in place: a lost peer (HorovodInternalError but a mismatch) makes every
    survivor restore its last commit and re-form the world; a replacement waiting to join (raised as
    HostsUpdatedInterrupt by ``state.commit()``) makes them re-form with it. Either way the reset
    callbacks run, and every rank takes the state of the new rank 0 (a survivor)."""
    _epochs.declare()
    skip_sync = False
    while True:
        if not skip_sync:
            state.sync()
        try:
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt as exc:
            skip_sync = exc.skip_sync
            why = "admitting a replacement"
        except PhalanxError as exc:
            if not _epochs.recoverable(exc):
                raise
            state.restore()
            skip_sync = False
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        _reset(why)
        state.on_reset()


def _reset(why: str) -> None:
    """Re-form the world (again while a peer is lost during it)."""
    while True:
        try:
            epoch = phalanx.reform(why)
            break
        except PhalanxError as exc:
            if not _epochs.recoverable(exc):
                raise
            why = f"{type(exc).__name__} while re-forming"
    _say(f"phalanx.horovod.torch.elastic: reset in place: epoch {epoch.number}, {epoch.size} rank(s) "
         f"({why}).")


def _say(text: str) -> None:
    if phalanx.rank() == 0:
        _log.warning(text)
