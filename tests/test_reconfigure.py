"""The recovery contract in one process: what follows a re-formed world (``phalanx._reconfigure``).

* the registry holds objects weakly (a collected one drops out) and ``on_reform`` callables strongly, and
  ``rebind_all`` (what ``phalanx.reform()`` calls) rebinds them in registration order, in one loop;
* a ``DistributedOptimizer`` with ``shard=None`` registers itself and follows a new world (a new engine on
  it; a second ``rebind()`` does nothing); a sharded one does not register and its ``rebind`` names
  ``release()``; ``release()`` and ``close()`` take an optimizer out;
* a ``DistributedSampler`` made without ``rank=``/``size=`` takes the new rank's part; one given them says so;
* the ``"phalanx"`` torch process group's ``Binding`` keeps working in a world that numbers it alike, and
  refuses its calls, naming the fix, in one that does not;
* ``World``'s recovery fields are set through its methods: ``set_retry_mismatch``, kept by ``supersede``.

The re-formed world here is a new local world made after ``shutdown()`` (the real ones, under
``phalanx run``, are ``tests/test_recovery.py``'s).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

import phalanx
from phalanx import _reconfigure, _world
from phalanx._epochs import Epoch

torch = pytest.importorskip("torch")
pt = pytest.importorskip("phalanx.torch")



def _epoch(number: int = 1, rank: int = 0, size: int = 1) -> Epoch:
    return Epoch(number, rank, size, tuple(range(size)))


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An empty registry for the test (objects of other tests stay out of its rebinds)."""
    monkeypatch.setattr(_reconfigure, "_ENTRIES", [])
    yield


@pytest.fixture
def world(registry: None) -> Iterator[None]:
    phalanx.init("local")
    yield
    if phalanx.initialized():
        phalanx.shutdown()


class Follower:
    """A Reconfigurable of the test's own: notes each rebind in ``seen``."""

    def __init__(self, name: str, seen: list[Any]) -> None:
        self.name, self.seen = name, seen

    def rebind(self, epoch: Epoch) -> None:
        self.seen.append((self.name, epoch.number))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def _reform_in_process() -> Epoch:
    """A new local world in place of the current one, and every registered object rebound to it."""
    phalanx.shutdown()
    phalanx.init("local")
    epoch = _epoch()
    _reconfigure.rebind_all(epoch)
    return epoch


def test_the_registry_rebinds_objects_and_callbacks_in_registration_order_in_one_loop(registry: None) -> None:
    seen: list[Any] = []
    first, last = Follower("first", seen), Follower("last", seen)
    _reconfigure.register(first)

    def callback(epoch: Epoch) -> None:
        seen.append(("callback", epoch.number))

    phalanx.on_reform(callback)
    _reconfigure.register(last)
    _reconfigure.register(first)  # again: still once, in its first place
    phalanx.on_reform(callback)
    assert isinstance(first, _reconfigure.Reconfigurable)
    _reconfigure.rebind_all(_epoch(1))
    assert seen == [("first", 1), ("callback", 1), ("last", 1)]
    phalanx.on_reform(callback, cancel=True)
    phalanx.on_reform(callback, cancel=True)  # not registered any more: nothing to take back
    _reconfigure.unregister(first)
    seen.clear()
    _reconfigure.rebind_all(_epoch(2))
    assert seen == [("last", 2)]


def test_the_registry_holds_objects_weakly_and_callbacks_strongly(registry: None) -> None:
    seen: list[Any] = []
    kept, dropped = Follower("kept", seen), Follower("dropped", seen)
    _reconfigure.register(kept)
    _reconfigure.register(dropped)
    phalanx.on_reform(lambda epoch: seen.append(("lambda", epoch.number)))  # only the registry holds it
    del dropped
    gc.collect()
    assert [type(o).__name__ for o in _reconfigure.registered()] == ["Follower", "_Callback"]
    _reconfigure.rebind_all(_epoch(3))
    assert seen == [("kept", 3), ("lambda", 3)]


def test_what_is_not_reconfigurable_or_not_weakly_held_is_refused(registry: None) -> None:
    class Plain:
        pass

    with pytest.raises(phalanx.InvalidArgumentError, match="rebind.*on_reform"):
        _reconfigure.register(Plain())  # type: ignore[arg-type]

    class NoWeak:
        __slots__ = ("x",)

        def rebind(self, epoch: Epoch) -> None: ...
        def state_dict(self) -> dict[str, Any]: return {}
        def load_state_dict(self, state: dict[str, Any]) -> None: ...

    with pytest.raises(phalanx.InvalidArgumentError, match="weakly"):
        _reconfigure.register(NoWeak())
    assert _reconfigure.registered() == []


def test_a_distributed_optimizer_follows_a_new_world_through_the_contract(world: None) -> None:
    model = torch.nn.Linear(3, 2)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert _reconfigure.registered() == [opt]
    old = opt.engine
    opt.rebind()  # already over the current world: nothing to do
    assert opt.engine is old
    _reform_in_process()
    assert opt.engine is not old and old.closed and opt.engine.world is _world.current("test")
    opt.rebind(_epoch())  # after reform() drove it: a call of one's own does nothing
    before = model.weight.detach().clone()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    assert not model.weight.detach().equal(before)
    opt.close()
    assert _reconfigure.registered() == []
    other = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    other.release()
    assert _reconfigure.registered() == []
    kept = pt.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    assert _reconfigure.registered() == [kept]
    del kept
    gc.collect()
    assert _reconfigure.registered() == []  # a collected optimizer drops out


def test_a_sharded_optimizer_does_not_register_and_its_rebind_names_release(world: None) -> None:
    model = torch.nn.Linear(4, 4)
    opt = pt.DistributedOptimizer(torch.optim.Adam(model.parameters()), shard="optimizer")
    assert _reconfigure.registered() == []
    _reform_in_process()  # reform() leaves it alone: it does not raise
    with pytest.raises(phalanx.UsageError, match=r"release\(\) before phalanx.reform\(\)"):
        opt.rebind(_epoch())


def test_a_sampler_follows_the_world_unless_given_its_rank_and_size(world: None) -> None:
    data = list(range(12))
    follows = pt.DistributedSampler(data, shuffle=False)
    fixed = pt.DistributedSampler(data, shuffle=False, rank=0, size=2)
    assert _reconfigure.registered() == [follows]
    next(iter(follows))  # mid-epoch
    _reconfigure.rebind_all(_epoch(1, rank=1, size=3))
    assert (follows.rank, follows.size, len(follows), list(follows)) == (1, 3, 4, [4, 5, 6, 7])
    assert (fixed.rank, fixed.size) == (0, 2)
    with pytest.raises(phalanx.UsageError, match="rank=0, size=2 given.*Make a new sampler"):
        fixed.rebind(_epoch(1, rank=1, size=3))


def test_the_process_group_binding_follows_a_world_that_numbers_it_alike(world: None) -> None:
    from phalanx.torch._binding import Binding

    binding = Binding(None, 0, 2)
    assert _reconfigure.registered() == [binding]
    _reconfigure.rebind_all(_epoch(1, rank=0, size=2))
    assert binding.group is None
    _reconfigure.rebind_all(_epoch(2, rank=0, size=1))
    with pytest.raises(phalanx.UsageError, match=r"rank 0 of 2.*rank 0 of 1.*destroy_process_group"):
        binding.group  # noqa: B018 - the property refuses
    binding.bind(None)
    assert binding.group is None
    group = phalanx.new_group([0])
    over_group = Binding(group)
    assert _reconfigure.registered() == [binding]
    with pytest.raises(phalanx.UsageError, match="new_group"):
        over_group.rebind(_epoch(3))


def test_world_recovery_fields_are_set_through_its_methods(world: None) -> None:
    def rule(world: _world.World, entries: list[dict[str, Any]], retry: bool) -> bool:
        return False

    old = _world.current("test")
    old.set_retry_mismatch(rule)
    new = _world.World(old.backend, timeout=old.timeout, check=old.checks, debug=old.debug, devices=None, epoch=1)
    old.supersede(new)
    assert new.retry_mismatch is rule and old.superseded is new and new.epoch == 1
