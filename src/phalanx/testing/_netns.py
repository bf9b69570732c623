"""Namespaces and processes under :func:`phalanx.testing.simulated_hosts`: probing, running ``ip``/``tc``,
finding the processes of a network namespace, and removing what a dead instance left behind.

Instances are named ``phalanx-PID-N`` (the creating process and a counter):
network namespaces ``phalanx-PID-N-sw`` and ``phalanx-PID-N-hI``, temporary
directories ``$TMPDIR/phalanx-hosts-PID-N-*``. A name whose PID no longer runs
belongs to a process that died without cleaning up (SIGKILL); the next instance
removes it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .._errors import SimulatedHostsUnavailableError

__all__ = ["NETNS_DIR", "PREFIX", "command", "net_inode", "processes_in", "remove_stale", "stop_all",
           "why_unavailable"]

NETNS_DIR = "/run/netns"  # where `ip netns add` keeps its names
PREFIX = "phalanx-"
_TOOLS = ("ip", "tc", "nsenter", "unshare", "mount", "sleep", "sh")
_STALE_NETNS = re.compile(r"phalanx-(\d+)-\d+-(sw|h\d+)$")
_STALE_DIR = re.compile(r"phalanx-hosts-(\d+)-\d+-")


@functools.lru_cache(maxsize=1)
def why_unavailable() -> str | None:
    """Why simulated hosts cannot be built here (not Linux, not root, a tool missing, namespaces refused),
    or ``None`` when they can. Probes once per process: ``unshare`` of the namespaces a host uses."""
    if not sys.platform.startswith("linux"):
        return f"simulated hosts need Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return f"simulated hosts need root (network namespaces, mounts); running as uid {os.geteuid()}"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} on PATH (iproute2 and util-linux)"
    try:
        probe = subprocess.run(["unshare", "--net", "--uts", "--ipc", "--mount", "true"], capture_output=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"simulated hosts need namespaces; `unshare --net --uts --ipc --mount true` failed: {exc}"
    if probe.returncode != 0:
        return ("simulated hosts need namespaces; `unshare --net --uts --ipc --mount true` said: "
                f"{probe.stderr.decode(errors='replace').strip()}")
    return None


def command(argv: list[str], *, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run an ``ip``/``tc`` command (bounded); failing, raise naming the command and what it said."""
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SimulatedHostsUnavailableError(f"phalanx.testing.simulated_hosts: `{' '.join(argv)}` failed: {exc}") \
            from exc
    if check and done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        shown = f"{' '.join(argv)}" + (f" <<< {stdin.strip()!r}" if stdin else "")
        raise SimulatedHostsUnavailableError(
            f"phalanx.testing.simulated_hosts: `{shown}` exited {done.returncode}: {said}. Check that this "
            "process may create network namespaces, veth pairs and bridges (root, CAP_NET_ADMIN).")
    return done


def net_inode(path: str) -> int | None:
    """The inode of the network namespace at ``path`` (``/proc/PID/ns/net`` or ``/run/netns/NAME``)."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def processes_in(inode: int) -> list[int]:
    """Every live process whose network namespace is ``inode`` (zombies have none), read from ``/proc``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and net_inode(f"/proc/{entry}/ns/net") == inode:
            found.append(int(entry))
    return sorted(found)


def stop_all(inodes: list[int], *, keep: frozenset[int] = frozenset(), timeout: float = 5.0) -> list[int]:
    """SIGKILL every process in these network namespaces (but ``keep``) until none is left or ``timeout``
    passes (processes may fork meanwhile); returns what survived."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for inode in inodes for pid in processes_in(inode) if pid not in keep]
        if not left or time.monotonic() > deadline:
            return left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces and temporary directories of instances whose process is gone; returns them."""
    removed = []
    try:
        names = sorted(os.listdir(NETNS_DIR))
    except OSError:
        names = []
    stale = [n for n in names if (m := _STALE_NETNS.match(n)) and not _alive(int(m.group(1)))]
    inodes = [i for i in (net_inode(os.path.join(NETNS_DIR, n)) for n in stale) if i is not None]
    stop_all(inodes)
    for name in stale:
        if command(["ip", "netns", "delete", name], check=False).returncode == 0:
            removed.append(name)
    tmp = tempfile.gettempdir()
    for entry in os.listdir(tmp):
        m = _STALE_DIR.match(entry)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(os.path.join(tmp, entry), ignore_errors=True)
            removed.append(os.path.join(tmp, entry))
    return removed
