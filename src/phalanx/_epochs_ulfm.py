"""MPI worlds that re-form in place: Open MPI 5's ULFM (User Level Failure Mitigation).

``phalanx run --backend mpi --max-restarts K`` (or ``--min-ranks M``) under Open MPI 5
starts ``mpirun --with-ft ulfm`` and gives every rank ``PHALANX_ELASTIC=ulfm``. No store
is needed: MPI itself tells the survivors of a lost process and re-forms among them.
:class:`UlfmMembership` is a :class:`phalanx._epochs.Membership` (the protocol: ``first``,
``reform``, ``announce``, ``declare``, ``grow_requested``, ``interrupted``), as the launcher's
store's :class:`phalanx._epochs.StoreMembership` is, so ``reform()``, ``fit(elastic=True)`` and
every rebind work on it unchanged:

* a collective with a dead peer fails with ``MPI_ERR_PROC_FAILED`` (Open MPI's runtime saw
  the process exit); the rank that sees it first *revokes* the communicator (``announce``),
  so every survivor's pending call fails at once with ``MPI_ERR_REVOKED``;
* ``reform`` shrinks the communicator to the live processes (a blocking ``MPI_Comm_shrink``,
  bounded by a timer: past the timeout + 5 s the rank records a QuorumLostError and ends). The
  same rule as the launcher's decides who continues (:func:`phalanx._epochs.why_not_continue`):
  a strict majority, or survivors on the hosts of every lost rank (their host's daemon saw it
  exit), never fewer than ``--min-ranks``;
* with replacements left (``--max-restarts``), the survivors spawn one process per lost
  rank (``MPI_Comm_spawn_multiple``: the same worker command, the lost rank's slot) and
  merge it into the new world; it joins in the same epoch, and ``fit`` sends it the state;
* a rank that is alive but never enters MPI again (stalled outside MPI) cannot be shrunk
  away: the survivors' shrink times out and the job ends (restarted whole under
  ``--max-restarts``), where gloo's launcher would kill it and go on.

Every process has a member id (``PHALANX_MEMBER``: 0..n-1, then n, n+1, ...) and a slot
(``RANK``: its log and records; a replacement keeps the slot of the rank it replaces).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any

from ._epochs import (
    COMMAND_ENV,
    ELASTIC_ENV,
    FORWARDED_ENV,
    JOINING_ENV,
    MEMBER_ENV,
    REPLACEMENTS_ENV,
    ULFM,
    Epoch,
    ulfm,
    why_not_continue,
)
from ._errors import QuorumLostError, RendezvousError
from ._failure import RAISED_STATUS, mark_rank, record_failure
from .comm._mpi import REVOKED
from .comm._mpilib import import_mpi

__all__ = ["UlfmMembership", "start_early"]

_GRACE = 5.0  # beyond the timeout: how long a shrink, or a replacement's start, may take


_ENV_TAG = 8  # the survivors' environment for a replacement (start_early)


def start_early() -> None:
    """In a spawned replacement (``PHALANX_JOINING=1`` under ULFM): initialize MPI now, before the user's
    imports, so the survivors' ``MPI_Comm_spawn`` returns at once; the worker calls it first. Then take the
    variables ``phalanx run`` forwarded to every rank from the first survivor (on another host than
    mpirun's, a spawned process has only the daemon's environment): those this process lacks are set."""
    if os.environ.get(JOINING_ENV) != "1" or not ulfm():
        return
    MPI = import_mpi()
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    deadline = time.monotonic() + float(os.environ.get("PHALANX_TIMEOUT", "300") or 300) + _GRACE
    status = MPI.Status()
    try:
        while not parent.Iprobe(source=0, tag=_ENV_TAG, status=status):
            if time.monotonic() > deadline:
                return  # the handshake that follows says what went wrong
            time.sleep(0.001)
        buf = bytearray(status.Get_count(MPI.BYTE))
        parent.Recv([buf, MPI.BYTE], source=0, tag=_ENV_TAG)
    except MPI.Exception:
        return  # likewise
    for name, value in json.loads(bytes(buf)).items():
        os.environ.setdefault(name, value)


def _forwarded() -> bytes:
    """What a replacement gets from :func:`start_early`: the forwarded variables but this process's own."""
    names = set(os.environ.get(FORWARDED_ENV, "").split(",")) - {JOINING_ENV, MEMBER_ENV, "RANK", ""}
    return json.dumps({name: os.environ[name] for name in sorted(names) if name in os.environ}).encode()


class UlfmMembership:
    """This rank's part in a world that ULFM re-forms (see the module notes): a :class:`phalanx._epochs.Membership`."""

    def __init__(self, member: int, timeout: float) -> None:
        self.MPI = MPI = import_mpi()
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        self.member, self.timeout = member, timeout
        self.parent = MPI.Comm.Get_parent()
        self.joining = self.parent != MPI.COMM_NULL
        self.declared = self.joining  # a replacement only exists in a job that re-forms
        self.admitted_late = self.joining
        self.epoch: Epoch | None = None
        self.comm: Any = None  # the current epoch's communicator (the mpi backend works on its duplicates)
        self.min_ranks = int(os.environ.get("PHALANX_MIN_RANKS", "1") or 1)
        self.left = int(os.environ.get(REPLACEMENTS_ENV, "0") or 0)  # replacements the ranks may still spawn
        self.hosts: dict[int, str] = {}  # member id -> host
        self.slots: dict[int, int] = {}  # member id -> slot
        self.target = 0  # the job's -n: replacements grow the world back to it
        self.next_id = 0
        self._revoked = False

    # -- the contract -------------------------------------------------------------------
    def first(self) -> Epoch:
        """The epoch this process starts in: 0 for the job's first ranks, the admitting one for a replacement."""
        MPI = self.MPI
        if self.joining:
            try:
                return self._joined()
            except RendezvousError as exc:  # the survivors gave up on this replacement, and go on without it
                sys.stderr.write(f"phalanx: a replacement (slot {os.environ.get('RANK', '?')}) was not admitted, "
                                 f"and leaves: {exc}\n")
                sys.stderr.flush()
                os._exit(0)
        comm = MPI.COMM_WORLD.Dup()
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._bounded("phalanx.init", comm)
        hosts = comm.allgather(socket.gethostname())
        n = len(hosts)
        self.hosts, self.slots = dict(enumerate(hosts)), {m: m for m in range(n)}
        self.target, self.next_id, self.comm = n, n, comm
        self.epoch = Epoch(0, comm.Get_rank(), n, tuple(range(n)))
        return self.epoch

    def announce(self, reason: str) -> None:
        """Revoke the current communicator (once): every peer's pending and next call on it fails at once."""
        if self.comm is not None and not self._revoked:
            self._revoked = True
            try:
                self.comm.Revoke()
            except self.MPI.Exception:  # revoked already by a peer
                pass

    def declare(self) -> None:
        self.declared = True  # nothing to tell: no launcher decides, the survivors do

    def grow_requested(self) -> bool:
        return False  # replacements join inside reform(), in the epoch that loses their predecessors

    def interrupted(self) -> str | None:
        return None  # a revoked communicator interrupts the peers' calls itself

    def close(self) -> None:
        pass

    def reform(self, reason: str) -> Epoch:
        """Shrink to the live processes, spawn replacements while allowed; the new :class:`Epoch`."""
        assert self.epoch is not None and self.comm is not None  # internal invariant: a formed world
        old = self.epoch
        self.announce(reason)
        shrunk = self._shrink(old)
        survivors = self._survivors(shrunk, old)
        lost = tuple(m for m in old.members if m not in survivors)
        seen = {self.hosts[m] for m in survivors}
        seen_exit = all(self.hosts.get(m) in seen for m in lost)
        spawn = min(self.target - len(survivors), self.left) if lost else 0
        why = why_not_continue(old.size, len(survivors), len(survivors) + max(spawn, 0), self.min_ranks, seen_exit)
        if why is not None:
            shrunk.Free()
            raise QuorumLostError(
                f"phalanx.reform: epoch {old.number} of {old.size} rank(s) lost member(s) {list(lost)} ({reason}); "
                f"the {len(survivors)} survivor(s) cannot continue: {why}. The job ends; lower --min-ranks, or "
                "restart it from its checkpoint.")
        comm: Any = shrunk
        joined: tuple[int, ...] = ()
        if spawn > 0:
            comm, joined = self._spawn(shrunk, list(lost[:spawn]))
        first, refilled = shrunk.Get_rank() == 0, max(spawn, 0)
        self._mark("dropped", list(lost[refilled:]), first)
        self._mark("replaced", list(lost[:refilled]), first, f"-e{old.number + 1}")
        old_comm, self.comm, self._revoked = self.comm, comm, False
        REVOKED.append(old_comm)  # never freed (comm/_mpi.py says why)
        members = survivors + joined
        self.epoch = Epoch(old.number + 1, comm.Get_rank(), comm.Get_size(), members, lost=lost, joined=joined,
                           previous_rank=old.rank)
        self.admitted_late = False
        for line in _notices(self.epoch, reason) if self.epoch.rank == 0 else ():
            print(f"phalanx: {line}", file=sys.stderr, flush=True)
        return self.epoch

    # -- how -------------------------------------------------------------------------------
    def _mark(self, kind: str, members: list[int], first: bool, tag: str = "") -> None:
        """Tell the launcher about these members' slots: :func:`phalanx._failure.mark_rank`'s ``<kind>`` marker
        of each slot, with ``tag`` (written by the first survivor). ``dropped``: a lost process no replacement
        takes, so ``phalanx run`` does not wait for its exit marker; ``replaced`` (one per epoch): a replacement
        spawned, which counts against ``--max-restarts`` with the whole restarts, as on gloo. A marker that
        cannot be written loses the launcher's report (or its budget) only this detail."""
        if not first:
            return
        for m in members:
            mark_rank(kind, self.slots[m], tag, any_host=True)

    def _shrink(self, old: Epoch) -> Any:
        """The current communicator without its failed processes (blocking: Open MPI 5.0's
        ``MPI_Comm_ishrink`` fails with ``MPI_ERR_INTERN``; :meth:`within` bounds the wait)."""
        shrunk = self._forming(
            self.comm.Shrink, f"epoch {old.number}'s survivors waited {self.timeout + _GRACE:g} s for every "
            "live rank to re-form, and some did not: a rank that is alive but never calls into MPI again "
            "(stalled outside MPI) cannot be removed from an MPI world, nor one that ended itself with a "
            "non-zero status (os._exit(3)): Open MPI 5's ULFM reports a process killed by a signal or "
            "exiting 0, not that", f"the survivors could not shrink epoch {old.number}'s communicator")
        shrunk.Set_errhandler(self.MPI.ERRORS_RETURN)
        return shrunk

    def within(self, call: Any, what: str) -> Any:
        """``call()`` (a blocking MPI call with no non-blocking form that works here), bounded by a timer:
        past the timeout + 5 s this rank records a QuorumLostError saying ``what`` and ends (the others
        do the same, or see it gone), so that a job never hangs in MPI."""
        done = threading.Event()

        def expire() -> None:
            if done.is_set():
                return
            exc = QuorumLostError(f"phalanx.reform: {what}. The job ends (restarted whole under --max-restarts); "
                                  "`phalanx run --log-dir` keeps each rank's output.")
            record_failure(QuorumLostError, exc, None)
            sys.stderr.write(f"{exc}\n")
            sys.stderr.flush()
            os._exit(RAISED_STATUS)

        timer = threading.Timer(self.timeout + _GRACE, expire)
        timer.daemon = True
        timer.start()
        try:
            return call()
        finally:
            done.set()
            timer.cancel()

    def _survivors(self, shrunk: Any, old: Epoch) -> tuple[int, ...]:
        """The members in the shrunk communicator, in their order there (ULFM keeps the old order)."""
        ranks = self.MPI.Group.Translate_ranks(shrunk.Get_group(), list(range(shrunk.Get_size())),
                                               self.comm.Get_group())
        return tuple(old.members[r] for r in ranks)

    def _spawn(self, shrunk: Any, replacing: list[int]) -> tuple[Any, tuple[int, ...]]:
        """Spawn one replacement per member of ``replacing`` and merge them in: (the new communicator,
        their member ids). Every survivor takes part; the first spawns."""
        MPI = self.MPI
        ids = tuple(range(self.next_id, self.next_id + len(replacing)))
        command = json.loads(os.environ[COMMAND_ENV])
        infos = []
        for new, lost in zip(ids, replacing, strict=True):
            info = MPI.Info.Create()
            # the rest of the environment is mpirun's, as for every rank (MPI_MAX_INFO_VAL: 256 bytes)
            env = {JOINING_ENV: "1", MEMBER_ENV: str(new), "RANK": str(self.slots[lost]), ELASTIC_ENV: ULFM}
            info.Set("PMIX_ENVAR", "\n".join(f"{k}={v}" for k, v in env.items()))
            info.Set("host", self.hosts[lost])
            # the lost rank's core is free, but the runtime keeps it allotted: without this it retries forever
            info.Set("map_by", "slot:OVERSUBSCRIBE")
            infos.append(info)
        try:
            inter = self._forming(
                lambda: shrunk.Spawn_multiple([command[0]] * len(ids), [command[1:]] * len(ids), [1] * len(ids),
                                              infos, root=0),
                f"the survivors could not start the replacement(s) for member(s) {replacing} within "
                f"{self.timeout + _GRACE:g} s (mpirun's output says why)",
                f"could not start the replacement(s) for member(s) {replacing}")
        finally:
            for info in infos:
                info.Free()
        self.left -= len(ids)  # spawned: they count, even if they never join (a retry then spawns fewer)
        self._handshake("phalanx.reform (the replacements reaching phalanx.init)", inter, _forwarded())
        merged = self._merge(inter, high=False)
        for new, lost in zip(ids, replacing, strict=True):
            self.hosts[new], self.slots[new] = self.hosts[lost], self.slots[lost]
        self.next_id += len(ids)
        state = {"epoch": self.epoch.number + 1 if self.epoch else 0, "hosts": self.hosts, "slots": self.slots,
                 "target": self.target, "next_id": self.next_id, "left": self.left,
                 "members": list(self._survivors(shrunk, self.epoch)) + list(ids)}  # type: ignore[arg-type]
        self._forming(lambda: merged.bcast(json.dumps(state), root=0), "the new epoch's state did not reach "
                      f"every rank within {self.timeout + _GRACE:g} s")
        return merged, ids

    def _joined(self) -> Epoch:
        """A replacement: meet the survivors that spawned it, and learn its epoch."""
        MPI, inter = self.MPI, self.parent
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        self._handshake("phalanx.init (a replacement meeting the survivors)", inter)
        merged = self._merge(inter, high=True)
        state = json.loads(self._forming(lambda: merged.bcast(None, root=0), "the new epoch's state did not "
                                         f"reach this replacement within {self.timeout + _GRACE:g} s"))
        self.hosts = {int(k): v for k, v in state["hosts"].items()}
        self.slots = {int(k): int(v) for k, v in state["slots"].items()}
        self.target, self.next_id, self.left = state["target"], state["next_id"], state["left"]
        members = tuple(state["members"])
        self.comm = merged
        self.epoch = Epoch(state["epoch"], merged.Get_rank(), merged.Get_size(), members)
        return self.epoch

    def _merge(self, inter: Any, high: bool) -> Any:
        """The intercommunicator's two sides as one communicator (blocking calls, bounded by :meth:`within`:
        a side whose handshake timed out raises instead of merging, and its peers must not wait forever)."""
        what = f"the survivors and the replacement(s) did not all merge within {self.timeout + _GRACE:g} s"
        merged = self._forming(lambda: inter.Merge(high=high), what)
        self._forming(inter.Disconnect, what)
        merged.Set_errhandler(self.MPI.ERRORS_RETURN)
        return merged

    def _forming(self, call: Any, what: str, failed: str = "a process was lost while the new epoch formed") -> Any:
        """``call()`` while a new epoch forms, bounded by :meth:`within` (``what``: why it timed out); an MPI
        error is a RendezvousError saying ``failed``, which ``reform()`` turns into a RankFailedError to retry on."""
        try:
            return self.within(call, what)
        except self.MPI.Exception as exc:
            raise RendezvousError(f"phalanx.reform: {failed} ({exc.Get_error_string()})") from None

    def _bounded(self, what: str, comm: Any) -> None:
        """A barrier on ``comm`` that waits at most the timeout + 5 s (RendezvousError naming ``what``):
        after it, the blocking calls that follow (a merge, a gather of host names) meet at once."""
        MPI = self.MPI
        request = comm.Ibarrier()
        deadline = time.monotonic() + self.timeout + _GRACE
        try:
            while not request.Test():
                if time.monotonic() > deadline:
                    raise RendezvousError(f"{what}: the other ranks did not answer within {self.timeout + _GRACE:g} "
                                          "s (the timeout + 5 s).")
                time.sleep(0.001)
        except MPI.Exception as exc:
            raise RendezvousError(f"{what}: a rank was lost while the world formed ({exc.Get_error_string()})") \
                from None

    def _handshake(self, what: str, inter: Any, env: bytes | None = None) -> None:
        """Every process on each side of ``inter`` (survivors, replacements) hears from every one on the
        other within the timeout + 5 s, by point-to-point messages (Open MPI 5.0's non-blocking collectives
        on an intercommunicator fail with ``MPI_ERR_INTERN``); the blocking merge that follows then meets.
        The first survivor also sends each replacement ``env`` (:func:`start_early` waits for it)."""
        MPI = self.MPI
        remote = inter.Get_remote_size()
        token, got = bytearray(b"\x01"), [bytearray(1) for _ in range(remote)]
        deadline = time.monotonic() + self.timeout + _GRACE
        try:  # posting fails too: across hosts, Open MPI 5.0.11's first message to a spawned job (MPI_ERR_INTERN)
            requests = [inter.Isend([token, MPI.BYTE], dest=r, tag=7) for r in range(remote)]
            requests += [inter.Irecv([got[r], MPI.BYTE], source=r, tag=7) for r in range(remote)]
            if env is not None and inter.Get_rank() == 0:
                requests += [inter.Isend([env, MPI.BYTE], dest=r, tag=_ENV_TAG) for r in range(remote)]
            while not MPI.Request.Testall(requests):
                if time.monotonic() > deadline:
                    raise RendezvousError(f"{what}: the other side did not answer within {self.timeout + _GRACE:g} "
                                          "s (the timeout + 5 s).")
                time.sleep(0.001)
        except MPI.Exception as exc:
            raise RendezvousError(f"{what}: a process was lost while the world formed "
                                  f"({exc.Get_error_string()})") from None

def _notices(epoch: Epoch, reason: str) -> list[str]:
    change = "; ".join(filter(None, [f"lost member(s) {list(epoch.lost)}" if epoch.lost else "",
                                     f"spawned {len(epoch.joined)} replacement(s)" if epoch.joined else ""]))
    return [f"epoch {epoch.number}: the world re-formed in place on {epoch.size} rank(s) ({change}; after: "
            f"{reason.splitlines()[0] if reason else 'a failure'})."]
