"""Which unit runs next: the order of the last pass, for prefetching the next unit's gather.

::

    order = UnitOrder()
    order.begin()                 # a forward (or backward) pass starts
    nxt = order.step(unit)        # this unit runs now: the unit that came after it last time, or None

Each pass records the units in the order their hooks saw them. While a pass
follows the previous one, ``step`` names the unit that came next then, so
its all-gather can be posted while this one computes (FSDP2's prefetch). A
pass that leaves the recorded order (another branch, another number of
calls) prefetches nothing more. Every rank runs the same passes, so every
rank posts the same gathers in the same order.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UnitOrder"]


class UnitOrder:
    """The units of the last pass in one direction, and where this pass is in it."""

    def __init__(self) -> None:
        self.last: list[Any] = []
        self.now: list[Any] = []
        self.on_track = True

    def begin(self) -> None:
        """A new pass: the one just run becomes the one to follow."""
        if self.now:
            self.last = self.now
        self.now, self.on_track = [], True

    def step(self, unit: Any) -> Any:
        """``unit`` runs now; return the next other unit of the last pass, or None."""
        i = len(self.now)
        self.now.append(unit)
        if not self.on_track or i >= len(self.last) or self.last[i] is not unit:
            self.on_track = False
            return None
        for later in self.last[i + 1:]:
            if later is not unit:
                return later
        return None
