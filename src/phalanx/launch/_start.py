"""The start timeout: every rank must reach ``phalanx.init`` within ``--start-timeout`` seconds.

A rank that never calls ``phalanx.init`` (stuck before it, or started late)
leaves the others blocked inside it: MPI's ``MPI_Init`` has no timeout at all.
``phalanx.init`` leaves an ``init-rank<r>`` marker in the job directory on
entry and a ``ready-rank<r>`` marker once the world is formed; once the start
timeout has passed and some rank has entered ``init``, the launcher ends the
job naming the ranks that have not. A job none of whose ranks calls
``phalanx.init`` (a plain script under ``phalanx run``) is never stopped by it.
"""

from __future__ import annotations

import time

from ._jobdir import marked_ranks

__all__ = ["StartClock"]


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class StartClock:
    """Tells the supervising launcher when the start timeout has run out, and why."""

    def __init__(self, job_dir: str, n: int, timeout: float) -> None:
        self.job_dir, self.n, self.timeout = job_dir, n, timeout
        self.deadline = time.monotonic() + timeout
        self.formed = False  # every rank is past init: nothing more to watch
        self.report: str | None = None

    def overdue(self, now: float) -> bool:
        """True (once, with :attr:`report` set) when the job must end for a rank that missed ``init``."""
        if self.formed or self.report is not None or now < self.deadline:
            return False
        ready = marked_ranks(self.job_dir, "ready")
        if len(ready) >= self.n:
            self.formed = True
            return False
        entered = marked_ranks(self.job_dir, "init") | ready
        if not entered:
            return False  # no rank has called phalanx.init: nobody is waiting for anybody
        missing = [r for r in range(self.n) if r not in entered]
        waiting = sorted(entered - ready)
        limit = f"within the start timeout of {self.timeout:g} s (--start-timeout, PHALANX_START_TIMEOUT)"
        if missing:
            lines = [f"phalanx run: {_ranks(missing)} did not reach phalanx.init {limit}."]
            if waiting:
                lines.append(f"{_ranks(waiting)} {'was' if len(waiting) == 1 else 'were'} waiting in "
                             f"phalanx.init for {'it' if len(missing) == 1 else 'them'}; every rank was stopped.")
        else:
            lines = [f"phalanx run: every rank reached phalanx.init, but the world did not form {limit}: "
                     f"{_ranks(waiting)} {'was' if len(waiting) == 1 else 'were'} still inside it; every rank "
                     "was stopped. The backend could not connect the ranks (network, firewall or MPI settings)."]
        lines.append("A rank that needs longer before phalanx.init (downloading data, compiling) needs a larger "
                     "--start-timeout.")
        self.report = "\n".join(lines)
        return True
