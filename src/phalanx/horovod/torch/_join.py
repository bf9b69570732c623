"""``hvd.join()``: a rank that ran out of data joins; the others' allreduces go on with its
contribution as zeros; ``join`` returns the last rank to join.

Cost while nobody has joined: nothing. A joined rank waits in a join exchange (an
allgather labelled with the step :data:`JOIN_STEP`); the others' next collective
then fails phalanx's per-call agreement on every rank at once (nothing is sent),
and the mismatch names that step. From then on (until every rank has joined) each
``hvd`` allreduce on the global process set is a join exchange (who has joined;
what the others reduce: kind, dtype, op, element count) followed by the
reduction, to which joined ranks contribute zeros. As in Horovod, ``Average``
divides by the full size (joined ranks count), only allreduce is supported while
ranks are joined (other collectives raise HorovodJoinedError on the ranks that
make them), and the last rank to join is returned (among ranks that joined in the
same exchange, the highest). It needs phalanx's agreement (``PHALANX_CHECK`` on).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import phalanx

from ..._errors import CollectiveMismatchError
from ..._world import current_or_none
from .._errors import HorovodJoinedError, HorovodMismatchError, HorovodUnsupportedError
from ._basics import _on_shutdown, _world
from ._resync import JOIN_STEP

__all__ = ["join"]

_MARKER = f"step={JOIN_STEP}"
_JOINED, _ALLREDUCE, _OTHER = 0, 1, 2
_OPS: tuple[phalanx.Op, ...] = ("sum", "prod", "min", "max", "avg")
_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
_MAX_RETRIES = 1000


class _State:
    """This rank's view of the join episode (reset when every rank has joined)."""

    seen = False  # an exchange happened: every hvd allreduce goes through exchanges now
    previous: list[int] | None = None  # joined flags of the last exchange
    attempts = 0  # exchanges this rank has tried (the ones that met another call included)
    joined_at: int | None = None  # ``attempts`` when this rank's join() began


def _reset() -> None:
    _State.seen, _State.previous, _State.joined_at = False, None, None


_on_shutdown.append(_reset)


def in_join_mode() -> bool:
    """True while some rank may be joined (an exchange happened and not every rank has joined)."""
    return _State.seen


def is_join_mismatch(exc: BaseException) -> bool:
    """True when ``exc`` is the mismatch a joined rank's exchange causes (every rank sees the same)."""
    return isinstance(exc, CollectiveMismatchError) and _MARKER in str(exc)


def _exchange(joined: bool, kind: int, dtype: int = -1, op: int = -1, numel: int = 0) -> np.ndarray:
    """Every rank's ``(joined, kind, dtype, op, numel, waited)``, rows in rank order (``waited``: how many
    exchanges a joined rank has tried since it joined); retried while it meets a rank's other call
    (each retry is one failed agreement, on every rank alike)."""
    mine = np.array([int(joined), kind, dtype, op, numel, 0], dtype=np.int64)
    for _ in range(_MAX_RETRIES):
        if joined and _State.joined_at is not None:
            mine[5] = _State.attempts - _State.joined_at
        _State.attempts += 1
        try:
            rows = np.asarray(phalanx.allgather(mine, step=JOIN_STEP)).reshape(-1, 6)
        except CollectiveMismatchError as exc:
            if not is_join_mismatch(exc):
                raise
            continue
        _State.seen = True
        return rows
    raise HorovodMismatchError(f"hvd.join: the other ranks made {_MAX_RETRIES} calls that are not hvd "
                               "collectives while this rank waited in join().")


def _last_joined(rows: np.ndarray) -> int:
    """The rank that joined last: the one that waited the fewest exchanges (the highest among equals)."""
    waited = rows[:, 5].tolist()
    return max(r for r, w in enumerate(waited) if w == min(waited))


def _after(rows: np.ndarray) -> list[int]:
    flags = rows[:, 0].tolist()
    if all(flags):
        _reset()
    else:
        _State.previous = flags
    return flags


def _active_request(rows: np.ndarray, call: str) -> np.ndarray | None:
    """The active ranks' common request, None when none is an allreduce; mismatch when they differ."""
    active = rows[rows[:, 0] == 0]
    if len(active) == 0:
        return None
    if not (active == active[0]).all():
        raise HorovodMismatchError(
            f"hvd.{call}: while ranks {np.flatnonzero(rows[:, 0]).tolist()} are joined, the other ranks made "
            f"different calls (kind, dtype, op, element count per rank: {active[:, 1:].tolist()}).")
    return active[0]


def reduce_with_joined(flat: Any, op: phalanx.Op, call: str) -> Any:
    """An active rank's allreduce of the 1-d tensor ``flat`` (phalanx ``op``) while ranks may be joined:
    one exchange, then the reduction (joined ranks add zeros)."""
    dtype = _DTYPES.index(str(flat.dtype).rpartition(".")[2])
    rows = _exchange(False, _ALLREDUCE, dtype, _OPS.index(op), flat.numel())
    _after(rows)
    _active_request(rows, call)  # the active ranks must all ask for the same reduction
    return phalanx.allreduce(flat, op)


def refuse_while_joined(call: str) -> None:
    """An active rank's collective other than allreduce while ranks may be joined: raise on every rank
    that made it (Horovod supports only allreduce then); a no-op once nobody is joined."""
    rows = _exchange(False, _OTHER)
    flags = _after(rows)
    joined = [r for r, f in enumerate(flags) if f]
    if joined:
        raise HorovodJoinedError(
            f"hvd.{call}: rank{'s' if len(joined) > 1 else ''} {joined} called hvd.join(), and while a rank is "
            "joined only allreduce can run (as in Horovod). Reduce with hvd.allreduce, or make this call "
            "before any rank joins.")


def join(device: int = -1) -> int:
    """Declare that this rank has run out of data; return the last rank to join, once every rank has.

    Meanwhile this rank takes part in the other ranks' ``hvd`` allreduces (global process
    set) with zeros; ``Average`` still divides by ``size()``. Other collectives raise
    HorovodJoinedError on the ranks that make them.

    Arguments: ``device``: the CUDA device for the zeros (-1: the CPU, or this rank's GPU on
    nccl). Returns the rank that joined last (the highest among ranks that joined together).
    Raises HorovodUnsupportedError when phalanx's agreement is off (``PHALANX_CHECK=0``),
    and phalanx's timeout and failure errors.
    """
    world = _world("join")
    if world.size == 1:
        return 0
    if not world.check:
        raise HorovodUnsupportedError("hvd.join() needs phalanx's per-call agreement to learn what the other "
                                      "ranks reduce; unset PHALANX_CHECK=0.")
    _State.joined_at = _State.attempts
    while True:
        rows = _exchange(True, _JOINED)
        flags = rows[:, 0].tolist()
        if all(flags):
            last = _last_joined(rows)
            _reset()
            return last
        _State.previous = flags
        try:
            request = _active_request(rows, "join")
        except HorovodMismatchError:  # the active ranks raise it; a joined rank waits on
            continue
        if request is not None and request[1] == _ALLREDUCE:
            _contribute_zeros(int(request[2]), int(request[3]), int(request[4]), device)


def _contribute_zeros(dtype: int, op: int, numel: int, device: int) -> None:
    import torch

    where = torch.device("cpu")
    world = current_or_none()
    if device >= 0:
        where = torch.device("cuda", device)
    elif world is not None and world.backend.name == "nccl":
        where = phalanx.device()
    phalanx.allreduce(torch.zeros(numel, dtype=getattr(torch, _DTYPES[dtype]), device=where), _OPS[op])
