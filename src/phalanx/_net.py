"""This host's loopback interface, and which rendezvous addresses mean "every rank is here".

Both the gloo set-up (``GLOO_SOCKET_IFNAME``) and the MPI launcher (UCX, libfabric,
Open MPI interface settings) confine a single-host job's sockets to the loopback
interface, whose name differs between systems: ``lo`` on Linux, ``lo0`` on macOS
and the BSDs.

Only a literal loopback address counts as "single host": a host name that merely
resolves to a loopback address does not. Debian and Ubuntu map the machine's own
name to 127.0.1.1, so ``MASTER_ADDR=$(hostname)`` in a multi-host job resolves to
loopback on rank 0 while the other ranks connect from other machines.
"""

from __future__ import annotations

import functools
import socket

__all__ = ["LOCAL_ADDRESSES", "is_local_address", "loopback_interface"]

# What `phalanx run`'s single-host spawner sets MASTER_ADDR to (127.0.0.1), and its spellings.
LOCAL_ADDRESSES = frozenset({"127.0.0.1", "::1", "localhost"})
_KNOWN = ("lo", "lo0")  # Linux; macOS and the BSDs


def is_local_address(host: str) -> bool:
    """True when ``host`` is literally a loopback address (so every rank must be on this host)."""
    return host.strip().strip("[]").lower() in LOCAL_ADDRESSES


@functools.lru_cache(maxsize=1)
def loopback_interface() -> str:
    """The name of this host's loopback interface: ``lo``, ``lo0``, or another ``lo*`` one listed.

    Falls back to ``lo`` where the system cannot list its interfaces.
    """
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):  # no if_nameindex on this platform
        return "lo"
    for name in _KNOWN:
        if name in names:
            return name
    loops = sorted(n for n in names if n.startswith("lo") and n[2:].isdigit())
    return loops[0] if loops else "lo"
