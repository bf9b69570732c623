"""Waits of a world with epochs (:mod:`phalanx._epochs`): a rank waiting in a collective also asks,
every quarter second, whether the launcher ended its epoch (a peer exited or asked to re-form), and
then raises PeerLost at once instead of waiting out the timeout. (A gloo ``Work`` whose timed wait
expired is still in flight and can be waited again.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._base import PeerLost, WaitTimeout
from ._torchsetup import translate

__all__ = ["interruptible_test", "wait_interruptible"]

_SLICE_S = 0.25  # how often a waiting rank asks whether its epoch ended


def wait_interruptible(work: Any, timeout: float, interrupted: Callable[[], str | None]) -> None:
    """gloo: wait for ``work`` in slices of a quarter second, asking ``interrupted()`` between them."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            work.wait(timedelta(seconds=max(0.001, min(_SLICE_S, left))))
            return
        except RuntimeError as exc:
            if left <= _SLICE_S or not isinstance(translate(exc), WaitTimeout):
                raise
        why = interrupted()
        if why is not None:
            raise PeerLost(f"the launcher ended this epoch: {why}")


def interruptible_test(work: Any, interrupted: Callable[[], str | None]) -> Callable[[], bool]:
    """nccl: ``work.is_completed``, which between quarter seconds also asks ``interrupted()`` (then
    PeerLost). Untested here: no GPU runs more than one nccl rank."""
    next_look = [time.monotonic() + _SLICE_S]

    def test() -> bool:
        if work.is_completed():
            return True
        now = time.monotonic()
        if now >= next_look[0]:
            next_look[0] = now + _SLICE_S
            why = interrupted()
            if why is not None:
                raise PeerLost(f"the launcher ended this epoch: {why}")
        return False

    return test
