"""The torch backend's agreement and diagnosis: the per-call check, on a gloo group of its own.

::

    backend._agreeing = backend._apart(ranks, timeout, members_only)   # gloo: made with each group
    backend.agree(signature, timeout)          # True when every rank passed the same signature
    backend.iagree(signature)                  # the same, non-blocking
    backend.allgather_bytes(payload, timeout)  # descriptions after a mismatch, objects

A mixin of :class:`~phalanx.comm._torch.TorchBackend` (its set-up, data and
lifecycle are in ``_torch.py``). On gloo the agreements run on a second
process group of the same ranks (:meth:`TorchAgreement._apart`), never
paired with a gradient bucket, which skips them (``docs/design.md``, "gloo
and nccl"); on nccl they share the data's communicator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._store_queries import diagnose
from ._torchdist import GroupDist, TorchRequest, group_dist
from ._torchsetup import translating

__all__ = ["TorchAgreement"]


class TorchAgreement:
    """``agree``/``iagree`` and the byte collectives and diagnosis of :class:`~phalanx.comm._torch.TorchBackend`."""

    _agreeing: GroupDist | None = None  # gloo: the group view the agreements run on, apart from the data
    _nccl: bool
    _dist: Any
    _torch: Any
    _chk: Any
    _chk_t: Any
    _chk_dev: Any
    _store: Any
    _prefix: str
    rank: int
    size: int
    device: Any

    if TYPE_CHECKING:  # TorchBackend's own (its waits and data), which these call
        def _wait(self, work: Any, timeout: float) -> None: ...
        def _request(self, post: Callable[[], Any], finish: Callable[[], Any], on_gpu: bool = False) -> TorchRequest: ...
        def allgather(self, x: Any, timeout: float) -> Any: ...
        def broadcast(self, x: Any, root: int, inplace: bool, timeout: float) -> Any: ...

    def _apart(self, ranks: tuple[int, ...], timeout: float, members_only: bool) -> GroupDist | None:
        """gloo: a second process group of ``ranks`` for the agreements alone (None on nccl, and on a
        non-member). gloo pairs a group's collectives by their order alone and aborts the process on
        a size mismatch, so an agreement on the data's group could pair with a gradient bucket, which
        skips the agreement (a rank one step ahead while its peer shuts down); apart, the bucket waits
        out the timeout and raises, as on MPI, where the agreement is a persistent collective."""
        if self._nccl or len(ranks) < 2:
            return None
        return group_dist(self._dist, ranks, self.rank, timeout, None, "gloo", members_only)

    @translating
    def agree(self, signature: int, timeout: float) -> bool:
        chk = self._chk
        chk[0] = signature
        chk[1] = -signature
        if self._nccl:
            self._chk_dev.copy_(self._chk_t)
        dist = self._agreeing or self._dist
        self._wait(dist.all_reduce(self._chk_dev, self._dist.ReduceOp.MAX, async_op=True), timeout)
        if self._nccl:
            self._chk_t.copy_(self._chk_dev)
        return bool(chk[0] == signature and chk[1] == -signature)

    def iagree(self, signature: int) -> TorchRequest:
        mine = self._torch.tensor([signature, -signature], dtype=self._torch.int64)
        out = mine.to(self.device, copy=True)
        dist = self._agreeing or self._dist
        return self._request(lambda: dist.all_reduce(out, self._dist.ReduceOp.MAX, async_op=True),
                             lambda: bool(self._torch.equal(out.cpu(), mine)))

    @translating
    def allgather_bytes(self, payload: bytes, timeout: float) -> list[bytes]:
        sizes = self.allgather(np.array(len(payload), np.int64), timeout).tolist()
        padded = np.zeros(max(sizes), np.uint8)
        padded[:len(payload)] = np.frombuffer(payload, np.uint8)
        rows = self.allgather(padded, timeout)
        return [rows[r, :n].tobytes() for r, n in enumerate(sizes)]

    @translating
    def broadcast_bytes(self, payload: bytes | None, root: int, timeout: float) -> bytes:
        mine = payload if self.rank == root and payload is not None else b""
        size = self.broadcast(np.array(len(mine), np.int64), root, True, timeout)
        buf = np.frombuffer(mine, np.uint8).copy() if self.rank == root else np.empty(int(size), np.uint8)
        return self.broadcast(buf, root, True, timeout).tobytes()

    def diagnose(self, call: str, call_index: int, grace: float) -> tuple[list[int], dict[int, str]]:
        """Leave this rank's stuck call in the store; read the peers' reports for ``grace`` s."""
        return diagnose(self._store, self._prefix, self.rank, self.size, call, call_index, grace)

