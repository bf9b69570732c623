"""Rank bodies for the sub-world tests: ``phalanx.new_group`` and ``group=`` on every collective.

The groups of a world of ``n`` ranks: the even world ranks, the odd ones (when
there are any) and all of them; at 3 ranks that is ``[0, 2]``, ``[1]`` and
``[0, 1, 2]``. Every result is compared with a NumPy reference computed from
the members' world ranks.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import phalanx
from behaviours import Behaviours
from helpers import raises

GROUPS = Behaviours()


def _layouts(n: int) -> list[list[int]]:
    odd = [r for r in range(n) if r % 2]
    return [[r for r in range(n) if r % 2 == 0], *([odd] if odd else []), list(range(n))]


def _mine(n: int) -> list[int]:
    """The members of this rank's parity group (even or odd world ranks)."""
    r = phalanx.rank()
    return [q for q in range(n) if q % 2 == r % 2]


def _my_parity_group(n: int) -> phalanx.Group:
    """Make the even and the odd group (every rank makes both, in order); return this rank's."""
    made = [phalanx.new_group([q for q in range(n) if q % 2 == parity]) for parity in (0, 1) if parity < n]
    return made[phalanx.rank() % 2]


def _data(w: int, k: int) -> np.ndarray:
    """World rank ``w``'s input: ``k`` rows of 2, distinct per rank."""
    return (np.arange(2 * k, dtype=np.float64) + 10.0 * w).reshape(k, 2)


def _check_every_collective(g: phalanx.Group) -> None:
    """Every collective on ``g`` (a member's view) against NumPy, roots as group ranks."""
    w, m, k = phalanx.rank(), list(g.ranks), g.size
    inputs = [_data(q, k) for q in m]
    last = k - 1  # the group rank used as root: world rank m[-1]
    assert np.array_equal(phalanx.allreduce(_data(w, k), group=g), sum(inputs))
    assert np.array_equal(phalanx.allreduce(_data(w, k), op="max", group=g), np.maximum.reduce(inputs))
    assert np.allclose(phalanx.allreduce(_data(w, k), op="avg", group=g), sum(inputs) / k)
    assert phalanx.allreduce(w, group=g) == sum(m), "a scalar over the group"
    assert np.array_equal(phalanx.broadcast(_data(w, k), root=last, group=g), inputs[last])
    reduced = phalanx.reduce(_data(w, k), root=last, group=g)
    assert np.array_equal(reduced, sum(inputs) if g.rank == last else _data(w, k))
    assert np.array_equal(phalanx.allgather(_data(w, k), group=g), np.stack(inputs))
    gathered = phalanx.gather(_data(w, k), root=last, group=g)
    assert (gathered is None) if g.rank != last else np.array_equal(gathered, np.stack(inputs))
    total = sum(inputs)
    assert np.array_equal(phalanx.reduce_scatter(_data(w, k), group=g), total[g.rank:g.rank + 1])
    assert np.array_equal(phalanx.alltoall(_data(w, k), group=g),
                          np.stack([inputs[j][g.rank] for j in range(k)]))
    phalanx.barrier(group=g)
    assert phalanx.broadcast_object({"from": w}, root=last, group=g, allow_pickle=True) == {"from": m[last]}
    assert phalanx.allgather_object(("rank", w), group=g, allow_pickle=True) == [("rank", q) for q in m]
    first = phalanx.iallreduce(_data(w, k), group=g)
    second = phalanx.ibroadcast(_data(w, k), root=last, group=g)
    assert np.array_equal(second.wait(), inputs[last]) and np.array_equal(first.wait(), total)
    state = phalanx.synchronize({"x": _data(w, k), "step": w}, root=last, group=g)
    assert np.array_equal(state["x"], inputs[last]) and state["step"] == m[last]
    grads = phalanx.allreduce_gradients([_data(w, k)], group=g)
    assert np.allclose(grads[0], total / k)
    import torch

    half = phalanx.allreduce(torch.from_numpy(_data(w, k)).half(), group=g)  # 16-bit paths (MPI: halfsum)
    assert half.dtype == torch.float16 and torch.equal(half, torch.from_numpy(total).half())
    assert torch.equal(phalanx.broadcast(torch.full((3,), float(w)), root=last, group=g),
                       torch.full((3,), float(m[last])))


def _check_layout(n: int, i: int) -> None:
    g = phalanx.new_group(_layouts(n)[i])
    assert g.ranks == tuple(_layouts(n)[i]) and g.size == len(g.ranks)
    assert g.member == (phalanx.rank() in g.ranks)
    assert g.rank == (g.ranks.index(phalanx.rank()) if g.member else None)
    if g.member:
        _check_every_collective(g)
    phalanx.barrier()  # the world lines up again, whoever was in the group


for _i, _name in enumerate(["even-ranks", "odd-ranks-or-all", "all-ranks"]):
    GROUPS.add(f"every-collective-on-a-group-of-{_name}-matches-numpy-with-roots-as-group-ranks",
               lambda n, i=_i: _check_layout(n, i) if i < len(_layouts(n)) else None)


@GROUPS.behaviour("world-group-is-the-whole-world")
def _(n: int) -> None:
    g = phalanx.world_group()
    assert g is phalanx.world_group() and g.ranks == tuple(range(n)) and g.rank == phalanx.rank()
    assert phalanx.allreduce(phalanx.rank(), group=g) == sum(range(n))


@GROUPS.behaviour("disjoint-groups-run-concurrently-with-different-numbers-of-calls")
def _(n: int) -> None:
    mine = _my_parity_group(n)
    calls = 3 if phalanx.rank() % 2 == 0 else 7
    for step in range(calls):
        got = phalanx.allreduce(np.full(3, float(step + phalanx.rank())), group=mine, step=step)
        assert np.array_equal(got, np.full(3, float(sum(step + q for q in _mine(n))))), got
    assert phalanx.allreduce(1) == n, "the world call after both groups' calls"


@GROUPS.behaviour("group-calls-interleave-with-world-calls")
def _(n: int) -> None:
    g = _my_parity_group(n)
    for _ in range(3):
        assert phalanx.allreduce(1, group=g) == len(_mine(n))
        assert phalanx.allreduce(1) == n
    pending = phalanx.iallreduce(np.ones(2), group=g)
    assert phalanx.allreduce(2) == 2 * n
    assert np.array_equal(pending.wait(), np.full(2, float(len(_mine(n)))))


@GROUPS.behaviour("nested-groups-made-while-others-live-work-side-by-side")
def _(n: int) -> None:
    outer = phalanx.new_group(range(n))
    inner = phalanx.new_group([r for r in range(n) if r % 2 == 0])
    innermost = phalanx.new_group([0])
    pending = phalanx.iallreduce(np.ones(2), group=outer)
    if inner.member:
        assert phalanx.allreduce(1, group=inner) == len(inner.ranks)
    if innermost.member:
        assert phalanx.broadcast(np.array([5.0]), root=0, group=innermost)[0] == 5.0
    assert np.array_equal(pending.wait(), np.full(2, float(n)))
    assert phalanx.allreduce(1, group=outer) == n


@GROUPS.behaviour("a-root-outside-the-group-is-refused-naming-the-group")
def _(n: int) -> None:
    g = _my_parity_group(n)
    with raises(phalanx.InvalidArgumentError, "a root past the group's size was accepted") as raised:
        phalanx.broadcast(np.ones(1), root=g.size, group=g)
    exc = raised.value
    assert "not a rank of this group" in str(exc) and f"0..{g.size - 1}" in str(exc), str(exc)


@GROUPS.behaviour("a-non-member-call-raises-naming-the-call-the-group-and-this-rank")
def _(n: int) -> None:
    r = phalanx.rank()
    if n == 1:
        return
    made = [phalanx.new_group([x for x in range(n) if x != q]) for q in range(n)]  # every rank, in order
    outside = made[r]
    assert not outside.member and outside.rank is None
    for call, args in (("allreduce", (1,)), ("barrier", ()), ("iallreduce", (np.ones(1),))):
        with raises(phalanx.NotInGroupError, f"{call} on a group without this rank did not raise") as raised:
            getattr(phalanx, call)(*args, group=outside)
        exc = raised.value
        text = str(exc)
        assert isinstance(exc, phalanx.UsageError)
        assert f"phalanx.{call}(group=" in text and f"world rank {r}" in text, text
        assert str(list(outside.ranks)) in text and "if group.member" in text, text


@GROUPS.behaviour("a-mismatch-inside-a-group-raises-on-its-members-only-naming-world-ranks")
def _(n: int) -> None:
    ranks = [r for r in range(n) if r % 2 == 0] if n >= 3 else list(range(n))
    g = phalanx.new_group(ranks)
    if g.member and g.size > 1:
        shape = 3 if g.rank == g.size - 1 else 2
        with raises(phalanx.CollectiveMismatchError, "the mismatch was not caught") as raised:
            phalanx.allreduce(np.ones(shape), group=g)
        exc = raised.value
        text = str(exc)
        assert f"in group {ranks}" in text and "buffer differs" in text, text
        assert f"group rank {g.size - 1} = world rank {ranks[-1]}" in text, text
        assert phalanx.allreduce(1, group=g) == g.size, "the group is usable after a mismatch"
    assert phalanx.allreduce(1) == n, "the non-members were never involved; the world lines up"


@GROUPS.behaviour("new-group-with-different-ranks-raises-a-mismatch-on-every-rank")
def _(n: int) -> None:
    if n == 1:
        return
    with raises(phalanx.CollectiveMismatchError, "different ranks lists made a group") as raised:
        phalanx.new_group([0] if phalanx.rank() == 0 else [0, 1])
    exc = raised.value
    assert "passed different groups" in str(exc) and "rank 0: phalanx.new_group([0])" in str(exc), str(exc)
    assert phalanx.allreduce(1) == n


@GROUPS.behaviour("invalid-ranks-raise-on-every-rank-and-the-world-stays-usable")
def _(n: int) -> None:
    for bad in ([n], [], [0, 0], "01", [True]):
        with raises(phalanx.InvalidArgumentError, f"new_group({bad!r}) was accepted") as raised:
            phalanx.new_group(bad)
        exc = raised.value
        assert "phalanx.new_group(ranks=" in str(exc), str(exc)
    assert phalanx.allreduce(1) == n


@GROUPS.behaviour("destroy-group-then-use-raises-and-destroying-twice-does-nothing")
def _(n: int) -> None:
    g = phalanx.new_group(range(n))
    assert phalanx.allreduce(1, group=g) == n
    phalanx.destroy_group(g)
    phalanx.destroy_group(g)
    with raises(phalanx.UsageError, "a destroyed group was usable") as raised:
        phalanx.allreduce(1, group=g)
    exc = raised.value
    assert "destroyed" in str(exc) and "phalanx.new_group" in str(exc), str(exc)
    with raises(phalanx.InvalidArgumentError, "the world's own group was destroyed") as raised:
        phalanx.destroy_group(phalanx.world_group())
    exc = raised.value
    assert "phalanx.shutdown()" in str(exc), str(exc)
    assert phalanx.allreduce(1) == n


def _model(torch: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _batch(torch: Any, w: int) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(100 + w)
    return torch.randn(5, 3, generator=gen), torch.randn(5, 1, generator=gen)


def _reference_grads(torch: Any, members: list[int], seed: int) -> list[Any]:
    """The mean over ``members`` of each one's gradients, from group rank 0's parameters."""
    per_rank = []
    for q in members:
        model = _model(torch, seed)
        x, y = _batch(torch, q)
        torch.nn.functional.mse_loss(model(x), y).backward()
        per_rank.append([p.grad.clone() for p in model.parameters()])
    return [sum(gs) / len(members) for gs in zip(*per_rank, strict=True)]


@GROUPS.behaviour("distributed-optimizer-with-group-reduces-only-in-the-group")
def _(n: int) -> None:
    import torch

    import phalanx.torch as pt

    r, members = phalanx.rank(), _mine(n)
    g = _my_parity_group(n)
    model = _model(torch, seed=1000 + r)  # group rank 0's parameters win (the broadcast)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), group=g)
    x, y = _batch(torch, r)
    torch.nn.functional.mse_loss(model(x), y).backward()
    expected = _reference_grads(torch, members, seed=1000 + members[0])
    for p, want in zip(model.parameters(), expected, strict=True):
        assert torch.allclose(p.grad, want, atol=1e-6), (p.grad, want)
    opt.step()
    opt.close()
    wrapped = pt.DataParallel(_model(torch, seed=2000 + r), group=g)
    torch.nn.functional.mse_loss(wrapped(x), y).backward()
    expected = _reference_grads(torch, members, seed=2000 + members[0])
    for p, want in zip(wrapped.module.parameters(), expected, strict=True):
        assert torch.allclose(p.grad, want, atol=1e-6), (p.grad, want)
    wrapped.close()
    assert phalanx.allreduce(1) == n


def groups() -> dict[str, str | None]:
    return GROUPS.run(phalanx.size())


def member_never_comes() -> None:
    """Group [0, n-1]: world rank n-1 never makes the group's call; rank 0 must time out naming it."""
    r, n = phalanx.rank(), phalanx.size()
    g = phalanx.new_group([0, n - 1])
    phalanx.barrier()
    if r != 0:
        time.sleep(40)  # the missing member (and any non-member) is busy elsewhere
        return
    start = time.monotonic()
    with raises(phalanx.CollectiveTimeoutError, "the group's allreduce completed without its member") as caught:
        phalanx.allreduce(np.ones(4), group=g)
    raised = time.monotonic() - start
    error = caught.value
    try:
        phalanx.allreduce(1)
    except phalanx.WorldBrokenError:
        world = "broken"
    else:
        world = "usable"
    raise RuntimeError(f"rank {r}: TIMES raised={raised:.2f} | missing={error.missing_ranks} | world after it: "
                       f"{world} | {error}")
