"""The Backend protocol: the one small interface every transport implements.

Backends move bytes; they do not validate. The front end
(:mod:`phalanx._collectives`) has already checked the arguments (op, root,
dtype, contiguity) and, on every rank, agreed on a fingerprint of the call
through :meth:`Backend.agree` before it calls a data method. The data phase
must still honour the call's ``timeout``: a peer can be lost mid-transfer (a
cut link, a dead host), so it is posted non-blocking and waited with a deadline.

Arrays are NumPy arrays or torch tensors (already detached and contiguous).
Data methods work in place when ``inplace`` is true and always return the
result, which the front end hands back to the user.

Internal exceptions cross this boundary, never reaching users:
:class:`WaitTimeout` (a wait passed its deadline; the front end turns it into
a diagnosed ``CollectiveTimeoutError``), :class:`PeerLost` (the transport
reported a dead peer; it becomes ``RankFailedError``) and
:class:`DiagnosisUnavailable` (a backend cannot say where its peers are; the
timeout error then says so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias, get_args, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["OPS", "Backend", "Data", "DiagnosisUnavailable", "GradientOp", "Op", "PeerLost", "Request", "WaitTimeout"]

Op = Literal["sum", "prod", "min", "max", "avg"]
Op.__doc__ = """The reduction ops of phalanx.allreduce, reduce, reduce_scatter and iallreduce (``op=``).

A ``typing.Literal`` of strings, applied elementwise across ranks:

* ``"sum"`` (the default), ``"prod"``, ``"min"``, ``"max"``: as numpy computes them, in
  the input's dtype.
* ``"avg"``: the sum divided by the number of ranks; floating dtypes only (an integer
  average would be truncated: :class:`phalanx.UnsupportedArgumentError`).
* on ``bool`` data only ``"min"`` (logical and) and ``"max"`` (logical or) are allowed.

Any other string raises :class:`phalanx.InvalidArgumentError`. Every rank must pass the
same op (else :class:`phalanx.CollectiveMismatchError`). Example::

    mean_loss = phalanx.allreduce(loss, op="avg")
    any_nan = phalanx.allreduce(np.isnan(x).any(), op="max")
"""
GradientOp = Literal["avg", "sum"]
"""How gradients are combined across ranks (and replicas): their mean, or their sum."""

# Reduction ops in a fixed order: the index is the op's code in fingerprints.
OPS: tuple[str, ...] = get_args(Op)


class WaitTimeout(Exception):
    """A blocking wait passed its deadline (internal; see module docstring)."""


class PeerLost(Exception):
    """The transport reported a dead or disconnected peer (internal)."""


Data: TypeAlias = "np.ndarray | torch.Tensor"
"""What a backend moves: a NumPy array (host memory) or a torch tensor (host or device), contiguous,
of a dtype the transport carries (``phalanx._arrays`` prepares it); a result is the same kind."""


class DiagnosisUnavailable(Exception):
    """A backend cannot ask its peers where they are (internal: the timeout error says so)."""


@runtime_checkable
class Request(Protocol):
    """A non-blocking operation in flight."""

    def test(self) -> bool:
        """Make progress; return True once the operation has completed."""

    def wait(self, timeout: float) -> Any:
        """Block until complete (raise :class:`WaitTimeout` after ``timeout`` s); return the result."""


@runtime_checkable
class Backend(Protocol):
    """What a transport provides. ``name`` is one of local, mpi, gloo, nccl."""

    name: str
    rank: int
    size: int
    local_rank: int
    local_size: int

    @property
    def gathers_by_broadcast(self) -> bool:
        """Whether sharded training all-gathers parameters by one broadcast per rank, in place."""

    # -- agreement (the per-call check) and diagnostics --------------------
    def agree(self, signature: int, timeout: float) -> bool:
        """True when every rank passed the same ``signature`` (62-bit int)."""

    def iagree(self, signature: int) -> Request:
        """Non-blocking :meth:`agree`; the request's result is the bool."""

    def allgather_bytes(self, payload: bytes, timeout: float) -> list[bytes]:
        """Every rank's ``payload``, in rank order (used for diagnostics and objects)."""

    def broadcast_bytes(self, payload: bytes | None, root: int, timeout: float) -> bytes:
        """Root's ``payload`` on every rank."""

    def diagnose(self, call: str, call_index: int, grace: float) -> tuple[list[int], dict[int, str]]:
        """After a timeout: (ranks that never reported, {rank: call it is stuck in})."""

    # -- data -------------------------------------------------------------
    def allreduce(self, x: Data, op: str, inplace: bool, timeout: float) -> Data: ...
    def iallreduce(self, x: Data, op: str, inplace: bool) -> Request: ...
    def broadcast(self, x: Data, root: int, inplace: bool, timeout: float) -> Data: ...
    def ibroadcast(self, x: Data, root: int, inplace: bool) -> Request: ...
    def reduce(self, x: Data, op: str, root: int, inplace: bool, timeout: float) -> Data: ...
    def allgather(self, x: Data, timeout: float) -> Data: ...
    def gather(self, x: Data, root: int, timeout: float) -> Data: ...
    def reduce_scatter(self, x: Data, op: str, timeout: float) -> Data: ...
    def ireduce_scatter(self, x: Data, op: str) -> Request:
        """Post a reduce-scatter of 1-D ``x`` (``size * k`` elements): the request's result is a new
        1-D array of this rank's ``k`` reduced elements (sharded gradients). ``x`` may be overwritten
        (a transport may reduce it in place)."""

    def iallgather_into(self, x: Data, out: Data) -> Request:
        """Post an all-gather of 1-D ``x`` (``k`` elements) into 1-D ``out`` (``size * k``, same dtype
        and device): rank ``r``'s ``x`` at ``out[r*k:(r+1)*k]``; the result is ``out``."""

    def alltoall(self, x: Data, timeout: float) -> Data: ...
    def barrier(self, timeout: float) -> None: ...

    # -- point to point (phalanx._p2p checks and tags them) --------------------------
    def isend(self, x: Data, dst: int, tag: int) -> Request:
        """Post a send of ``x`` to rank ``dst`` with ``tag``; ``x`` stays untouched until it completes."""

    def irecv(self, x: Data, src: int, tag: int) -> Request:
        """Post a receive from rank ``src`` with ``tag`` into ``x`` (its shape and dtype); the result is
        the data (``x``, filled in)."""

    # -- groups and lifecycle -------------------------------------------------
    def subgroup(self, ranks: tuple[int, ...], serial: int, timeout: float,
                 members_only: bool = False) -> Backend | None:
        """The backend of the group of world ranks ``ranks`` (sorted) on a member; None elsewhere.

        Collective over the whole world, in the same order on every rank (``serial``
        numbers the groups of the world; ``timeout`` bounds the making); with
        ``members_only``, called by the group's members only (each rank makes its own
        group of a partition, :func:`phalanx._groups.split_group`). The group's
        backend is this backend's class, with ``rank`` and ``size`` of the group; its
        :meth:`shutdown` releases the group's transport and leaves the world's alone.
        """

    def shutdown(self) -> None: ...
    def abort(self, code: int) -> None: ...
    # Make every peer's pending and next call on this backend fail at once, as the world re-forms (MPI
    # under ULFM: :mod:`phalanx._epochs_ulfm`); nothing where the transport has no such thing.
    def revoke(self) -> None: ...
