"""The ``gloo`` and ``nccl`` backends' data path: torch.distributed, with the same semantics as ``mpi``.

Set-up (launch environment, rendezvous store, joining) is in :mod:`._torchsetup`.
Every operation is posted with ``async_op=True`` and waited with a deadline, so
a stuck peer is a timeout, not a hang; why the dtypes and buffers are handled
as they are is in ``docs/design.md`` ("gloo and nccl").
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

from .._devices import rank_device
from .._errors import BackendUnavailableError, InvalidArgumentError, UsageError
from ._base import WaitTimeout
from ._epoch_waits import interruptible_test, wait_interruptible
from ._hier import build_hierarchy
from ._shard_ops import TorchShardOps
from ._store_queries import node_ranks_from_store
from ._torch_agree import TorchAgreement
from ._torch_buffers import TorchBuffers
from ._torchdist import GroupDist, TorchRequest, WaitedWork, end_group, group_dist
from ._torchsetup import (
    Rendezvous,
    check_own_gpus,
    env,
    import_torch,
    translate,
    translating,
)
from ._wait import poll

__all__ = ["TorchBackend"]

class TorchBackend(TorchAgreement, TorchBuffers, TorchShardOps):
    """Backend over torch.distributed (gloo or NCCL); see the module docstring."""

    _made = 0  # backends made in this process: separates the store keys of successive worlds
    _rendezvous: Rendezvous | None = None  # phalanx's own meeting (when it made the process group)
    _group: Any = None  # a subgroup backend's process group (None: the world's)

    def __init__(self, name: str | None, *, timeout: float, devices: list[Any] | None = None,
                 epoch: Any = None, interrupted: Callable[[], str | None] | None = None) -> None:
        """``epoch`` (a :class:`phalanx._epochs.Epoch`): this rank's place in a world with epochs, whose
        store the launcher serves; ``interrupted()`` then says why the epoch ended, and every wait
        looks at it (``_wait``)."""
        torch = import_torch()
        dist = self._dist = torch.distributed
        self._torch = torch
        TorchBackend._made += 1
        generation: int | str = TorchBackend._made if epoch is None else f"e{epoch.number}"
        self._prefix = f"phalanx/{generation}/"
        self._interrupted = interrupted if epoch is not None else None
        self._owns_group = not dist.is_initialized()
        if epoch is not None and not self._owns_group:
            raise UsageError("phalanx.init: torch.distributed is already initialized, and this job's world "
                             "re-forms in place (phalanx run --max-restarts/--min-ranks): let phalanx make "
                             "the process group (call phalanx.init() before torch.distributed's own).")
        if self._owns_group:
            name = name or ("nccl" if torch.cuda.is_available() else "gloo")
            self._check_available(name)
            if epoch is None:
                self.rank, self.size = env("RANK", int), env("WORLD_SIZE", int)
            else:
                self.rank, self.size = epoch.rank, epoch.size
            meeting = Rendezvous(dist, self.rank, self.size, timeout, generation, served=epoch is not None,
                                 interrupted=self._interrupted)
            self._store, self._rendezvous = meeting.store, meeting
            try:
                self._setup(name, timeout, devices, meeting)
            except BaseException:  # nothing of the rendezvous (guard, store) may outlive a failed init
                meeting.close()
                raise
        else:  # the user or torchrun made the process group: use it as it is
            existing = str(dist.get_backend())
            name = name or ("nccl" if "nccl" in existing and torch.cuda.is_available() else "gloo")
            if name not in existing:
                raise UsageError(f"phalanx.init(backend={name!r}): torch.distributed is already "
                                 f"initialized with backend {existing!r}; pass backend='auto'.")
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
            self._store = get_store() if get_store is not None else None
            self.local_rank, self.local_size = node_ranks_from_store(self._store, self.rank, self.size,
                                                                     timeout)
            self._setup(name, timeout, devices, None)

    def _setup(self, name: str, timeout: float, devices: list[Any] | None, meeting: Rendezvous | None) -> None:
        """The rest of ``__init__``: the device, the process group (with ``meeting``: phalanx makes it)."""
        torch, dist = self._torch, self._dist
        if meeting is not None:
            self.local_rank, self.local_size = meeting.node_ranks()
        self.name = name
        self._nccl = name == "nccl"
        bound = None if self._owns_group else getattr(dist.group.WORLD, "bound_device_id", None)
        self.device = (bound or rank_device("init(backend='nccl')", devices, self.local_rank)) \
            if self._nccl else torch.device("cpu")
        if meeting is not None:
            if self._nccl:
                check_own_gpus(meeting, self.device)
            self._init_group(name, timeout, meeting)
        self.hierarchy = build_hierarchy(self, meeting.hosts, timeout) if meeting is not None else None
        if meeting is not None:  # its own group, named on every call: torch's default may become another
            # (phalanx.torch.init_process_group makes the "phalanx" backend torch's default group)
            world_group = dist.group.WORLD
            self._bind(GroupDist(dist, world_group, tuple(range(self.size))), world_group)
        else:
            self._bind(dist, None)
        self._agreeing = self._apart(tuple(range(self.size)), timeout, False)

    def _bind(self, dist: Any, group: Any) -> None:
        """Make every call through ``dist``: torch.distributed, or a group's view of it (``group``)."""
        self._dist, self._group = dist, group
        ops = dist.ReduceOp  # on bool, MIN is logical and and MAX logical or, on gloo and NCCL alike
        self._ops = {"sum": ops.SUM, "prod": ops.PRODUCT, "min": ops.MIN, "max": ops.MAX,
                     "avg": ops.AVG if self._nccl else ops.SUM}
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._chk = np.zeros(2, np.int64)  # agree()'s buffer: NumPy writes cost less than tensor writes
        self._chk_t = self._torch.from_numpy(self._chk)
        self._chk_dev = self._chk_t.to(self.device)
        self._ordered: collections.deque[tuple[Any, float, float]] = collections.deque()  # _order's waits

    def subgroup(self, ranks: tuple[int, ...], serial: int, timeout: float,
                 members_only: bool = False) -> TorchBackend | None:
        """The backend of group ``ranks`` (world ranks) on a member, None elsewhere: this backend's
        device, store and options over the group's process group (see :meth:`Backend.subgroup`)."""
        view = group_dist(self._dist, ranks, self.rank, timeout, self.device if self._nccl else None, self.name,
                          members_only)
        agreeing = self._apart(ranks, timeout, members_only)  # on every rank that made ``view``, in order
        if view is None:
            return None
        sub = copy.copy(self)  # the hierarchy stays the world's (it serves only the world: _hier)
        sub._owns_group, sub._rendezvous, sub._prefix = False, None, f"{self._prefix}group{serial}/"
        sub.rank, sub.size = ranks.index(self.rank), len(ranks)
        sub._bind(view, view.group)
        sub._agreeing = agreeing
        return sub

    def __repr__(self) -> str:
        return f"<phalanx {self.name} backend rank {self.rank}/{self.size}>"

    @property
    def own_group(self) -> Any:
        """The world's process group when phalanx made it (torch's default until handed over), else None."""
        return self._group if self._owns_group else None

    @property
    def torch_store(self) -> Any:
        """The store every rank reaches (the rendezvous'): torch groups made beside phalanx's meet there."""
        return self._store

    # -- setup ------------------------------------------------------------------
    def _check_available(self, name: str) -> None:
        torch, dist = self._torch, self._dist
        if name not in ("gloo", "nccl"):
            raise InvalidArgumentError(f"phalanx.init(backend={name!r}): torch.distributed backends are "
                                       "'gloo' (CPU) and 'nccl' (GPU).")
        if name == "nccl" and not torch.cuda.is_available():
            raise BackendUnavailableError(
                "phalanx backend 'nccl' needs CUDA GPUs, and torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}). Use backend='gloo' on CPUs, or install a CUDA build of torch.")
        if not (dist.is_nccl_available() if name == "nccl" else dist.is_gloo_available()):
            raise BackendUnavailableError(f"phalanx backend {name!r}: this PyTorch build "
                                          f"({torch.__version__}) was compiled without {name}.")

    def _init_group(self, name: str, timeout: float, meeting: Rendezvous) -> None:
        dist = self._dist
        if self._nccl:
            self._torch.cuda.set_device(self.device)
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        try:
            # The group's own timeout is a backstop behind phalanx's: if gloo gave up first,
            # its background thread could end the process while phalanx asks the peers
            # where they are (a rank dying silently instead of raising the timeout).
            dist.init_process_group(name, rank=self.rank, world_size=self.size, store=self._store,
                                    timeout=timedelta(seconds=timeout + max(30.0, timeout)),
                                    **({"device_id": self.device} if self._nccl else {}))
        except RuntimeError as exc:
            raise meeting.failed(exc) from exc
        # Exiting with a live gloo group sometimes dies in "terminate called without an
        # active exception" (about 1 run in 20, raw torch too); destroying it first does not.
        atexit.register(self.shutdown)

    @translating
    def _wait(self, work: Any, timeout: float) -> None:
        """Wait for ``work`` at most ``timeout`` s; its failure as WaitTimeout or PeerLost."""
        if self._nccl:
            poll(work.is_completed if self._interrupted is None else interruptible_test(work, self._interrupted), timeout)
            work.wait()  # never blocks the host on a kernel that cannot finish: it completed
        elif self._interrupted is None:
            work.wait(timedelta(seconds=timeout))
        else:
            wait_interruptible(work, timeout, self._interrupted)

    @translating
    def _order(self, work: Any, timeout: float) -> None:
        """nccl, for a result that stays on the GPU: make the current stream wait for ``work`` (the host
        does not wait, so it queues the next kernels). The bound stays: each such wait is kept until
        its work completes, and a later call finding one older than its ``timeout`` raises
        WaitTimeout; a host blocked on the GPU meanwhile is ended by NCCL's watchdog (the group's
        timeout, with TORCH_NCCL_ASYNC_ERROR_HANDLING). Elsewhere the same as :meth:`_wait`."""
        if not self._nccl:
            self._wait(work, timeout)
            return
        pending, now = self._ordered, time.monotonic()
        while pending and pending[0][0].is_completed():
            pending.popleft()
        if pending and now > pending[0][1]:
            raise WaitTimeout(pending.popleft()[2])
        work.wait()
        if not work.is_completed():
            pending.append((work, now + timeout, timeout))

    def _request(self, post: Callable[[], Any], finish: Callable[[], Any], on_gpu: bool = False) -> TorchRequest:
        wait = self._order if on_gpu else self._wait
        try:
            return TorchRequest(wait, post(), finish)
        except RuntimeError as exc:  # a failure to post is raised by wait(), like any other
            failure = translate(exc)
            if failure is None:
                raise
            return TorchRequest(wait, None, finish, failure)

    # -- data -----------------------------------------------------------------
    @translating
    def allreduce(self, x: Any, op: str, inplace: bool, timeout: float) -> Any:
        t, finish = self._work(x, inplace, op)
        (self._order if _on_gpu(x) else self._wait)(self._all_reduce(t, op), timeout)
        self._scale(t, op)
        return finish(t)

    def _all_reduce(self, t: Any, op: str) -> Any:
        """Post the allreduce of ``t``: hierarchical where the world has a hierarchy (:mod:`._hier`)."""
        hier = self.hierarchy
        if hier is not None and hier.serves(self):
            return hier.all_reduce(t, self._ops[op])
        return self._dist.all_reduce(t, self._ops[op], async_op=True)

    def iallreduce(self, x: Any, op: str, inplace: bool) -> TorchRequest:
        t, finish = self._work(x, inplace, op)

        def complete() -> Any:
            self._scale(t, op)
            return finish(t)

        return self._request(lambda: self._all_reduce(t, op), complete, _on_gpu(x))

    @translating
    def broadcast(self, x: Any, root: int, inplace: bool, timeout: float) -> Any:
        t, finish = self._work(x, inplace)
        self._wait(self._dist.broadcast(self._bits(t), root, async_op=True), timeout)
        return finish(t)

    def ibroadcast(self, x: Any, root: int, inplace: bool) -> TorchRequest:
        t, finish = self._work(x, inplace)
        return self._request(lambda: self._dist.broadcast(self._bits(t), root, async_op=True),
                             lambda: finish(t))

    @translating
    def reduce(self, x: Any, op: str, root: int, inplace: bool, timeout: float) -> Any:
        if self.rank != root:  # gloo writes partial results into non-root buffers: give it a copy
            src = self._tensor(x)
            t = self._send(src, op)
            t = t.clone() if t is src else t
            self._wait(self._dist.reduce(t, root, self._ops[op], async_op=True), timeout)
            return x
        t, finish = self._work(x, inplace, op)
        self._wait(self._dist.reduce(t, root, self._ops[op], async_op=True), timeout)
        self._scale(t, op)
        return finish(t)

    @translating
    def allgather(self, x: Any, timeout: float) -> Any:
        send = self._send(x)
        out, finish = self._output(x, send, (self.size, *send.shape))
        self._wait(self._all_gather(self._bits(out).view(-1), self._bits(send).reshape(-1), async_op=True),
                   timeout)
        return finish()

    @translating
    def gather(self, x: Any, root: int, timeout: float) -> Any:
        send = self._send(x)
        if self.rank != root:
            self._wait(self._dist.gather(self._bits(send), None, root, async_op=True), timeout)
            return None
        out, finish = self._output(x, send, (self.size, *send.shape))
        parts = list(self._bits(out).unbind(0))
        self._wait(self._dist.gather(self._bits(send), parts, root, async_op=True), timeout)
        return finish()

    @translating
    def reduce_scatter(self, x: Any, op: str, timeout: float) -> Any:
        send = self._send(x, op)
        out = self._torch.empty((send.shape[0] // self.size, *send.shape[1:]), dtype=send.dtype,
                                device=self.device)
        self._wait(self._reduce_scatter(out.view(-1), send.reshape(-1), self._ops[op], async_op=True),
                   timeout)
        self._scale(out, op)
        return self._user(x, out)

    @translating
    def alltoall(self, x: Any, timeout: float) -> Any:
        send = self._send(x)
        out, finish = self._output(x, send, tuple(send.shape))
        self._wait(self._dist.all_to_all_single(self._bits(out).view(-1), self._bits(send).reshape(-1),
                                                async_op=True), timeout)
        return finish()

    @translating
    def isend(self, x: Any, dst: int, tag: int) -> TorchRequest:
        t = self._torch.from_numpy(x) if isinstance(x, np.ndarray) else self._bits(x)
        return self._request(lambda: WaitedWork(self._dist.isend(t, dst, tag=tag)), lambda: x)

    def irecv(self, x: Any, src: int, tag: int) -> TorchRequest:
        t = self._torch.from_numpy(x) if isinstance(x, np.ndarray) else self._bits(x)
        return self._request(lambda: WaitedWork(self._dist.irecv(t, src, tag=tag)), lambda: x)

    def barrier(self, timeout: float) -> None:
        token = self._torch.zeros(1, device=self.device)  # not dist.barrier: NCCL's guesses a device
        self._wait(self._dist.all_reduce(token, async_op=True), timeout)

    # -- lifecycle --------------------------------------------------------------
    def revoke(self) -> None:
        """Nothing to revoke: peers learn of a re-forming world from the launcher's store (gloo, nccl)."""

    def shutdown(self) -> None:
        """Destroy the process group if this backend made it (a user's own is left alone), or the
        group's of a :meth:`subgroup` backend (the world's is left alone).

        In a thread, given up after a few seconds: after a failure, destroying the
        group can block on a peer that is gone or cut off, and leaving must not.
        """
        atexit.unregister(self.shutdown)
        # No reference to the group may outlive it (its threads end only when it is freed): this backend
        # is rebound to torch.distributed itself, and its last references go to the teardown thread.
        # (No local name may hold them here: the thread's release may come first, and the last
        # reference would then end in this thread, joining the group's threads past a lost peer.)
        held: list[Any] = [self._dist, self._group, self._all_gather, self._reduce_scatter]
        # the agreements' group view too (held[4]): its last reference must end in a teardown thread
        held.append(self._agreeing)
        self._agreeing = None
        self._bind(self._torch.distributed, None)
        torch_dist = self._torch.distributed
        lost = self._interrupted is not None and self._interrupted() is not None  # an epoch that ended
        if (self._owns_group or held[1] is not None) and torch_dist.is_initialized():
            # the world's own group: None destroys torch's default group and every group with it (the
            # hierarchy's, the agreements'); once "phalanx" is torch's default instead, only phalanx's
            # own groups end
            if self._owns_group and torch_dist.group.WORLD is held[1]:
                end_group(torch_dist, None, held, lost_peer=lost)
            else:
                if held[4] is not None:
                    end_group(torch_dist, held[4].group, [held.pop()], lost_peer=lost)
                end_group(torch_dist, held[1], held, lost_peer=lost)
        elif held[4] is not None and torch_dist.is_initialized():  # beside a user's own group
            end_group(torch_dist, held[4].group, held, lost_peer=lost)
        else:
            held.clear()
        if self._rendezvous is not None:  # its guard: nothing of it listens after this
            self._rendezvous.close()
        self._store = None

    def abort(self, code: int) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream must not stop the abort
                stream.flush()
        os._exit(code)


def _on_gpu(x: Any) -> bool:
    """Whether the user's result is a CUDA tensor (on nccl its wait then orders streams: ``_order``)."""
    return not isinstance(x, np.ndarray) and x.is_cuda
