"""``simulated_hosts(k)``: k Linux hosts on one machine, joined by a switch, for tests of multi-host jobs.

Each host is a network namespace (``eth0`` at 198.18.0.(i+1)/24, ``lo`` up, no
default route) whose ``eth0`` is one end of a veth pair; the other ends are the
ports ``pI`` of a bridge in a private "switch" namespace. One long-lived holder
process per host (``sleep infinity``) also owns the host's UTS, IPC and mount
namespaces: host name ``hI``, a private tmpfs on ``/dev/shm``, and a generated
``/etc/hosts`` naming every host, so MPI libraries see distinct nodes and move
data over the network, not through shared memory. Commands join a host with
``nsenter -t HOLDER --net --uts --ipc --mount`` (no pid namespace: the machine's
``/proc`` and file system are shared, as an NFS home would be).
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any

from .._errors import InvalidArgumentError, SimulatedHostsUnavailableError
from ._netns import PREFIX, command, net_inode, processes_in, remove_stale, stop_all, why_unavailable

__all__ = ["SimulatedHosts", "simulated_hosts"]

SUBNET = "198.18.0."  # 198.18.0.0/15 is reserved for benchmark networks (RFC 2544)
_MAX_HOSTS = 250
_START_TIMEOUT = 15.0
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*$", re.IGNORECASE)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_counter = itertools.count()
_open: set[SimulatedHosts] = set()
_lock = threading.Lock()


def simulated_hosts(k: int, rate: str | float | None = None) -> SimulatedHosts:
    """``k`` simulated Linux hosts on this machine, built on ``with`` entry and removed on exit.

    ::

        with simulated_hosts(2, rate="1gbit") as hosts:
            hosts.run(0, ["hostname"], capture_output=True, text=True).stdout  # "h0\\n"
            subprocess.run([hosts.rsh, "h1", "echo", "hi"])                     # ssh-style, to h1

    Host ``i`` is named ``hI`` (resolvable on every host), has address ``198.18.0.(i+1)`` on
    ``eth0`` behind one switch, its own host name, IPC namespace, ``/dev/shm`` and ``TMPDIR``;
    the rest of the file system is shared. On exit, also when the body raises or a SIGTERM
    arrives, every process on every host is killed and every namespace and file removed.

    Arguments:
        ``k``: the number of hosts, 1 to 250. ``rate``: each link's rate both ways through
        ``tc tbf``, as ``"100mbit"``, ``"1gbit"``, ``"10mbps"`` (bytes) or bits per second;
        ``None`` leaves the links unshaped.

    Returns:
        a :class:`SimulatedHosts`, to use as a context manager.

    Raises:
        :class:`~phalanx.SimulatedHostsUnavailableError` on entry when this machine cannot build
        hosts (not root, not Linux, ``ip``/``nsenter``/``unshare``/``tc`` missing);
        :class:`~phalanx.InvalidArgumentError` for a bad ``k`` or ``rate``.
    """
    return SimulatedHosts(k, rate)


class SimulatedHosts:
    """k simulated hosts (made by :func:`simulated_hosts`): run commands on them, cut links, kill hosts.

    ``names`` (``["h0", ...]``), ``addresses`` (``["198.18.0.1", ...]``), ``iface`` (``"eth0"``)
    and ``rsh`` (the path of an ssh stand-in, ``RSH [ssh options] HOST COMMAND...``, for
    ``mpiexec -launcher ssh -launcher-exec RSH``, Open MPI's ``--mca plm_rsh_agent RSH`` or
    ``phalanx run --rsh RSH``) are set once entered. Hosts are numbered from 0.

    Arguments:
        ``k``: the number of hosts. ``rate``: the initial link rate (see :meth:`set_rate`).
    """

    iface = "eth0"

    def __init__(self, k: int, rate: str | float | None = None) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= _MAX_HOSTS:
            raise InvalidArgumentError(f"phalanx.testing.simulated_hosts(k={k!r}): k is the number of hosts, an "
                                       f"int from 1 to {_MAX_HOSTS}; pass e.g. simulated_hosts(2).")
        self._tbf(rate)  # checked now, applied on entry
        self.names = [f"h{i}" for i in range(k)]
        self.addresses = [f"{SUBNET}{i + 1}" for i in range(k)]
        self.rate = rate
        self.rsh = ""
        self._owner = os.getpid()  # a forked child that exits must not take the hosts down (atexit)
        self._id = f"{PREFIX}{self._owner}-{next(_counter)}"
        self._switch = f"{self._id}-sw"
        self._netns = [f"{self._id}-{name}" for name in self.names]
        self._dir = ""
        self._holders: list[subprocess.Popen[bytes]] = []
        self._inodes: list[int] = []
        self._started: list[subprocess.Popen[Any]] = []  # popen()'s processes, killed on close even mid-nsenter
        self._state = "new"

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"<SimulatedHosts {self._id} k={len(self)} {self._state}>"

    # -- life cycle ------------------------------------------------------------------------------

    def __enter__(self) -> SimulatedHosts:
        if self._state != "new":
            raise InvalidArgumentError(f"phalanx.testing.simulated_hosts: {self!r} was already entered; make a "
                                       "new one with simulated_hosts(k) for each `with` block.")
        reason = why_unavailable()
        if reason is not None:
            raise SimulatedHostsUnavailableError(
                f"phalanx.testing.simulated_hosts({len(self)}): {reason}. Run as root on Linux (in a container: "
                "--privileged, or CAP_SYS_ADMIN and CAP_NET_ADMIN), or skip the test there.")
        self._state = "open"
        with _lock:
            _open.add(self)
            _catch_sigterm()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _build(self) -> None:
        remove_stale()
        self._dir = tempfile.mkdtemp(prefix=f"phalanx-hosts-{self._id[len(PREFIX):]}-")
        command(["ip", "-batch", "-"], stdin="".join(f"netns add {ns}\n" for ns in [self._switch, *self._netns]))
        switch = ["link add br0 type bridge", "link set br0 addrgenmode none", "link set br0 up"]
        for i, ns in enumerate(self._netns):
            switch += [f"link add p{i} type veth peer name {self.iface} netns {ns}", f"link set p{i} master br0",
                       f"link set p{i} addrgenmode none", f"link set p{i} up"]
        command(["ip", "-n", self._switch, "-batch", "-"], stdin="\n".join(switch) + "\n")
        for i, ns in enumerate(self._netns):
            host = ["link set lo up", f"link set {self.iface} addrgenmode none",  # no IPv6 chatter on the wire
                    f"addr add {self.addresses[i]}/24 dev {self.iface}", f"link set {self.iface} up"]
            command(["ip", "-n", ns, "-batch", "-"], stdin="\n".join(host) + "\n")
        self._inodes = [net_inode(f"/run/netns/{ns}") or 0 for ns in self._netns]
        hosts_file = os.path.join(self._dir, "hosts")
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
            f.writelines(f"{address}\t{name}\n" for address, name in zip(self.addresses, self.names, strict=True))
        for i in range(len(self)):
            os.makedirs(self.tmpdir(i))
            os.makedirs(os.path.join(self._dir, "cut"), exist_ok=True)
        self._holders = [self._start_holder(i, hosts_file) for i in range(len(self))]
        for i in range(len(self)):
            self._wait_ready(i)
        self.rsh = self._write_rsh()
        if self.rate is not None:
            self.set_rate(self.rate)

    def _start_holder(self, i: int, hosts_file: str) -> subprocess.Popen[bytes]:
        script = " && ".join(["mount -t tmpfs -o mode=1777 tmpfs /dev/shm", f"hostname {self.names[i]}",
                              f"mount --bind {shlex.quote(hosts_file)} /etc/hosts", "echo ready",
                              "exec sleep infinity >/dev/null 2>&1"])
        argv = ["ip", "netns", "exec", self._netns[i], "unshare", "--uts", "--ipc", "--mount", "--propagation",
                "private", "sh", "-c", script]
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)

    def _wait_ready(self, i: int) -> None:
        holder = self._holders[i]
        assert holder.stdout is not None and holder.stderr is not None
        ready, _, _ = select.select([holder.stdout], [], [], _START_TIMEOUT)
        line = holder.stdout.readline() if ready else b""
        if line.strip() != b"ready" or net_inode(f"/proc/{holder.pid}/ns/net") != self._inodes[i]:
            holder.kill()
            said = holder.stderr.read().decode(errors="replace").strip() if ready else "(no answer)"
            raise SimulatedHostsUnavailableError(
                f"phalanx.testing.simulated_hosts: host {self.names[i]} could not start within "
                f"{_START_TIMEOUT:g} s (unshare, a tmpfs on /dev/shm, hostname, a bind mount over /etc/hosts): "
                f"{said or 'no message'}. Check that this process may mount file systems (CAP_SYS_ADMIN).")
        holder.stdout.close()
        holder.stderr.close()

    def _write_rsh(self) -> str:
        import json

        hosts = {}
        for i, (name, address) in enumerate(zip(self.names, self.addresses, strict=True)):
            hosts[name] = hosts[address] = {"pid": self._holders[i].pid, "tmpdir": self.tmpdir(i),
                                            "cut_marker": self._cut_marker(i), "net": self._inodes[i]}
        config = os.path.join(self._dir, "rsh.json")
        with open(config, "w") as f:
            json.dump({"hosts": hosts}, f)
        path = os.path.join(self._dir, "rsh")
        stand_in = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rsh.py")
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -I {shlex.quote(stand_in)} "
                    f"{shlex.quote(config)} \"$@\"\n")
        os.chmod(path, 0o755)
        return path

    def close(self) -> None:
        """Kill every process on every host and remove the namespaces and files (idempotent)."""
        if self._state == "closed":
            return
        self._state = "closed"
        try:
            for proc in self._started:  # one still inside nsenter is in no host's namespaces yet
                if proc.poll() is None:
                    proc.kill()
            left = stop_all([inode for inode in self._inodes if inode])
            for holder in self._holders:
                try:
                    holder.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            lines = "".join(f"netns delete {ns}\n" for ns in [*self._netns, self._switch]
                            if os.path.exists(f"/run/netns/{ns}"))
            if lines:
                command(["ip", "-force", "-batch", "-"], stdin=lines, check=False)
            if self._dir:
                shutil.rmtree(self._dir, ignore_errors=True)
            if left:
                print(f"phalanx.testing.simulated_hosts: processes {left} outlived SIGKILL", file=sys.stderr)
        finally:
            with _lock:
                _open.discard(self)
                if not _open:
                    _restore_sigterm()

    # -- running things ---------------------------------------------------------------------------

    def run(self, i: int, argv: str | Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` on host ``i`` and wait, as ``subprocess.run(argv, **kw)`` does (``timeout=``, ``check=``...).

        The command starts in ``kw["cwd"]`` (default: this process's directory) with ``kw["env"]``
        (default: this process's environment) plus the host's ``TMPDIR``; ``shell=True`` runs the
        string ``argv`` with ``/bin/sh -c`` on the host. A command that cannot start exits non-zero (127:
        not found) with ``nsenter``'s message (no ``OSError``, unlike ``subprocess``). Raises
        ``InvalidArgumentError`` for a bad ``i``.
        """
        return subprocess.run(self._enter(i, argv, kw), **kw)

    def popen(self, i: int, argv: str | Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``i`` and return at once, as ``subprocess.Popen(argv, **kw)`` does.

        ``i``: the host; ``argv``: the command (a string with ``shell=True``); ``kw``: Popen's keywords
        (``cwd`` and ``env`` apply on the host, which adds its ``TMPDIR``). The process is killed
        (SIGKILL) when the hosts close, if it is still running. Raises ``InvalidArgumentError`` for a
        bad ``i``.
        """
        proc = subprocess.Popen(self._enter(i, argv, kw), **kw)
        self._started = [p for p in self._started if p.returncode is None] + [proc]
        return proc

    def _enter(self, i: int, argv: str | Sequence[str], kw: dict[str, Any]) -> list[str]:
        i = self._index(i, "run")
        cwd = os.fspath(kw.pop("cwd", None) or os.getcwd())
        env = kw.pop("env", None)
        if env is None:
            env = {key: value for key, value in os.environ.items() if key != "HOSTNAME"}
        kw["env"] = dict(env, TMPDIR=self.tmpdir(i))
        if kw.pop("shell", False):
            words = ["/bin/sh", "-c", argv if isinstance(argv, str) else " ".join(argv)]
        else:
            words = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv)
        return ["nsenter", "-t", str(self._holders[i].pid), "--net", "--uts", "--ipc", "--mount", f"--wd={cwd}",
                "--", *map(os.fsdecode, words)]

    def tmpdir(self, i: int) -> str:
        """Host ``i``'s private temporary directory (its ``TMPDIR``), on the shared file system."""
        return os.path.join(self._dir, self.names[self._index(i, "tmpdir")], "tmp")

    def netns(self, i: int) -> str:
        """The name of host ``i``'s network namespace, for ``ip -n NAME ...`` or ``ip netns exec NAME ...``."""
        return self._netns[self._index(i, "netns")]

    # -- faults ------------------------------------------------------------------------------------

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down at the switch: its packets go nowhere, its connections stall.

        New ``rsh`` connections to or from it fail (exit 255) after ssh's connect timeout; ``rsh``
        streams already open keep flowing (they do not cross the simulated network), but an ``rsh``
        client signalled, or whose stdin is closed, while the cut lasts leaves its command running
        (and its stdin open) for 5 s or until the heal, as a real ssh connection's far end would (a
        launcher cannot end a cut host's ranks through it). Undo with :meth:`heal`.
        """
        i = self._index(i, "cut")
        command(["ip", "-n", self._switch, "link", "set", f"p{i}", "down"])
        open(self._cut_marker(i), "w").close()

    def heal(self, i: int) -> None:
        """Bring host ``i``'s link back up after :meth:`cut` (``i``: the host)."""
        i = self._index(i, "heal")
        command(["ip", "-n", self._switch, "link", "set", f"p{i}", "up"])
        if os.path.exists(self._cut_marker(i)):
            os.unlink(self._cut_marker(i))

    def _cut_marker(self, i: int) -> str:
        return os.path.join(self._dir, "cut", self.names[i])

    def pids(self, i: int) -> list[int]:
        """The pids of every process on host ``i`` (its network namespace), sorted; the holder left out."""
        i = self._index(i, "pids")
        return [pid for pid in processes_in(self._inodes[i]) if pid != self._holders[i].pid]

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process on host ``i``; with SIGKILL (the default), until none is left.

        ``i``: the host; ``sig``: the signal number. A SIGKILLed host stays up (its address answers,
        ``run`` works), like a machine whose processes all died.
        """
        i = self._index(i, "kill")
        if sig == signal.SIGKILL:
            stop_all([self._inodes[i]], keep=frozenset({self._holders[i].pid}))
            return
        for pid in self.pids(i):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def set_rate(self, rate: str | float | None) -> None:
        """Shape every link, both ways, to ``rate`` with ``tc tbf`` (``None``: remove the shaping).

        ``rate``: ``"100mbit"``, ``"1gbit"``, ``"10mbps"`` (bytes per second) or a number of bits
        per second. Raises ``InvalidArgumentError`` for a rate ``tc`` would not understand.
        """
        tbf = self._tbf(rate)
        if self._state != "open":
            raise InvalidArgumentError(f"phalanx.testing.simulated_hosts: set_rate({rate!r}) on {self!r}; call it "
                                       "inside the `with` block.")
        ports = [f"qdisc {'del' if tbf is None else 'replace'} dev p{i} root {tbf or ''}\n" for i in range(len(self))]
        command(["tc", "-force", "-n", self._switch, "-batch", "-"], stdin="".join(ports), check=tbf is not None)
        for ns in self._netns:
            command(["tc", "-n", ns, "qdisc", "del" if tbf is None else "replace", "dev", self.iface, "root",
                     *(tbf or "").split()], check=tbf is not None)
        self.rate = rate

    @staticmethod
    def _tbf(rate: str | float | None) -> str | None:
        if rate is None:
            return None
        m = _RATE.match(str(rate)) if not isinstance(rate, bool) else None
        bits = float(m.group(1)) * _SCALE[m.group(2).lower()] * (8 if (m.group(3) or "").lower() == "bps" else 1) \
            if m else 0.0
        if bits < 8000:
            raise InvalidArgumentError(
                f"phalanx.testing.simulated_hosts: rate={rate!r} is not a link rate; pass e.g. '100mbit', '1gbit', "
                "'10mbps' (bytes per second), a number of bits per second of at least 8000, or None for no limit.")
        burst = max(int(bits / 8 / 500), 16384)  # 2 ms worth, at least about ten full frames
        return f"tbf rate {int(bits)}bit burst {burst} latency 50ms"

    def _index(self, i: int, call: str) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self):
            raise InvalidArgumentError(f"phalanx.testing.simulated_hosts: {call}({i!r}): hosts are numbered 0 to "
                                       f"{len(self) - 1}; pass one of those.")
        if self._state != "open":
            raise InvalidArgumentError(f"phalanx.testing.simulated_hosts: {call}({i}) on {self!r}; call it inside "
                                       "the `with` block.")
        return i


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _catch_sigterm() -> None:
    """While hosts are open, a SIGTERM that would kill this process at once unwinds it instead (cleanup runs).

    Only where SIGTERM has its default action, and only from the main thread (Python's rule for handlers).
    """
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _restore_sigterm() -> None:
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@atexit.register
def _close_all() -> None:
    with _lock:
        still_open = list(_open)
    for hosts in still_open:
        if hosts._owner == os.getpid():
            hosts.close()
