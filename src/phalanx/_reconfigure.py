"""What follows a re-formed world: the :class:`Reconfigurable` contract, and the registry that
:func:`phalanx.reform` drives.

::

    class Follower:                          # anything sized or numbered by the world
        def rebind(self, epoch): ...         # follow the new world (collective where it must agree)
        def state_dict(self): ...            # what a fresh one, made in the new world, needs to continue
        def load_state_dict(self, state): ...

    _reconfigure.register(follower)          # held weakly: a collected object drops out
    phalanx.on_reform(lambda epoch: ...)     # a plain callable: adapted into the same registry, held

After :func:`phalanx.reform` has made the new world, :func:`rebind_all` calls ``rebind(epoch)`` of
every live entry, in the order they were registered, in one loop. The registered entries of phalanx:

* ``phalanx.torch.DistributedOptimizer`` with ``shard=None`` over the whole world, at construction
  (its new gradient engine: the structure agreement a replacement's construction makes);
* ``phalanx.torch.DistributedSampler`` made without ``rank=``/``size=`` (it takes the new rank's part);
* the ``"phalanx"`` torch.distributed process group over the whole world (its ``Binding``);
* Horovod's state (``hvd.init``'s cross communicator, a callback) and Horovod's DistributedOptimizer.

What cannot follow in place does not register, so ``reform()`` never raises for it, and its own
``rebind`` raises UsageError naming the path that works instead: a sharded or group
DistributedOptimizer (``release()`` before ``reform()``, wrap again after, load its state: what
``fit(elastic=True)`` does), a sampler given ``rank=``/``size=``, a process group over a phalanx group.
``state_dict()``/``load_state_dict()`` are how such state crosses into objects of the new world.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ._errors import InvalidArgumentError

if TYPE_CHECKING:
    from ._epochs import Epoch

__all__ = ["Reconfigurable", "on_reform", "rebind_all", "register", "registered", "unregister"]


@runtime_checkable
class Reconfigurable(Protocol):
    """An object that follows a re-formed world: :func:`phalanx.reform` calls its :meth:`rebind`."""

    def rebind(self, epoch: Epoch) -> None:
        """Follow the world of ``epoch`` (the current one, just formed); every rank calls it in the
        same order, so it may make collectives. UsageError where the object cannot follow."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What an object of this kind, made in another world, needs to continue from this one."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, a :meth:`state_dict`."""
        ...


class _Callback:
    """A plain callable registered with :func:`on_reform`, as a :class:`Reconfigurable`."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[Epoch], None]) -> None:
        self.callback = callback

    def __call__(self) -> _Callback:  # an entry of the registry, as a weak reference is: its object
        return self

    def rebind(self, epoch: Epoch) -> None:
        self.callback(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


_Entry = Callable[[], "Reconfigurable | None"]  # a weak reference, or a held _Callback
_ENTRIES: list[_Entry] = []


def _live() -> list[Reconfigurable]:
    """The registered objects still alive, in registration order (dead references dropped)."""
    pairs = [(entry, entry()) for entry in _ENTRIES]
    _ENTRIES[:] = [entry for entry, obj in pairs if obj is not None]
    return [obj for _, obj in pairs if obj is not None]


def register(obj: Reconfigurable) -> None:
    """Let ``obj`` follow every re-formed world from now on, after the objects registered before it;
    held weakly (a collected object drops out); again does nothing. InvalidArgumentError for an object
    that is not :class:`Reconfigurable` or cannot be referenced weakly."""
    if not isinstance(obj, Reconfigurable):
        raise InvalidArgumentError(
            f"phalanx: a {type(obj).__name__} cannot follow a re-formed world: it needs rebind(epoch), "
            "state_dict() and load_state_dict(state). For a plain function use phalanx.on_reform(callback).")
    if any(other is obj for other in _live()):
        return
    try:
        _ENTRIES.append(weakref.ref(obj))
    except TypeError:
        raise InvalidArgumentError(
            f"phalanx: a {type(obj).__name__} cannot be held weakly (give its class a __weakref__ slot), so "
            "it cannot follow a re-formed world; register a function with phalanx.on_reform instead.") from None


def unregister(obj: object) -> None:
    """Stop ``obj`` from following (a released or closed wrapper); nothing where it is not registered."""
    _ENTRIES[:] = [entry for entry in _ENTRIES if entry() is not obj]


def registered() -> list[Reconfigurable]:
    """The objects that follow the next re-formed world, in the order :func:`rebind_all` rebinds them
    (an :func:`on_reform` callback as its adapter)."""
    return _live()


def rebind_all(epoch: Epoch) -> None:
    """Rebind every registered object to the world of ``epoch``, in registration order (``reform()``
    calls it once the new world is installed). One unregistered by an earlier one's rebind is skipped;
    one registered meanwhile was made in the new world and is not rebound."""
    for obj in _live():
        if any(entry() is obj for entry in _ENTRIES):
            obj.rebind(epoch)


def on_reform(callback: Callable[[Epoch], None], *, cancel: bool = False) -> None:
    """Call ``callback(epoch)`` after each re-formation, in the new world, in registration order with
    every other object that follows it (``phalanx.torch``'s optimizers, samplers, process groups);
    held until ``cancel=True`` takes it back (an absent callback: nothing to take back)."""
    if cancel:
        _ENTRIES[:] = [e for e in _ENTRIES if not (isinstance(e, _Callback) and e.callback == callback)]
    elif not any(isinstance(e, _Callback) and e.callback == callback for e in _ENTRIES):
        _ENTRIES.append(_Callback(callback))
