"""The launcher's side of a world with epochs: the store, who is in each epoch, and replacements.

``phalanx run -n N --backend gloo --max-restarts K`` (or ``--min-ranks M``) on one
host serves the job's rendezvous store here, not in rank 0 (:mod:`phalanx.comm._epoch_store`),
so it outlives any rank. The ranks' side is :mod:`phalanx._epochs`; both name the store's keys
through :mod:`phalanx._epoch_keys`.

The spawner (:mod:`._spawn`) calls :meth:`Coordinator.tick` every poll. While not every member
of the current epoch has declared that it re-forms (``fit(elastic=True)`` does), nothing
changes: the first failure ends the job as always, and ``--max-restarts`` restarts it whole.
Once all have:

* a member that dies (a signal, ``os._exit``, the OOM killer) is *absorbed* (the job goes on):
  the epoch is marked broken, so the survivors' pending collectives raise within a quarter
  second. A rank that raises an uncaught exception leaves a record and ends the job as always
  (its error is the script's, not a lost rank); one that ends its script (status 0) is gone
  from the next epoch and ends the admission of replacements;
* the next epoch forms once every member of the current one has checked in or is gone.
  One that has neither checked in nor exited ``timeout`` seconds after the re-forming
  began (stalled) is killed, so that it is gone for certain before the others continue;
* only a strict majority of the last epoch continues, or the survivors of members this
  launcher saw exit (on one host it sees every exit, so a lone survivor of 2 continues);
  and never fewer than ``--min-ranks``: otherwise the epoch's verdict says why, the
  survivors raise QuorumLostError, and the job ends as a failure;
* with restarts left (``--max-restarts``), a lost member's slot gets a replacement
  process; it waits to be admitted, the launcher raises the epoch's ``grow`` flag, and
  the survivors admit it at their next step boundary (the next epoch: survivors first,
  in their order, then replacements).

Each process has a *member id* (``PHALANX_MEMBER``: 0..N-1, then N, N+1, ...) and
keeps the *slot* (``RANK`` in its environment, its log ``rank.<slot>.log``) of the
process it replaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import _epoch_keys as keys
from .._epochs import ELASTIC_ENV, JOINING_ENV, MEMBER_ENV, why_not_continue
from ._job import Launch, notice
from ._jobdir import any_record
from ._procs import signal_name

__all__ = ["Coordinator", "kill_member", "wants_epochs"]

_GRACE_AFTER_TIMEOUT = 5.0  # seconds beyond the ranks' timeout before a silent member counts as stalled


def wants_epochs(job: Launch) -> bool:
    """Whether ``job`` gets a world that can re-form in place: gloo/nccl on this host, with
    ``--max-restarts`` or ``--min-ranks`` (``phalanx.train.fit(elastic=True)`` then uses it)."""
    return job.backend in ("gloo", "nccl") and bool(job.max_restarts or job.min_ranks is not None)


@dataclass
class _Member:
    id: int
    slot: int
    pid: int
    admitted: bool = True


@dataclass
class _Reform:
    """A re-forming in progress: since when, the members known gone (id -> how), and those of them
    not seen to exit (a stalled rank on another host, which may only be cut off)."""

    since: float
    gone: dict[int, str] = field(default_factory=dict)
    unseen: set[int] = field(default_factory=set)


class Coordinator:
    """Serves the store and decides the epochs of one job's ranks (see the module notes)."""

    def __init__(self, job: Launch, port: int, secret: str, timeout: float, address: str = "127.0.0.1",
                 stop: Callable[[_Member], bool] | None = None) -> None:
        """``address``: where the ranks reach the store (loopback on one host); ``stop(member)`` kills a
        stalled member and says whether it is gone for certain (default: this host's process, waited for)."""
        from ..comm._epoch_store import serve

        self.address = address
        self.stop = stop or _kill_here
        self._respawn: Callable[[int, dict[str, str]], int] | None = None
        self.server = serve(port, secret, address)
        self.store = self.server.store
        self.n, self.timeout = job.n, timeout
        restarts = int(job.env.get("PHALANX_RESTART_COUNT", "0") or 0)  # whole restarts so far (._elastic)
        self.restarts_left = max(0, job.max_restarts - restarts - len(job.replaced))
        self.replaced = job.replaced  # shared with the whole-job restarts (._elastic): one budget
        self.min_ranks = job.min_ranks or 1
        self.epoch = 0
        self.current: list[int] = list(range(job.n))  # member ids in rank order
        self.members: dict[int, _Member] = {}
        self.next_id = job.n
        self.declared: set[int] = set()
        self.reform: _Reform | None = None
        self.grow_raised = False
        self.killed: dict[int, int] = {}  # slot -> member id of a stalled rank this launcher killed
        self.ended = False  # a verdict ended the job: failures end it as always from now on
        self.finishing = False  # a member ended its script: replacements no longer join
        self.exited: set[int] = set()  # members that ended their script (exit status 0)
        self.timeouts: dict[int, float] = {}  # each declared member's own collective timeout
        self.store.set(keys.members(0), json.dumps(self.current))

    # -- what the ranks get ----------------------------------------------------------
    def env(self, slot: int, member: int | None = None) -> dict[str, str]:
        """The environment a rank of slot ``slot`` gets (``member``: a replacement's new id)."""
        out = {ELASTIC_ENV: f"{self.address}:{self.server.port}", MEMBER_ENV: str(slot if member is None else member),
               "PHALANX_MIN_RANKS": str(self.min_ranks)}
        if member is not None:
            out[JOINING_ENV] = "1"
        return out

    def started(self, slot: int, pid: int, member: int | None = None) -> None:
        """The spawner started ``pid`` for ``slot`` (a replacement: with its ``member`` id)."""
        m = slot if member is None else member
        self.members[m] = _Member(m, slot, pid, admitted=member is None)

    def close(self) -> None:
        self.server.close()

    def failing(self, job_dir: str) -> bool:
        """Whether a rank's record ends the job: any record (a raised exception is the script's)."""
        return any_record(job_dir)

    # -- every poll ------------------------------------------------------------------------
    def tick(self, deaths: dict[int, Any], respawn: Callable[[int, dict[str, str]], int]) -> list[int]:
        """Look at the ranks' ends (``deaths``: slot -> Death, of the processes now at each slot) and the
        store; returns the slots whose failure the job absorbs (the spawner forgets those processes).
        ``respawn(slot, env)`` starts a replacement at ``slot`` and returns its pid."""
        if self.ended:
            return []
        self._respawn = respawn
        absorbed: list[int] = []
        by_slot = {m.slot: m for m in self.members.values()}
        elastic = self._all_declared()
        for slot, death in deaths.items():
            if slot in self.killed:  # a stalled member this launcher killed: already out of its epoch
                del self.killed[slot]
                absorbed.append(slot)
                self._replace(slot, respawn)
                continue
            member = by_slot.get(slot)
            if member is not None and death.code == 0 and member.id not in self.exited:
                self.exited.add(member.id)  # it ended its script: gone, never waited for or killed
                self._finishing()  # and no replacement can join any more
            if member is None or death.code == 0 or not (elastic or not member.admitted):
                continue
            absorbed.append(slot)
            del self.members[member.id]
            how = _how(death.code)
            if member.id in self.current:
                self._begin(f"rank {self.current.index(member.id)} (pid {member.pid}) {how}")
                assert self.reform is not None
                self.reform.gone[member.id] = how
            notice(f"the rank in slot {slot} (pid {member.pid}) {how}; the job continues in place"
                   f"{'' if member.id in self.current else ' (it had not joined yet)'}.")
            self._replace(slot, respawn)
        if elastic:
            self._progress()
        return absorbed

    def _replace(self, slot: int, respawn: Callable[[int, dict[str, str]], int]) -> None:
        """Start a replacement at ``slot`` while ``--max-restarts`` allow it (not once the job is ending)."""
        if self.restarts_left <= 0 or self.finishing or self.ended:
            return
        self.restarts_left -= 1
        self.replaced.append(slot)
        new = self.next_id
        self.next_id += 1
        pid = respawn(slot, self.env(slot, new))
        self.started(slot, pid, new)
        where = f"pid {pid}; " if pid else ""  # 0: on another host (its launcher said where)
        notice(f"started a replacement for slot {slot} ({where}{self.restarts_left} more allowed by "
               "--max-restarts); it joins at the survivors' next step boundary.")

    def _finishing(self) -> None:
        """The job is ending: replacements still waiting to join are told to leave (exit status 0)."""
        if not self.finishing:
            self.finishing = True
            for m in self.members.values():
                if not m.admitted:
                    self.store.set(keys.admit(m.id), "-1")

    def in_place(self) -> bool:
        """Whether the job now re-forms in place: every member of the epoch declared it, and no verdict ended it."""
        return not self.ended and self._all_declared()

    def _all_declared(self) -> bool:
        for m in self.current:
            key = keys.declared(m)
            if m not in self.declared and self.store.check([key]):
                self.declared.add(m)
                with contextlib.suppress(ValueError):  # the rank's own timeout (init(timeout=...))
                    self.timeouts[m] = float(bytes(self.store.get(key)).decode())
        return bool(self.current) and all(m in self.declared for m in self.current)

    def _timeout(self) -> float:
        """How long a rank of the current epoch may wait in a collective: the longest of theirs."""
        theirs = [self.timeouts[m] for m in self.current if m in self.timeouts]
        return max(theirs) if theirs else self.timeout

    def _begin(self, why: str) -> None:
        """Start re-forming (once per epoch): mark the epoch broken, so waiting ranks stop waiting."""
        if self.reform is None:
            self.reform = _Reform(time.monotonic())
        key = keys.broken(self.epoch)
        if not self.store.check([key]):
            self.store.set(key, why)

    def _progress(self) -> None:
        checked = [m for m in self.current if self.store.check([keys.alive(self.epoch, m)])]
        if self.reform is None and checked:  # a rank asked (a timeout, a grow, its own reform() call)
            self._begin(self._get(keys.broken(self.epoch)) or "a rank asked to re-form the world")
        if self.reform is None:
            self._offer_joiners()
            return
        gone = self.reform.gone
        gone.update({m: "finished its script" for m in self.current if m in self.exited and m not in gone})
        pending = [m for m in self.current if m not in checked and m not in gone]
        if pending and time.monotonic() - self.reform.since < self._timeout() + _GRACE_AFTER_TIMEOUT:
            return
        for m in pending:  # stalled past the timeout: gone for certain before the others go on
            member = self.members.pop(m, None)
            if member is None or self.stop(member):  # gone for certain (on one host: killed and waited for)
                if member is not None:
                    self.killed[member.slot] = m  # replaced once its exit is seen
                gone[m] = "did not check in within the timeout (stalled), and was killed"
            else:  # on another host, which may only be cut off: never seen to exit, replaced now
                gone[m] = "did not check in within the timeout (stalled, or cut off from the launcher)"
                self.reform.unseen.add(m)
                if self._respawn is not None:
                    self._replace(member.slot, self._respawn)
        self._form([m for m in checked if m not in gone], gone)

    def _offer_joiners(self) -> None:
        waiting = self._waiting()
        if waiting and self.finishing:
            for m in waiting:
                self.store.set(keys.admit(m), "-1")
        elif waiting and not self.grow_raised:
            self.store.set(keys.grow(self.epoch), "1")
            self.grow_raised = True

    def _waiting(self) -> list[int]:
        return [m.id for m in sorted(self.members.values(), key=lambda m: m.id)
                if not m.admitted and self.store.check([keys.joined(m.id)])]

    def _form(self, survivors: list[int], gone: dict[int, str]) -> None:
        last = self.current
        assert self.reform is not None  # internal invariant: _form ends a re-forming
        seen_exit = not (self.reform.unseen & set(gone))  # this launcher saw (or made) every missing exit
        joiners = self._waiting()
        members = survivors + joiners
        lost = "; ".join(f"rank {last.index(m)}: {how}" for m, how in gone.items())
        why = why_not_continue(len(last), len(survivors), len(members), self.min_ranks, seen_exit)
        if why is not None:
            verdict = (f"phalanx.reform: epoch {self.epoch} of {len(last)} rank(s) lost {lost or 'no rank'}; the "
                       f"{len(survivors)} survivor(s) (ranks {[last.index(m) for m in survivors]}) cannot continue: "
                       f"{why}. The job ends; lower --min-ranks, or restart it from its checkpoint.")
            self.store.set(keys.verdict(self.epoch), verdict)
            notice(verdict.replace("phalanx.reform: ", ""))
            self.reform, self.ended = None, True
            for m in joiners + [m.id for m in self.members.values() if not m.admitted]:
                self.store.set(keys.admit(m), "-1")  # nothing to join: leave
            return
        self.epoch += 1
        self.store.set(keys.members(self.epoch), json.dumps(members))
        for m in joiners:
            self.members[m].admitted = True
            self.declared.add(m)
            self.store.set(keys.admit(m), str(self.epoch))
        self.current, self.reform, self.grow_raised = members, None, False
        change = "; ".join(filter(None, [f"lost {lost}" if lost else "",
                                         f"admitted {len(joiners)} replacement(s)" if joiners else ""]))
        notice(f"epoch {self.epoch}: the world re-formed in place on {len(members)} rank(s) ({change}).")

    def _get(self, key: str) -> str | None:
        return bytes(self.store.get(key)).decode() if self.store.check([key]) else None


def _how(code: int | None) -> str:
    if code is None:
        return "ended"
    return f"was killed by {signal_name(-code)}" if code < 0 else f"exited with status {code}"


def _kill_here(member: _Member) -> bool:
    kill_member(member.pid)
    return True


def kill_member(pid: int, wait: float = 2.0) -> None:
    """SIGKILL ``pid``'s group (its own session: the rank and what it started) and wait, at most ``wait``
    seconds, until it has exited (a zombie, left for the spawner to reap, or gone)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except (OSError, IndexError):
            return
        time.sleep(0.01)
