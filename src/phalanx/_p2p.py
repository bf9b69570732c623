"""Point-to-point messages: ``isend``/``irecv`` of one array or tensor between two ranks, checked and bounded.

A collective's fingerprint is agreed by every rank; a message has two
parties, so its check travels with it. The sender posts a small header
(magic number, dtype code, shape) and the data at once; the receiver posts
the header's receive, and once the header has come and matches the buffer
it was given, the data's. A header that differs is a
``CollectiveMismatchError`` on the receiver naming both sides, before any of
the data is received (its rank's error then ends the job, as any raising
rank does). While a rank waits for any message, every receive it has posted
advances: so the exchange users write (``isend`` then ``irecv`` on both
sides of a pair, waited in any order) cannot deadlock, even on a transport
that completes a send only once its receive is posted (gloo). Every wait polls
with the world's timeout: a peer that never sends or receives is a
``CollectiveTimeoutError``, never a hang.

Tags: a user tag ``t`` (0 ≤ t < ``MAX_TAG``) travels as ``BASE + 2t``
(header) and ``BASE + 2t + 1`` (data), a range no other phalanx message
uses. Messages between the same pair with the same tag arrive in order.
The nccl backend has no point-to-point path here (UnsupportedArgumentError).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._arrays import DTYPE_CODES, Buffer, as_buffer
from ._errors import CollectiveMismatchError, InvalidArgumentError, UnsupportedArgumentError
from ._groups import Group, world_for
from ._world import World
from .comm._wait import poll

__all__ = ["MAX_TAG", "Message", "irecv", "isend"]

BASE = 20_000
MAX_TAG = 5_000  # BASE + 2 * MAX_TAG stays below 32767, the least tag bound MPI guarantees
_MAGIC = 0x5048414C  # "PHAL"
_DIMS = 8  # shapes of up to 8 axes travel whole; longer ones by a hash
_NAMES = {code: name for name, code in DTYPE_CODES.items()}


def _header(buf: Buffer) -> np.ndarray:
    head = np.zeros(3 + _DIMS, np.int64)
    head[:3] = (_MAGIC, buf.code, len(buf.shape))
    if len(buf.shape) <= _DIMS:
        head[3:3 + len(buf.shape)] = buf.shape
    else:
        head[3] = hash(tuple(buf.shape)) & ((1 << 62) - 1)
    return head


def _shown(head: np.ndarray) -> str:
    ndim = int(head[2])
    shape = [int(v) for v in head[3:3 + ndim]] if ndim <= _DIMS else f"<{ndim} axes>"
    return f"{_NAMES.get(int(head[1]), '?')}{shape}"


def _check(call: str, world: World, peer: int, tag: int, group: Group | None) -> None:
    if world.backend.name == "nccl":
        raise UnsupportedArgumentError(
            f"phalanx.{call}: point-to-point messages are not supported on the nccl backend here; use "
            "collectives, or the gloo or mpi backend.")
    if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < world.size or peer == world.rank:
        raise InvalidArgumentError(
            f"phalanx.{call}: peer {peer!r} is not another rank of this {'group' if group else 'world'} "
            f"(rank {world.rank} of {world.size}); pass the other rank's number.")
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag < MAX_TAG:
        raise InvalidArgumentError(f"phalanx.{call}(tag={tag!r}): a tag is an int from 0 to {MAX_TAG - 1}.")


class Message:
    """One message in flight: :meth:`wait` completes it (within the world's timeout) and returns the
    buffer (for a receive: the data, in the buffer given)."""

    __slots__ = ("_world", "_call", "_buf", "_peer", "_tag", "_head", "_theirs", "_reqs", "_done", "_result")

    def __init__(self, world: World, call: str, buf: Buffer, peer: int, tag: int) -> None:
        self._world, self._call, self._buf, self._peer, self._tag = world, call, buf, peer, tag
        self._head = _header(buf)
        self._done, self._result = False, buf.data
        backend = world.backend
        world.ready(call)
        with world.guard(call):
            if call == "isend":
                self._reqs = [backend.isend(self._head, peer, BASE + 2 * tag),
                              backend.isend(buf.data, peer, BASE + 2 * tag + 1)]
            else:  # the data's receive is posted once the header has been checked (_advance)
                self._theirs = np.empty_like(self._head)
                self._reqs = [backend.irecv(self._theirs, peer, BASE + 2 * tag)]
                _RECEIVING.setdefault(id(world), []).append(self)

    def _advance(self) -> None:
        """A receive whose header has come: check it, then post the data's receive."""
        if len(self._reqs) > 1 or not self._reqs[0].test():
            return
        _RECEIVING[id(self._world)].remove(self)
        if not np.array_equal(self._theirs, self._head):
            raise CollectiveMismatchError(
                f"phalanx.irecv: rank {self._world.rank} expected {_shown(self._head)} from rank {self._peer} "
                f"(tag {self._tag}), and rank {self._peer} sent {_shown(self._theirs)}. Receive into a buffer "
                "of the shape and dtype sent, with the same tag.")
        self._reqs.append(self._world.backend.irecv(self._buf.data, self._peer, BASE + 2 * self._tag + 1))

    def _test(self) -> bool:
        for pending in tuple(_RECEIVING.get(id(self._world), ())):  # every receive advances while any waits:
            pending._advance()  # a send may need its peer's data receive, posted by the peer's progress
        if self._call == "irecv" and len(self._reqs) < 2:
            return False
        return all(req.test() for req in self._reqs)

    def wait(self) -> Any:
        """Complete the message: the data sent, or received into the buffer. Raises
        CollectiveMismatchError (the header differs from this buffer), CollectiveTimeoutError."""
        if self._done:
            return self._result
        world = self._world
        with world.guard(self._call):
            poll(self._test, world.timeout, patient=False)
            self._result = self._buf.back(self._reqs[-1].wait(world.timeout))
        self._done = True
        return self._result


_RECEIVING: dict[int, list[Message]] = {}  # per world: the receives whose header has not come yet


def isend(x: Any, dst: int, *, tag: int = 0, group: Group | None = None) -> Message:
    """Send ``x`` (an array or tensor, not modified until the message completes) to rank ``dst``.

    Arguments: ``x``, ``dst`` (another rank of the world or ``group``), ``tag`` (an int from
    0 to MAX_TAG - 1: messages with the same tag between a pair arrive in order), ``group``.

    Returns a :class:`Message`; its ``wait()`` completes the send. Raises InvalidArgumentError
    (``dst`` or ``tag``), UnsupportedArgumentError (nccl), and from ``wait()``
    CollectiveTimeoutError (the peer never received it, within the timeout).
    """
    world = world_for(group, "isend")
    _check("isend", world, dst, tag, group)
    return Message(world, "isend", as_buffer(x, "isend"), dst, tag)


def irecv(x: Any, src: int, *, tag: int = 0, group: Group | None = None) -> Message:
    """Receive into ``x`` (an array or tensor of the shape and dtype sent) from rank ``src``.

    Arguments: ``x``, ``src`` (another rank of the world or ``group``), ``tag`` (the sender's),
    ``group``.

    Returns a :class:`Message`; its ``wait()`` returns the data (``x``, filled in). Raises
    InvalidArgumentError (``src`` or ``tag``), UnsupportedArgumentError (nccl), and from
    ``wait()`` CollectiveMismatchError (the sender's shape or dtype differs),
    CollectiveTimeoutError (nothing came within the timeout).
    """
    world = world_for(group, "irecv")
    _check("irecv", world, src, tag, group)
    buf = as_buffer(x, "irecv")
    if not buf.inplace or buf.scalar is not None:
        raise UnsupportedArgumentError(
            f"phalanx.irecv: a message is received into the buffer given, and {buf.describe()} cannot be "
            "written; pass a writable NumPy array or a torch tensor.")
    return Message(world, "irecv", buf, src, tag)
