"""Initialization, identity, and the per-call agreement that guards every collective.

(World's agreement, failure marking and queue are one object with ``init`` that makes it; a call's
fingerprint and description are :mod:`._agreement`'s, the re-formation of a world lives in
:mod:`._reform`, the epochs in :mod:`._epochs`.)

There is one :class:`World` per process, made by :func:`init`. The functions
in this module (``rank()``, ``size()``, ...) and the collectives read it; each
raises :class:`NotInitializedError` before ``init()``.

Every user-facing collective first calls :meth:`World.enter`, which agrees on
a fingerprint of the call across ranks: ``(collective, op, root, dtype, shape)``
(plus the caller's step label when given, and its file and line in debug
mode). One tiny allreduce, polled with a deadline, so that

* a different shape/dtype/op/root/collective/step on some rank is a
  :class:`CollectiveMismatchError` on every rank *before* data moves;
* a rank that never arrives is a :class:`CollectiveTimeoutError` naming it;
* a rank that calls :func:`phalanx.shutdown` while its peers wait in a collective is a
  :class:`RankFailedError` on those peers, at once (shutdown agrees too).
"""

from __future__ import annotations

import atexit
import math
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, Protocol, cast

from . import _current, _epochs, _trace
from ._agreement import CALL_CODES, MASK, OP_CODES, describe_call, fingerprint, mismatch_error, timeout_error
from ._arrays import Buffer
from ._devices import rank_device
from ._errors import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    InvalidSettingError,
    RankFailedError,
    UsageError,
    WorldBrokenError,
)
from ._failure import install_abort_hook, mark_rank
from ._settings import settings
from .comm._base import Backend, PeerLost, Request, WaitTimeout
from .comm._detect import BACKENDS, BackendName, detect_backend

__all__ = [
    "World", "backend", "current", "current_or_none", "device", "init", "initialized", "local_rank",
    "local_size", "rank", "size", "swap",
]



class _Guard:
    """``with world.guard(call):`` turns a backend's WaitTimeout/PeerLost into phalanx errors."""

    __slots__ = ("world", "call")

    def __init__(self, world: World, call: str) -> None:
        self.world, self.call = world, call

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if kind is None:
            return False
        if issubclass(kind, WaitTimeout):
            raise self.world.timed_out(self.call) from None
        if issubclass(kind, PeerLost):
            raise self.world.peer_lost(self.call, exc) from None  # type: ignore[arg-type]
        return False


class Pending(Protocol):
    """A non-blocking call queued on a world by :meth:`World.queue` (a ``phalanx.Handle``)."""

    def post(self, block: bool) -> bool:
        """Post the call's data phase once its agreement passed (blocking if asked); True when posted."""


class World:
    """This process's view of the job: backend, settings, and call bookkeeping."""

    def __init__(self, backend: Backend, *, timeout: float, check: bool, debug: bool,
                 devices: list[Any] | None, epoch: int | None = None) -> None:
        self.backend = backend
        self.rank = backend.rank
        self.size = backend.size
        self.timeout = timeout
        self.check = check and backend.size > 1
        self.checks = check  # as asked: a re-formed world of more ranks checks again (_epochs)
        self.epoch: int | None = epoch  # in a world with epochs (phalanx._epochs): its number, else None
        self.superseded: World | None = None  # the next epoch's world, once phalanx.reform() made it (supersede)
        self.debug = debug
        self.devices = devices
        self.calls = 0  # collectives entered so far on this rank
        self.broken: str | None = None
        self._pending: deque[Pending] = deque()  # non-blocking calls whose data phase is not posted
        self._at_shutdown: list[Callable[[], None]] = []
        self._released = False
        self.groups_made, self.world_group = 0, cast(Any, None)  # phalanx.new_group's (_groups.py)
        # A layer's rule (phalanx.horovod's), called on every rank of a mismatch with every rank's
        # description and whether this rank can retry (a blocking call): True makes this rank agree on
        # the same call again instead of raising (it may exchange more with the peers: all call it).
        self.retry_mismatch: Callable[[World, list[dict[str, Any]], bool], bool] | None = None

    def set_retry_mismatch(self, rule: Callable[[World, list[dict[str, Any]], bool], bool] | None) -> None:
        """Install a layer's ``rule`` for a mismatch (:attr:`retry_mismatch`: ``phalanx.horovod``'s majority
        retry), or None to raise as usual; the next epoch's world keeps it (:meth:`supersede`)."""
        self.retry_mismatch = rule

    def supersede(self, world: World) -> None:
        """Hand over to ``world``, the next epoch's (``phalanx.reform()`` made it): it keeps this world's
        ``retry_mismatch``, and this one's ``superseded`` names it (the abort hook follows that chain)."""
        world.retry_mismatch = self.retry_mismatch
        self.superseded = world

    def guard(self, call: str) -> _Guard:
        """A context in which the backend's timeouts and lost peers become phalanx errors for ``call``."""
        return _Guard(self, call)

    def ready(self, call: str, until: Pending | None = None) -> None:
        """Raise if the world is broken; post the pending non-blocking calls (before ``until``)."""
        if self.broken is not None:
            fix = ("Call phalanx.reform() on every surviving rank to continue in a new epoch (fit(elastic=True) "
                   "does), then use the objects made in it." if self.epoch is not None and _epochs.recovers() else
                   "Let the exception end the job (the launcher stops every rank) and restart from a checkpoint.")
            raise WorldBrokenError(
                f"phalanx.{call}: the world is unusable after an earlier failure ({self.broken}). {fix}")
        if self._pending:
            self.flush(call, until)

    # -- the agreement ------------------------------------------------------
    def enter(self, call: str, buf: Buffer | None, op: str | None = None, root: int = -1,
              step: int | None = None, *, wait: bool = True) -> Request | None:
        """Start collective ``call``: flush pending handles, then agree on the fingerprint.

        ``wait=False`` (a non-blocking call, traced by its handle) posts the agreement
        without waiting: its request is returned, or None when calls are not checked.
        """
        if self.broken is not None or self._pending:
            self.ready(call)
        self.calls += 1
        if _trace.ON and wait:
            _trace.begin(self, call, buf, op, root)
        if not self.check:
            return None
        if not wait:
            with _Guard(self, call):
                return self.backend.iagree(self.signature(call, buf, op, root, step))
        if buf is None or self.debug or step is not None:
            signature = self.signature(call, buf, op, root, step)
        else:  # fingerprint() inlined: this is every checked call's hot path
            # Not _agreement.agree (JSON, blake2b, a detail to gather): that costs microseconds per
            # call, which a structure check made once can pay and every collective cannot.
            signature = hash((CALL_CODES[call], OP_CODES[op] if op else -1, root, buf.code,
                              buf.shape)) & MASK
        with _Guard(self, call):
            same = self.backend.agree(signature, self.timeout)
        while not same:  # raises, unless retry_mismatch says this rank makes the call again
            self.explain_mismatch(call, buf, op, root, step, retry=True)
            self.calls += 1
            with _Guard(self, call):
                same = self.backend.agree(signature, self.timeout)
        return None

    def signature(self, call: str, buf: Buffer | None, op: str | None, root: int,
                  step: int | None = None) -> int:
        return fingerprint(call, buf, op, root, step, self.debug)

    def describe(self, call: str, buf: Buffer | None, op: str | None, root: int,
                 step: int | None = None) -> dict[str, Any]:
        return describe_call(call, self.calls, buf, op, root, step, self.debug)

    def explain_mismatch(self, call: str, buf: Buffer | None, op: str | None, root: int,
                         step: int | None = None, *, retry: bool = False) -> None:
        """Every rank reached here together: exchange descriptions and raise the same error
        (with ``retry``, return instead where ``retry_mismatch`` says this rank calls again)."""
        entries = self.allgather_json(call, self.describe(call, buf, op, root, step))
        error = mismatch_error(call, self.rank, entries)
        if isinstance(error, RankFailedError):
            self.mark_broken(f"a peer called shutdown() during {call}")
        elif self.retry_mismatch is not None and self.retry_mismatch(self, entries, retry):
            return
        raise error

    def allgather_json(self, call: str, value: Any) -> list[Any]:
        """Every rank's JSON-able ``value``, in rank order: how ranks explain a mismatch to each
        other (JSON, never pickle, so nothing a peer sends can run code here)."""
        import json

        with _Guard(self, call):
            parts = self.backend.allgather_bytes(json.dumps(value).encode(), self.timeout)
        return [json.loads(p) for p in parts]

    # -- failures -------------------------------------------------------------
    def timed_out(self, call: str) -> CollectiveTimeoutError:
        """Diagnose which ranks are missing (bounded), mark the world broken, build the error."""
        error = timeout_error(self.backend, call, self.calls, self.timeout)
        self.mark_broken(f"{call} timed out")
        return error

    def peer_lost(self, call: str, exc: BaseException) -> RankFailedError:
        self.mark_broken(f"a peer was lost during {call}")
        after = (f"This epoch ({self.epoch}) of the world cannot be used any more: phalanx.reform() re-forms "
                 "it with the survivors." if self.epoch is not None and _epochs.recovers() else
                 "This world cannot be used any more.")
        return RankFailedError(
            f"phalanx.{call}: a peer rank died or closed its connection ({exc}). The failing rank's "
            f"own error is in its output (`phalanx run` reports it first). {after}"
        )

    def mark_broken(self, why: str) -> None:
        """Mark the world unusable (``why``) and drop its pending non-blocking calls."""
        self._pending.clear()
        self.broken = why

    def on_shutdown(self, callback: Callable[[], None], *, cancel: bool = False) -> None:
        """Call ``callback()`` when this world shuts down, before the backend is released (local,
        bounded, never raising: a group's teardown); ``cancel=True`` takes it back."""
        if cancel:
            self._at_shutdown.remove(callback)
        else:
            self._at_shutdown.append(callback)

    def release(self) -> None:
        """Run the :meth:`on_shutdown` callbacks, then release the backend (the end of ``shutdown()``);
        once (a world that re-forms may be released before a new epoch fails to form, and again after)."""
        if self._released:
            return
        self._released = True
        for callback in list(self._at_shutdown):
            callback()
        self.backend.shutdown()

    # -- non-blocking calls: agreed now, data phases posted in call order on every rank ----------
    def queue(self, handle: Pending) -> None:
        """Queue a non-blocking call's ``handle`` (its agreement in flight) until :meth:`flush` posts it."""
        self._pending.append(handle)

    def flush(self, call: str, until: Pending | None = None) -> None:
        """Post the data phase of every pending non-blocking call made before ``until`` (all of
        them without it), in call order: MPI matches collectives by order, on every rank."""
        pending = self._pending
        while pending and pending[0] is not until:
            pending[0].post(block=True)

    def complete(self, handle: Pending) -> None:
        """``handle``'s agreement completed: take it off the queue (``flush`` until it made it first)."""
        first = self._pending.popleft()
        assert first is handle  # internal invariant, not user input


# The slot is _current's (the trace recorder reads it from below this module); here it is typed.
current: Callable[[str], World] = _current.current  # the world, or NotInitializedError naming the call
current_or_none: Callable[[], World | None] = _current.current_or_none  # the world, or None before init
AT_EXIT: list[Callable[[World], None]] = []  # run at a normal exit with the world (_shutdown adds its own)
swap: Callable[[World | None], World | None] = _current.swap  # install a world, return the previous one


def init(backend: BackendName = "auto", *, devices: list[Any] | None = None, timeout: float | None = None,
         gpu_aware_mpi: bool | None = None, check: bool | None = None,
         debug: bool | None = None, elastic: bool = False) -> Backend:
    """Start phalanx in this process and return the backend; calling it again returns the same one.

    Which transport:
        backend: ``"auto"`` (what the launcher started: ``phalanx run``, mpiexec or
            srun → mpi, torchrun → gloo/nccl; a script started alone is a world of
            one), or ``"local"``, ``"mpi"``, ``"gloo"``, ``"nccl"``.
        devices: the GPU of each rank of a node, indexed by local rank (default
            ``local_rank % device_count``).
        gpu_aware_mpi: pass CUDA memory to MPI directly (default: ask the MPI library,
            or ``PHALANX_GPU_AWARE_MPI``).

    Safety:
        timeout: seconds any collective may wait before it raises
            CollectiveTimeoutError naming the missing ranks (default ``PHALANX_TIMEOUT``
            or 300).
        check: agree on every collective's shape, dtype, op and root across ranks
            before data moves (default on; ``PHALANX_CHECK=0`` turns it off).
        debug: also compare the line of code each rank calls from (``PHALANX_DEBUG=1``).
        elastic: this rank recovers from a lost peer in place, with :func:`phalanx.reform`
            (``fit(elastic=True)`` says so itself). Under ``phalanx run --backend gloo
            --max-restarts K`` (or ``--min-ranks M``) the launcher then keeps the survivors
            running once every rank said so; elsewhere it changes nothing.

    Returns the backend (``.name``, ``.rank``, ``.size``). Raises InvalidArgumentError
    for an unknown backend or a bad timeout, UsageError when already initialized with
    another backend, BackendUnavailableError when the backend's package is missing,
    and RendezvousError/LaunchEnvironmentError when gloo/nccl ranks cannot meet.
    """
    world = current_or_none()
    if world is not None:
        if elastic and world.epoch is not None:
            _epochs.declare()
        if backend not in ("auto", world.backend.name):
            raise UsageError(
                f"phalanx.init(backend={backend!r}): already initialized with backend "
                f"{world.backend.name!r}. Call phalanx.shutdown() first to switch backends."
            )
        return world.backend
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < math.inf):
        raise InvalidArgumentError(f"phalanx.init(timeout={timeout!r}): the timeout must be a positive, "
                                   "finite number of seconds, e.g. timeout=60.")
    name = detect_backend() if backend == "auto" else backend
    if name not in (*BACKENDS, "torch"):
        source = "" if backend != "auto" else f" (from PHALANX_BACKEND={name!r})"
        raise InvalidArgumentError(f"phalanx.init(backend={backend!r}){source}: unknown backend; use one "
                                   f"of 'auto', {', '.join(repr(b) for b in BACKENDS)}.")
    seconds = float(timeout if timeout is not None else settings.timeout)
    if not 0 < seconds < math.inf:  # phalanx.settings.timeout set in code
        raise InvalidSettingError(f"phalanx.init: phalanx.settings.timeout={settings.timeout!r} must be a "
                                  "positive, finite number of seconds, e.g. phalanx.settings.timeout = 60.")
    mark_rank("init")  # for `phalanx run --start-timeout`: this rank has reached init
    epoch = None
    if name in ("gloo", "nccl", "torch", "mpi") and _epochs.available(name):  # this job's worlds re-form
        make = None
        if name == "mpi":  # Open MPI 5's ULFM re-forms the communicator; no launcher's store
            from ._epochs_ulfm import UlfmMembership

            make = UlfmMembership
        epoch = _epochs.first_epoch(seconds, make)
    impl = make_backend(name, timeout=seconds, gpu_aware_mpi=gpu_aware_mpi if gpu_aware_mpi is not None
                         else settings.gpu_aware_mpi, devices=devices, epoch=epoch)
    world = World(impl, timeout=seconds, check=settings.check if check is None else check,
                  debug=settings.debug if debug is None else debug, devices=devices,
                  epoch=None if epoch is None else epoch.number)
    swap(world)
    install_abort_hook(world)
    if elastic and epoch is not None:
        _epochs.declare()
    # After the abort hook's: exit handlers run last-registered first, so a normal exit shuts down
    # (a rank that just ends its script has left) before a broken world's MPI job is aborted.
    for hook in AT_EXIT:
        atexit.register(hook, world)
    return impl


def make_backend(name: str, *, timeout: float, gpu_aware_mpi: bool | None,
                  devices: list[Any] | None, epoch: _epochs.Epoch | None = None) -> Backend:
    if name == "local":
        from .comm._local import LocalBackend

        return LocalBackend()
    if name == "mpi":
        from .comm._mpi import MPIBackend

        ms: Any = _epochs.membership() if epoch is not None else None  # an UlfmMembership (_epochs_ulfm.py)
        if ms is None or epoch is None:
            return MPIBackend(gpu_aware_mpi=gpu_aware_mpi)
        # an epoch's (ULFM): its blocking MPI_Comm_dup on a re-formed communicator is bounded by a timer
        return cast(Backend, ms.within(lambda: MPIBackend(gpu_aware_mpi=gpu_aware_mpi, base=ms.comm),
                                       f"the ranks of epoch {epoch.number} did not finish making its communicators "
                                       "(MPI_Comm_dup) in time"))
    from .comm._torch import TorchBackend

    if epoch is None:
        return TorchBackend(None if name == "torch" else name, timeout=timeout, devices=devices)
    ms = _epochs.membership()
    return TorchBackend(None if name == "torch" else name, timeout=timeout, devices=devices, epoch=epoch,
                        interrupted=ms.interrupted if ms is not None else None)


def initialized() -> bool:
    """True between :func:`init` and :func:`phalanx.shutdown` (never raises; needs no world)."""
    return current_or_none() is not None


def backend() -> Backend:
    """The backend object (``phalanx.backend().name`` is ``'local'``, ``'mpi'``, ``'gloo'`` or ``'nccl'``)."""
    return current("backend").backend


def rank() -> int:
    """This process's rank, in ``range(size())``; NotInitializedError before :func:`init`."""
    return current("rank").rank


def size() -> int:
    """The number of processes in the job (1 when started alone); NotInitializedError before
    :func:`init`."""
    return current("size").size


def local_rank() -> int:
    """This process's rank among the processes on its node (picks its GPU); NotInitializedError
    before :func:`init`."""
    return current("local_rank").backend.local_rank


def local_size() -> int:
    """The number of processes on this node; NotInitializedError before :func:`init`."""
    return current("local_size").backend.local_size


def device() -> Any:
    """The torch device this rank should use, made current: its GPU, or the CPU when there is none.

    The GPU is ``devices[local_rank()]`` when ``phalanx.init(devices=...)`` listed
    them, else ``local_rank() % torch.cuda.device_count()``. Imports torch; raises
    BackendUnavailableError without it, InvalidArgumentError when ``devices`` has no
    entry for this rank, NotInitializedError before :func:`init`.
    """
    world = current("device")
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailableError("phalanx.device() needs PyTorch: `pip install torch`") from exc
    chosen = rank_device("device()", world.devices, world.backend.local_rank)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    return chosen
