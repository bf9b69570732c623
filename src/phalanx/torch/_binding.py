"""What a ``"phalanx"`` torch process group runs on (:class:`Binding`), and how it follows a re-formed world."""

from __future__ import annotations

from typing import Any

from .. import _reconfigure
from .._epochs import Epoch
from .._errors import UsageError
from .._groups import Group

__all__ = ["Binding"]


class Binding:
    """What a :class:`PhalanxProcessGroup` runs on: a phalanx group, or None for the whole current world.

    The one named contract between torch's view of the world and phalanx's:
    the process group keeps a Binding, never a World, and asks it on each call.
    A Binding over the whole world (``rank``, ``size``: the numbering torch fixed)
    follows a re-formed world (``phalanx._reconfigure``: :func:`phalanx.reform`
    calls :meth:`rebind`): where this process keeps its rank and the world its size,
    nothing changes; else, since torch fixes a group's rank and size when it makes
    it, every later call raises UsageError naming the fix (``destroy_process_group``
    and ``phalanx.torch.init_process_group`` again). One over a phalanx group does
    not follow (the group belonged to the old world): :meth:`bind` moves it.
    """

    __slots__ = ("_group", "_fixed", "_stale", "__weakref__")

    def __init__(self, group: Group | None, rank: int | None = None, size: int | None = None) -> None:
        self._group = group
        self._fixed = None if rank is None or size is None else (rank, size)
        self._stale: str | None = None  # why the calls are refused (a re-formed world torch's numbering misses)
        if group is None and self._fixed is not None:
            _reconfigure.register(self)

    @property
    def group(self) -> Group | None:
        """The phalanx group every call runs on (None: the current world); UsageError once the world
        re-formed into one that torch's rank and size of this group no longer number."""
        if self._stale is not None:
            raise UsageError(self._stale)
        return self._group

    def bind(self, group: Group | None) -> None:
        """Run every later call on ``group`` (None: the current world)."""
        self._group, self._stale = group, None

    def rebind(self, epoch: Epoch) -> None:
        """Follow the re-formed world ``epoch`` (local): see the class notes. UsageError for a Binding
        over a phalanx group, which belonged to the old world."""
        if self._group is not None:
            raise UsageError(
                "phalanx: a torch.distributed group over a phalanx group cannot follow a re-formed world: "
                "the group belonged to the old one. Make the group again in the new world "
                "(torch.distributed.new_group), or bind() this one to a phalanx group of it.")
        if self._fixed is None or self._fixed == (epoch.rank, epoch.size):
            self._stale = None
            return
        rank, size = self._fixed
        self._stale = (
            f"torch.distributed on the 'phalanx' backend: this process group numbers this process rank {rank} "
            f"of {size}, and the world re-formed (epoch {epoch.number}) into rank {epoch.rank} of {epoch.size}; "
            "torch fixes a group's rank and size when it makes it. Call torch.distributed.destroy_process_group() "
            "and phalanx.torch.init_process_group() again after phalanx.reform().")

    def state_dict(self) -> dict[str, Any]:
        """Nothing: a Binding holds no state of its own (``{}``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to load (``state`` is a :meth:`state_dict`, ``{}``)."""
        return None
