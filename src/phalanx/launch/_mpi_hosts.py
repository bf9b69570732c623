"""``--hosts``/``--hostfile``, ``--rsh``, ``--iface`` and a Slurm allocation, in each mpiexec's own words.

=====================  ==========================================  ==============================================
phalanx run            MPICH (Hydra)                               Open MPI
=====================  ==========================================  ==============================================
``--hosts h0:2,h1:2``  ``-hosts h0:2,h1:2`` (``-f FILE``, ``h:N``   ``--host h0:2,h1:2`` (``--hostfile FILE``,
                       lines, past 16 hosts)                       ``h slots=N`` lines, past 16 hosts)
remote start           ``-launcher ssh``                           ssh (its default), ``--prefix`` where its
                                                                   daemon lies beside mpiexec (a venv)
``--rsh CMD``          ``-launcher-exec CMD`` (a wrapper script    ``--mca plm_rsh_agent CMD``
                       when CMD has arguments)
``--iface NAME``       ``-iface NAME``; UCX_NET_DEVICES,           ``--mca btl_tcp_if_include NAME``, the
                       FI_TCP_IFACE, FI_SOCKETS_IFACE              runtime's ``oob_tcp_if_include NAME``
``--oversubscribe``    (Hydra oversubscribes by itself)            ``--oversubscribe`` / ``--map-by :OVERSUBSCRIBE``
Slurm allocation       ``-launcher slurm -hosts`` the allocation   nothing: it reads the allocation and starts
                       (pip's Hydra does not read it itself)       its daemons with ``srun``
=====================  ==========================================  ==============================================

``--iface`` (or ``PHALANX_IFACE``) also reaches every rank as ``PHALANX_IFACE``.
Ranks on other hosts learn the launcher's host name (``PHALANX_LAUNCH_HOST``): they
cannot write into its job directory, so they report a failure on stderr instead.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
from pathlib import Path

from ._hostlist import Host, format_hosts
from ._job import Launch, all_local
from ._slurm import allocation

__all__ = ["LAUNCH_HOST_ENV", "host_args", "interface_env"]

LAUNCH_HOST_ENV = "PHALANX_LAUNCH_HOST"
_FILE_PAST = 16  # more hosts than this go into a host file (command lines have limits)
IFACE_ENV = ("UCX_NET_DEVICES", "FI_TCP_IFACE", "FI_SOCKETS_IFACE")  # the transports MPICH may use


def interface_env(env: dict[str, str], iface: str) -> list[str]:
    """Point the ranks' transports (UCX, libfabric's tcp and sockets) and phalanx at ``iface``;
    a setting the user made is kept. Returns the names set."""
    added = []
    for name in (*IFACE_ENV, "PHALANX_IFACE"):
        if name not in env or name == "PHALANX_IFACE":
            env[name] = iface
            added.append(name)
    return added


def _hostfile(job_dir: str, hosts: list[Host], openmpi: bool) -> str:
    path = os.path.join(job_dir, "hostfile")
    with open(path, "w") as f:
        f.writelines(f"{h.name} slots={h.slots}\n" if openmpi else f"{h.name}:{h.slots}\n" for h in hosts)
    return path


def _rsh_exec(rsh: str, job_dir: str) -> str:
    """Hydra's ``-launcher-exec`` takes one program: wrap a command with arguments in a script."""
    words = shlex.split(rsh)
    if len(words) == 1:
        return shutil.which(words[0]) or words[0]
    path = os.path.join(job_dir, "rsh")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nexec {shlex.join(words)} \"$@\"\n")
    os.chmod(path, 0o755)
    return path


def _hydra(job: Launch, hosts: list[Host] | None, slurm: bool, job_dir: str, iface: str | None) -> list[str]:
    args: list[str] = []
    if hosts:
        args += ["-f", _hostfile(job_dir, hosts, False)] if len(hosts) > _FILE_PAST else \
            ["-hosts", format_hosts(hosts)]
    if slurm:
        args += ["-launcher", "slurm"]
    elif hosts and not all_local(job):
        args += ["-launcher", "ssh"] + (["-launcher-exec", _rsh_exec(job.rsh, job_dir)] if job.rsh else [])
    if iface:
        args += ["-iface", iface]
    return args


def _openmpi_prefix(mpiexec: str, user: list[str]) -> list[str]:
    """``--prefix DIR`` where Open MPI's daemon (``prted``/``orted``) lies beside ``mpiexec`` (a pip
    install): the remote shell's minimal PATH would not find it. Not where the user gave one."""
    if "--prefix" in user:
        return []
    bin_dir = Path(os.path.realpath(mpiexec)).parent
    if any((bin_dir / daemon).is_file() for daemon in ("prted", "orted")):
        return ["--prefix", str(bin_dir.parent)]
    return []


def _openmpi(job: Launch, hosts: list[Host] | None, mpiexec: str, job_dir: str, iface: str | None) -> list[str]:
    # --mca, not --prtemca, for the runtime's settings too: Open MPI 5 passes plm_rsh_agent and
    # oob_tcp_if_include on to PRRTE (where the agent is plm_ssh_agent), Open MPI 4 reads them itself.
    args: list[str] = []
    if hosts:
        args += ["--hostfile", _hostfile(job_dir, hosts, True)] if len(hosts) > _FILE_PAST else \
            ["--host", format_hosts(hosts)]
        if job.rsh:
            args += ["--mca", "plm_rsh_agent", job.rsh]
        args += _openmpi_prefix(mpiexec, job.mpi_args)
    if iface:
        args += ["--mca", "btl_tcp_if_include", iface, "--mca", "oob_tcp_if_include", iface]
    return args


def host_args(job: Launch, family: str, mpiexec: str, job_dir: str, env: dict[str, str],
              ours: list[str]) -> list[str]:
    """The mpiexec arguments that place ``job``'s ranks on its hosts (or the Slurm allocation), start
    them through its rsh, and keep them on its interface; adjusts ``env`` and the names in ``ours``
    (the variables Open MPI must forward). ``family``: ``"mpich"`` or ``"openmpi"``."""
    hosts = job.hosts
    slurm = False
    alloc = allocation() if hosts is None else None
    if alloc is not None and family == "mpich" and alloc.nodes:
        hosts, slurm = alloc.hosts, True
    iface = job.iface or env.get("PHALANX_IFACE") or None
    if iface:
        ours += interface_env(env, iface)
    if not all_local(job) or slurm:
        env[LAUNCH_HOST_ENV] = socket.gethostname()
        ours.append(LAUNCH_HOST_ENV)
    if family == "openmpi":
        return _openmpi(job, hosts, mpiexec, job_dir, iface)
    return _hydra(job, hosts, slurm, job_dir, iface)
