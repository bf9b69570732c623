"""The keys of a world with epochs in the launcher's store: the one place that spells them.

The ranks (:mod:`phalanx._epochs`) and the launcher (:mod:`phalanx.launch._epochs`) both name
every key through these functions, so the two sides cannot drift apart. Pure: no imports.

All keys lie under ``elastic/``:

==============================  ============================  ==========================================
key                             written by                    holds
==============================  ============================  ==========================================
``elastic/e<E>/members``        the launcher                  epoch E's member ids, in rank order (JSON)
``elastic/e<E>/broken``         the launcher, or a rank       why epoch E ended
``elastic/e<E>/grow``           the launcher                  a replacement waits to join epoch E's world
``elastic/e<E>/alive/<m>``      member m                      its check-in for the epoch after E
``elastic/e<E>/verdict``        the launcher                  why no epoch follows E
``elastic/declared/<m>``        member m                      it re-forms in place (its timeout)
``elastic/join/<m>``            replacement m                 it waits to be admitted
``elastic/admit/<m>``           the launcher                  the epoch that admits m (-1: leave)
==============================  ============================  ==========================================
"""

from __future__ import annotations

__all__ = ["admit", "alive", "broken", "declared", "grow", "joined", "members", "verdict"]

_ROOT = "elastic/"


def _epoch(epoch: int) -> str:
    return f"{_ROOT}e{epoch}/"


def members(epoch: int) -> str:
    """Epoch ``epoch``'s member ids, in rank order (JSON)."""
    return _epoch(epoch) + "members"


def broken(epoch: int) -> str:
    """Why epoch ``epoch`` ended (set once, by the launcher or a rank that starts re-forming)."""
    return _epoch(epoch) + "broken"


def grow(epoch: int) -> str:
    """Set while a replacement waits to be admitted into epoch ``epoch``'s world."""
    return _epoch(epoch) + "grow"


def alive(epoch: int, member: int) -> str:
    """Member ``member``'s check-in for the epoch after ``epoch``."""
    return f"{_epoch(epoch)}alive/{member}"


def verdict(epoch: int) -> str:
    """Why no epoch follows epoch ``epoch`` (the survivors cannot continue)."""
    return _epoch(epoch) + "verdict"


def declared(member: int) -> str:
    """Member ``member`` re-forms in place; its value is the member's collective timeout."""
    return f"{_ROOT}declared/{member}"


def joined(member: int) -> str:
    """Replacement ``member`` waits to be admitted into the running job."""
    return f"{_ROOT}join/{member}"


def admit(member: int) -> str:
    """The epoch that admits replacement ``member`` (``-1``: it is not needed, and leaves)."""
    return f"{_ROOT}admit/{member}"
