"""Setting up the ``gloo``/``nccl`` backends: torch, the launch environment, the rendezvous store.

Design notes (why, not what):

* The rendezvous is a ``TCPStore`` served by rank 0 on ``MASTER_ADDR:MASTER_PORT``
  (what torchrun and ``phalanx run`` set). When ``MASTER_ADDR`` is literally a
  loopback address (``127.0.0.1``, ``::1``, ``localhost``: what ``phalanx run``
  sets on one host) every rank is on this host, so phalanx binds the store's
  socket to that address itself and hands it to torch (``master_listen_fd``):
  torch's own server would listen on every interface, letting anyone on the
  network read and write the job's keys. gloo's own connections are confined
  the same way (``GLOO_SOCKET_IFNAME`` set to the loopback interface, ``lo`` or
  ``lo0``, unless the user set it). A file store was the alternative; it
  needs a directory every rank shares and has no ``check`` without a round
  trip to the file system, so the diagnosis would be slower.
* Otherwise the ranks may be on several hosts (a host name that merely
  resolves to loopback, as Debian maps the machine's name, counts too): the
  interface and the guard are chosen in :mod:`._netplan`, and rank 0's store
  listens on loopback behind phalanx's handshake (:mod:`._guard`), the other
  ranks' store clients reach it through a guard of their own. torch's store
  has no authentication to switch on (``docs/design.md``, "The guarded
  rendezvous").
* The store is kept after set-up: after a timeout the process group is
  unusable, but the store still answers, so the backend's ``diagnose`` asks it
  who is stuck where (with short store timeouts of its own).
* Joining is phalanx's own protocol on the store, not torch's: every rank
  writes ``join/<rank>`` (its host and ``WORLD_SIZE``) and polls until all have.
  So a rank that never starts, or a wrong ``WORLD_SIZE``, is a
  :class:`RendezvousError` on *every* rank, saying how many joined and which
  are missing; rank 0 leaves that verdict in the store for the others to read
  before it gives up.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from .._errors import BackendUnavailableError, LaunchEnvironmentError, RendezvousError, UsageError
from ._base import PeerLost, WaitTimeout
from ._guard import Guard
from ._netplan import plan
from ._store_queries import get_all

__all__ = ["Rendezvous", "check_own_gpus", "import_torch", "translate", "translating"]

# How torch reports a dead peer (gloo: "Connection closed by peer [addr]:port", NCCL: remote errors).
_LOST = ("connection closed", "connection reset", "broken pipe", "connection refused", "ncclremoteerror",
         "communicator was aborted", "remote process exiting", "socket closed", "end of file")
_F = TypeVar("_F", bound=Callable[..., Any])
_VERDICT_READ_S = 1.0  # rank 0 keeps the store up this long after a failed rendezvous, for the others


def translate(exc: RuntimeError) -> Exception | None:
    """torch's error for a timeout or a lost peer as WaitTimeout/PeerLost; None for anything else."""
    text = str(exc)
    first = re.sub(r"^\[[^\]]*\] ", "", text.strip().split("\n", 1)[0])  # drop "[.../pair.cc:553] "
    if any(s in text.lower() for s in _LOST):
        return PeerLost(first)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return WaitTimeout(first)
    return None


def translating(method: _F) -> _F:
    """Raise torch's timeout/peer errors from ``method`` as WaitTimeout/PeerLost."""
    @functools.wraps(method)
    def wrapper(*args: Any) -> Any:
        try:
            return method(*args)
        except RuntimeError as exc:
            failure = translate(exc)
            if failure is None:
                raise
            raise failure from exc

    return wrapper  # type: ignore[return-value]


def import_torch() -> Any:
    """torch, with torch.distributed usable; BackendUnavailableError naming the fix otherwise."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise BackendUnavailableError("phalanx.init(backend='gloo'/'nccl') needs PyTorch: "
                                      "`pip install 'phalanx[torch]'` (or `pip install torch`).") from exc
    if not dist.is_available():
        raise BackendUnavailableError(
            f"phalanx.init(backend='gloo'/'nccl'): this PyTorch build ({torch.__version__}) has no "
            "torch.distributed. Install an official wheel (`pip install torch`), or use backend='mpi'.")
    # Before any process group exists: torch.distributed.nn.functional takes ``group.WORLD`` as the
    # default argument of its functions, evaluated when it is first imported (torch._dynamo imports
    # it, e.g. when a torch optimizer is made). Imported while a group exists, those defaults keep
    # the group alive after destroy_process_group, and its gloo threads then end only at interpreter
    # exit, where they can abort the process ("terminate called without an active exception").
    # A group the user made first is theirs: importing it now would bind the defaults to it.
    if not dist.is_initialized():
        with contextlib.suppress(ImportError):
            import torch.distributed.nn  # noqa: F401
    return torch


def env(name: str, kind: type = str) -> Any:
    """Launch variable ``name`` as ``kind``; LaunchEnvironmentError naming the fix when missing or bad."""
    value = os.environ.get(name, "").strip()
    if not value:
        raise LaunchEnvironmentError(
            f"phalanx.init(backend='gloo'/'nccl') needs the environment variable {name}, which is not "
            "set. Start the script with `phalanx run -n N script.py` or `torchrun --nproc-per-node N "
            "script.py` (they set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or set them yourself.")
    try:
        return kind(value)
    except ValueError:
        raise LaunchEnvironmentError(f"phalanx.init: {name}={value!r} is not an integer; the launcher "
                                     f"must set it to one, e.g. {name}=0.") from None


class Rendezvous:
    """The ranks' meeting point: the store, and what each rank told it when it joined."""

    def __init__(self, dist: Any, rank: int, size: int, timeout: float, generation: int | str,
                 served: bool = False, interrupted: Callable[[], str | None] | None = None) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        if served:  # the launcher's store (PHALANX_ELASTIC, "host:port"), not rank 0's MASTER_PORT
            host, _, port = os.environ.get("PHALANX_ELASTIC", "").strip().rpartition(":")
            self.host, self.port = host, int(port)
        else:
            self.host, self.port = env("MASTER_ADDR"), env("MASTER_PORT", int)
        self.where = f"{self.host}:{self.port}"
        self.prefix = f"phalanx/{generation}/"
        # ``served``: the launcher serves the store for the whole job (a world with epochs, phalanx._epochs);
        # every rank is a client, and this epoch's keys are its own (``generation`` names the epoch).
        self.served, self.generation = served, generation
        self.interrupted = interrupted  # why this epoch ended while it forms (a member lost), else None
        if not 0 <= rank < size:
            raise LaunchEnvironmentError(
                f"phalanx.init: RANK={rank} is not a rank of WORLD_SIZE={size} (need 0 <= RANK < "
                "WORLD_SIZE); every rank must be started with the same WORLD_SIZE and its own RANK.")
        # Under torchrun the agent already serves a store on MASTER_PORT, shared by restarts.
        self.agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.plan = plan(self.host, self.port, rank, size, self.agent)  # gloo's interface too
        self.guard: Guard | None = None
        try:
            self.store = self._connect(dist)
            self._await_open(dist)
            self.hosts = self._join()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop this rank's guard, if any (nothing of the rendezvous listens afterwards)."""
        if self.guard is not None:
            self.guard.close()
            self.guard = None
        self.store = None

    def _connect(self, dist: Any) -> Any:
        serve, guarded = self.rank == 0 and not self.agent and not self.served, self.plan.guarded
        host, port, options = self.host, self.port, {}
        if serve:  # the store on loopback behind the guard, or on the one address every rank uses
            listener = _listen("127.0.0.1" if guarded else self.plan.bind[0], 0 if guarded else port)
            host, port = ("127.0.0.1", listener.getsockname()[1]) if guarded else (host, port)
            options["master_listen_fd"] = listener.detach()  # torch owns it now
        elif guarded:
            self.guard = Guard.client(self.host, self.port, self.plan.key, self.timeout)
            host, port = "127.0.0.1", self.guard.port
        elif not _await_listener(host, port, self.timeout):
            raise self._unreachable("nothing listens there")
        try:
            store = self._store(dist, host, port, serve, options)
        except RuntimeError as exc:
            if "master_listen_fd" in options:
                with contextlib.suppress(OSError):
                    os.close(options["master_listen_fd"])
            if serve:
                raise RendezvousError(
                    f"phalanx.init: rank 0 could not serve the rendezvous store at {self.where} ({exc}). "
                    "Is MASTER_PORT free? Pick another port, or let `phalanx run` choose one.") from exc
            raise self._unreachable(_first_line(exc)) from exc
        if store is None:  # rank 0's guard could not prove the secret: no retry can change that
            raise self._unreachable("", waited=False)
        if serve and guarded:
            try:
                self.guard = Guard.serve(self.plan.bind, self.port, port, self.plan.key)
            except OSError as exc:
                raise RendezvousError(
                    f"phalanx.init: rank 0 could not listen on {', '.join(self.plan.bind)} port {self.port} "
                    f"for the rendezvous ({exc.strerror or exc}). Is MASTER_PORT free? Pick another port, "
                    "or let `phalanx run` choose one.") from None
        if self.agent:
            store = dist.PrefixStore(f"phalanx{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        elif self.served:
            store = dist.PrefixStore(f"phalanx-{self.generation}", store)
        return store

    def _await_open(self, dist: Any) -> None:
        """Rank 0 marks its store as this world's; the others wait for the mark and reconnect when the store
        they reached vanishes unmarked (the last world's, on a rank 0 still shutting down; bounded)."""
        mark = f"{self.prefix}open"
        if self.rank == 0:
            self.store.set(mark, "1")
            return
        deadline, pause = time.monotonic() + self.timeout, 0.002
        while True:
            try:
                if self.store.check([mark]):
                    return
            except RuntimeError as exc:  # gone: reconnect (to rank 0's new store, once it serves)
                if time.monotonic() > deadline:
                    raise self._unreachable(_first_line(exc)) from exc
                if self.guard is not None:
                    self.guard.close()
                    self.guard = None
                self.store = self._connect(dist)
                continue
            if time.monotonic() > deadline:
                raise self._unreachable("rank 0 did not open it")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _unreachable(self, detail: str, waited: bool = True) -> RendezvousError:
        why = self.guard.failure if self.guard is not None and self.guard.failure else detail
        within = f" within {self.timeout:g} s" if waited else ""
        return RendezvousError(
            f"phalanx.init: rank {self.rank} of {self.size} could not reach the rendezvous store that "
            f"rank 0 serves at {self.where}{within} ({why}). Rank 0 has "
            "not started, has already failed, or MASTER_ADDR/MASTER_PORT (or PHALANX_SECRET) differ "
            "between ranks: start every rank with the same values (`phalanx run` does).")

    def _store(self, dist: Any, host: str, port: int, serve: bool, options: dict[str, Any]) -> Any:
        """torch's store (server or client); None once the guard refused rank 0's handshake. Behind a
        guard the client connects in a thread, so that a refused handshake (another secret) fails at
        once, not after the whole timeout that torch's client spends reconnecting; the thread ends by
        itself within that timeout."""
        def make() -> Any:
            return dist.TCPStore(host, port, None, serve, timedelta(seconds=self.timeout),
                                 wait_for_workers=False, **options)
        guard = self.guard  # rank 0's guard starts after its store: None here
        if guard is None:
            return make()
        box: dict[str, Any] = {}

        def connect() -> None:
            try:
                box["store"] = make()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
                box["error"] = exc

        thread = threading.Thread(target=connect, name="phalanx-store-client", daemon=True)
        thread.start()
        while thread.is_alive() and guard.refusal is None:
            thread.join(0.02)
        if "store" in box:
            return box["store"]
        if "error" in box:
            raise box["error"]
        return None

    def _join(self) -> list[str]:
        """Every rank's host, in rank order, once every rank has joined (RendezvousError otherwise)."""
        store, keys = self.store, [f"{self.prefix}join/{r}" for r in range(self.size)]
        verdict = f"{self.prefix}verdict"
        me = json.dumps({"host": socket.gethostname(), "size": self.size, "pid": os.getpid()})
        deadline = time.monotonic() + self.timeout
        pause = 0.002
        try:
            store.set(keys[self.rank], me)
            while not store.check(keys):
                if self.rank != 0 and store.check([verdict]):
                    raise RendezvousError(store.get(verdict).decode())
                why = self.interrupted() if self.interrupted is not None else None
                if why is not None:
                    raise RendezvousError(f"phalanx.init: the epoch ended while its ranks met: {why}")
                if time.monotonic() > deadline:
                    self._give_up(keys, verdict)
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
            joined = [json.loads(v) for v in get_all(store, keys)]
        except RendezvousError:
            raise
        except RuntimeError as exc:  # the store went away: rank 0 failed or gave up first
            raise RendezvousError(
                f"phalanx.init: rank {self.rank} of {self.size} lost the rendezvous store at {self.where} "
                f"while waiting for the other ranks ({_first_line(exc)}): rank 0, which serves it, gave "
                "up or failed; its own error names the missing ranks.") from exc
        sizes = {r: j["size"] for r, j in enumerate(joined) if j["size"] != self.size}
        if sizes:
            raise RendezvousError(
                f"phalanx.init: rank {self.rank} was started with WORLD_SIZE={self.size} but rank(s) "
                f"{sorted(sizes)} with WORLD_SIZE={sorted(set(sizes.values()))}; start every rank with "
                "the same WORLD_SIZE.")
        return [j["host"] for j in joined]

    def _give_up(self, keys: list[str], verdict: str) -> None:
        """RendezvousError naming the missing ranks (rank 0 first leaves it for the others);
        returns normally when every rank has joined after all."""
        joined = [r for r, k in enumerate(keys) if self.store.check([k])]
        missing = [r for r in range(self.size) if r not in joined]
        if not missing:  # the last rank joined after the loop's check: the rendezvous is complete
            return
        message = (
            f"phalanx.init: only {len(joined)} of {self.size} ranks joined the rendezvous at {self.where} "
            f"within {self.timeout:g} s; missing: rank{'s' if len(missing) > 1 else ''} "
            f"{missing if len(missing) > 1 else missing[0]}. Check that every rank was started (a "
            "launcher that stopped early, or a wrong WORLD_SIZE) with the same MASTER_ADDR/MASTER_PORT; "
            "raise the limit with `phalanx.init(timeout=...)` or PHALANX_TIMEOUT if ranks start slowly.")
        if self.guard is not None and self.guard.serving and self.guard.refusals:
            message += (f" The rendezvous refused {self.guard.refusals} connection(s) without the job's "
                        "secret: start every rank with the same PHALANX_SECRET.")
        if self.rank == 0:  # leave the verdict for the others, and keep the store up while they read it
            self.store.set(verdict, message)
            time.sleep(_VERDICT_READ_S)
        raise RendezvousError(message)

    def node_ranks(self) -> tuple[int, int]:
        """(local rank, local size): the launcher's, else counted from the hosts the ranks joined from."""
        local, count = os.environ.get("LOCAL_RANK", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
        if local.isdigit() and count.isdigit() and not self.served:  # an epoch's ranks are not the launcher's
            return int(local), int(count)
        here = [r for r, h in enumerate(self.hosts) if h == self.hosts[self.rank]]
        return here.index(self.rank), len(here)

    def failed(self, exc: RuntimeError) -> RendezvousError:
        """``init_process_group``'s failure after the join, as a RendezvousError naming the fix
        (this rank's guard is stopped: the world will not be used)."""
        self.close()
        return RendezvousError(
            f"phalanx.init: rank {self.rank} of {self.size} joined at {self.where}, but torch.distributed "
            f"could not connect the ranks ({_first_line(exc)}). A peer failed during set-up (its own "
            "error is in its output), or a firewall blocks the ranks' connections.")


def check_own_gpus(meeting: Rendezvous, device: Any) -> None:
    """Before NCCL starts: every rank's GPU (host and UUID, so ``CUDA_VISIBLE_DEVICES`` per rank is
    seen through) is its own; else the same UsageError on every rank at once, naming the ranks, the
    device and the fix (NCCL itself fails later with an unrelated-looking connection error)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    gpu = str(getattr(props, "uuid", "") or f"{device}")
    store, keys = meeting.store, [f"{meeting.prefix}gpu/{r}" for r in range(meeting.size)]
    store.set(keys[meeting.rank], json.dumps([meeting.hosts[meeting.rank], gpu, str(device)]))
    seen: dict[tuple[str, str], list[int]] = {}
    named: dict[tuple[str, str], str] = {}
    try:
        values = get_all(store, keys)
    except RuntimeError as exc:  # a peer failed after it joined: its own error is in its output
        raise meeting.failed(exc) from exc
    for r, value in enumerate(values):
        host, uuid, name = json.loads(value)
        seen.setdefault((host, uuid), []).append(r)
        named[(host, uuid)] = f"{name} of {host}"
    shared = {k: v for k, v in seen.items() if len(v) > 1}
    if shared:
        where = "; ".join(f"ranks {ranks} on {named[k]}" for k, ranks in shared.items())
        read = [f"{meeting.prefix}gpu-read/{r}" for r in range(meeting.size)]
        with contextlib.suppress(RuntimeError):  # rank 0 serves the store: keep it until all have read
            store.set(read[meeting.rank], "1")
            deadline = time.monotonic() + min(meeting.timeout, 10.0)
            while meeting.rank == 0 and not store.check(read) and time.monotonic() < deadline:
                time.sleep(0.01)
        meeting.close()
        raise UsageError(
            f"phalanx.init(backend='nccl'): ranks share a GPU ({where}); NCCL needs one GPU per rank. "
            "Start at most as many ranks per node as it has GPUs, give each rank its own GPU with "
            "init(devices=[...]), or use backend='gloo' or 'mpi', which share a GPU between ranks.")


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` only (for the store on a single host)."""
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise RendezvousError(
            f"phalanx.init: rank 0 could not listen on {host}:{port} for the rendezvous ({exc}). Is "
            "MASTER_PORT free? Pick another port, or let `phalanx run` choose one.") from None
    return sock


def _await_listener(host: str, port: int, timeout: float) -> bool:
    """Whether something listens on ``host:port`` within ``timeout`` s. torch's store client retries its
    whole timeout per attempt, with a pause between (about twice the timeout in all, each try printing a
    C++ traceback); a refused plain connection is known at once, so the wait is ours and bounded."""
    deadline, pause = time.monotonic() + timeout, 0.01
    while True:
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=max(0.05, deadline - time.monotonic())):
                return True
        except OSError:
            if time.monotonic() + pause > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


def _first_line(exc: BaseException) -> str:
    return re.sub(r"^\[[^\]]*\] ", "", str(exc).strip().split("\n", 1)[0])
