"""A world that changes while it runs: epochs, re-forming in place with the survivors, replacements.

::

    phalanx run -n 4 --backend gloo --max-restarts 3 train.py   # or --min-ranks M (shrink only)

    phalanx.init(elastic=True)                 # this script recovers in place: keep the survivors
    while step < steps:
        try:
            train_step()
        except phalanx.RankFailedError:        # a peer died, stalled past the timeout, or was cut off
            phalanx.reform()                   # the survivors meet again: a new epoch, renumbered ranks
            state = restore_from_a_live_peer() # e.g. phalanx.train.fit(elastic=True) does this for you

Under ``phalanx run`` with ``--max-restarts`` or ``--min-ranks`` on gloo or nccl,
the launcher serves the rendezvous store and decides every epoch's members
(:mod:`phalanx.launch._epochs`); no rank, rank 0 included, holds anything the
others need to meet again. Each rank keeps a connection to that store
(:class:`StoreMembership`, one implementation of the :class:`Membership` contract; ULFM's
:class:`phalanx._epochs_ulfm.UlfmMembership` is the other) for the whole job:

* while a collective waits, it looks (every quarter second) whether the launcher
  marked the epoch broken (a rank exited, or a peer asked to re-form), so a
  survivor's pending call raises at once instead of waiting out the timeout;
* :func:`reform` checks in for the next epoch and waits for the launcher's
  decision: the members that checked in, plus replacements waiting to join.
  Only a side holding a strict majority of the last epoch continues, or one
  whose launcher saw the missing ranks exit; fewer ranks than ``--min-ranks``
  never continue. A rank left out raises :class:`QuorumLostError` naming why;
* a replacement (started by the launcher for a lost rank) waits in ``init`` to
  be admitted; the survivors admit it at their next step boundary (the launcher
  raises the epoch's ``grow`` flag, :func:`grow_requested` reads it).

The store's keys (``e<E>/members``, ``e<E>/broken``, ``e<E>/grow``, ``e<E>/alive/<m>``,
``e<E>/verdict``, ``declared/<m>``, ``join/<m>``, ``admit/<m>``) are spelled in one place,
:mod:`phalanx._epoch_keys`, which the launcher's side uses too.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from . import _epoch_keys as keys
from ._current import current, current_or_none
from ._errors import (
    CollectiveTimeoutError,
    QuorumLostError,
    RankFailedError,
    UsageError,
    WorldBrokenError,
)

if TYPE_CHECKING:
    from .comm._guard import Guard

__all__ = ["ELASTIC_ENV", "JOINING_ENV", "MEMBER_ENV", "Epoch", "Membership", "StoreMembership", "available", "declare",
           "epoch", "first_epoch", "grow_requested", "joined_late", "membership", "recoverable", "recovers",
           "required", "ulfm", "why_not_continue"]

ELASTIC_ENV = "PHALANX_ELASTIC"  # "host:port": the launcher's store (behind the job's guard)
MEMBER_ENV = "PHALANX_MEMBER"  # this process's member id (0..n-1 at the start, then n, n+1, ... for replacements)
JOINING_ENV = "PHALANX_JOINING"  # "1": a replacement, admitted into a running job
_CHECK_S = 0.2  # how often rank 0 asks the store whether a replacement waits (at step boundaries)


@dataclass(frozen=True)
class Epoch:
    """One formation of the world: its ``number`` (0 at the start), this process's ``rank`` of ``size``,
    the ``members`` (stable ids, in rank order), and what changed from the epoch before: the members
    ``lost`` and ``joined``, and this process's ``previous_rank`` (None when it just joined)."""

    number: int
    rank: int
    size: int
    members: tuple[int, ...]
    lost: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    previous_rank: int | None = None


class Membership(Protocol):
    """The recovery contract: this rank's part in a world with epochs, for the whole job.

    :class:`StoreMembership` keeps it through the launcher's store (gloo, nccl);
    :class:`phalanx._epochs_ulfm.UlfmMembership` through MPI itself (Open MPI 5's ULFM).
    ``reform()`` and ``fit(elastic=True)`` use only this (what follows the new world: :mod:`._reconfigure`).
    """

    epoch: Epoch | None  # the current epoch, once :meth:`first` returned it
    declared: bool  # this rank re-forms in place (:meth:`declare`)
    admitted_late: bool  # a replacement, until its first re-formation

    def first(self) -> Epoch:
        """The epoch this process starts in: 0 for the job's first ranks, the admitting one for a replacement."""
        ...

    def reform(self, reason: str) -> Epoch:
        """The epoch after the current one (``reason``: why it ended), or QuorumLostError."""
        ...

    def announce(self, reason: str) -> None:
        """Tell the peers that the current epoch ended (``reason``), so their pending calls stop waiting."""
        ...

    def declare(self) -> None:
        """This rank survives a lost peer by re-forming."""
        ...

    def grow_requested(self) -> bool:
        """Whether a replacement waits to be admitted into the current epoch's world."""
        ...

    def interrupted(self) -> str | None:
        """Why the current epoch ended, once a peer or the launcher said so; else None."""
        ...

    def close(self) -> None:
        """Let go of what the membership holds (its connection)."""
        ...


class StoreMembership:
    """This rank's connection to the launcher's store, for the whole job (see the module notes):
    a :class:`Membership`."""

    def __init__(self, where: str, member: int, joining: bool, timeout: float) -> None:
        from .comm._epoch_store import connect

        self.where, self.member, self.joining = where, member, joining
        self.timeout = timeout
        self.store, guard = connect(where, timeout)
        self._guard: Guard | None = guard
        self.epoch: Epoch | None = None
        self.declared = False
        self._looked = 0.0
        self.admitted_late = joining

    # -- reading the store ---------------------------------------------------------
    def _get(self, key: str) -> str | None:
        try:
            if not self.store.check([key]):
                return None
            return bytes(self.store.get(key)).decode()
        except RuntimeError as exc:
            raise QuorumLostError(
                f"phalanx: rank lost the launcher's rendezvous store at {self.where} ({exc}). The launcher "
                "(`phalanx run` on the first host) serves it for the whole job: it has ended, or this host "
                "was cut off from it (a network partition). This rank cannot continue; the others go on "
                "without it where they hold a majority.") from None

    def _set(self, key: str, value: str) -> None:
        try:
            self.store.set(key, value)
        except RuntimeError as exc:
            raise QuorumLostError(f"phalanx: rank could not write to the launcher's rendezvous store at "
                                  f"{self.where} ({exc}); the launcher has ended or this host was cut off from "
                                  "it (a network partition). This rank cannot continue.") from None

    def interrupted(self) -> str | None:
        """Why the current epoch ended, once the launcher (or a peer) marked it broken; else None."""
        if self.epoch is None:
            return None
        try:
            return self._get(keys.broken(self.epoch.number))
        except RankFailedError as exc:
            return str(exc)

    def grow_requested(self) -> bool:
        """Whether the launcher asks the current epoch to admit a replacement (looked up at most every
        0.2 s; call it on one rank and share the answer: ranks must decide together)."""
        now = time.monotonic()
        if self.epoch is None or now - self._looked < _CHECK_S:
            return False
        self._looked = now
        return self._get(keys.grow(self.epoch.number)) is not None

    def declare(self) -> None:
        """Tell the launcher that this rank survives a lost peer by re-forming (set once)."""
        if not self.declared:
            self._set(keys.declared(self.member), repr(self.timeout))  # the launcher waits this long
            self.declared = True

    # -- epochs ----------------------------------------------------------------------
    def first(self) -> Epoch:
        """The epoch this process starts in: 0 for the job's first ranks, the admitting one for a replacement."""
        if not self.joining:
            self.epoch = self._read(0, None)
            return self.epoch
        self._set(keys.joined(self.member), json.dumps({"pid": os.getpid()}))
        # as long as the launcher lives: the survivors admit it at their next step boundary, or tell it to leave
        number = self._await(keys.admit(self.member), None, "to be admitted into the running job", None)
        if int(number) < 0:  # the survivors finished before a step boundary could admit this replacement
            print(f"phalanx: the replacement in slot {os.environ.get('RANK', '?')} was not needed: the job "
                  "finished before it could join.", file=sys.stderr, flush=True)
            raise SystemExit(0)
        self.epoch = self._read(int(number), None)
        self.declared = True  # a replacement only exists in a job that re-forms
        return self.epoch

    def reform(self, reason: str) -> Epoch:
        """Check in for the epoch after the current one; its :class:`Epoch`, or QuorumLostError."""
        assert self.epoch is not None  # internal invariant: reform() runs in a formed world
        old = self.epoch
        self.announce(reason)
        self._set(keys.alive(old.number, self.member), json.dumps({"pid": os.getpid(), "rank": old.rank}))
        self._await(keys.members(old.number + 1), keys.verdict(old.number), "for the launcher to re-form the world")
        self.epoch = self._read(old.number + 1, old)
        self.admitted_late = False
        return self.epoch

    def announce(self, reason: str) -> None:
        """Mark the current epoch broken (``reason``), unless the launcher or a peer did already."""
        assert self.epoch is not None  # internal invariant
        key = keys.broken(self.epoch.number)
        if self._get(key) is None:
            self._set(key, reason)

    def _await(self, key: str, verdict: str | None, what: str, limit: float | None = -1.0) -> str:
        """``key``'s value once set; QuorumLostError with ``verdict``'s once that is set, or after ``limit``
        seconds (default: twice the timeout and 30 s: the launcher waits up to the timeout for ranks
        still checking in; None: no limit but the store's, which fails when the launcher is gone)."""
        if limit is not None and limit < 0:
            limit = 2 * self.timeout + 30
        deadline, pause = time.monotonic() + (limit if limit is not None else float("inf")), 0.002
        while True:
            value = self._get(key)
            if value is not None:
                return value
            refused = self._get(verdict) if verdict is not None else None
            if refused is not None:
                raise QuorumLostError(refused)
            if time.monotonic() > deadline:
                raise QuorumLostError(
                    f"phalanx.reform: rank waited {limit:g} s {what}, and the launcher at {self.where} gave no "
                    "answer. It has stopped the job, or this host was cut off from it.")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _read(self, number: int, old: Epoch | None) -> Epoch:
        raw = self._get(keys.members(number))
        if raw is None:
            raise QuorumLostError(f"phalanx: epoch {number} has no members in the launcher's store at {self.where}.")
        members = tuple(int(m) for m in json.loads(raw))
        if self.member not in members:
            lost_why = self._get(keys.broken(number - 1)) or "a failure"
            raise QuorumLostError(
                f"phalanx.reform: the launcher re-formed the world without this rank (member {self.member}) "
                f"in epoch {number} of {len(members)} rank(s), after {lost_why}: it did not check in within "
                "the timeout (stalled, or cut off from the launcher). This rank ends; the job continues "
                "without it.")
        before = old.members if old is not None else ()
        return Epoch(number, members.index(self.member), len(members), members,
                     lost=tuple(m for m in before if m not in members),
                     joined=tuple(m for m in members if m not in before) if old is not None else (),
                     previous_rank=old.rank if old is not None else None)

    def close(self) -> None:
        if self._guard is not None:
            self._guard.close()
            self._guard = None


_MEMBERSHIP: Membership | None = None


COMMAND_ENV = "PHALANX_RANK_COMMAND"  # ULFM: JSON, the command every rank runs (a replacement is spawned with it)
FORWARDED_ENV = "PHALANX_FORWARDED"  # ULFM: the variables phalanx run forwards to every rank (comma-separated)
REPLACEMENTS_ENV = "PHALANX_REPLACEMENTS"  # ULFM: how many replacements the ranks may spawn (--max-restarts)
ULFM = "ulfm"  # ELASTIC_ENV's value in an MPI job under Open MPI's ULFM (phalanx._epochs_ulfm): no store


def ulfm() -> bool:
    """Whether this process's MPI world re-forms in place through ULFM (``phalanx run --backend mpi``
    with ``--max-restarts`` or ``--min-ranks`` under Open MPI 5: ``mpirun --with-ft ulfm``)."""
    return os.environ.get(ELASTIC_ENV, "").strip() == ULFM


def why_not_continue(last: int, survivors: int, members: int, min_ranks: int, seen_exit: bool) -> str | None:
    """Why the survivors of an epoch of ``last`` ranks cannot continue as a world of ``members``
    (survivors plus replacements), or None where they can: the one rule of who continues (the
    launcher's :mod:`phalanx.launch._epochs` and ULFM's :mod:`phalanx._epochs_ulfm` both ask it).
    Only a strict majority of the last epoch continues, or survivors whose missing peers were seen
    to exit (``seen_exit``: so a partition never splits a job in two), never fewer than ``min_ranks``."""
    if members < min_ranks:
        return f"fewer than --min-ranks {min_ranks}"
    if not survivors or not (2 * survivors > last or seen_exit):
        return "no strict majority of the last epoch, and the missing ranks were not seen to exit"
    return None


def available(backend: str | None = None) -> bool:
    """Whether this process was started by a launcher that re-forms worlds (``phalanx run`` with
    ``--max-restarts`` or ``--min-ranks`` on gloo/nccl, or on mpi under ULFM), and its world can:
    not when the script made torch.distributed's group itself (phalanx then uses that group as it
    is, as without the flags). ``backend``: the world's backend name (default: the current world's)."""
    if not os.environ.get(ELASTIC_ENV, "").strip():
        return False
    if backend is None:
        world = current_or_none()
        backend = None if world is None else world.backend.name
    if ulfm() or backend == "mpi":
        return ulfm() and backend in ("mpi", None)
    dist = sys.modules.get("torch.distributed")
    return _MEMBERSHIP is not None or dist is None or not dist.is_available() or not dist.is_initialized()


def membership() -> Membership | None:
    """This process's :class:`Membership` (a :class:`StoreMembership` or an ``UlfmMembership``) once its
    world formed, else None."""
    return _MEMBERSHIP


def first_epoch(timeout: float, make: Callable[[int, float], Membership] | None = None) -> Epoch:
    """Connect to the launcher's store (or, with ``make(member, timeout)``, make another :class:`Membership`:
    ULFM's, :mod:`._epochs_ulfm`) and return the epoch this process starts in (``init`` calls it)."""
    global _MEMBERSHIP
    if _MEMBERSHIP is None:
        member = os.environ.get(MEMBER_ENV, os.environ.get("RANK", "0"))
        if make is not None:
            _MEMBERSHIP = make(int(member), timeout)
        else:
            _MEMBERSHIP = StoreMembership(os.environ[ELASTIC_ENV].strip(), int(member),
                                          os.environ.get(JOINING_ENV) == "1", timeout)
        assert _MEMBERSHIP is not None
        return _MEMBERSHIP.first()
    if _MEMBERSHIP.epoch is None:  # pragma: no cover - first() raised before: try again
        return _MEMBERSHIP.first()
    raise UsageError(
        "phalanx.init: called again after phalanx.shutdown() in a job whose world re-forms in place (phalanx run "
        "--backend gloo with --max-restarts or --min-ranks): the world's epoch cannot be formed twice. Keep the "
        "world for the whole script (phalanx.reform() re-forms it after a failure), or run without those flags.")


def required(call: str) -> Membership:
    """This process's membership, or UsageError naming ``call`` and the fix where worlds cannot re-form."""
    world = current(call)
    if _MEMBERSHIP is None or world.epoch is None:
        raise UsageError(
            f"phalanx.{call}: this world cannot re-form: it was not started by a launcher that keeps the "
            "rendezvous. Run the script with `phalanx run -n N --backend gloo --max-restarts K train.py` "
            "(or --min-ranks M to continue on fewer ranks); mpi worlds re-form only under Open MPI 5 "
            "(its ULFM), and restart whole elsewhere (docs/cluster.md, \"Restarts\").")
    return _MEMBERSHIP


def epoch() -> int:
    """The world's epoch: 0 until it is first re-formed (always 0 where worlds never re-form)."""
    number = current("epoch").epoch
    return 0 if number is None else int(number)


def declare() -> None:
    """Declare that this rank recovers from a lost peer in place (``init(elastic=True)`` and
    ``fit(elastic=True)`` call it): from
    now on the launcher keeps the survivors running when a rank is lost, instead of ending the job.
    Every rank must declare; a job where some rank has not behaves as without it. UsageError where
    worlds cannot re-form."""
    required("declare").declare()


def recovers() -> bool:
    """Whether this rank declared that it recovers in place (``init(elastic=True)``, ``fit(elastic=True)``)."""
    return _MEMBERSHIP is not None and _MEMBERSHIP.declared


def joined_late() -> bool:
    """True on a replacement until its first re-formation: its state must come from the live peers."""
    return _MEMBERSHIP is not None and _MEMBERSHIP.admitted_late


def grow_requested() -> bool:
    """Whether a replacement waits to be admitted (cheap: the store is asked at most every 0.2 s).
    Ranks may see it at different steps: decide on one rank and share the answer."""
    return _MEMBERSHIP is not None and _MEMBERSHIP.grow_requested()


def recoverable(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost peer that :func:`reform` can recover from (in a world that re-forms)."""
    if _MEMBERSHIP is None or isinstance(exc, QuorumLostError):
        return False
    return isinstance(exc, (RankFailedError, CollectiveTimeoutError, WorldBrokenError))


def describe_loss(exc: BaseException) -> str:
    """One line for a recoverable failure, for notices."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
