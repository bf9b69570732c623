"""Horovod's process sets on phalanx's sub-worlds: ``ProcessSet``, ``global_process_set``,
``add_process_set``, ``remove_process_set``.

A process set is a ``phalanx.new_group(ranks)``: a sub-communicator on MPI, a
process group on gloo/nccl, with phalanx's checks and timeouts inside it. The
global process set is the whole world (``group=None``). ``add_process_set`` and
``remove_process_set`` are collective over the whole world, as in Horovod; unlike
Horovod they need no ``HOROVOD_DYNAMIC_PROCESS_SETS=1``. Roots (``broadcast``'s
``root_rank``) are global ranks, as in Horovod; phalanx's are group ranks, so the
shim maps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import phalanx

from ..._errors import InvalidArgumentError, UnsupportedArgumentError
from ._errmap import horovod_errors

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]


class ProcessSet:
    """A set of ranks that run collectives together: ``ProcessSet([0, 2])``, then
    ``hvd.add_process_set(ps)`` (or ``hvd.init(process_sets=[ps])``) on every rank, then
    ``hvd.allreduce(x, process_set=ps)`` on its members.

    Arguments: ``ranks_or_comm``: the global ranks (any order; kept sorted). An mpi4py
    communicator is not accepted (pass its ranks). Attributes: ``ranks`` (sorted list),
    ``process_set_id`` (None until registered; 0 for the global set). Methods: ``size()``,
    ``rank()`` (this process's rank in the set; None when not registered), ``included()``.
    Raises InvalidArgumentError for anything but a sequence of ints.
    """

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        if isinstance(ranks_or_comm, (str, bytes)) or not hasattr(ranks_or_comm, "__iter__"):
            raise InvalidArgumentError(
                f"hvd.ProcessSet({ranks_or_comm!r}): pass a list of global ranks, e.g. ProcessSet([0, 1]) "
                "(a set built from an mpi4py communicator: pass `comm` ranks in COMM_WORLD instead).")
        ranks = sorted(ranks_or_comm)
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise InvalidArgumentError(f"hvd.ProcessSet({ranks_or_comm!r}): ranks must be ints, e.g. [0, 2].")
        self.ranks: list[int] = ranks
        self.process_set_id: int | None = None
        self.mpi_comm = None
        self._group: Any = None  # phalanx Group once registered (None for the global set)
        self._index: dict[int, int] = {}  # global rank -> rank in the set

    def size(self) -> int | None:
        """The number of ranks in the set, or None when it is not registered."""
        if self.process_set_id is None:
            return None
        return phalanx.size() if self.process_set_id == 0 else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (None when not registered); InvalidArgumentError when
        this process is not a member."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return phalanx.rank()
        me = phalanx.rank()
        if me not in self._index:
            raise InvalidArgumentError(f"{self}.rank(): rank {me} is not part of this process set.")
        return self._index[me]

    def included(self) -> bool | None:
        """Whether this process is a member (None when the set is not registered)."""
        if self.process_set_id is None:
            return None
        return self.process_set_id == 0 or phalanx.rank() in self._index

    def set_rank_of(self, global_rank: int, call: str) -> int:
        """``global_rank``'s rank within the set (phalanx roots are set ranks; Horovod's are global)."""
        if self.process_set_id == 0:
            return global_rank
        try:
            return self._index[global_rank]
        except (KeyError, TypeError):
            raise InvalidArgumentError(
                f"hvd.{call}(root_rank={global_rank!r}): not a rank of {self}; Horovod roots are "
                f"global ranks, one of {self.ranks}.") from None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_registered: dict[int, ProcessSet] = {}
_next_id = [1]


def set_group(process_set: ProcessSet, call: str) -> Any:
    """The phalanx group of a registered set, for phalanx's collectives' ``group=`` (None: the whole world)."""
    if process_set is global_process_set:
        return None
    if not isinstance(process_set, ProcessSet) or process_set.process_set_id is None:
        raise InvalidArgumentError(
            f"hvd.{call}(process_set={process_set!r}): not a registered process set; register it on every "
            "rank with hvd.add_process_set(ps) or hvd.init(process_sets=[ps]) first.")
    return None if process_set.process_set_id == 0 else process_set._group


def set_size(process_set: ProcessSet) -> int:
    """The size of a registered set (the world's for the global set)."""
    return phalanx.size() if process_set.process_set_id == 0 else len(process_set.ranks)


@horovod_errors
def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set on every rank and return it (collective over the whole world).

    Arguments: ``process_set``: a :class:`ProcessSet` or a list of global ranks; every
    rank must pass the same ranks, in the same order of calls. Returns the registered set
    (``process_set_id`` set). Raises InvalidArgumentError for ranks out of range or a set
    registered already (Horovod's duplicate error), UnsupportedArgumentError when this
    phalanx has no sub-worlds (``phalanx.new_group``).
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    n = phalanx.size()
    if not ps.ranks or ps.ranks[0] < 0 or ps.ranks[-1] >= n or len(set(ps.ranks)) != len(ps.ranks):
        raise InvalidArgumentError(f"hvd.add_process_set({ps.ranks}): ranks must be distinct ints in 0..{n - 1}.")
    if any(other.ranks == ps.ranks for other in _registered.values()) or ps.process_set_id is not None:
        raise InvalidArgumentError(f"hvd.add_process_set: attempted to add a duplicate process set: {ps}.")
    new_group = getattr(phalanx, "new_group", None)
    if new_group is None:
        raise UnsupportedArgumentError(
            "hvd.add_process_set: this phalanx has no sub-worlds (phalanx.new_group); only "
            "hvd.global_process_set can be used.")
    ps._group = new_group(ps.ranks)
    ps._index = {r: i for i, r in enumerate(ps.ranks)}
    ps.process_set_id = _next_id[0]
    _next_id[0] += 1
    _registered[ps.process_set_id] = ps
    return ps


@horovod_errors
def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (collective over the world); returns whether it was
    registered. The global set is never removed (False)."""
    ps_id = getattr(process_set, "process_set_id", None)
    if ps_id is None or ps_id == 0 or _registered.get(ps_id) is not process_set:
        return False
    del _registered[ps_id]
    destroy = getattr(phalanx, "destroy_group", None)
    if destroy is not None:
        destroy(process_set._group)
    process_set.process_set_id, process_set._group, process_set._index = None, None, {}
    return True


def forget_all() -> None:
    """Drop every registered set (hvd.shutdown: their groups died with the world)."""
    for ps in _registered.values():
        ps.process_set_id, ps._group, ps._index = None, None, {}
    _registered.clear()
    global_process_set.ranks = []


def register_global(n: int) -> None:
    """hvd.init: the global set's ranks are the world's."""
    global_process_set.ranks = list(range(n))
