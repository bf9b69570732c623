"""Sub-backends: a backend over a subset of the world's ranks (the transport of ``phalanx.new_group``).

A sub-backend is the parent backend's class, over a smaller transport, so it
keeps every data method, the bounded waits and the buffer handling as they
are; only what names the transport changes:

* ``mpi``: a communicator of the members (``MPI_Comm_create_group`` on the
  parent's communicator, members only), and one for diagnosis likewise; its
  own agreement buffers and persistent agreement.
* ``gloo``/``nccl``: a ``torch.distributed.new_group`` process group (every
  rank of the world makes it, members or not, in the same order). The data
  methods call ``torch.distributed`` through :class:`_GroupDist`, which adds
  ``group=`` and turns group ranks (roots) into the world ranks torch expects.
  Diagnosis uses the world's store under a key prefix of the group's own.
* ``local``: a world of one has only the group ``[0]``: a new local backend.

``rank`` and ``size`` of a sub-backend are the group's; ``world_ranks`` maps
a group rank to its world rank (for messages).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from datetime import timedelta
from typing import Any

import numpy as np

from ._base import Backend, PeerLost
from ._torchsetup import translate

__all__ = ["make_subbackend", "release_subbackend"]

_TEARDOWN_S = 2.0
_TAG = 7_713  # MPI_Comm_create_group's tag (calls are ordered by the world-wide agreement anyway)


def make_subbackend(parent: Backend, ranks: tuple[int, ...], serial: int, timeout: float) -> Backend | None:
    """The backend of group ``ranks`` (world ranks, sorted) on a member, None on a non-member.

    Collective over the whole world (every rank calls it, in the same order);
    ``serial`` numbers the groups made in this world (store prefixes).
    """
    member = parent.rank in ranks
    if parent.name == "local":
        from ._local import LocalBackend

        return LocalBackend()
    if parent.name == "mpi":
        return _mpi_sub(parent, ranks) if member else None
    return _torch_sub(parent, ranks, serial, timeout, member)


def release_subbackend(sub: Backend) -> None:
    """Free the sub-backend's transport (bounded: a lost peer must not block the teardown)."""
    group = getattr(sub, "_group", None)
    with contextlib.suppress(Exception):
        sub.shutdown()
    if group is None:
        return
    dist = sub._dist._dist  # type: ignore[attr-defined]

    def destroy() -> None:
        with contextlib.suppress(Exception):  # destroying after a failure may itself fail
            dist.destroy_process_group(group)

    thread = threading.Thread(target=destroy, name="phalanx-group-teardown", daemon=True)
    thread.start()
    thread.join(_TEARDOWN_S)


# -- MPI ---------------------------------------------------------------------------------------------

def _mpi_sub(parent: Any, ranks: tuple[int, ...]) -> Any:
    import array

    from ._ring import Rings

    cls = type(parent)
    sub = cls.__new__(cls)
    sub.__dict__.update(parent.__dict__)  # options, op tables, the MPI module
    MPI = parent.MPI
    try:  # blocking, among the members only: they have just agreed on it, world-wide
        members = parent.comm.Get_group().Incl(list(ranks))
        sub.comm = parent.comm.Create_group(members, _TAG)
        sub._diag = parent._diag.Create_group(members, _TAG + 1)
        members.Free()
        sub._ring = Rings(MPI, sub.comm.Dup()) if parent._ring is not None and len(ranks) > 1 else None
    except MPI.Exception as exc:
        raise PeerLost(str(exc)) from exc
    sub.rank, sub.size = sub.comm.Get_rank(), sub.comm.Get_size()
    sub.world_ranks = ranks
    sub._chk = array.array("q", [0, 0])
    sub._chk_out = array.array("q", [0, 0])
    sub._abandoned = parent._abandoned  # kept alive as long as the parent's (to the end of the process)
    try:
        sub._agreement = sub.comm.Allreduce_init(sub._chk, sub._chk_out, MPI.MAX)
    except (NotImplementedError, MPI.Exception, AttributeError):
        sub._agreement = None
    return sub


# -- torch.distributed ---------------------------------------------------------------------------------

class _GroupDist:
    """``torch.distributed`` as a sub-backend calls it: every collective on ``group``, roots translated.

    torch takes the roots of ``broadcast``/``reduce``/``gather`` as world ranks even
    with ``group=``; the backend's code passes group ranks.
    """

    def __init__(self, dist: Any, group: Any, ranks: tuple[int, ...]) -> None:
        self._dist, self._group, self._ranks = dist, group, ranks
        self.ReduceOp = dist.ReduceOp
        self._gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._scatter_from = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def __getattr__(self, name: str) -> Any:  # anything else (is_initialized, ...) as it is
        return getattr(self._dist, name)

    def all_reduce(self, t: Any, op: Any = None, async_op: bool = False) -> Any:
        op = self._dist.ReduceOp.SUM if op is None else op
        return self._dist.all_reduce(t, op, group=self._group, async_op=async_op)

    def broadcast(self, t: Any, src: int, async_op: bool = False) -> Any:
        return self._dist.broadcast(t, self._ranks[src], group=self._group, async_op=async_op)

    def reduce(self, t: Any, dst: int, op: Any, async_op: bool = False) -> Any:
        return self._dist.reduce(t, self._ranks[dst], op, group=self._group, async_op=async_op)

    def gather(self, t: Any, parts: Any, dst: int, async_op: bool = False) -> Any:
        return self._dist.gather(t, parts, self._ranks[dst], group=self._group, async_op=async_op)

    def all_to_all_single(self, out: Any, send: Any, async_op: bool = False) -> Any:
        return self._dist.all_to_all_single(out, send, group=self._group, async_op=async_op)

    def all_gather(self, out: Any, send: Any, async_op: bool = False) -> Any:
        return self._gather_into(out, send, group=self._group, async_op=async_op)

    def reduce_scatter(self, out: Any, send: Any, op: Any, async_op: bool = False) -> Any:
        return self._scatter_from(out, send, op, group=self._group, async_op=async_op)


def _torch_sub(parent: Any, ranks: tuple[int, ...], serial: int, timeout: float, member: bool) -> Any:
    dist = parent._dist
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout + max(30.0, timeout))}
    if parent._nccl and "device_id" in inspect.signature(dist.new_group).parameters:
        kwargs["device_id"] = parent.device
    try:  # every rank makes the group, members or not: torch numbers the groups in order
        group = dist.new_group(list(ranks), **kwargs)
    except RuntimeError as exc:
        failure = translate(exc)
        if failure is None:
            raise
        raise failure from exc
    if not member:
        return None
    cls = type(parent)
    sub = cls.__new__(cls)
    sub.__dict__.update(parent.__dict__)  # device, op tables, the store
    gd = _GroupDist(dist, group, ranks)
    sub._dist = gd
    sub._group = group
    sub._all_gather, sub._reduce_scatter = gd.all_gather, gd.reduce_scatter
    sub._owns_group = False  # its shutdown leaves the world's process group alone
    sub._rendezvous = None
    sub._prefix = f"{parent._prefix}group{serial}/"
    sub.rank, sub.size = ranks.index(parent.rank), len(ranks)
    sub.world_ranks = ranks
    torch = parent._torch
    sub._chk = np.zeros(2, np.int64)
    sub._chk_t = torch.from_numpy(sub._chk)
    sub._chk_dev = sub._chk_t.to(parent.device)
    return sub
