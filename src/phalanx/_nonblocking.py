"""Non-blocking collectives: ``iallreduce``/``ibroadcast`` and the :class:`Handle` they return.

The agreement is posted at once; the data phase is deferred until the
agreement has passed, and data phases are posted in call order on every rank
(MPI matches collectives by posting order), so handles may be waited on in
any order.
"""

from __future__ import annotations

from typing import Any

from . import _trace
from ._arrays import Buffer, as_buffer
from ._collectives import _check_op, _check_root, _check_step
from ._errors import PhalanxError
from ._groups import Group, world_for
from ._world import World
from .comm._base import Op, Request

__all__ = ["Handle", "iallreduce", "ibroadcast"]


class Handle:
    """A non-blocking collective in flight: ``wait()`` returns the result, ``test()`` polls.

    Returned by :func:`iallreduce` and :func:`ibroadcast`, never made directly: the
    constructor's arguments (``world``, ``call``, ``buf``, ``start``, ``agreement``)
    are internal. The call's agreement runs first (non-blocking too); the data phase
    is posted once it has passed, always in the order the calls were made.

    Methods: ``wait()`` blocks (bounded by the world's timeout) and returns the
    result; ``test()`` returns True once it is ready, without blocking. Both raise
    the call's CollectiveMismatchError, CollectiveTimeoutError or RankFailedError,
    the same error on every later call.
    """

    __slots__ = ("_world", "_call", "_buf", "_start", "_agreement", "_request", "_result", "_done",
                 "_error")

    def __init__(self, world: World, call: str, buf: Buffer, start: _Start,
                 agreement: Request | None) -> None:
        self._world = world
        self._call = call
        self._buf = buf
        self._start = start  # _Start: () -> backend Request for the data phase
        self._agreement = agreement
        self._request: Request | None = None
        self._result: Any = None
        self._done = False
        self._error: PhalanxError | None = None  # how it failed, re-raised by every later wait/test
        if _trace.ON:
            _trace.span_begin(self, call, buf, start.op, start.root)
        if agreement is None:
            self._request = start()
        else:
            world.queue(self)  # the world posts queued data phases in call order (World.flush)

    def post(self, block: bool) -> bool:
        """Post the data phase once the agreement passed (blocking if asked). True when posted."""
        if self._error is not None:
            raise self._error
        if self._request is not None:
            return True
        try:
            return self._post(block)
        except PhalanxError as exc:  # a mismatch, a timeout, a lost peer: the same error every time
            self._error = exc
            raise

    def _post(self, block: bool) -> bool:
        world = self._world
        assert self._agreement is not None  # internal invariant, not user input
        # Raises if an earlier failure dropped this call with the others pending; earlier calls go first.
        world.ready(self._call, until=self)
        with world.guard(self._call):
            if not block and not self._agreement.test():
                return False
            same = self._agreement.wait(world.timeout)
            world.complete(self)
            if not same:
                start = self._start
                world.explain_mismatch(self._call, self._buf, start.op, start.root, start.step)
            self._request = self._start()
        return True

    def test(self) -> bool:
        """True once the result is ready (never blocks, except to report a mismatch)."""
        if self._done:
            return True
        if not self.post(block=False):
            return False
        assert self._request is not None
        try:
            with self._world.guard(self._call):  # a lost peer: RankFailedError, here as from wait()
                return self._request.test()
        except PhalanxError as exc:
            self._error = exc
            raise

    def wait(self) -> Any:
        """Block until done (bounded by the world's timeout) and return the result."""
        if not self._done:
            self.post(block=True)
            assert self._request is not None
            try:
                with self._world.guard(self._call):
                    self._result = self._buf.finish(self._request.wait(self._world.timeout))
            except PhalanxError as exc:
                self._error = exc
                raise
            self._done = True
            if _trace.ON:
                _trace.span_end(self)
        return self._result


class _Start:
    """The deferred data phase of a non-blocking call (keeps op/root/step for error messages)."""

    __slots__ = ("fn", "args", "op", "root", "step")

    def __init__(self, fn: Any, args: tuple[Any, ...], op: str | None, root: int,
                 step: int | None) -> None:
        self.fn, self.args, self.op, self.root, self.step = fn, args, op, root, step

    def __call__(self) -> Request:
        return self.fn(*self.args)


def iallreduce(x: Any, op: Op = "sum", *, step: int | None = None, group: Group | None = None) -> Handle:
    """Start a sum (or other ``op``) over all ranks without waiting: ``handle.wait()`` returns it.

    >>> h = phalanx.iallreduce(grads)   # ... compute meanwhile ...
    >>> grads = h.wait()

    Arguments:
        x: a NumPy array, torch tensor (CPU or CUDA) or Python/NumPy scalar, the same
            shape and dtype on every rank; arrays and tensors are updated in place
            once done (do not touch ``x`` before ``wait()``).
        op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"avg"`` (floats only; on
            bool, ``"min"`` is logical and, ``"max"`` logical or).
        step: an optional int label (e.g. the training step), the same on every rank.
        group: a :class:`Group` from :func:`new_group`: run among its members only
            (roots are group ranks); None (default) is the whole world; a rank outside
            the group gets NotInGroupError.

    Returns a :class:`Handle` whose ``wait()`` gives the reduced value, of ``x``'s
    type. Handles complete in the order they were started, on every rank; a
    blocking collective made meanwhile posts the earlier handles first.

    Raises here InvalidArgumentError (unknown op or bad step) and
    UnsupportedArgumentError (a type or dtype that cannot be sent); from
    ``wait()``/``test()`` CollectiveMismatchError (ranks passed different shapes,
    dtypes, ops or steps), CollectiveTimeoutError and RankFailedError.
    """
    world = world_for(group, "iallreduce")
    buf = as_buffer(x, "iallreduce")
    _check_op("iallreduce", op, buf)
    start = _Start(world.backend.iallreduce, (buf.data, op, buf.inplace), op, -1,
                   _check_step("iallreduce", step))
    return _start_handle(world, "iallreduce", buf, start)


def ibroadcast(x: Any, root: int = 0, *, step: int | None = None,
               group: Group | None = None) -> Handle:
    """Start sending ``root``'s ``x`` to every rank without waiting: ``handle.wait()`` returns it.

    Arguments:
        x: a NumPy array, torch tensor or scalar, the same shape and dtype on every
            rank; arrays and tensors are overwritten in place once done.
        root: the sending rank, the same on every rank.
        step: an optional int label (e.g. the training step), the same on every rank.
        group: a :class:`Group` from :func:`new_group`: run among its members only
            (roots are group ranks); None (default) is the whole world; a rank outside
            the group gets NotInGroupError.

    Returns a :class:`Handle` whose ``wait()`` gives root's value, of ``x``'s type;
    handles complete in the order they were started, on every rank.

    Raises here InvalidArgumentError (a root that is not a rank, a bad step) and
    UnsupportedArgumentError (a type that cannot be sent); from ``wait()``/``test()``
    CollectiveMismatchError (ranks disagree on shape, dtype, root or step),
    CollectiveTimeoutError and RankFailedError.
    """
    world = world_for(group, "ibroadcast")
    buf = as_buffer(x, "ibroadcast")
    _check_root("ibroadcast", root, world)
    start = _Start(world.backend.ibroadcast, (buf.data, root, buf.inplace), None, root,
                   _check_step("ibroadcast", step))
    return _start_handle(world, "ibroadcast", buf, start)


def _start_handle(world: World, call: str, buf: Buffer, start: _Start) -> Handle:
    agreement = world.enter(call, buf, start.op, start.root, start.step, wait=False)  # posted, not waited
    return Handle(world, call, buf, start, agreement)


# -- object collectives (opt-in: they unpickle what peers send) ---------------------------------
