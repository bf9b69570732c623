"""Body for the sharding collectives: the backends' ireduce_scatter/iallgather_into, and
phalanx.reduce_scatter/allgather with ``counts=`` (unequal shards, a zero among them) and ``out=``.

Inputs are deterministic functions of the rank, so every rank computes every result itself.
"""

from __future__ import annotations

import numpy as np

import phalanx
from behaviours import Behaviours
from helpers import raises as _raises_block
from phalanx._world import current
from worlds_collectives import FLOAT_OPS, close, reference

SHARD = Behaviours()
ROWS = 3  # columns of every 2-D input


def _counts(n: int) -> list[int]:
    """Unequal, odd counts with a zero on every world of more than one rank: [3], [3, 0], [3, 0, 5]."""
    return [0 if i == 1 else 2 * i + 3 for i in range(n)]


def _input(rank: int, rows: int) -> np.ndarray:
    return ((np.arange(rows * ROWS) + rank) % 5 + 1).reshape(rows, ROWS).astype(np.float64)


def raises(kind, fn, *args, match: str, **kwargs) -> None:
    """``fn(*args, **kwargs)`` raises ``kind`` with ``match`` in its message."""
    with _raises_block(kind, f"{fn.__name__}{args} {kwargs} was accepted", match=match):
        fn(*args, **kwargs)


def _backend():
    return current("test").backend


def _kinds(backend: str):
    import torch

    kinds = [("torch", d) for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)]
    if backend in ("mpi", "local"):
        kinds += [("numpy", np.float32), ("numpy", np.float64)]
    return kinds


def _make(kind, dtype, values: np.ndarray):
    if kind == "numpy":
        return values.astype(dtype)
    import torch

    if isinstance(dtype, torch.dtype):
        return torch.tensor(values).to(dtype)
    return torch.from_numpy(values.astype(dtype))


@SHARD.behaviour("backend-ireduce-scatter-returns-this-ranks-chunk-for-every-op-and-dtype")
def _(r, n, backend):
    b, k = _backend(), 5
    for kind, dtype in _kinds(backend):
        for op in FLOAT_OPS:
            x = _make(kind, dtype, _input(r, n * k)[:, 0] % 3 + 1)
            before = x.clone() if kind == "torch" else x.copy()
            got = b.ireduce_scatter(x, op).wait(30)
            want = reference(op, [_input(q, n * k)[:, 0] % 3 + 1 for q in range(n)])[r * k:(r + 1) * k]
            assert type(got) is type(x) and got.dtype == x.dtype and tuple(got.shape) == (k,), (kind, dtype, op)
            close(got, want, str(dtype).removeprefix("torch."), f"{kind} {dtype} {op}")
            if backend != "gloo":  # gloo reduces the bucket in place: x is undefined afterwards there
                assert (before == x).all(), f"{kind} {dtype} {op}: x was written"


@SHARD.behaviour("backend-ireduce-scatter-of-large-16-bit-floats-sums-in-float32")
def _(r, n, backend):
    import torch

    b, k = _backend(), 40_001  # from 64 KiB MPI moves the 16-bit words and phalanx adds them
    base = (np.arange(n * k) % 7 + r) / 8  # exact in 16 bits; the sums need float32
    for kind, dtype in [("torch", torch.bfloat16), ("torch", torch.float16), ("numpy", np.float16)]:
        if kind == "numpy" and backend not in ("mpi", "local"):
            continue
        for op in ("sum", "avg"):
            got = b.ireduce_scatter(_make(kind, dtype, base), op).wait(30)
            parts = [np.asarray(_make(kind, dtype, (np.arange(n * k) % 7 + q) / 8).float()
                                if kind == "torch" else (np.arange(n * k) % 7 + q) / 8) for q in range(n)]
            want = reference(op, [np.asarray(p, np.float64) for p in parts])[r * k:(r + 1) * k]
            assert got.dtype == _make(kind, dtype, base[:1]).dtype and tuple(got.shape) == (k,)
            close(got, want, str(dtype).removeprefix("torch."), f"{kind} {dtype} {op}")


@SHARD.behaviour("backend-iallgather-into-writes-rank-r-at-r-times-k-and-returns-out")
def _(r, n, backend):
    b, k = _backend(), 7
    for kind, dtype in _kinds(backend):
        x = _make(kind, dtype, _input(r, k)[:, 0])
        out = _make(kind, dtype, np.zeros(n * k))
        got = b.iallgather_into(x, out).wait(30)
        assert got is out, f"{kind} {dtype}: the result is not out"
        want = np.concatenate([_input(q, k)[:, 0] for q in range(n)])
        close(out, want, str(dtype).removeprefix("torch."), f"{kind} {dtype}")


@SHARD.behaviour("backend-requests-overlap-in-posting-order")
def _(r, n, backend):
    import torch

    b, k = _backend(), 4
    x = torch.arange(n * k, dtype=torch.float64) + r
    out = torch.empty(n * k, dtype=torch.float64)
    first = b.ireduce_scatter(x, "sum")
    second = b.iallgather_into(torch.full((k,), float(r), dtype=torch.float64), out)
    mine = first.wait(30)
    second.wait(30)
    assert mine.tolist() == [float(sum(range(n)) + n * i) for i in range(r * k, (r + 1) * k)]
    assert out.tolist() == [float(q) for q in range(n) for _ in range(k)]


def _reduce_scatter_counts(r, n, kind, counts):
    total = sum(counts)
    x = _make(kind, np.float64, _input(r, total))
    got = phalanx.reduce_scatter(x, "sum", counts=counts)
    start = sum(counts[:r])
    want = reference("sum", [_input(q, total) for q in range(n)])[start:start + counts[r]]
    assert type(got) is type(x), type(got)
    close(got, want, "float64", f"{kind} counts={counts}")


@SHARD.behaviour("reduce-scatter-with-unequal-counts-and-a-zero-gives-each-rank-its-rows")
def _(r, n, backend):
    kinds = ["torch"] + (["numpy"] if backend != "nccl" else [])
    for kind in kinds:
        _reduce_scatter_counts(r, n, kind, _counts(n))
        _reduce_scatter_counts(r, n, kind, [2] * n)  # equal counts: no padding
        _reduce_scatter_counts(r, n, kind, [0] * n)  # nothing at all


@SHARD.behaviour("reduce-scatter-counts-every-op")
def _(r, n, backend):
    counts = _counts(n)
    for op in FLOAT_OPS:
        got = phalanx.reduce_scatter(np.ascontiguousarray(_input(r, sum(counts))), op, counts=counts)
        start = sum(counts[:r])
        close(got, reference(op, [_input(q, sum(counts)) for q in range(n)])[start:start + counts[r]],
              "float64", op)


@SHARD.behaviour("allgather-with-counts-concatenates-unequal-shards")
def _(r, n, backend):
    import torch

    counts = _counts(n)
    want = np.concatenate([_input(q, c) for q, c in enumerate(counts)])
    for x in (_input(r, counts[r]), torch.tensor(_input(r, counts[r]))):
        got = phalanx.allgather(x, counts=counts)
        assert type(got) is type(x) and tuple(got.shape) == (sum(counts), ROWS), tuple(got.shape)
        close(got, want, "float64", type(x).__name__)
    got = phalanx.allgather(np.full(2, float(r)), counts=[2] * n)  # equal counts: no padding
    assert got.tolist() == [float(q) for q in range(n) for _ in range(2)]


@SHARD.behaviour("out-is-written-and-returned")
def _(r, n, backend):
    import torch

    counts = _counts(n)
    total = sum(counts)
    out = torch.empty(counts[r], ROWS, dtype=torch.float64)
    got = phalanx.reduce_scatter(torch.tensor(_input(r, total)), counts=counts, out=out)
    start = sum(counts[:r])
    assert got is out
    close(out, reference("sum", [_input(q, total) for q in range(n)])[start:start + counts[r]], "float64", "rs")
    out = np.empty((total, ROWS))
    assert phalanx.allgather(_input(r, counts[r]), counts=counts, out=out) is out
    close(out, np.concatenate([_input(q, c) for q, c in enumerate(counts)]), "float64", "ag counts")
    out = np.empty((n, 2))
    assert phalanx.allgather(np.full(2, float(r)), out=out) is out
    assert out.tolist() == [[float(q)] * 2 for q in range(n)]
    out = np.empty((2, ROWS))
    assert phalanx.reduce_scatter(np.ones((2 * n, ROWS)), out=out) is out and (out == n).all()


@SHARD.behaviour("bad-counts-and-out-raise-naming-the-call-and-the-fix")
def _(r, n, backend):
    import torch

    x = np.ones((n + 1, 2))
    raises(phalanx.InvalidArgumentError, phalanx.reduce_scatter, x, counts=[1] * (n + 1),
           match=r"phalanx.reduce_scatter\(counts=.*one count per rank")
    raises(phalanx.InvalidArgumentError, phalanx.reduce_scatter, x, counts=[-1] + [1] * (n - 1),
           match="non-negative int")
    raises(phalanx.InvalidArgumentError, phalanx.reduce_scatter, x, counts=[1] * n,
           match="must sum to x.shape")
    raises(phalanx.InvalidArgumentError, phalanx.reduce_scatter, x, counts=5, match="sequence of ints")
    raises(phalanx.UnsupportedArgumentError, phalanx.reduce_scatter, np.float64(1.0), counts=[1] * n,
           match="a scalar has none")
    raises(phalanx.InvalidArgumentError, phalanx.allgather, np.ones((r + 2, 2)), counts=[1] * n,
           match=r"phalanx.allgather\(counts=.*counts\[rank\] rows")
    raises(phalanx.InvalidArgumentError, phalanx.allgather, np.ones(2), out=np.empty((n, 3)),
           match=r"phalanx.allgather\(out=...\): out has shape")
    raises(phalanx.InvalidArgumentError, phalanx.allgather, np.ones(2), out=np.empty((n, 2), np.float32),
           match="dtype")
    raises(phalanx.UnsupportedArgumentError, phalanx.reduce_scatter, torch.ones(n), out=np.empty(1),
           match="pass a torch tensor")


@SHARD.behaviour("ranks-passing-different-counts-get-collective-mismatch")
def _(r, n, backend):
    if n == 1:
        return
    counts = [2 if q == r else 1 for q in range(n)]  # each rank owns more rows in its own view
    raises(phalanx.CollectiveMismatchError, phalanx.reduce_scatter, np.ones(n + 1), counts=counts,
           match="counts=")
    raises(phalanx.CollectiveMismatchError, phalanx.allgather, np.ones(counts[r]), counts=counts,
           match="counts=")
    assert phalanx.allreduce(np.ones(1))[0] == n  # the world still works


@SHARD.behaviour("step-and-group-work-with-counts")
def _(r, n, backend):
    counts = _counts(n)
    got = phalanx.allgather(_input(r, counts[r]), counts=counts, step=7)
    assert got.shape == (sum(counts), ROWS)
    group = phalanx.new_group(list(range(n)))
    got = phalanx.reduce_scatter(np.ones((sum(counts), 1)), counts=counts, group=group)
    assert got.shape == (counts[r], 1) and (got == n).all()


@SHARD.behaviour("jax-arrays-take-counts-and-refuse-out")
def _(r, n, backend):
    if backend != "mpi" or n != 3:  # one world is enough: importing jax costs seconds per rank
        return
    import importlib.util

    if importlib.util.find_spec("jax") is None:  # an environment without JAX (the Open MPI one)
        return
    import jax.numpy as jnp

    import phalanx.jax as px

    counts = _counts(n)
    got = px.reduce_scatter(jnp.asarray(_input(r, sum(counts)), jnp.float32), counts=counts)
    start = sum(counts[:r])
    close(np.asarray(got), reference("sum", [_input(q, sum(counts)) for q in range(n)])[start:start + counts[r]],
          "float32", "jax reduce_scatter")
    got = px.allgather(jnp.asarray(_input(r, counts[r]), jnp.float32), counts=counts)
    close(np.asarray(got), np.concatenate([_input(q, c) for q, c in enumerate(counts)]), "float32", "jax allgather")
    raises(phalanx.UnsupportedArgumentError, px.allgather, jnp.ones(2), out=jnp.zeros((n, 2)),
           match="JAX arrays are immutable")


def shard(backend: str, n: int) -> dict[str, str | None]:
    return SHARD.run(phalanx.rank(), n, backend)
