"""Shared test settings: which worlds exist on this machine.

Every multi-rank test runs its body through :func:`phalanx.testing.run_world`
on worlds of 1, 2 and 3 ranks for each backend available here (local, mpi,
gloo). A backend that is missing is skipped with the reason, never silently.

``worlds_*.py`` hold those bodies (module-level functions that ``run_world`` calls on every
rank); ``program_*.py`` are whole scripts that a test starts itself (``phalanx run``, on simulated
hosts, or as a plain process), each saying in its docstring how it is run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from phalanx.testing import WorldFailed, available_backends, run_world

AVAILABLE = available_backends()

# (backend, ranks) pairs every collective test body runs on.
ALL_WORLDS = [("local", 1), ("mpi", 1), ("mpi", 2), ("mpi", 3), ("gloo", 1), ("gloo", 2), ("gloo", 3)]
# Worlds of the suites built on the collectives (training, fit, sharding, sync, PowerSGD, Horovod's ops):
# every size (1, 2, 3) and every backend, not every pair of them. Above the collectives a body takes the
# same path whichever backend carries its calls; what differs per backend and size (one rank, three
# uneven shards, gloo's own reduce-scatter, MPI's) is the collectives' business, checked on every pair
# (ALL_WORLDS) in test_collectives, test_collectives_shard, test_world_of_one and test_failures.
TRAINING_WORLDS = [("local", 1), ("mpi", 2), ("gloo", 2), ("gloo", 3)]
# Multi-rank worlds for failure tests.
MULTI_WORLDS = [("mpi", 2), ("mpi", 3), ("gloo", 2), ("gloo", 3)]


def world_params(worlds: list[tuple[str, int]]) -> list[object]:
    params = []
    for backend, n in worlds:
        marks = [] if backend in AVAILABLE else [
            pytest.mark.skip(reason=f"backend {backend!r} is not available here (see `phalanx info`)")
        ]
        params.append(pytest.param(backend, n, id=f"{backend}-{n}", marks=marks))
    return params


class Worlds:
    """One world per (body, backend, size) for the whole session; its report read per behaviour.

    ``results`` starts the world on first use and remembers what it returned
    (or how it failed: a failed world fails every test that reads it, with
    the same message, without being started again).
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], Any] = {}

    def results(self, body: Callable[..., Any], backend: str, n: int, **kwargs: Any) -> list[Any]:
        key = (body.__module__, body.__qualname__, backend, n, repr(sorted(kwargs.items(), key=str)))  # env: a dict
        if key not in self._cache:
            try:
                self._cache[key] = run_world(body, n, backend, **kwargs)
            except WorldFailed as failed:
                self._cache[key] = failed
        cached = self._cache[key]
        if isinstance(cached, WorldFailed):
            raise cached
        return cached

    def check(self, body: Callable[..., Any], backend: str, n: int, behaviour: str, **kwargs: Any) -> None:
        """Fail (naming every rank it failed on) unless ``behaviour`` passed on every rank of the world
        ``body`` ran in; the body returns :meth:`behaviours.Behaviours.run`'s report."""
        results = self.results(body, backend, n, **kwargs)
        failures = {}
        for r, report in enumerate(results):
            if behaviour not in report:
                failures[r] = f"not reported (the body returned {sorted(report)})"
            elif report[behaviour] is not None:
                failures[r] = report[behaviour]
        if failures:
            pytest.fail("\n".join(f"--- {behaviour} failed on rank {r} of {n} ({backend}) ---\n{text}"
                                  for r, text in failures.items()), pytrace=False)


@pytest.fixture(scope="session")
def worlds() -> Worlds:
    """Worlds shared by the tests of a session: start few, check many behaviours in each."""
    return Worlds()
