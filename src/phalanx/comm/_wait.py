"""Polling a request until it completes or a deadline passes.

MPI cannot time out a blocking call, so every wait phalanx makes is a poll of
a non-blocking request. Polling tests in a tight loop and yields the core
every 64 tests (a short collective finishes in microseconds and must not pay
for a sleep; ``sched_yield`` returns at once when no other thread wants the
core), then, once a wait has lasted long enough to be a peer that is busy
elsewhere, sleeps a little between polls so a waiting rank does not burn a
core for minutes. Yielding from the first microseconds matters when ranks
outnumber cores (3 ranks on 2 cores): a rank that only spins holds a core
its peer needs to make the progress it waits for; MPI's own blocking waits
yield the same way. Measured in ``benchmarks/README.md`` ("Bounded data phase").
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ._base import WaitTimeout

__all__ = ["Stepped", "poll"]

_YIELD_S = 0.05     # sched_yield every 64 tests until 50 ms
_SLEEP_S = 0.0002   # then sleep 200 us between polls


def poll(test: Callable[[], bool], timeout: float, *, patient: bool = True) -> None:
    """Call ``test()`` until it returns True; raise WaitTimeout after ``timeout`` seconds.

    ``patient=False`` never sleeps (for data phases whose progress happens
    inside ``test``); it still yields the core so oversubscribed ranks advance.
    """
    if test():
        return
    monotonic = time.monotonic
    start = monotonic()
    deadline = start + timeout
    spins = 0
    while not test():
        spins += 1
        if spins & 63:
            continue
        now = monotonic()
        if now > deadline:
            raise WaitTimeout(timeout)
        if not patient or now - start < _YIELD_S:
            os.sched_yield()
        else:
            time.sleep(_SLEEP_S)


_ABANDONED: list[Stepped] = []  # stepped requests whose wait timed out: MPI may still write into their buffers


class Stepped:
    """``wait`` for request state machines that move on inside ``test()`` (the mpi rings): ``test`` polled,
    never sleeping, until ``_done``; then ``_result``. One that times out is kept alive (its buffers with it)."""

    __slots__ = ()
    _done: bool
    _result: Any

    def test(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float) -> Any:
        """The result (``x`` itself when in place) once done; WaitTimeout after ``timeout`` s."""
        if not self._done:
            try:
                poll(self.test, timeout, patient=False)
            except WaitTimeout:
                _ABANDONED.append(self)
                raise
        return self._result
