"""Epochs across hosts: ``phalanx run --hosts ... --backend gloo --max-restarts K`` re-forms in place.

The driver (``phalanx run``, :mod:`._from_one_host`) serves the job's store and decides every
epoch (:class:`._epochs.Coordinator`), as on one host; the ranks it cannot see are the per-host
launchers' (:mod:`._remote`). Both sides of that are here:

* :class:`Relay`, in each per-host launcher, is the spawner's ``epochs`` (:func:`._spawn.run_spawn`):
  it gives each rank the store's address and its member id, and tells the driver (on stderr, one
  ``@phalanx-remote`` line each) every rank it started and every rank that ended. Once the driver
  says the job is in place (every member declared that it re-forms), a rank that dies, or that
  raises only because it is out of the job (:data:`ABSORBED`: left out of an epoch, or cut off from
  the store), no longer ends this host's ranks: its end is the driver's to decide. Any other
  exception is the script's and ends the job as always. ``{"kill": member}`` from the driver kills
  a stalled rank.
* :class:`InPlace`, in the driver, feeds those ends to the coordinator, forgets a per-host launcher
  whose ranks are all gone from the job, and starts a replacement for a lost rank through ``--rsh``:
  on the host it ran on when that host told of its end, else on the first host of the list with a
  free slot that lost no rank without a word (a host cut off, or that stalled).

A host cut off from the driver tells nothing: its ranks count as gone unseen, so the others go on
only while they hold a strict majority of the last epoch. The cut-off ranks lose the store and end
with :class:`phalanx.QuorumLostError` naming the partition. Losing the driver's host ends the job.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

from .._epochs import ELASTIC_ENV, JOINING_ENV, MEMBER_ENV
from ._epochs import Coordinator, kill_member
from ._job import Launch, notice
from ._jobdir import any_record, read_records
from ._report import Death

__all__ = ["ABSORBED", "InPlace", "Relay"]

# What a rank raises when it is out of the job (left out of an epoch, or cut off from the driver's store),
# never its script's own error: absorbed in place. Any other exception ends the job, as on one host.
ABSORBED = ("QuorumLostError",)


class Relay:
    """A per-host launcher's side of epochs across hosts (see the module notes)."""

    def __init__(self, config: dict[str, Any], job_dir: str, tell: Callable[..., None]) -> None:
        self.store, self.min_ranks = str(config["store"]), int(config["min_ranks"])
        self.joining = config.get("member")  # a replacement launcher: its one rank's new member id
        self.in_place = self.joining is not None  # a replacement exists only in a job that re-forms
        self.job_dir, self.tell = job_dir, tell
        self.members: dict[int, int] = {}  # slot -> member id of the rank now there
        self.pids: dict[int, int] = {}  # member id -> pid
        self.records: dict[int, dict[str, Any]] = {}  # slot -> a record this relay took (ABSORBED)
        self.told: set[int] = set()  # member ids whose end the driver was told
        self._kills: list[int] = []
        self._lock = threading.Lock()

    # -- what the spawner asks -----------------------------------------------------------
    def env(self, slot: int, member: int | None = None) -> dict[str, str]:
        m = slot if self.joining is None else int(self.joining)
        out = {ELASTIC_ENV: self.store, MEMBER_ENV: str(m), "PHALANX_MIN_RANKS": str(self.min_ranks)}
        if self.joining is not None:
            out[JOINING_ENV] = "1"
        return out

    def started(self, slot: int, pid: int, member: int | None = None) -> None:
        m = slot if self.joining is None else int(self.joining)
        self.members[slot], self.pids[m] = m, pid
        self.tell(member={"slot": slot, "member": m, "pid": pid})

    def failing(self, job_dir: str) -> bool:
        """Whether a record here ends the job: in place, a lost-world record is taken (the driver decides)."""
        if self.in_place:
            for slot, record in read_records(job_dir).items():
                if record.get("type") in ABSORBED and slot in self.members:
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(job_dir, f"failure-rank{slot}.json"))
                    self.records[slot] = record
        return any_record(job_dir)

    def tick(self, deaths: dict[int, Death], respawn: Callable[[int, dict[str, str]], int]) -> list[int]:
        """Tell the driver of every end; return the slots whose failure the driver decides (in place)."""
        with self._lock:
            kills, self._kills = self._kills, []
        for m in kills:
            if m in self.pids and m not in self.told:
                kill_member(self.pids[m], wait=0.0)
        self.failing(self.job_dir)
        absorbed = []
        for slot, death in deaths.items():
            if slot not in self.members or self.members[slot] in self.told:
                continue
            m = self.members[slot]
            record = self.records.pop(slot, None)
            if death.code != 0 and (not self.in_place or os.path.exists(
                    os.path.join(self.job_dir, f"failure-rank{slot}.json"))):
                continue  # before the job is in place, or the script's own error: ends the job as always
            self.told.add(m)
            self.tell(death={"slot": slot, "member": m, "pid": self.pids.get(m), "code": death.code,
                             "time": death.at, "type": (record or {}).get("type", ""),
                             "message": ((record or {}).get("message") or "").split("\n")[0]})
            if death.code != 0:
                absorbed.append(slot)
        return absorbed

    def close(self) -> None:
        pass

    # -- what the driver says (the stdin thread) -------------------------------------------
    def receive(self, message: dict[str, Any]) -> None:
        if "in_place" in message:
            self.in_place = bool(message["in_place"])
        if "kill" in message:
            with self._lock:
                self._kills.append(int(message["kill"]))


class InPlace:
    """The driver's side: the coordinator of a job on several hosts, and where its ranks are."""

    def __init__(self, job: Launch, secret: str, address: str, hosts: list[tuple[str, int]],
                 launch: Callable[[str, int, int, dict[str, Any]], Any]) -> None:
        from ._spawn import free_port

        timeout = float(job.timeout or os.environ.get("PHALANX_TIMEOUT") or 300.0)  # the ranks' (--timeout)
        self.coordinator = Coordinator(job, free_port(address), secret, timeout, address=address, stop=self._kill)
        self.slots = dict(hosts)  # host -> slots, in the list's order
        self.launch = launch  # (host, slot, member, relay config) -> the new per-host launcher
        self.where: dict[int, Any] = {}  # member id -> its per-host launcher (a _Remote)
        self.silent: set[str] = set()  # hosts that lost a rank without telling (cut off, stalled)
        self.deaths: dict[int, Death] = {}  # slot -> an end told, for the coordinator's next tick
        self.told: dict[int, dict[str, Any]] = {}  # slot -> that end as told (the report, if not absorbed)
        self.slot_of: dict[int, int] = {}  # member id -> its slot
        self.starting: dict[int, tuple[Any, int]] = {}  # replacement member -> (its launcher, slot), until it speaks
        self.said_in_place = False
        self.failure: dict[str, Any] | None = None  # an end the job does not absorb: how it failed

    def config(self) -> dict[str, Any]:
        """What each per-host launcher's :class:`Relay` needs."""
        c = self.coordinator
        return {"store": c.env(0)[ELASTIC_ENV], "min_ranks": c.min_ranks}

    def close(self) -> None:
        self.coordinator.close()

    # -- every poll ----------------------------------------------------------------------------
    def message(self, remote: Any, message: dict[str, Any]) -> None:
        """A per-host launcher's line: a rank it started, or one that ended."""
        if "member" in message:
            m = message["member"]
            self.where[m["member"]], self.slot_of[m["member"]] = remote, m["slot"]
            known = self.coordinator.members.get(m["member"])
            if known is not None:  # a replacement: known since it was started
                known.pid = int(m["pid"])
            else:
                self.coordinator.started(m["slot"], int(m["pid"]))
        if "death" in message:
            d = message["death"]
            if d["member"] in self.coordinator.members:  # not one this driver declared gone already
                self.deaths[d["slot"]] = Death(d["code"], d["time"], host=remote.host)
                self.told[d["slot"]] = dict(d, host=remote.host)
                if d["code"] != 0 and d.get("type"):  # it lost the world (the store, its peers): its host may be
                    self.silent.add(remote.host)      # cut off, so a replacement goes elsewhere

    def tick(self, remotes: list[Any]) -> bool:
        """Decide what the ends told so far mean; True when the job fails (``failure`` says how)."""
        c = self.coordinator
        if not self.said_in_place and c.in_place():
            self.said_in_place = True
            for remote in remotes:
                remote.send(in_place=True)
        self._restart_failed_starts()
        deaths, self.deaths = self.deaths, {}
        absorbed = set(c.tick(deaths, self._respawn))
        for slot, death in deaths.items():
            if death.code != 0 and slot not in absorbed:
                self.failure = self.told.get(slot)
                return True
        return c.ended

    def absorbs(self, remote: Any) -> bool:
        """Whether a per-host launcher that ended may be forgotten: the job is in place and none of the
        members it ran is still in it (each told its end, or was declared gone)."""
        alive = set(self.coordinator.members)
        return self.said_in_place and not any(m in alive for m, r in self.where.items() if r is remote)

    def _restart_failed_starts(self) -> None:
        """A replacement whose launcher could not be started (its host does not answer): on another host."""
        for member, (remote, slot) in list(self.starting.items()):
            if remote.started:
                del self.starting[member]
            elif remote.poll() is not None:
                del self.starting[member]
                remote.absorbed = True
                self.silent.add(remote.host)
                notice(f"the replacement for slot {slot} could not be started on host {remote.host} "
                       f"({remote.tail[-1] if remote.tail else 'its launcher ended'}).")
                self._respawn(slot, {MEMBER_ENV: str(member)})

    # -- the coordinator's hands ------------------------------------------------------------
    def _kill(self, member: Any) -> bool:
        """A stalled member: its host is told to kill it; never seen gone (the host may be cut off)."""
        remote = self.where.get(member.id)
        if remote is not None:
            self.silent.add(remote.host)
            remote.send(kill=member.id)
        return False

    def _respawn(self, slot: int, env: dict[str, str]) -> int:
        member = int(env[MEMBER_ENV])
        host = self._host_for(slot)
        if host is None:
            notice(f"no host of the list has a free slot for a replacement of slot {slot}; the job continues "
                   "without it.")
            return 0
        remote = self.launch(host, slot, member, dict(self.config(), member=member))
        self.where[member], self.slot_of[member] = remote, slot
        self.starting[member] = (remote, slot)
        remote.send(in_place=True)
        notice(f"starting the replacement for slot {slot} on host {host}.")
        return 0

    def _host_for(self, slot: int) -> str | None:
        """The host of ``slot``'s last rank if it told of its end, else the first with a free slot."""
        alive = set(self.coordinator.members)
        used: dict[str, int] = {}
        last = None
        for m, remote in self.where.items():
            if m in alive:
                used[remote.host] = used.get(remote.host, 0) + 1
            if self.slot_of.get(m) == slot:
                last = remote.host
        if last is not None and last not in self.silent and used.get(last, 0) < self.slots.get(last, 0):
            return last
        for host, slots in self.slots.items():
            if host not in self.silent and used.get(host, 0) < slots:
                return host
        return None
