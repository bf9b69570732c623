"""One group of parameters sharded together, and where it is in the step: :class:`ShardGroup`.

::

    group = ShardGroup("blocks.0", keeps_whole=False)   # ZeRO-3: a unit's flat shard (whole buffer freed)
    group.advance(GroupState.GATHERING)                  # a hook moves it on; an illegal move raises
    group = ShardGroup("bucket 3", keeps_whole=True)     # ZeRO-1/2: a gradient bucket (parameters whole)

Every sharding level is a list of groups laid out by :mod:`phalanx._layout`
(``n`` elements end to end, ``N`` chunks of ``ceil(n/N)``) whose collectives
are the free functions of :mod:`phalanx.torch._transfers`:

- ``shard="optimizer"``/``"gradients"``: one group per gradient bucket of the
  engine (:class:`~phalanx.torch._shard_plan.ShardPlan` holds them). The
  parameters stay whole (``keeps_whole``), so a group rests in ``WHOLE``:
  backward's reduction moves it to ``REDUCING`` (posted) and ``REDUCED`` (this
  rank's chunk landed in its slices' ``.grad``); after the optimizer's step
  the all-gather of the updated slices moves it through ``GATHERING`` back
  to ``WHOLE``.
- ``shard="parameters"``: one group per unit and dtype
  (:class:`~phalanx.torch._flat_shard.FlatShard`), resting in ``FREE`` (only
  this rank's chunk exists): a forward pre-hook moves it to ``GATHERING``
  (posted) and ``WHOLE``; after forward it may go back to ``FREE``
  (``reshard_after_forward``) and be gathered again for backward; its
  gradients move it to ``REDUCING`` and ``REDUCED``, and it is freed.

The hooks only move a group along :data:`NEXT`; a move outside it is a
sequencing defect and raises a UsageError naming the group and both states,
rather than letting a collective pair with the wrong one.
"""

from __future__ import annotations

import enum

from .._errors import UsageError

__all__ = ["NEXT", "GroupState", "ShardGroup"]


class GroupState(enum.Enum):
    """Where a shard group is in the step."""

    FREE = "free"            # only this rank's chunk exists (ZeRO-3 between uses)
    GATHERING = "gathering"  # the all-gather into the whole buffer is posted
    WHOLE = "whole"          # every rank's elements are in the whole parameters
    REDUCING = "reducing"    # the gradients' reduce-scatter (or allreduce) is posted
    REDUCED = "reduced"      # this rank's reduced chunk is in its shards' .grad


NEXT: dict[GroupState, frozenset[GroupState]] = {
    # REDUCING: (ZeRO-3) gradients accumulated under no_sync() after the unit was freed, reduced later.
    GroupState.FREE: frozenset({GroupState.GATHERING, GroupState.REDUCING}),
    GroupState.GATHERING: frozenset({GroupState.WHOLE}),
    # REDUCING: backward's gradients posted; GATHERING: (whole groups) a step's update with no reduction
    # before it; FREE: (ZeRO-3) freed after forward, or after a backward inside no_sync().
    GroupState.WHOLE: frozenset({GroupState.REDUCING, GroupState.GATHERING, GroupState.FREE}),
    GroupState.REDUCING: frozenset({GroupState.REDUCED}),
    # REDUCING: a second backward before the step; GATHERING: the step's update; FREE: ZeRO-3 after its
    # reduction; WHOLE: a unit still whole when its gradients were reduced (the root, or
    # reshard_after_forward=False), used again before it is freed.
    GroupState.REDUCED: frozenset({GroupState.REDUCING, GroupState.GATHERING, GroupState.FREE,
                                   GroupState.WHOLE}),
}
"""The moves a hook may make from each state."""


class ShardGroup:
    """Parameters sharded together (a bucket or a unit's flat shard) and their :class:`GroupState`.

    ``keeps_whole``: the whole parameters always exist (ZeRO-1/2; the group rests in ``WHOLE``), else
    only this rank's chunk between uses (ZeRO-3; it rests in ``FREE``)."""

    def __init__(self, name: str, keeps_whole: bool) -> None:
        self.name = name
        self.keeps_whole = keeps_whole
        self.state = GroupState.WHOLE if keeps_whole else GroupState.FREE

    def advance(self, to: GroupState) -> None:
        """Move to ``to``; UsageError unless :data:`NEXT` allows it from the current state."""
        if to not in NEXT[self.state]:
            raise UsageError(
                f"phalanx: the shard group {self.name!r} cannot go from {self.state.value} to {to.value}: its "
                "collectives would pair with another step's. This is phalanx's defect unless the model was "
                "run from inside a backward hook or another thread; please report it with the traceback.")
        self.state = to

    def settle(self) -> None:
        """Back to the resting state (``WHOLE`` or ``FREE``) after a cycle that was abandoned (its world
        broke or its step was skipped): nothing of it is in flight any more."""
        self.state = GroupState.WHOLE if self.keeps_whole else GroupState.FREE
