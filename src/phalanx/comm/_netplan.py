"""Which interface gloo/NCCL use, and how the rendezvous store is reached (guarded or not).

Read once per ``phalanx.init`` by :class:`._torchsetup.Rendezvous`, from the launch
environment: ``MASTER_ADDR``, ``PHALANX_IFACE`` (``phalanx run --iface``),
``PHALANX_SECRET`` (the launcher's per-job secret), ``LOCAL_WORLD_SIZE``. Why the
rules are what they are is in ``docs/design.md`` ("The guarded rendezvous").
"""

from __future__ import annotations

import dataclasses
import os
import socket
import warnings

from .._errors import LaunchEnvironmentError, RendezvousError
from .._net import (
    describe_interfaces,
    interface_address,
    interface_of,
    interfaces,
    is_local_address,
    is_loopback,
    loopback_interface,
    resolve,
    route_source,
)

__all__ = ["MIN_SECRET", "Plan", "job_key", "plan"]

MIN_SECRET = 16  # characters of PHALANX_SECRET (the launcher's: 64 hex digits)
_HOW = ("choose one with `phalanx run --iface NAME` or the environment variable PHALANX_IFACE=NAME "
        "(the interface whose address the other hosts reach)")


@dataclasses.dataclass
class Plan:
    """How this rank reaches the store: ``guarded`` (through the guards, with ``key``) or not;
    ``bind``: the addresses rank 0's guard (or, unguarded, the store) listens on."""

    guarded: bool
    bind: list[str]
    key: bytes = b""


def plan(host: str, port: int, rank: int, size: int, agent: bool) -> Plan:
    """Set gloo's and NCCL's interface variables for ``MASTER_ADDR=host``, and say how the store
    is reached. Raises LaunchEnvironmentError (a bad PHALANX_IFACE or secret) or RendezvousError
    (no usable interface, no secret where one is needed), naming the fix."""
    if is_local_address(host):  # every rank on this host: loopback, guarded when the job has a secret
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        if agent or not os.environ.get("PHALANX_SECRET", "").strip():
            if rank == 0 and not agent:
                warnings.warn("phalanx.init: PHALANX_SECRET is not set, so any local process can read and write "
                              "this job's rendezvous on loopback; `phalanx run` sets one per job.",
                              RuntimeWarning, stacklevel=2)
            return Plan(False, [host])
        return Plan(True, [host] if rank == 0 else [], _secret(host))
    single = os.environ.get("LOCAL_WORLD_SIZE", "").strip() == str(size)
    iface = _interface(host, port, single)
    if agent:  # torchrun's agent serves the store: phalanx cannot guard it
        return Plan(False, [])
    try:
        master = resolve(host)
    except OSError as exc:
        raise RendezvousError(f"phalanx.init: MASTER_ADDR={host} cannot be resolved on this host "
                              f"({socket.gethostname()}: {exc}); set it to rank 0's address.") from None
    if is_loopback(master) and single:
        return Plan(False, [master])
    key = _secret(host)
    if rank != 0:
        return Plan(True, [], key)
    if not is_loopback(master) and interface_of(master) is not None:
        return Plan(True, [master], key)
    own = interface_address(iface) if iface else None
    if own is None or is_loopback(own):
        raise RendezvousError(
            f"phalanx.init: rank 0 cannot tell which address to serve the rendezvous on: "
            f"MASTER_ADDR={host} is {master} here, not an address the other hosts reach; set MASTER_ADDR "
            f"to this host's address, or {_HOW}. Interfaces here: {describe_interfaces()}.")
    return Plan(True, [own, master] if is_loopback(master) else [own], key)


def _interface(host: str, port: int, single: bool) -> str | None:
    """The interface chosen for gloo (and NCCL), its variables set; None when gloo's own choice
    (the address the host name resolves to) is left alone."""
    name = os.environ.get("PHALANX_IFACE", "").strip()
    if name:
        address = interface_address(name)
        if address is None:
            raise LaunchEnvironmentError(
                f"phalanx.init: PHALANX_IFACE={name} (`phalanx run --iface`) is not an interface of this "
                f"host ({socket.gethostname()}) with an address; its interfaces: {describe_interfaces()}. "
                "Pass one of these names.")
        _loopback_check(name, address, host, single, f"PHALANX_IFACE={name}")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
        return name
    chosen = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if chosen or not _name_is_loopback():
        return chosen or None
    try:  # gloo would use a loopback address: take the interface that routes to the master
        source = route_source(host, port)
    except OSError as exc:
        raise RendezvousError(
            f"phalanx.init: this host's name ({socket.gethostname()}) resolves to a loopback address, "
            f"which ranks on other hosts cannot reach, and no route to MASTER_ADDR={host} was found "
            f"({exc}) to choose an interface by; {_HOW}. Interfaces here: {describe_interfaces()}.") from None
    if is_loopback(source):  # the master is this host under a loopback name (Debian's 127.0.1.1)
        only = _only_interface()
        source = only[1] if only is not None else source
    name = interface_of(source) or ""
    if not name:
        raise RendezvousError(
            f"phalanx.init: this host's name ({socket.gethostname()}) resolves to a loopback address, and "
            f"the address {source} that routes to MASTER_ADDR={host} is on no interface listed here; "
            f"{_HOW}. Interfaces here: {describe_interfaces()}.")
    _loopback_check(name, source, host, single, "the interface that routes to MASTER_ADDR")
    os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def _only_interface() -> tuple[str, str] | None:
    """(name, address) of this host's one non-loopback interface with an address; None when it has
    none or several (then the user must choose)."""
    found: dict[str, str] = {}
    for name, address in interfaces():
        if address and not is_loopback(address):
            found.setdefault(name, address)
    return next(iter(found.items())) if len(found) == 1 else None


def _loopback_check(name: str, address: str, host: str, single: bool, what: str) -> None:
    if is_loopback(address) and not single:
        raise RendezvousError(
            f"phalanx.init: {what} is {name} ({address}), a loopback address, but MASTER_ADDR={host} is "
            f"not: ranks on other hosts cannot reach this rank there. If every rank runs on this host, set "
            f"MASTER_ADDR=127.0.0.1; otherwise {_HOW}. Interfaces here: {describe_interfaces()}.")


def _name_is_loopback() -> bool:
    """True when this host's name resolves to a loopback address (or not at all): gloo's default."""
    try:
        return is_loopback(resolve(socket.gethostname()))
    except OSError:
        return True


def job_key(host: str) -> bytes:
    """The job's secret as the guards prove it (``PHALANX_SECRET``; RendezvousError naming the fix when unset)."""
    return _secret(host)


def _secret(host: str) -> bytes:
    secret = os.environ.get("PHALANX_SECRET", "").strip()
    if not secret:
        raise RendezvousError(
            f"phalanx.init: MASTER_ADDR={host} is not a loopback address, so the rendezvous is reachable "
            "from the network and needs a per-job secret, and PHALANX_SECRET is not set. `phalanx run` "
            "sets it; with torchrun, srun or your own launcher set the same value on every rank, e.g. "
            "`export PHALANX_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')`. On "
            "Kubernetes (a Kubeflow PyTorchJob), keep it in a Secret and give it to every pod as the "
            "environment variable PHALANX_SECRET (`valueFrom: secretKeyRef:`; docs/kubernetes.md).")
    if len(secret) < MIN_SECRET:
        raise LaunchEnvironmentError(
            f"phalanx.init: PHALANX_SECRET has {len(secret)} characters; use at least {MIN_SECRET} random "
            "ones, e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`.")
    return secret.encode()
