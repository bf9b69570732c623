"""The files ranks leave in the job directory (``$PHALANX_JOB_DIR``) for their launcher.

==========================  ==========================================  ===============================
file                        written by                                  tells the launcher
==========================  ==========================================  ===============================
``pid-rank<r>``             the worker bootstrap, first thing           the rank's pid and host
``init-rank<r>``            ``phalanx.init``, on entry                  the rank has reached init
``ready-rank<r>``           ``phalanx.init``, once the world is formed  the rank is past init; the MPICH
                                                                        shared-memory files it maps
``failure-rank<r>.json``    the worker or the abort hook, on an error   the exception and when
``exit-rank<r>``            the worker, as the very last thing          the rank ended by itself
``status-rank<r>``          the rank's keeper (``_keeper``), at exit    its exact wait status and when
==========================  ==========================================  ===============================

Every reader here tolerates missing and half-written files: a rank may be
killed at any moment, and on another host the directory may not exist.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .._failure import marker_rank

__all__ = ["any_record", "marked_ranks", "pid_files", "read_records", "read_statuses", "replaced_slots"]


def _names(job_dir: str) -> list[str]:
    try:
        return os.listdir(job_dir)
    except OSError:
        return []


def marked_ranks(job_dir: str, kind: str) -> set[int]:
    """The ranks that left a ``<kind>-rank<r>`` marker (``kind``: ``init``, ``ready``, ``exit``, ``pid``;
    read by :func:`phalanx._failure.marker_rank`)."""
    return {rank for name in _names(job_dir) if (rank := marker_rank(name, kind)) is not None}


def replaced_slots(job_dir: str) -> list[int]:
    """The slots refilled in place by the ranks themselves (MPI under ULFM: ``replaced-rank<slot>-e<epoch>``),
    one entry per replacement."""
    return sorted(slot for name in _names(job_dir) if (slot := marker_rank(name, "replaced", tagged=True)) is not None)


def any_record(job_dir: str) -> bool:
    """Cheap: has some rank recorded an exception yet?"""
    return any(name.startswith("failure-rank") for name in _names(job_dir))


def read_records(job_dir: str) -> dict[int, dict[str, Any]]:
    """rank -> its failure record (``rank``, ``time``, ``type``, ``message``, ``traceback``)."""
    records: dict[int, dict[str, Any]] = {}
    for name in _names(job_dir):
        if name.startswith("failure-rank") and name.endswith(".json"):
            try:
                with open(os.path.join(job_dir, name)) as f:
                    record = json.load(f)
                records[int(record["rank"])] = record
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a rank killed while writing: records are written atomically, but be safe
    return records


def pid_files(job_dir: str, skip: set[int] | frozenset[int] = frozenset()) -> dict[int, tuple[int, str]]:
    """rank -> (pid, host), from the ``pid-rank<r>`` files the workers wrote."""
    found = {}
    for rank in marked_ranks(job_dir, "pid") - set(skip):
        try:
            with open(os.path.join(job_dir, f"pid-rank{rank}")) as f:
                pid, host = f.read().split()
            found[rank] = (int(pid), host)
        except (OSError, ValueError):
            continue
    return found


def read_statuses(job_dir: str) -> dict[int, tuple[int, float]]:
    """rank -> (wait status, negative for a signal; when it ended), from the ``status-rank<r>`` files."""
    found = {}
    for rank in marked_ranks(job_dir, "status"):
        try:
            with open(os.path.join(job_dir, f"status-rank{rank}")) as f:
                code, at = f.read().split()
            found[rank] = (int(code), float(at))
        except (OSError, ValueError):
            continue
    return found
