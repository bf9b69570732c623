"""gloo/nccl on several hosts, torchrun's convention: one ``phalanx run`` per host.

::

    # on every host, the same command but for --node-rank (0 on the host named by --master)
    export PHALANX_SECRET=...    # the same on every host
    phalanx run --nnodes 2 --node-rank K --master h0:29500 -n 4 --backend gloo train.py

Every host runs the same number of ranks (``-n``); host K's rank ``i`` is
global rank ``K * n + i`` of ``nnodes * n``. Each rank gets torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), the
interface (``PHALANX_IFACE`` from ``--iface``; without it the ranks take the
one that routes to the master where the host name would not do) and the
job's secret (``PHALANX_SECRET``, from the environment or ``--secret-file``),
which a job on more than one host must have: rank 0's rendezvous listens on
the network and admits only clients that know it.

Each launcher supervises its own ranks as on one host (:mod:`._spawn`): a
failure elsewhere reaches them as a lost peer, so they fail too and every
launcher exits non-zero. The start timeout is not applied (a launcher sees
only its own ranks' progress).
"""

from __future__ import annotations

import os
import re

from .._errors import LaunchError
from ._job import Launch, Signals
from ._spawn import Placement, run_spawn

__all__ = ["DEFAULT_PORT", "MARK", "SECRET_HELP", "check_nodes", "check_secret", "parse_master", "rank_placement",
           "read_secret", "run_node"]

DEFAULT_PORT = 29500  # torchrun's
SECRET_HELP = ("make one and give the same to every host, e.g. `export PHALANX_SECRET=$(python -c 'import "
               "secrets; print(secrets.token_hex(32))')` (or `--secret-file FILE`), or start the job with "
               "`phalanx run --hosts h0:N,h1:N ...`, which makes one")
MIN_SECRET = 16  # characters, as the ranks require (phalanx.comm._netplan)
MARK = "@phalanx-remote "  # starts a stderr line from a per-host launcher (._remote) to its driver (._from_one_host)


def parse_master(text: str) -> tuple[str, int]:
    """``(host, port)`` from ``--master HOST[:PORT]`` (``[v6]:PORT`` for IPv6); port 29500 when absent.

    Raises :class:`LaunchError` for an empty host or a port that is not 1..65535.
    """
    text = text.strip()
    match = re.fullmatch(r"\[([^\]]+)\](?::(\w*))?|([^:\[\]]+)(?::(\w*))?|([0-9a-fA-F:]+)", text)
    if match is None or not text:
        raise LaunchError(f"phalanx run --master {text!r}: give the host of node 0 and optionally a port, "
                          "e.g. --master h0 or --master 10.0.0.1:29500 ([::1]:29500 for IPv6).")
    host = match.group(1) or match.group(3) or match.group(5)
    port_text = match.group(2) if match.group(1) else match.group(4)
    if port_text is None:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise LaunchError(f"phalanx run --master {text!r}: the port {port_text!r} is not a number in 1..65535; "
                          f"e.g. --master {host}:{DEFAULT_PORT}.")
    return host, int(port_text)


def check_secret(secret: str, source: str) -> str:
    """``secret`` stripped; :class:`LaunchError` naming ``source`` unless it is 16 or more characters
    without blanks (``secrets.token_hex(32)`` makes 64)."""
    secret = secret.strip()
    blanks = re.search(r"\s", secret) is not None
    if len(secret) < MIN_SECRET or blanks:
        raise LaunchError(f"phalanx run: the job secret from {source} has {len(secret)} characters"
                          f"{' with blanks' if blanks else ''}; it needs {MIN_SECRET} or more without blanks: "
                          f"{SECRET_HELP}.")
    return secret


def read_secret(secret_file: str | None) -> str | None:
    """The job's secret: the contents of ``secret_file`` if given, else ``$PHALANX_SECRET``, else None.

    Raises :class:`LaunchError` when the file cannot be read or the secret is too short (:func:`check_secret`).
    """
    if secret_file is not None:
        try:
            with open(secret_file) as f:
                return check_secret(f.read(), f"--secret-file {secret_file}")
        except OSError as exc:
            raise LaunchError(f"phalanx run --secret-file {secret_file}: cannot read it ({exc.strerror}); "
                              f"{SECRET_HELP}.") from None
    value = os.environ.get("PHALANX_SECRET", "")
    return check_secret(value, "PHALANX_SECRET") if value.strip() else None


def rank_placement(job: Launch, ranks: list[int], world_size: int, master: tuple[str, int],
                   secret: str | None, nnodes: int, node_rank: int) -> Placement:
    """Where this host's ``ranks`` (global, one per local rank) sit in a multi-host job, with the
    environment they need for it (``PHALANX_IFACE``, ``PHALANX_SECRET``, torchrun's ``GROUP_RANK``)."""
    host, port = master
    extra = {"GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(nnodes)}
    if secret:
        extra["PHALANX_SECRET"] = secret
    if job.iface:  # the ranks choose gloo's and NCCL's interface from it (or, without, by the route to the master)
        extra["PHALANX_IFACE"] = job.iface
    return Placement(world_size=world_size, ranks=tuple(ranks), master_addr=host, master_port=port, env=extra)


def check_nodes(job: Launch) -> None:
    """Refuse multi-host settings no job can use: ``nnodes``/``node_rank``/``master`` with MPI or with
    ``hosts``, a ``node_rank`` outside ``0..nnodes-1``, several nodes without a master.

    Raises :class:`LaunchError` naming the flags and the fix.
    """
    nodes = job.nnodes != 1 or job.node_rank != 0 or job.master is not None
    if nodes and job.backend == "mpi":
        raise LaunchError("phalanx run --nnodes/--node-rank/--master: only for --backend gloo or nccl; an MPI "
                          "job on several hosts is one `phalanx run --hosts h0:N,h1:N --backend mpi ...`.")
    if (job.nnodes != 1 or job.node_rank != 0) and getattr(job, "hosts", None):
        raise LaunchError(f"phalanx run --hosts with --nnodes {job.nnodes} --node-rank {job.node_rank}: give either "
                          "--hosts (one command starts every host) or --nnodes/--node-rank/--master (one command "
                          "per host), not both.")
    if job.nnodes < 1 or not 0 <= job.node_rank < job.nnodes:
        raise LaunchError(f"phalanx run --nnodes {job.nnodes} --node-rank {job.node_rank}: need nnodes >= 1 "
                          "and 0 <= node-rank < nnodes, e.g. --nnodes 2 --node-rank 0 on the first host and "
                          "--node-rank 1 on the second.")
    if job.nnodes > 1 and not job.master:
        raise LaunchError(f"phalanx run --nnodes {job.nnodes}: give --master HOST[:PORT], the address of node 0 "
                          "(where rank 0 serves the rendezvous), the same on every host.")


def run_node(job: Launch, env: dict[str, str], job_dir: str, signals: Signals) -> int:
    """Run this host's ``job.n`` ranks of a ``job.nnodes``-host job to their end; returns the exit status.

    Rank ``i`` here is global rank ``job.node_rank * job.n + i``. Raises :class:`LaunchError` for
    inconsistent ``nnodes``/``node_rank``/``master`` or when ``job.nnodes > 1`` and no secret is
    set (``PHALANX_SECRET`` or ``job.secret_file``).
    """
    check_nodes(job)
    secret = read_secret(job.secret_file)
    if secret is None and job.nnodes > 1:
        raise LaunchError(f"phalanx run --nnodes {job.nnodes}: a job on several hosts needs a secret (rank 0's "
                          f"rendezvous admits only the job's own ranks), and PHALANX_SECRET is not set; "
                          f"{SECRET_HELP}.")
    master = parse_master(job.master or "127.0.0.1")
    first = job.node_rank * job.n
    placement = rank_placement(job, list(range(first, first + job.n)), job.nnodes * job.n, master, secret,
                               job.nnodes, job.node_rank)
    return run_spawn(job, env, job_dir, signals, placement)
