"""Leaving the world: :func:`shutdown`, the agreement that every rank is leaving, then the release.

``shutdown`` is an agreement like any collective's (bounded by the timeout), so
that a rank still waiting in a collective learns at once that a peer left
(RankFailedError naming it) instead of waiting out its timeout. Then the
world's groups (registered with :meth:`World.on_shutdown`) and its backend are
released, locally and bounded, whatever the agreement found.
"""

from __future__ import annotations

import atexit
import warnings
from typing import Any

from ._agreement import fingerprint, where
from ._errors import PhalanxError
from ._world import AT_EXIT, World, current_or_none, swap

__all__ = ["shutdown", "shutdown_at_exit"]


def shutdown() -> None:
    """Leave the world and release the backend; calling it again does nothing.

    Every rank should call it, after the same collective calls: it agrees with
    the peers (bounded by the timeout) before releasing anything. Peers that are
    still waiting in a collective instead raise RankFailedError naming this rank
    at once, and this rank leaves without waiting for them (with a warning).
    """
    world = swap(None)
    if world is None:
        return
    atexit.unregister(shutdown_at_exit)
    try:
        if world.broken is None and world.size > 1:
            world.ready("shutdown")
            entries = _leave(world)
            if entries is not None:
                _warn_left_behind(world, entries)
    except PhalanxError as exc:  # the peers failed or never came: leave anyway, quickly
        if world.broken is None:
            world.mark_broken(f"shutdown failed: {type(exc).__name__}")
    finally:
        world.release()


def shutdown_at_exit(world: World) -> None:
    """At a normal exit, a rank that never called :func:`shutdown` shuts down now: exiting counts
    as leaving, so the peers' ``shutdown()`` agrees with it instead of waiting out the timeout
    (on MPI, for an agreement that would never come). Registered by ``phalanx.init``; does
    nothing once ``shutdown()`` ran, when another world replaced this one, or when it is broken
    (the abort path ends that job)."""
    if world.broken is None and current_or_none() is world:
        shutdown()


AT_EXIT.append(shutdown_at_exit)


def _leave(world: World) -> list[dict[str, Any]] | None:
    """Agree on ``shutdown`` with the peers: None when every rank is shutting down, else every
    rank's description (the peers then raise RankFailedError naming this rank)."""
    world.calls += 1
    with world.guard("shutdown"):
        # debug=False: in debug mode the call site joins the fingerprint, and ranks may shut down anywhere.
        if world.backend.agree(fingerprint("shutdown", None, None, -1, None, False), world.timeout):
            return None
    return world.allgather_json("shutdown", world.describe("shutdown", None, None, -1))


def _warn_left_behind(world: World, entries: list[dict[str, Any]]) -> None:
    others = {r: where(e) for r, e in enumerate(entries) if e["call"] != "shutdown"}
    world.mark_broken("shut down while peers were in a collective")
    warnings.warn(f"phalanx.shutdown() on rank {world.rank}: other ranks were still in a collective "
                  f"({', '.join(f'rank {r}: {p}' for r, p in others.items())}); they raise "
                  "RankFailedError. Every rank must make the same collective calls before shutdown().",
                  RuntimeWarning, stacklevel=3)
