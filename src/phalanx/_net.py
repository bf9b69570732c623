"""This host's loopback interface, and which rendezvous addresses mean "every rank is here".

Both the gloo set-up (``GLOO_SOCKET_IFNAME``) and the MPI launcher (UCX, libfabric,
Open MPI interface settings) confine a single-host job's sockets to the loopback
interface, whose name differs between systems: ``lo`` on Linux, ``lo0`` on macOS
and the BSDs. Across hosts the gloo set-up lists this host's interfaces (name and
address) and finds the one whose address routes to the master, with nothing
beyond the standard library (``socket.if_nameindex``, ``ioctl(SIOCGIFADDR)``,
``/proc/net/if_inet6``).

Only a literal loopback address counts as "single host": a host name that merely
resolves to a loopback address does not. Debian and Ubuntu map the machine's own
name to 127.0.1.1, so ``MASTER_ADDR=$(hostname)`` in a multi-host job resolves to
loopback on rank 0 while the other ranks connect from other machines.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import struct

__all__ = ["LOCAL_ADDRESSES", "describe_interfaces", "interface_address", "interface_of", "interfaces",
           "is_local_address", "is_loopback", "loopback_interface", "resolve", "route_source"]

# What `phalanx run`'s single-host spawner sets MASTER_ADDR to (127.0.0.1), and its spellings.
LOCAL_ADDRESSES = frozenset({"127.0.0.1", "::1", "localhost"})
_KNOWN = ("lo", "lo0")  # Linux; macOS and the BSDs
_SIOCGIFADDR = 0x8915  # Linux's ioctl number


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


def is_loopback(address: str) -> bool:
    """True when ``address`` (an IP address, not a name) is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(address.strip("[]").split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> str:
    """The first address ``host`` resolves to here (``host`` itself when it is an address); OSError if none."""
    return str(socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0])


def interfaces() -> list[tuple[str, str]]:
    """(name, address) of every address of this host's interfaces, IPv4 first, in interface order.

    IPv4 addresses come from ``ioctl(SIOCGIFADDR)`` (one per interface), IPv6 ones from
    ``/proc/net/if_inet6`` (link-local ones left out); both are Linux's. Elsewhere an
    interface is listed by name with an empty address.
    """
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return []
    found = [(name, _ipv4(name)) for name in names]
    listed = [(n, a) for n, a in found if a]
    listed += [(n, a) for n, a in _ipv6() if n in names]
    shown = {n for n, _ in listed}
    return listed + [(n, "") for n in names if n not in shown]


def interface_address(name: str) -> str | None:
    """The address of interface ``name`` (its IPv4 one when it has one); None for an unknown name."""
    for iface, address in interfaces():
        if iface == name and address:
            return address
    return None


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address``; None when no interface of this host does."""
    for iface, own in interfaces():
        if own and own == address:
            return iface
    return None


def route_source(host: str, port: int) -> str:
    """The address of this host that packets to ``host:port`` leave from (a UDP ``connect``, nothing sent).

    Raises OSError when ``host`` cannot be resolved or reached from here.
    """
    family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        return str(sock.getsockname()[0])


def describe_interfaces() -> str:
    """This host's interfaces as ``"lo 127.0.0.1, eth0 192.0.2.2"`` (for error messages)."""
    listed = interfaces()
    return ", ".join(f"{n} {a}" if a else n for n, a in listed) if listed else "none could be listed"


def _ipv4(name: str) -> str:
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return ""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:  # no IPv4 address (or not Linux's ioctl number)
            return ""
    return socket.inet_ntoa(packed[20:24])


def _ipv6() -> list[tuple[str, str]]:
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    found = []
    for row in rows:  # address (32 hex digits), index, prefix length, scope, flags, name
        if len(row) >= 6 and row[3] != "20":  # 0x20: link-local
            found.append((row[5], str(ipaddress.IPv6Address(bytes.fromhex(row[0])))))
    return found
