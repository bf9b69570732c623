"""The ``local`` backend: a world of one process, with no dependencies.

Every collective over a single rank is the identity (a stacked copy for
gathers), so a script written for N ranks runs unchanged when started alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import InvalidArgumentError

__all__ = ["Done", "LocalBackend"]


def _copy(x: Any) -> Any:
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def _stacked(x: Any) -> Any:
    return _copy(x)[None]


class Done:
    """A request that completed when it was made."""

    __slots__ = ("_result",)

    def __init__(self, result: Any) -> None:
        self._result = result

    def test(self) -> bool:
        return True

    def wait(self, timeout: float) -> Any:
        return self._result


class LocalBackend:
    """A world of one rank (see module docstring)."""

    gathers_by_broadcast = False  # one rank: nothing to gather

    name = "local"
    rank = 0
    size = 1
    local_rank = 0
    local_size = 1

    def __repr__(self) -> str:
        return "<phalanx local backend (a world of one)>"

    def agree(self, signature: int, timeout: float) -> bool:
        return True

    def iagree(self, signature: int) -> Done:
        return Done(True)

    def allgather_bytes(self, payload: bytes, timeout: float) -> list[bytes]:
        return [payload]

    def broadcast_bytes(self, payload: bytes | None, root: int, timeout: float) -> bytes:
        return payload or b""

    def diagnose(self, call: str, call_index: int, grace: float) -> tuple[list[int], dict[int, str]]:
        return [], {}

    def allreduce(self, x: Any, op: str, inplace: bool, timeout: float) -> Any:
        return x if inplace else _copy(x)

    def iallreduce(self, x: Any, op: str, inplace: bool) -> Done:
        return Done(self.allreduce(x, op, inplace, 0.0))

    def broadcast(self, x: Any, root: int, inplace: bool, timeout: float) -> Any:
        return x if inplace else _copy(x)

    def ibroadcast(self, x: Any, root: int, inplace: bool) -> Done:
        return Done(self.broadcast(x, root, inplace, 0.0))

    def reduce(self, x: Any, op: str, root: int, inplace: bool, timeout: float) -> Any:
        return x if inplace else _copy(x)

    def allgather(self, x: Any, timeout: float) -> Any:
        return _stacked(x)

    def gather(self, x: Any, root: int, timeout: float) -> Any:
        return _stacked(x)

    def reduce_scatter(self, x: Any, op: str, timeout: float) -> Any:
        return _copy(x)

    def ireduce_scatter(self, x: Any, op: str) -> Done:
        return Done(_copy(x))

    def iallgather_into(self, x: Any, out: Any) -> Done:
        out[:] = x
        return Done(out)

    def alltoall(self, x: Any, timeout: float) -> Any:
        return _copy(x)

    def barrier(self, timeout: float) -> None:
        return None

    def isend(self, x: Any, dst: int, tag: int) -> Done:
        raise InvalidArgumentError(f"phalanx.isend: a world of one rank has no rank {dst} to send to.")

    def irecv(self, x: Any, src: int, tag: int) -> Done:
        raise InvalidArgumentError(f"phalanx.irecv: a world of one rank has no rank {src} to receive from.")

    def subgroup(self, ranks: tuple[int, ...], serial: int, timeout: float,
                 members_only: bool = False) -> LocalBackend:
        return LocalBackend()  # a world of one has only the group [0]

    def revoke(self) -> None:
        """Nothing to revoke: peers learn of a re-forming world from the launcher's store (gloo, nccl)."""

    def shutdown(self) -> None:
        return None

    def abort(self, code: int) -> None:
        raise SystemExit(code)
