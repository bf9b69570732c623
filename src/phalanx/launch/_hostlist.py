"""Host lists: ``--hosts h0:2,h1:2`` and ``--hostfile FILE``, read and checked before anything starts.

::

    hosts = parse_hosts("h0:2,h1:2")              # [Host("h0", 2), Host("h1", 2)]
    hosts = read_hostfile("hosts.txt")            # "h0 slots=2" / "h0:2" / "h0" lines, # comments
    check_hosts(hosts, "--hosts", resolve=True)   # duplicates, unknown names
    n = ranks_for(None, hosts, oversubscribe=False, flag="--hosts")  # -n: the total slots
    placement(n, hosts)                           # [("h0", 0), ("h0", 1), ("h1", 0), ("h1", 1)]

A host's slots are the ranks it takes (1 when ``:N`` or ``slots=N`` is absent).
Ranks fill the hosts in the order given, each host's slots in turn, as
``mpiexec`` maps them by slot; with ``--oversubscribe`` the extra ranks go round
the hosts again. Every refusal is a :class:`~phalanx.LaunchError` that names the
flag, what it received and the fix.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from .._errors import LaunchError

__all__ = ["Host", "as_hosts", "check_hosts", "format_hosts", "hosts_from_args", "parse_hosts", "placement",
           "ranks_for", "read_hostfile", "total_slots"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$|^\[[0-9A-Fa-f:.]+\]$")  # a host name, an IPv4 or a bracketed IPv6 address
_FILE_LINE = re.compile(r"^(?P<name>\[[^\]]*\]|[^\s:]+)(?::(?P<colon>\S+))?(?:\s+(?P<rest>.*))?$")


@dataclass(frozen=True)
class Host:
    """One host of a job: its ``name`` (a host name or address) and its ``slots`` (ranks it takes)."""

    name: str
    slots: int = 1

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def _slots(text: str, flag: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise LaunchError(f"phalanx run {flag}: bad slot count {text!r} in {where}; give a whole number of "
                          "ranks, 1 or more, e.g. h0:2 (or `h0 slots=2` in a host file).")
    return int(text)


def _name(text: str, flag: str, where: str) -> str:
    if not _NAME.match(text):
        raise LaunchError(f"phalanx run {flag}: {text!r} in {where} is not a host name; give names or "
                          "addresses with an optional slot count, e.g. --hosts h0:2,h1:2.")
    return text


def parse_hosts(spec: str, flag: str = "--hosts") -> list[Host]:
    """The hosts of ``spec``, a comma-separated list of ``name[:slots]`` (``"h0:2,h1:2"``; slots default 1).

    Raises :class:`~phalanx.LaunchError` for an empty list, an empty entry or a bad slot count
    (duplicates and unknown names: :func:`check_hosts`).
    """
    if not spec.strip():
        raise LaunchError(f"phalanx run {flag}: got an empty host list; give the hosts and their slots, "
                          "e.g. --hosts h0:2,h1:2.")
    hosts = []
    for entry in spec.split(","):
        entry = entry.strip()
        where = f"{flag} {spec!r}"
        if not entry:
            raise LaunchError(f"phalanx run {flag}: empty entry in {spec!r}; separate hosts with single "
                              "commas, e.g. --hosts h0:2,h1:2.")
        name, sep, slots = entry.rpartition(":") if not entry.endswith("]") else (entry, "", "")
        if not sep:
            name, slots = entry, "1"
        hosts.append(Host(_name(name, flag, where), _slots(slots, flag, where)))
    return hosts


def _hostfile_line(line: str, flag: str, where: str) -> Host:
    """``host``, ``host:N`` (MPICH), or ``host slots=N [max_slots=M]`` (Open MPI, horovodrun)."""
    match = _FILE_LINE.match(line)
    assert match is not None  # every non-blank line matches
    slots = match["colon"] or "1"
    for word in (match["rest"] or "").split():
        key, _, value = word.partition("=")
        if key in ("slots", "cpu", "cpus"):  # Open MPI's synonyms for slots
            slots = value
        elif key not in ("max_slots", "max-slots"):
            raise LaunchError(f"phalanx run {flag}: cannot read {line!r} at {where}; write `host slots=N`, "
                              "`host:N` or `host` on each line.")
    return Host(_name(match["name"], flag, where), _slots(slots, flag, where))


def read_hostfile(path: str, flag: str = "--hostfile") -> list[Host]:
    """The hosts listed in the file at ``path``: one per line, as ``host slots=N`` (Open MPI, horovodrun),
    ``host:N`` (MPICH) or a bare ``host`` (1 slot); ``#`` starts a comment; blank lines are skipped.

    Raises :class:`~phalanx.LaunchError` when the file cannot be read, lists no host, or has a
    line or slot count it cannot read.
    """
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise LaunchError(f"phalanx run {flag} {path}: cannot read it ({exc.strerror or exc}); give a file "
                          "with one `host slots=N` line per host.") from None
    hosts = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            hosts.append(_hostfile_line(line, flag, f"{path} line {number}"))
    if not hosts:
        raise LaunchError(f"phalanx run {flag} {path}: the file lists no host; write one `host slots=N` "
                          "line per host (e.g. `h0 slots=2`).")
    return hosts


def _resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name.strip("[]"), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return True


def check_hosts(hosts: list[Host], flag: str = "--hosts", *, resolve: bool = True) -> None:
    """Refuse a host list no job can run on: empty, a host named twice, or (``resolve``) a name that
    does not resolve on this host (``socket.getaddrinfo``).

    Raises :class:`~phalanx.LaunchError` naming ``flag``, the offending hosts and the fix.
    """
    if not hosts:
        raise LaunchError(f"phalanx run {flag}: got an empty host list; give the hosts and their slots, "
                          "e.g. --hosts h0:2,h1:2.")
    seen: set[str] = set()
    twice = [h.name for h in hosts if h.name in seen or seen.add(h.name)]  # type: ignore[func-returns-value]
    if twice:
        raise LaunchError(f"phalanx run {flag}: host {twice[0]!r} is listed more than once "
                          f"({format_hosts(hosts)}); list each host once with all its slots, "
                          f"e.g. {twice[0]}:{sum(h.slots for h in hosts if h.name == twice[0])}.")
    if resolve:
        unknown = [h.name for h in hosts if not _resolves(h.name)]
        if unknown:
            raise LaunchError(f"phalanx run {flag}: unknown host name{'s' * (len(unknown) > 1)} "
                              f"{', '.join(map(repr, unknown))} (does not resolve here); check the spelling, "
                              "or add the host to DNS or /etc/hosts.")


def total_slots(hosts: Iterable[Host]) -> int:
    """The number of ranks the hosts take, summed over their slots."""
    return sum(h.slots for h in hosts)


def ranks_for(n: int | None, hosts: list[Host], *, oversubscribe: bool = False, flag: str = "--hosts") -> int:
    """The job's number of ranks: ``n``, or the total slots of ``hosts`` when ``n`` is None.

    Raises :class:`~phalanx.LaunchError` when ``n`` is below 1, or above the total slots
    without ``oversubscribe``.
    """
    slots = total_slots(hosts)
    if n is None:
        return slots
    if n < 1:
        raise LaunchError(f"phalanx run -n {n}: a job needs at least one rank; use -n 1 or more.")
    if n > slots and not oversubscribe:
        raise LaunchError(f"phalanx run -n {n} {flag}: {n} ranks but only {slots} slot{'s' * (slots > 1)} "
                          f"({format_hosts(hosts)}); give -n {slots} or less, more slots, or --oversubscribe "
                          "to run more ranks than slots.")
    return n


def placement(n: int, hosts: list[Host]) -> list[tuple[str, int]]:
    """``(host name, local rank)`` of each of ``n`` ranks: the hosts' slots in order, then round again."""
    if not hosts:
        raise LaunchError("phalanx run: no hosts to place ranks on; give --hosts h0:2,h1:2.")
    where: list[tuple[str, int]] = []
    local = dict.fromkeys((h.name for h in hosts), 0)
    while len(where) < n:
        for host in hosts:
            for _ in range(min(host.slots, n - len(where))):
                where.append((host.name, local[host.name]))
                local[host.name] += 1
    return where


def format_hosts(hosts: Iterable[Host]) -> str:
    """``"h0:2,h1:2"``: the form of ``--hosts`` (and MPICH's ``-hosts``)."""
    return ",".join(map(str, hosts))


def as_hosts(value: object) -> list[Host] | None:
    """Hosts from what a :class:`~phalanx.launch.Launch` may hold: ``None``, ``"h0:2,h1:2"``, or a list
    of :class:`Host`, ``"h0:2"`` strings, ``[name, slots]`` pairs (as JSON gives them back) or
    ``{"name", "slots"}`` dicts (as :func:`dataclasses.asdict` gives them)."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_hosts(value)
    hosts = []
    for item in value:  # type: ignore[attr-defined]
        if isinstance(item, Host):
            hosts.append(item)
        elif isinstance(item, str):
            hosts += parse_hosts(item)
        elif isinstance(item, dict):  # dataclasses.asdict(job)
            hosts.append(Host(str(item["name"]), int(item.get("slots", 1))))
        else:
            name, slots = item
            hosts.append(Host(str(name), int(slots)))
    return hosts


def hosts_from_args(hosts: str | None, hostfile: str | None, *, resolve: bool = True) -> list[Host] | None:
    """The checked host list of ``--hosts`` or ``--hostfile`` (None when neither is given).

    Raises :class:`~phalanx.LaunchError` when both are given, or as :func:`parse_hosts`,
    :func:`read_hostfile` and :func:`check_hosts` do.
    """
    if hosts is not None and hostfile is not None:
        raise LaunchError(f"phalanx run: got both --hosts {hosts!r} and --hostfile {hostfile}; give one of them.")
    if hosts is not None:
        found, flag = parse_hosts(hosts), "--hosts"
    elif hostfile is not None:
        found, flag = read_hostfile(os.path.expanduser(hostfile)), "--hostfile"
    else:
        return None
    check_hosts(found, flag, resolve=resolve)
    return found
