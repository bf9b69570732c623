"""A Slurm allocation, as ``phalanx run`` reads it from the environment inside ``sbatch``/``salloc``.

::

    expand_nodelist("node[01-04,07],gpu3")   # ["node01", "node02", "node03", "node04", "node07", "gpu3"]
    expand_tasks_per_node("2(x3),1")         # [2, 2, 2, 1]
    alloc = allocation()                     # None outside an allocation (no SLURM_JOB_ID)
    alloc.hosts                              # [Host("node01", 2), ...]: the nodes and their tasks

Slurm sets ``SLURM_JOB_ID`` in the allocation, ``SLURM_NTASKS`` when tasks were
asked for (``-n``/``--ntasks``, ``--ntasks-per-node``), ``SLURM_JOB_NODELIST``
(compressed: ``node[01-04,07]``) and ``SLURM_TASKS_PER_NODE`` (``2(x3),1``).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from .._errors import LaunchError
from ._hostlist import Host, ranks_for

__all__ = ["Allocation", "allocation", "expand_nodelist", "expand_tasks_per_node", "job_ranks"]


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets: ``"a[1,2],b"`` -> ``["a[1,2]", "b"]``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _range(item: str, nodelist: str) -> list[str]:
    low, sep, high = item.partition("-")
    if not low.isdigit() or sep and not high.isdigit():
        raise LaunchError(f"phalanx run: cannot read the Slurm node list {nodelist!r} (range {item!r}); "
                          "expected names like node[01-04,07],gpu3 (SLURM_JOB_NODELIST).")
    if not sep:
        return [low]
    width = len(low) if low.startswith("0") or len(low) == len(high) else 0
    return [str(i).zfill(width) for i in range(int(low), int(high) + 1)]


def _expand_one(pattern: str, nodelist: str) -> list[str]:
    """``rack[1-2]-n[1,3]`` -> every combination, in order."""
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern or not pattern:
            raise LaunchError(f"phalanx run: cannot read the Slurm node list {nodelist!r} (at {pattern!r}); "
                              "expected names like node[01-04,07],gpu3 (SLURM_JOB_NODELIST).")
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    middles = [v for item in match.group(1).split(",") for v in _range(item.strip(), nodelist)]
    rests = _expand_one(tail, nodelist) if tail else [""]
    return [head + middle + rest for middle in middles for rest in rests]


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a Slurm node list: ``"node[01-04,07],gpu3"`` -> ``node01 ... node04, node07, gpu3``.

    Zero padding is kept (``[01-04]``); several bracket groups give every combination
    (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``). Raises :class:`~phalanx.LaunchError` when the
    list cannot be read.
    """
    names: list[str] = []
    for part in _split_top(nodelist.strip()):
        names += _expand_one(part.strip(), nodelist)
    return names


def expand_tasks_per_node(text: str) -> list[int]:
    """The tasks of each node from Slurm's ``SLURM_TASKS_PER_NODE``: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises :class:`~phalanx.LaunchError` when the text cannot be read.
    """
    counts: list[int] = []
    for item in text.strip().split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise LaunchError(f"phalanx run: cannot read SLURM_TASKS_PER_NODE={text!r}; expected counts like "
                              "2(x3),1.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


@dataclass
class Allocation:
    """The Slurm allocation this process runs in: ``job_id``, ``ntasks`` (None when Slurm set no task
    count), ``nodes`` (host names) and ``tasks_per_node`` (one count per node, or [])."""

    job_id: str
    ntasks: int | None
    nodes: list[str]
    tasks_per_node: list[int]

    @property
    def hosts(self) -> list[Host]:
        """The nodes as :class:`Host` entries, a node's tasks as its slots (1 each when unknown)."""
        counts = self.tasks_per_node if len(self.tasks_per_node) == len(self.nodes) else [1] * len(self.nodes)
        return [Host(name, max(1, count)) for name, count in zip(self.nodes, counts, strict=True)]


def allocation(environ: Mapping[str, str] | None = None) -> Allocation | None:
    """The Slurm allocation described by ``environ`` (default ``os.environ``), or None without ``SLURM_JOB_ID``.

    Reads ``SLURM_NTASKS`` (or ``SLURM_NPROCS``), ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``) and
    ``SLURM_TASKS_PER_NODE``. Raises :class:`~phalanx.LaunchError` when one is malformed.
    """
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    ntasks_text = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or ""
    if ntasks_text and not ntasks_text.strip().isdigit():
        raise LaunchError(f"phalanx run: cannot read SLURM_NTASKS={ntasks_text!r} (Slurm job {job_id}); "
                          "expected a number of tasks, as `sbatch -n N` sets it.")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    tasks = env.get("SLURM_TASKS_PER_NODE", "")
    return Allocation(job_id=job_id, ntasks=int(ntasks_text) if ntasks_text else None,
                      nodes=expand_nodelist(nodelist) if nodelist else [],
                      tasks_per_node=expand_tasks_per_node(tasks) if tasks else [])


def job_ranks(n: int | None, hosts: list[Host] | None, backend: str, *, oversubscribe: bool = False,
              flag: str = "--hosts", environ: Mapping[str, str] | None = None) -> int:
    """The number of ranks of a ``phalanx run`` job: ``n`` (``-n``), checked against ``hosts``; else the
    hosts' slots; else, for an mpi job inside a Slurm allocation, its task count (``SLURM_NTASKS``,
    or the sum of ``SLURM_TASKS_PER_NODE``).

    Raises :class:`~phalanx.LaunchError` when no count can be found (``-n`` is needed), or when ``n``
    exceeds the hosts' slots without ``oversubscribe``.
    """
    if hosts is not None:
        return ranks_for(n, hosts, oversubscribe=oversubscribe, flag=flag)
    if n is not None:
        return n
    alloc = allocation(environ) if backend == "mpi" else None
    if alloc is not None:
        if alloc.ntasks is not None:
            return alloc.ntasks
        if alloc.tasks_per_node:
            return sum(alloc.tasks_per_node)
    where = " (this Slurm allocation sets no SLURM_NTASKS: ask for tasks with sbatch -n N)" if alloc else ""
    raise LaunchError(f"phalanx run: no number of ranks given{where}; give -n N (e.g. phalanx run -n 4 train.py), "
                      "or the hosts and their slots with --hosts h0:2,h1:2 or --hostfile FILE.")


def slurm_hosts(rsh: str | None, environ: Mapping[str, str] | None = None) -> tuple[list[Host] | None, str | None]:
    """``(hosts, rsh)`` for a gloo/nccl ``phalanx run`` given no hosts: inside a Slurm allocation of
    several nodes, its nodes (their tasks as slots) reached through ``srun`` (unless ``rsh`` is given);
    elsewhere, or on one node, ``(None, rsh)``: the ranks run here, as without Slurm.
    """
    alloc = allocation(environ)
    if alloc is None or len(alloc.nodes) < 2:
        return None, rsh
    return alloc.hosts, rsh or shlex.join([sys.executable, "-m", "phalanx.launch._srun_rsh"])
