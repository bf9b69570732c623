"""Sub-worlds: ``phalanx.new_group(ranks)`` and the ``group=`` argument of every collective.

A :class:`Group` is made on every rank of the world (``new_group`` is
collective over the world, like ``torch.distributed.new_group``). On a member
it holds a :class:`GroupWorld`: the same :class:`~phalanx._world.World` as the
global one (its own call counter, fingerprint agreement, timeouts and broken
state) over a sub-backend (:meth:`Backend.subgroup`). Collectives find
it through :func:`world_for`.

What differs from the world: errors speak of the group and name its members
by world rank; a failure in a group (a timeout, a lost peer) breaks the group
and the world too (the job ends as it does today: the abort hook), and a
world broken by anything breaks its groups.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterable
from typing import Any

from ._agreement import agree, mismatch_error, timeout_error
from ._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    NotInGroupError,
    RankFailedError,
    UsageError,
)
from ._world import World, current, current_or_none
from .comm._base import Backend

__all__ = ["Group", "GroupWorld", "destroy_group", "new_group", "split_group", "world_for", "world_group"]


class Group:
    """A set of ranks that make collectives among themselves: ``phalanx.allreduce(x, group=g)``.

    Made by :func:`new_group` (or :func:`world_group` for the whole world) on
    every rank, members or not. Attributes: ``ranks`` (the world ranks, sorted),
    ``size``, ``member`` (True when this rank is one of them), ``rank`` (this
    rank's index in ``ranks``, the rank collectives on the group use, e.g. for
    ``root=``; None on non-members). Compared by identity.

    The constructor is internal (``ranks``, the world ``parent``, the member's
    ``world``, the ``serial`` number of the group in its world): use new_group.
    """

    __slots__ = ("ranks", "size", "member", "rank", "_parent", "_world", "_destroyed", "_serial",
                 "__weakref__")

    def __init__(self, ranks: tuple[int, ...], parent: World, world: World | None, serial: int = 0) -> None:
        self.ranks = ranks
        self.size = len(ranks)
        self.member = parent.rank in ranks
        self.rank: int | None = ranks.index(parent.rank) if self.member else None
        self._parent = parent
        self._world = world  # the member's World (the parent itself for world_group()); None elsewhere
        self._destroyed = False
        self._serial = serial  # the how-many-th group of its world (0: the world's own)

    def __repr__(self) -> str:
        state = " destroyed" if self._destroyed else (f" rank {self.rank}" if self.member else " (not a member)")
        return f"<phalanx.Group ranks={list(self.ranks)}{state}>"

    def release(self) -> None:
        """Release this group when its world shuts down (local, bounded, never raises).

        :func:`new_group` registers it with :meth:`World.on_shutdown`, so the world need not know groups.
        """
        try:
            _release(self._parent, self)
        except Exception:  # noqa: BLE001 - leaving must not fail on a group's teardown
            self._destroyed = True


class GroupWorld(World):
    """The World of a group, on a member: errors name the group and its members by world rank."""

    def __init__(self, backend: Backend, parent: World, group: Group) -> None:
        super().__init__(backend, timeout=parent.timeout, check=parent.check,
                         debug=parent.debug, devices=parent.devices)
        self.parent = parent
        self.group = group
        self.retry_mismatch = parent.retry_mismatch

    def _label(self) -> str:
        return f"group {list(self.group.ranks)}"

    def _world_rank(self, r: int) -> int:
        return self.group.ranks[r]

    def mark_broken(self, why: str) -> None:
        super().mark_broken(why)
        if self.parent.broken is None:  # the job ends as for any failure: the abort hook reads this
            self.parent.mark_broken(f"{why} in {self._label()}")

    def timed_out(self, call: str) -> CollectiveTimeoutError:
        """Diagnose which members are missing (bounded), break the group and the world, build the error."""
        error = timeout_error(self.backend, call, self.calls, self.timeout, members=self.group.ranks)
        self.mark_broken(f"{call} timed out")
        return error

    def peer_lost(self, call: str, exc: BaseException) -> RankFailedError:
        self.mark_broken(f"a peer was lost during {call}")
        return RankFailedError(
            f"phalanx.{call} in {self._label()}: a member died or closed its connection ({exc}). The "
            "failing rank's own error is in its output (`phalanx run` reports it first). This group and "
            "its world cannot be used any more.")

    def explain_mismatch(self, call: str, buf: Any, op: str | None, root: int,
                         step: int | None = None, *, retry: bool = False) -> None:
        """Every member reached here together: exchange descriptions and raise the same error
        (or return, with ``retry``, as :meth:`World.explain_mismatch`)."""
        entries = self.allgather_json(call, self.describe(call, buf, op, root, step))
        error = mismatch_error(call, self.rank, entries)
        if not isinstance(error, RankFailedError) and self.retry_mismatch is not None \
                and self.retry_mismatch(self, entries, retry):
            return
        mapping = ", ".join(f"group rank {r} = world rank {w}" for r, w in enumerate(self.group.ranks))
        text = str(error).replace(f"phalanx.{call}", f"phalanx.{call} in {self._label()}", 1)
        raise type(error)(f"{text}\n(Ranks above are ranks of the group: {mapping}.)")


def world_for(group: Group | None, call: str) -> World:
    """The World to run ``call`` on: the global one for ``group=None``, else the group's.

    Raises NotInitializedError before ``init()``, InvalidArgumentError for a
    ``group`` that is not a Group, NotInGroupError on a rank outside the group,
    UsageError for a destroyed group or one of a world that was shut down.
    """
    if group is None:
        return current(call)
    if type(group) is Group:
        world, parent = group._world, group._parent
        if world is not None and parent.broken is None and parent is current_or_none():
            return world
    return _resolve(group, call)


def _resolve(group: Any, call: str) -> World:
    """world_for's slow path: every way ``group`` can be unusable, as an error (or a broken world)."""
    if not isinstance(group, Group):
        raise InvalidArgumentError(f"phalanx.{call}(group={group!r}): pass a group made by "
                                   "phalanx.new_group(ranks) (or phalanx.world_group()), or None for the "
                                   "whole world.")
    if group._destroyed:
        raise UsageError(f"phalanx.{call}(group={group!r}): the group was destroyed by "
                         "phalanx.destroy_group(); make a new one with phalanx.new_group(ranks).")
    if group._parent is not current(call):
        raise UsageError(f"phalanx.{call}(group={group!r}): the group belongs to a world that was shut "
                         "down; make groups again after phalanx.init().")
    world = group._world
    if world is None:
        raise NotInGroupError(
            f"phalanx.{call}(group={group!r}): this rank (world rank {group._parent.rank}) is not a "
            f"member of the group (world ranks {list(group.ranks)}), so it cannot take part in its "
            f"collectives. Call it only on members, e.g. `if group.member: phalanx.{call}(..., "
            "group=group)`.")
    if world.broken is None:  # the parent is broken: so is every group of it
        world.mark_broken(f"the world is unusable ({group._parent.broken})")
    return world


def world_group() -> Group:
    """The Group of the whole world: ``ranks`` is ``0..size()-1`` and ``group=world_group()`` is ``group=None``.

    The same object on every call in one world. Raises NotInitializedError
    before :func:`phalanx.init`.
    """
    world = current("world_group")
    if world.world_group is None:
        world.world_group = Group(tuple(range(world.size)), world, world)
    return world.world_group


def _normalize(ranks: Any, size: int) -> tuple[tuple[int, ...] | None, str]:
    """(sorted ranks, "") or (None, what is wrong with ``ranks``)."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        return None, f"got {type(ranks).__name__}; pass a list of world ranks, e.g. new_group([0, 2])"
    items = list(ranks)
    bad = [r for r in items if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < size]
    if bad:
        return None, f"{bad[0]!r} is not a rank of this world (ranks 0..{size - 1})"
    if not items:
        return None, "a group needs at least one rank"
    if len(set(items)) != len(items):
        return None, "a rank is listed twice"
    return tuple(sorted(items)), ""


def _agree(world: World, call: str, key: tuple[int, ...], shown: Any) -> None:
    """World-wide agreement that every rank makes ``call`` on the same ``key``; mismatch on every rank."""
    entries = agree(world, call, list(key), lambda: shown)
    if entries is None:
        return
    lines = "\n".join(f"  rank {r}: phalanx.{call}({e})" for r, e in enumerate(entries))
    raise CollectiveMismatchError(
        f"phalanx.{call}: the ranks passed different groups, so nothing was made or destroyed:\n{lines}\n"
        f"Every rank of the world, members or not, must call phalanx.{call} with the same group, in "
        "the same order.")


def new_group(ranks: Iterable[int]) -> Group:
    """Make a group of world ranks ``ranks``, whose collectives run among its members only.

    Collective over the whole world: every rank calls it (members and others),
    with the same ranks, in the same order. Then ``phalanx.allreduce(x,
    group=g)`` (and every other collective) runs on the members; roots are
    group ranks (``g.rank``), 0..``g.size``-1.

    Arguments: ``ranks``: the world ranks of the group (any order; stored sorted).

    Returns a :class:`Group` on every rank (``g.member`` says whether this rank is
    in it). Raises InvalidArgumentError (a rank out of range or twice, no ranks:
    on every rank alike), CollectiveMismatchError (ranks passed different groups,
    on every rank), CollectiveTimeoutError (a rank never called it), RankFailedError.
    """
    world = current("new_group")
    chosen, problem = _normalize(ranks, world.size)
    shown = list(chosen) if chosen is not None else repr(ranks)
    key = chosen if chosen is not None else (-1, zlib.crc32(repr(ranks).encode()))
    _agree(world, "new_group", key, shown)
    if chosen is None:
        raise InvalidArgumentError(f"phalanx.new_group(ranks={ranks!r}): {problem}.")
    world.groups_made += 1
    with world.guard("new_group"):
        sub = world.backend.subgroup(chosen, world.groups_made, world.timeout)
    group = Group(chosen, world, None, world.groups_made)
    if sub is not None:
        group._world = GroupWorld(sub, world, group)
    world.on_shutdown(group.release)
    return group


def split_group(ranks: Iterable[int]) -> Group:
    """This rank's group of a partition of the world: each rank names the group it belongs to.

    Collective over the whole world, like :func:`new_group`, but each rank passes
    its own group: ``split_group([0, 1])`` on ranks 0 and 1 and ``split_group([2])``
    on rank 2 make two groups. (torch's ``new_group`` calls and ``DeviceMesh``
    dimensions reach phalanx's process group this way: torch asks the members of
    each group only, and the groups of one dimension partition the world.)

    Arguments: ``ranks``: the world ranks of this rank's group (any order).

    Returns this rank's :class:`Group`. Raises CollectiveMismatchError (the groups
    named do not partition the world: a rank outside its own group, or members that
    named different groups; on every rank), InvalidArgumentError, CollectiveTimeoutError
    (a rank never called it), RankFailedError.
    """
    world = current("split_group")
    chosen, problem = _normalize(ranks, world.size)
    world.enter("split_group", None)
    entries = world.allgather_json("split_group", list(chosen) if chosen is not None else repr(ranks))
    wrong = [r for r, g in enumerate(entries)
             if not isinstance(g, list) or r not in g or any(entries[m] != g for m in g)]
    if wrong:
        lines = "\n".join(f"  rank {r}: {entries[r]}" for r in range(len(entries)))
        raise CollectiveMismatchError(
            f"phalanx.split_group: the groups the ranks named do not partition the world (ranks {wrong} "
            f"disagree with their groups), so nothing was made:\n{lines}\nEach rank must name the group it "
            "belongs to, and every member of a group the same group.")
    if chosen is None:  # unreachable: a bad list is named by its rank above; kept for the type
        raise InvalidArgumentError(f"phalanx.split_group(ranks={ranks!r}): {problem}.")
    world.groups_made += 1
    with world.guard("split_group"):
        sub = world.backend.subgroup(chosen, world.groups_made, world.timeout, members_only=True)
    group = Group(chosen, world, None, world.groups_made)
    if sub is not None:
        group._world = GroupWorld(sub, world, group)
    world.on_shutdown(group.release)
    return group


def destroy_group(group: Group) -> None:
    """Release ``group``'s transport; using the group afterwards raises UsageError.

    Collective over the whole world, like :func:`new_group`: every rank calls it
    with the same group, in the same order. Destroying a group twice does
    nothing; :func:`phalanx.shutdown` destroys every group left.

    Raises InvalidArgumentError (not a group, or the world's own group),
    CollectiveMismatchError (ranks destroyed different groups), CollectiveTimeoutError.
    """
    world = current("destroy_group")
    if not isinstance(group, Group):
        raise InvalidArgumentError(f"phalanx.destroy_group(group={group!r}): pass a group made by "
                                   "phalanx.new_group(ranks).")
    own = group._parent is world and not group._destroyed and group._serial > 0  # not world_group()
    key = (group._serial, *group.ranks) if own else (-1,)
    _agree(world, "destroy_group", key, list(group.ranks) if own else repr(group))
    if group._destroyed:
        return
    if not own:
        raise InvalidArgumentError(f"phalanx.destroy_group({group!r}): not a group of this world made by "
                                   "phalanx.new_group (the world's own group ends with phalanx.shutdown()).")
    _release(world, group)


def _release(world: World, group: Group) -> None:
    world.on_shutdown(group.release, cancel=True)
    group._destroyed = True
    sub_world, group._world = group._world, None
    if sub_world is not None:
        with contextlib.suppress(Exception):  # a lost peer must not fail the teardown
            sub_world.backend.shutdown()
