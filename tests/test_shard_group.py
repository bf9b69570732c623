"""The shard group's state machine and the transfers every sharding level calls, in a world of one.

The worlds of 2 and 3 ranks (mpi, gloo) check the same contract through training: every ZeRO-1/2
bucket's group is back to ``whole`` after each step (``worlds_sharding.run_case``) and every ZeRO-3
unit's is ``free`` (``worlds_param_shards.train``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

import phalanx  # noqa: E402
from phalanx import _world  # noqa: E402
from phalanx.torch import _shard_group, _transfers  # noqa: E402
from phalanx.torch._shard_group import NEXT, GroupState, ShardGroup  # noqa: E402
from phalanx.torch._shard_tensor import ShardedTensor, ShardSpec  # noqa: E402

S = GroupState
ZERO3_STEP = [S.GATHERING, S.WHOLE, S.FREE, S.GATHERING, S.WHOLE, S.REDUCING, S.REDUCED, S.FREE]
ZERO12_STEP = [S.REDUCING, S.REDUCED, S.REDUCING, S.REDUCED, S.GATHERING, S.WHOLE]


@pytest.fixture
def world() -> Iterator[object]:
    phalanx.init("local")
    try:
        yield _world.current("test")
    finally:
        phalanx.shutdown()


def test_a_zero3_group_rests_free_and_walks_gather_forward_free_regather_reduce_free() -> None:
    group = ShardGroup("blocks.0", keeps_whole=False)
    assert group.state is S.FREE
    for to in ZERO3_STEP * 2:
        group.advance(to)
    assert group.state is S.FREE


def test_a_zero12_group_rests_whole_and_walks_two_backwards_then_the_steps_gather() -> None:
    group = ShardGroup("bucket 0", keeps_whole=True)
    assert group.state is S.WHOLE
    for to in ZERO12_STEP * 2:
        group.advance(to)
    assert group.state is S.WHOLE


@pytest.mark.parametrize(("start", "to"), [(a, b) for a in S for b in S if b not in NEXT[a]])
def test_a_move_outside_next_raises_usage_error_naming_the_group_and_both_states(start: GroupState,
                                                                                 to: GroupState) -> None:
    group = ShardGroup("blocks.3", keeps_whole=False)
    group.state = start
    with pytest.raises(phalanx.UsageError, match=f"'blocks.3' cannot go from {start.value} to {to.value}"):
        group.advance(to)
    assert group.state is start, "a refused move changed the state"


def test_settle_returns_an_abandoned_group_to_its_resting_state() -> None:
    for keeps_whole, rest in ((True, S.WHOLE), (False, S.FREE)):
        group = ShardGroup("g", keeps_whole=keeps_whole)
        group.state = S.REDUCING
        group.settle()
        assert group.state is rest


def test_the_modules_document_themselves() -> None:
    for module in (_shard_group, _transfers):
        assert module.__doc__ and "::" in module.__doc__


def test_transfers_in_a_world_of_one_complete_at_once_with_the_local_result(world: object) -> None:
    comm = _transfers.Comm(world, "test")  # type: ignore[arg-type]
    send, whole = torch.arange(4.0), torch.zeros(4)
    request = _transfers.post_gather(comm, send, whole)
    assert request.test() and _transfers.finish(comm, request) is whole and whole.equal(send)
    tail = torch.ones(2)
    chunk = _transfers.finish(comm, _transfers.post_reduce_scatter(comm, send, tail))
    assert chunk is send and tail.equal(torch.ones(2)), "one rank's sum is its own gradient and presence"
    buf = torch.arange(3.0)
    assert _transfers.finish(comm, _transfers.post_broadcast(comm, buf, 0)) is buf


def test_land_adds_each_part_into_its_shards_grad_and_skips_what_no_rank_had(world: object) -> None:
    shards = []
    for name, m in (("a", 3), ("b", 2), ("c", 1)):
        spec = ShardSpec(name, torch.Size([m]), "", None, 0, m, ((0, m),))
        shards.append(ShardedTensor(torch.zeros(m), spec, requires_grad=True))
    chunk = torch.arange(6.0)
    parts = [(0, 3), (3, 5), (5, 6)]
    landed = _transfers.land(shards, parts, chunk, [1.0, 0.0, 1.0])
    assert landed[1] is None and shards[1].grad is None, "a gradient no rank had stays None"
    assert shards[0].grad.to_local().equal(chunk[:3]) and shards[2].grad.to_local().equal(chunk[5:])
    assert shards[0].grad.to_local().data_ptr() == chunk.data_ptr(), "landed as a view of the chunk, no copy"
    again = torch.arange(6.0)  # a second backward before the step: a fresh reduced chunk, added
    _transfers.land(shards, parts, again, [1.0, 1.0, 1.0])
    assert shards[0].grad.to_local().equal(torch.tensor([0.0, 2.0, 4.0])) and shards[1].grad.to_local().equal(again[3:5])
