"""Initialization, identity, and the per-call agreement that guards every collective.

There is one :class:`World` per process, made by :func:`init`. The functions
in this module (``rank()``, ``size()``, ...) and the collectives read it; each
raises :class:`NotInitializedError` before ``init()``.

Every user-facing collective first calls :meth:`World.enter`, which agrees on
a fingerprint of the call across ranks: ``(collective, op, root, dtype, shape)``
(plus the caller's file and line in debug mode). One tiny allreduce, polled
with a deadline, so that

* a different shape/dtype/op/root/collective on some rank is a
  :class:`CollectiveMismatchError` on every rank *before* data moves;
* a rank that never arrives is a :class:`CollectiveTimeoutError` naming it.
"""

from __future__ import annotations

import json
import sys
import zlib
from collections import deque
from typing import TYPE_CHECKING, Any

from ._arrays import Buffer
from ._errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    NotInitializedError,
    PhalanxError,
    RankFailedError,
    WorldBrokenError,
)
from ._settings import settings
from .comm._base import OPS, Backend, PeerLost, WaitTimeout
from .comm._detect import BACKENDS, detect_backend

if TYPE_CHECKING:
    from ._collectives import Handle

__all__ = [
    "World", "backend", "current", "device", "init", "initialized", "local_rank", "local_size",
    "rank", "shutdown", "size",
]

# Collective codes in fingerprints (and names in messages).
CALLS = ("allreduce", "broadcast", "reduce", "allgather", "gather", "reduce_scatter", "alltoall",
         "barrier", "iallreduce", "ibroadcast", "broadcast_object", "allgather_object")
CALL_CODES = {name: i for i, name in enumerate(CALLS)}
OP_CODES = {name: i for i, name in enumerate(OPS)}
_MASK = (1 << 62) - 1


class World:
    """This process's view of the job: backend, settings, and call bookkeeping."""

    def __init__(self, backend: Backend, *, timeout: float, check: bool, debug: bool,
                 devices: list[Any] | None) -> None:
        self.backend = backend
        self.rank = backend.rank
        self.size = backend.size
        self.timeout = timeout
        self.check = check and backend.size > 1
        self.debug = debug
        self.devices = devices
        self.calls = 0  # collectives entered so far on this rank
        self.broken: str | None = None
        self.pending: deque[Handle] = deque()

    # -- the agreement ------------------------------------------------------
    def enter(self, call: str, buf: Buffer | None, op: str | None = None, root: int = -1) -> None:
        """Start collective ``call``: flush pending handles, then agree on the fingerprint."""
        if self.broken is not None:
            raise WorldBrokenError(
                f"phalanx.{call}: the world is unusable after an earlier failure ({self.broken}). "
                "Let the exception end the job (the launcher stops every rank) and restart from a checkpoint."
            )
        if self.pending:
            self.flush(call)
        self.calls += 1
        if not self.check:
            return
        if buf is None or self.debug:
            signature = self.signature(call, buf, op, root)
        else:  # signature() inlined: this is every checked call's hot path
            signature = hash((CALL_CODES[call], OP_CODES[op] if op else -1, root, buf.code,
                              buf.shape)) & _MASK
        try:
            same = self.backend.agree(signature, self.timeout)
        except WaitTimeout:
            raise self.timed_out(call) from None
        except PeerLost as exc:
            raise self.peer_lost(call, exc) from None
        if not same:
            self.explain_mismatch(call, buf, op, root)

    def signature(self, call: str, buf: Buffer | None, op: str | None, root: int) -> int:
        # Codes, not names: str hashes are salted per process, ints and tuples of ints are not.
        if buf is None:
            key: tuple[Any, ...] = (CALL_CODES[call], OP_CODES[op] if op else -1, root)
        else:
            key = (CALL_CODES[call], OP_CODES[op] if op else -1, root, buf.code, buf.shape)
        signature = hash(key)
        if self.debug:
            signature ^= zlib.crc32(_call_site().encode()) << 20
        return signature & _MASK

    def describe(self, call: str, buf: Buffer | None, op: str | None, root: int) -> dict[str, Any]:
        entry: dict[str, Any] = {"call": call, "index": self.calls}
        if buf is not None:
            entry["buffer"] = buf.describe()
        if op:
            entry["op"] = op
        if root >= 0:
            entry["root"] = root
        if self.debug:
            entry["site"] = _call_site()
        return entry

    def explain_mismatch(self, call: str, buf: Buffer | None, op: str | None, root: int) -> None:
        """Every rank reached here together: exchange descriptions and raise the same error."""
        entries = self.allgather_json(call, self.describe(call, buf, op, root))
        lines = []
        for r, e in enumerate(entries):
            args = ", ".join(f"{k}={e[k]!r}" if k != "buffer" else e[k]
                             for k in ("buffer", "op", "root") if k in e)
            site = f" at {e['site']}" if "site" in e else ""
            lines.append(f"  rank {r}: {e['call']}({args}) [call #{e['index']}]{site}")
        field = next(k for k in ("call", "buffer", "op", "root", "site", "index")
                     if len({json.dumps(e.get(k)) for e in entries}) > 1)
        hint = {
            "call": "Ranks made different collective calls: every rank must make the same collective "
                    "calls in the same order. A rank that skips a call (e.g. inside `if rank == 0:`) "
                    "pairs its next call with the others' current one.",
            "buffer": "Every rank must pass a buffer of the same shape and dtype. Pad or cast on the "
                      "ranks that differ (e.g. `x.astype(np.float32)`), or use allgather_object for "
                      "ragged data.",
            "op": "Every rank must pass the same `op`.",
            "root": "Every rank must pass the same `root`.",
            "site": "Ranks reached this collective from different lines of code (debug mode): the "
                    "calls are out of order on some rank.",
            "index": "Ranks have made a different number of collective calls so far.",
        }[field]
        raise CollectiveMismatchError(
            f"phalanx.{call}: the ranks' calls do not match ({field} differs), so nothing was sent:\n"
            + "\n".join(lines) + f"\n{hint}"
        )

    def allgather_json(self, call: str, value: Any) -> list[Any]:
        """Every rank's JSON-able ``value``, in rank order: how ranks explain a mismatch to each
        other (JSON, never pickle, so nothing a peer sends can run code here)."""
        try:
            parts = self.backend.allgather_bytes(json.dumps(value).encode(), self.timeout)
        except WaitTimeout:
            raise self.timed_out(call) from None
        except PeerLost as exc:
            raise self.peer_lost(call, exc) from None
        return [json.loads(p) for p in parts]

    # -- failures -------------------------------------------------------------
    def timed_out(self, call: str) -> CollectiveTimeoutError:
        """Diagnose which ranks are missing, mark the world broken, build the error."""
        grace = min(2.0, max(0.5, self.timeout / 4))
        try:
            missing, elsewhere = self.backend.diagnose(call, self.calls, grace)
        except Exception as exc:  # noqa: BLE001 - diagnosis is best effort
            missing, elsewhere = [], {}
            diag_note = f" (could not ask the peers: {exc})"
        else:
            diag_note = ""
        parts = [f"phalanx.{call} (call #{self.calls} on rank {self.rank}) timed out after "
                 f"{self.timeout:g} s waiting for the other ranks{diag_note}."]
        if missing:
            parts.append(f"Ranks that never reached a phalanx call: {missing} (stuck computing, "
                         "waiting in non-phalanx code, or finished early).")
        for r, where in sorted(elsewhere.items()):
            parts.append(f"Rank {r} is waiting in {where} instead.")
        parts.append("Every rank must make the same collective calls in the same order. If the wait "
                     "is legitimate (e.g. rank 0 evaluates alone), raise the limit with "
                     "`phalanx.init(timeout=...)` or PHALANX_TIMEOUT. This world cannot be used "
                     "after a timeout.")
        self.broken = f"{call} timed out"
        return CollectiveTimeoutError(" ".join(parts), missing_ranks=missing, elsewhere=elsewhere)

    def peer_lost(self, call: str, exc: BaseException) -> RankFailedError:
        self.broken = f"a peer was lost during {call}"
        return RankFailedError(
            f"phalanx.{call}: a peer rank died or closed its connection ({exc}). The failing rank's "
            "own error is in its output (`phalanx run` reports it first). This world cannot be used "
            "any more."
        )

    def flush(self, call: str) -> None:
        """Post the data phase of every pending non-blocking call, in the order they were made.

        MPI matches collectives by order, so before anything new is posted the
        earlier handles' data phases must be posted on every rank in the same order.
        """
        while self.pending:
            self.pending[0].post(block=True)


def _call_site() -> str:
    """file:line of the first frame outside phalanx (debug mode only: walking frames costs)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("phalanx."):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


_WORLD: World | None = None


def current_or_none() -> World | None:
    """The initialized world, or ``None`` before :func:`init` (for code that works either way)."""
    return _WORLD


def swap(world: World | None) -> World | None:
    """Install ``world`` as this process's world and return the previous one (benchmarks use this
    to time a second world side by side; everything else goes through :func:`init`)."""
    global _WORLD
    previous, _WORLD = _WORLD, world
    return previous


def current(what: str) -> World:
    """The initialized world, or NotInitializedError naming ``what``."""
    world = _WORLD
    if world is None:
        raise NotInitializedError(what)
    return world


def init(backend: str = "auto", *, devices: list[Any] | None = None, timeout: float | None = None,
         gpu_aware_mpi: bool | None = None, check: bool | None = None,
         debug: bool | None = None) -> Backend:
    """Start phalanx in this process and return the backend. Idempotent.

    ``backend``: ``"auto"`` (what the launcher started: ``phalanx run``/mpiexec/srun/torchrun,
    else a world of one), ``"local"``, ``"mpi"``, ``"gloo"`` or ``"nccl"``.
    ``devices``: GPUs for the ranks of a node, indexed by local rank (default:
    ``local_rank % device_count``). ``timeout``: seconds any collective may wait
    (default ``PHALANX_TIMEOUT`` or 300). ``gpu_aware_mpi``: pass CUDA memory to
    MPI directly (default: ask the MPI library). ``check``/``debug``: see
    :mod:`phalanx._settings`.
    """
    global _WORLD
    if _WORLD is not None:
        if backend not in ("auto", _WORLD.backend.name):
            raise PhalanxError(
                f"phalanx.init(backend={backend!r}): already initialized with backend "
                f"{_WORLD.backend.name!r}. Call phalanx.shutdown() first to switch backends."
            )
        return _WORLD.backend
    if timeout is not None and not timeout > 0:
        raise ValueError(f"phalanx.init(timeout={timeout!r}): the timeout must be a positive number of seconds")
    name = detect_backend() if backend == "auto" else backend
    if name not in (*BACKENDS, "torch"):
        raise ValueError(f"phalanx.init(backend={backend!r}): unknown backend; use one of "
                         f"'auto', {', '.join(repr(b) for b in BACKENDS)}")
    seconds = float(timeout if timeout is not None else settings.timeout)
    impl = _make_backend(name, timeout=seconds, gpu_aware_mpi=gpu_aware_mpi if gpu_aware_mpi is not None
                         else settings.gpu_aware_mpi, devices=devices)
    _WORLD = World(impl, timeout=seconds, check=settings.check if check is None else check,
                   debug=settings.debug if debug is None else debug, devices=devices)
    from ._failure import install_abort_hook

    install_abort_hook(_WORLD)
    return impl


def _make_backend(name: str, *, timeout: float, gpu_aware_mpi: bool | None,
                  devices: list[Any] | None) -> Backend:
    if name == "local":
        from .comm._local import LocalBackend

        return LocalBackend()
    if name == "mpi":
        from .comm._mpi import MPIBackend

        return MPIBackend(gpu_aware_mpi=gpu_aware_mpi)
    from .comm._torch import TorchBackend

    return TorchBackend(None if name == "torch" else name, timeout=timeout, devices=devices)


def initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _WORLD is not None


def shutdown() -> None:
    """Release the backend (after a final barrier when the world is healthy). Idempotent."""
    global _WORLD
    world, _WORLD = _WORLD, None
    if world is None:
        return
    try:
        if world.broken is None and world.size > 1:
            world.flush("shutdown")
            world.backend.barrier(world.timeout)
    except (WaitTimeout, PeerLost):
        pass
    finally:
        world.backend.shutdown()


def backend() -> Backend:
    """The backend object (``phalanx.backend().name`` is ``'local'``, ``'mpi'``, ``'gloo'`` or ``'nccl'``)."""
    return current("backend").backend


def rank() -> int:
    """This process's rank in ``range(size())``."""
    return current("rank").rank


def size() -> int:
    """The number of processes in the job."""
    return current("size").size


def local_rank() -> int:
    """This process's rank among the processes on its node."""
    return current("local_rank").backend.local_rank


def local_size() -> int:
    """The number of processes on this node."""
    return current("local_size").backend.local_size


def device() -> Any:
    """The torch device this rank should use: its GPU (``devices[local_rank]`` or
    ``local_rank % device_count``), or the CPU when there is none. Imports torch."""
    world = current("device")
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailableError("phalanx.device() needs PyTorch: `pip install torch`") from exc
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = world.backend.local_rank
    if world.devices is not None:
        if local >= len(world.devices):
            raise ValueError(
                f"phalanx.init(devices={world.devices!r}) lists {len(world.devices)} devices but this "
                f"node runs local rank {local}; give one device per rank on the node."
            )
        chosen = torch.device(world.devices[local] if not isinstance(world.devices[local], int)
                              else f"cuda:{world.devices[local]}")
    else:
        chosen = torch.device(f"cuda:{local % torch.cuda.device_count()}")
    torch.cuda.set_device(chosen)
    return chosen
