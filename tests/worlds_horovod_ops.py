"""Rank bodies for the hvd collectives: each behaviour checks one function against a NumPy reference.

Every rank builds the same per-rank inputs (``_data(r)``), so each can compute what
every collective must return.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

import phalanx
import phalanx.horovod.torch as hvd
from behaviours import Behaviours
from helpers import raises
from phalanx.horovod.common.exceptions import (
    DuplicateNameError,
    HorovodInternalError,
    HorovodJoinedError,
    HorovodMismatchError,
    HorovodUnsupportedError,
)
from phalanx.horovod.torch._adasum import combine

OPS = Behaviours()


def _data(r: int, shape: tuple[int, ...] = (3, 2), dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = np.random.default_rng(100 + r)
    return torch.tensor(g.integers(-9, 10, size=shape), dtype=dtype)


def _all(n: int, **kw) -> np.ndarray:
    return np.stack([_data(q, **kw).numpy() for q in range(n)])


def _close(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    assert tuple(got.shape) == want.shape, f"{what}: shape {tuple(got.shape)} != {want.shape}"
    assert np.allclose(got.detach().numpy().astype(np.float64), want, atol=1e-6), f"{what}: {got} != {want}"


@OPS.behaviour("init-size-rank-local-cross-and-flags-tell-the-truth")
def _(r: int, n: int) -> None:
    assert hvd.is_initialized() and (hvd.size(), hvd.rank()) == (n, r)
    assert hvd.local_size() == n and hvd.local_rank() == r  # one host
    assert (hvd.cross_size(), hvd.cross_rank()) == (1, 0) and hvd.is_homogeneous()
    name = phalanx.backend().name
    assert hvd.mpi_enabled() == (name == "mpi") and hvd.gloo_enabled() == (name == "gloo")
    assert hvd.mpi_built() and hvd.gloo_built() and hvd.nccl_built() == 0 and not hvd.ddl_built()
    assert isinstance(hvd.nccl_built(), int) and not hvd.ccl_built() and not hvd.rocm_built()
    if name == "mpi":
        assert hvd.mpi_threads_supported() is True
    else:
        with raises(NotImplementedError, "mpi_threads_supported() off MPI did not raise"):
            hvd.mpi_threads_supported()


@OPS.behaviour("allreduce-averages-by-default-and-sums-mins-maxes-multiplies-with-op")
def _(r: int, n: int) -> None:
    x, every = _data(r), _all(n)
    _close(hvd.allreduce(x), every.mean(0), "default")
    _close(hvd.allreduce(x, op=hvd.Average), every.mean(0), "Average")
    _close(hvd.allreduce(x, op=hvd.Sum), every.sum(0), "Sum")
    _close(hvd.allreduce(x, op=hvd.Min), every.min(0), "Min")
    _close(hvd.allreduce(x, op=hvd.Max), every.max(0), "Max")
    _close(hvd.allreduce(x, op=hvd.Product), every.prod(0), "Product")
    assert torch.equal(x, _data(r)), "allreduce modified its input"


@OPS.behaviour("allreduce-average-of-integers-rounds-toward-zero-as-horovod")
def _(r: int, n: int) -> None:
    x = _data(r, dtype=torch.int64)
    got = hvd.allreduce(x)
    assert got.dtype == torch.int64
    total = _all(n).sum(0).astype(np.int64)
    _close(got, np.sign(total) * (np.abs(total) // n), "int Average")


@OPS.behaviour("prescale-and-postscale-multiply-before-and-after")
def _(r: int, n: int) -> None:
    got = hvd.allreduce(_data(r), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    _close(got, _all(n).sum(0) * 1.5, "scaled")


@OPS.behaviour("deprecated-average-argument-warns-and-picks-average-or-sum")
def _(r: int, n: int) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _close(hvd.allreduce(_data(r), average=False), _all(n).sum(0), "average=False")
        _close(hvd.allreduce(_data(r), average=True), _all(n).mean(0), "average=True")
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    with raises(ValueError, "op with average did not raise"):
        hvd.allreduce(_data(r), average=True, op=hvd.Sum)


@OPS.behaviour("in-place-allreduce-and-broadcast-write-the-input")
def _(r: int, n: int) -> None:
    x = _data(r)
    assert hvd.allreduce_(x, op=hvd.Sum) is x
    _close(x, _all(n).sum(0), "allreduce_")
    y = _data(r)
    assert hvd.broadcast_(y, root_rank=n - 1) is y
    _close(y, _all(n)[n - 1], "broadcast_")


@OPS.behaviour("allgather-concatenates-different-first-dimensions-in-rank-order")
def _(r: int, n: int) -> None:
    got = hvd.allgather(_data(r, shape=(r + 1, 2)))
    _close(got, np.concatenate([_data(q, shape=(q + 1, 2)).numpy() for q in range(n)]), "uneven")
    _close(hvd.allgather(_data(r)), np.concatenate(list(_all(n))), "even")
    empty = hvd.allgather(torch.zeros(0, 4))
    assert tuple(empty.shape) == (0, 4)


@OPS.behaviour("broadcast-from-every-root-returns-a-new-tensor")
def _(r: int, n: int) -> None:
    for root in range(n):
        x = _data(r)
        got = hvd.broadcast(x, root)
        _close(got, _all(n)[root], f"root {root}")
        assert torch.equal(x, _data(r))


@OPS.behaviour("alltoall-with-splits-returns-received-rows-and-splits")
def _(r: int, n: int) -> None:
    def sends(q: int) -> list[int]:
        return [(q + j) % 3 for j in range(n)]

    def rows(q: int) -> torch.Tensor:
        return _data(q, shape=(sum(sends(q)), 2))

    out, received = hvd.alltoall(rows(r), splits=sends(r))
    want = []
    for q in range(n):
        start = sum(sends(q)[:r])
        want.append(rows(q).numpy()[start:start + sends(q)[r]])
    _close(out, np.concatenate(want), "splits")
    assert received.dtype == torch.int32 and received.tolist() == [sends(q)[r] for q in range(n)]
    even = hvd.alltoall(_data(r, shape=(2 * n, 2)))  # no splits: equal parts, one tensor back
    _close(even, np.concatenate([_data(q, shape=(2 * n, 2)).numpy()[2 * r:2 * r + 2] for q in range(n)]), "even")


@OPS.behaviour("reducescatter-splits-uneven-first-dimension-as-horovod")
def _(r: int, n: int) -> None:
    for rows in (2 * n, 2 * n + 1, 1):
        every = _all(n, shape=(rows, 2))
        base, extra = divmod(rows, n)
        start = r * base + min(r, extra)
        mine = base + (r < extra)
        _close(hvd.reducescatter(_data(r, shape=(rows, 2)), op=hvd.Sum), every.sum(0)[start:start + mine],
               f"Sum {rows} rows")
        _close(hvd.reducescatter(_data(r, shape=(rows, 2))), every.mean(0)[start:start + mine],
               f"Average {rows} rows")
    with raises(HorovodUnsupportedError, "reducescatter(op=Max) did not raise a RuntimeError (as Horovod)"):
        hvd.reducescatter(_data(r), op=hvd.Max)


@OPS.behaviour("grouped-allreduce-allgather-reducescatter-match-one-by-one")
def _(r: int, n: int) -> None:
    xs = [_data(r), _data(r, shape=(4,), dtype=torch.float32), _data(r, shape=(2, 2), dtype=torch.int64)]
    got = hvd.grouped_allreduce(xs, op=hvd.Sum)
    for g, q in zip(got, xs, strict=True):
        assert g.dtype == q.dtype
        _close(g, np.stack([_data(p, shape=tuple(q.shape), dtype=q.dtype).numpy() for p in range(n)]).sum(0),
               "grouped")
    done = hvd.grouped_allreduce_(xs, op=hvd.Max)
    assert len(done) == len(xs) and all(d is q for d, q in zip(done, xs, strict=True)), "in place: returns tensors"
    for q in xs:
        _close(q, np.stack([_data(p, shape=tuple(q.shape), dtype=q.dtype).numpy() for p in range(n)]).max(0),
               "grouped_allreduce_ Max")
    gathered = hvd.grouped_allgather([_data(r, shape=(r + 1, 2)), _data(r)])
    _close(gathered[1], np.concatenate(list(_all(n))), "grouped_allgather")
    scattered = hvd.grouped_reducescatter([_data(r, shape=(n, 2))], op=hvd.Sum)
    _close(scattered[0], _all(n, shape=(n, 2)).sum(0)[r:r + 1], "grouped_reducescatter")


@OPS.behaviour("async-handles-poll-and-synchronize-return-the-results")
def _(r: int, n: int) -> None:
    x = _data(r)
    h1 = hvd.allreduce_async(x, name="h1", op=hvd.Sum)
    h2 = hvd.allreduce_async_(_data(r, dtype=torch.int64), name="h2")
    h3 = hvd.broadcast_async(x, root_rank=0, name="h3")
    h4 = hvd.alltoall_async(_data(r, shape=(n, 2)))
    h5 = hvd.allgather_async(_data(r, shape=(r + 1, 2)))
    assert len({h1, h2, h3, h4, h5}) == 5 and all(isinstance(h, int) for h in (h1, h2, h3, h4, h5))
    assert n == 1 or not hvd.poll(h1), "poll said done before any rank waited (operations run when one waits)"
    _close(hvd.synchronize(h3), _all(n)[0], "broadcast_async")
    assert hvd.poll(h1), "the wait on h3 ran every operation all ranks had submitted, h1 included"
    total = _all(n).sum(0).astype(np.int64)
    _close(hvd.synchronize(h2), np.sign(total) * (np.abs(total) // n), "allreduce_async_ int (rounded toward 0)")
    _close(hvd.synchronize(h1), _all(n).sum(0), "allreduce_async")
    out, received = hvd.synchronize(h4)
    assert received.tolist() == [1] * n
    assert hvd.synchronize(h5).shape[0] == n * (n + 1) // 2
    assert hvd.synchronize(h1) is None, "a synchronized handle is unknown afterwards (Horovod returns None)"


@OPS.behaviour("duplicate-name-in-flight-raises-horovods-value-error")
def _(r: int, n: int) -> None:
    h = hvd.allreduce_async(_data(r), name="dup")
    with raises(DuplicateNameError, "a duplicate name in flight did not raise") as raised:
        hvd.allreduce_async(_data(r), name="dup")
    exc = raised.value
    assert isinstance(exc, ValueError) and "dup" in str(exc)
    hvd.synchronize(h)
    hvd.synchronize(hvd.allreduce_async(_data(r), name="dup"))  # free again once synchronized


@OPS.behaviour("unknown-op-and-non-tensor-are-phalanx-errors-naming-the-call")
def _(r: int, n: int) -> None:
    for bad, kind in ((lambda: hvd.allreduce(_data(r), op=42), ValueError),
                      (lambda: hvd.allreduce([1.0]), TypeError),
                      (lambda: hvd.alltoall(_data(r), splits=[1] * (n + 1)), ValueError)):
        with raises(phalanx.PhalanxError, "no error") as raised:
            bad()
        exc = raised.value
        assert isinstance(exc, kind) and "hvd." in str(exc), exc


@OPS.behaviour("mismatched-shapes-raise-a-mismatch-error-horovod-users-catch-on-every-rank")
def _(r: int, n: int) -> None:
    if n == 1:
        return
    for call in (lambda: hvd.allreduce(_data(r, shape=(2 + r,))),
                 lambda: hvd.allgather(_data(r, shape=(2, 1 + r))),
                 lambda: hvd.reducescatter(_data(r, shape=(n + 1 + r, 2))),
                 lambda: hvd.allreduce(_data(r), name=f"name-{r}")):
        with raises(HorovodMismatchError, "the mismatch was not raised") as raised:
            call()
        exc = raised.value
        assert isinstance(exc, phalanx.CollectiveMismatchError) and isinstance(exc, HorovodInternalError)
        assert isinstance(exc, RuntimeError) and str(exc).startswith("hvd.")
    _close(hvd.allreduce(_data(r), op=hvd.Sum), _all(n).sum(0), "usable after the mismatches")


@OPS.behaviour("autograd-follows-horovods-backward-rules")
def _(r: int, n: int) -> None:
    x = _data(r).requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum) * (r + 1)).sum().backward()
    _close(x.grad, np.full((3, 2), sum(q + 1 for q in range(n))), "allreduce Sum")
    x = _data(r, shape=(r + 1, 2)).requires_grad_()
    (hvd.allgather(x) * (r + 1)).sum().backward()
    _close(x.grad, np.full((r + 1, 2), sum(q + 1 for q in range(n)) / n), "allgather: averaged")
    x = _data(r).requires_grad_()
    hvd.broadcast(x, root_rank=0).sum().backward()
    _close(x.grad, np.full((3, 2), 1.0 if r == 0 else 0.0), "broadcast: root only")
    x = _data(r, shape=(n, 2)).requires_grad_()
    out, _ = hvd.alltoall(x, splits=[1] * n)
    (out * torch.arange(n, dtype=out.dtype).view(n, 1)).sum().backward()
    _close(x.grad, np.full((n, 2), float(r)), "alltoall")
    x = _data(r, shape=(n, 2)).requires_grad_()
    hvd.reducescatter(x, op=hvd.Sum, postscale_factor=2.0).sum().backward()
    _close(x.grad, np.full((n, 2), 2.0 * n), "reducescatter (Sum: gathered gradient times the size, as Horovod)")


@OPS.behaviour("adasum-matches-the-numpy-pairwise-formula-and-refuses-non-powers-of-two")
def _(r: int, n: int) -> None:
    x = _data(r, shape=(5,))
    if n & (n - 1):
        with raises(HorovodUnsupportedError, "Adasum on a non-power-of-two size did not raise") as raised:
            hvd.allreduce(x, op=hvd.Adasum)
        exc = raised.value
        assert isinstance(exc, NotImplementedError)
        return
    vs = [v.astype(np.float64) for v in _all(n, shape=(5,))]
    while len(vs) > 1:
        nxt = []
        for a, b in zip(vs[::2], vs[1::2], strict=True):
            d = a @ b
            nxt.append((1 - d / (2 * (a @ a))) * a + (1 - d / (2 * (b @ b))) * b)
        vs = nxt
    _close(hvd.allreduce(x, op=hvd.Adasum), vs[0], "Adasum")
    a, b = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    assert np.allclose(combine([torch.tensor(a), torch.tensor(b)]).numpy(), a + b), "orthogonal: sum"
    assert np.allclose(combine([torch.tensor(a), torch.tensor(a)]).numpy(), a), "parallel: average"


@OPS.behaviour("global-process-set-and-process-set-argument")
def _(r: int, n: int) -> None:
    ps = hvd.global_process_set
    assert ps.process_set_id == 0 and ps.size() == n and ps.rank() == r and ps.included()
    assert ps.ranks == list(range(n))
    _close(hvd.allreduce(_data(r), op=hvd.Sum, process_set=ps), _all(n).sum(0), "process_set=global")
    if not hasattr(phalanx, "new_group"):
        return
    evens = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    if r % 2 == 0:
        members = list(range(0, n, 2))
        got = hvd.allreduce(_data(r), op=hvd.Sum, process_set=evens)
        _close(got, _all(n)[members].sum(0), "process set")
        _close(hvd.broadcast(_data(r), root_rank=members[-1], process_set=evens), _all(n)[members[-1]], "root")
        assert evens.rank() == members.index(r) and evens.size() == len(members)
    assert hvd.remove_process_set(evens) and not hvd.remove_process_set(hvd.global_process_set)


@OPS.behaviour("join-others-reduce-with-zeros-for-joined-and-last-joiner-is-returned")
def _(r: int, n: int) -> None:
    if n == 1:
        assert hvd.join() == 0
        return
    last = n - 1
    if r == last:
        returned = hvd.join()
    else:
        every = _all(n)
        every[last] = 0  # the joined rank contributes zeros
        _close(hvd.allreduce(_data(r)), every.sum(0) / n, "Average divides by size")
        _close(hvd.allreduce(_data(r), op=hvd.Sum, name="sum"), every.sum(0), "Sum")
        h = hvd.allreduce_async(_data(r), op=hvd.Sum)
        _close(hvd.synchronize(h), every.sum(0), "async")
        with raises(HorovodJoinedError, "allgather while a rank is joined did not raise") as raised:
            hvd.allgather(_data(r))
        exc = raised.value
        assert isinstance(exc, HorovodInternalError) and f"[{last}]" in str(exc)
        returned = hvd.join()
    # Ranks 0..n-2 join in the same exchange, after rank n-1: the highest of them is the last.
    assert returned == n - 2, f"join returned {returned}"
    _close(hvd.allreduce(_data(r), op=hvd.Sum), _all(n).sum(0), "after every rank joined")


def ops() -> dict[str, str | None]:
    hvd.init()
    return OPS.run(hvd.rank(), hvd.size())
