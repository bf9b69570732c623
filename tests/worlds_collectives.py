"""Test bodies run on every rank of a world (imported by the rank processes).

Each body runs many named behaviours (``behaviours.Behaviours``) against a NumPy
reference and reports each by name, so one failure does not hide the others.
The inputs are deterministic functions of the rank, so every rank can compute
what every other rank sent and therefore the expected result.
"""

from __future__ import annotations

import numpy as np

import phalanx
from behaviours import Behaviours
from helpers import raises

NUMPY_DTYPES = ["float16", "float32", "float64", "int32", "int64", "bool"]
TORCH_DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"]
OPS_FOR = {
    "bool": ["min", "max"],
    "int32": ["sum", "prod", "min", "max"],
    "int64": ["sum", "prod", "min", "max"],
}
FLOAT_OPS = ["sum", "prod", "min", "max", "avg"]


def rank_input(rank: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Rank ``rank``'s input as float64 (small integers: exact in every dtype, even bf16 products)."""
    k = int(np.prod(shape))
    if dtype == "bool":
        return ((np.arange(k) + rank) % 2 == 0).reshape(shape).astype(np.float64)
    return ((np.arange(k) + rank) % 3 + 1).reshape(shape).astype(np.float64)


def reference(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    stack = np.stack(arrays)
    return {"sum": stack.sum(0), "prod": stack.prod(0), "min": stack.min(0), "max": stack.max(0),
            "avg": stack.mean(0)}[op]


def make(kind: str, values: np.ndarray, dtype: str):
    if kind == "numpy":
        return values.astype(dtype)
    import torch

    return torch.tensor(values, dtype=getattr(torch, dtype))


def to_f64(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    return x.detach().to("cpu").double().numpy()


def close(got, want: np.ndarray, dtype: str, what: str) -> None:
    tol = {"float16": 2e-3, "bfloat16": 1e-2}.get(dtype, 1e-6)
    got64 = to_f64(got)
    assert got64.shape == want.shape, f"{what}: shape {got64.shape} != {want.shape}"
    if dtype in ("int32", "int64", "bool"):
        assert np.array_equal(got64, want), f"{what}: {got64.tolist()} != {want.tolist()}"
    else:
        assert np.allclose(got64, want, rtol=tol, atol=tol), f"{what}: {got64.tolist()} != {want.tolist()}"


def same_type(got, sent, what: str) -> None:
    assert type(got) is type(sent), f"{what}: returned {type(got)} for a {type(sent)}"
    assert got.dtype == sent.dtype, f"{what}: returned dtype {got.dtype} for {sent.dtype}"


COLLECTIVES = Behaviours()
CASES = [("numpy", d) for d in NUMPY_DTYPES] + [("torch", d) for d in TORCH_DTYPES]
SHAPE = (2, 3)


def _inputs(r: int, n: int, dtype: str) -> tuple[np.ndarray, list[np.ndarray]]:
    return rank_input(r, SHAPE, dtype), [rank_input(q, SHAPE, dtype) for q in range(n)]


def _want(op: str, arrays: list[np.ndarray], dtype: str) -> np.ndarray:
    want = reference(op, arrays)
    return want.astype(bool).astype(np.float64) if dtype == "bool" else want


def _allreduce(r: int, n: int, kind: str, dtype: str) -> None:
    mine, everyone = _inputs(r, n, dtype)
    for op in OPS_FOR.get(dtype, FLOAT_OPS):
        x = make(kind, mine, dtype)
        out = phalanx.allreduce(x, op=op)
        want = _want(op, everyone, dtype)
        close(out, want, dtype, f"allreduce {kind} {dtype} {op}")
        close(x, want, dtype, f"allreduce {kind} {dtype} {op} (in place)")
        same_type(out, x, f"allreduce {kind} {dtype}")


def _reduce(r: int, n: int, kind: str, dtype: str) -> None:
    mine, everyone = _inputs(r, n, dtype)
    root = n - 1
    for op in OPS_FOR.get(dtype, FLOAT_OPS):
        out = phalanx.reduce(make(kind, mine, dtype), op=op, root=root)
        close(out, _want(op, everyone, dtype) if r == root else mine, dtype,
              f"reduce {kind} {dtype} {op} root={root}")


def _iallreduce(r: int, n: int, kind: str, dtype: str) -> None:
    mine, everyone = _inputs(r, n, dtype)
    for op in OPS_FOR.get(dtype, FLOAT_OPS):
        h = phalanx.iallreduce(make(kind, mine, dtype), op=op)
        close(h.wait(), _want(op, everyone, dtype), dtype, f"iallreduce {kind} {dtype} {op}")
        assert h.test(), "a completed handle must test() True"


def _reduce_scatter(r: int, n: int, kind: str, dtype: str) -> None:
    chunks = [np.concatenate([rank_input(q, SHAPE, dtype)] * n) for q in range(n)]  # first axis n*2
    for op in OPS_FOR.get(dtype, FLOAT_OPS):
        if op not in ("sum", "max", "avg") and dtype != "bool":
            continue
        x = make(kind, chunks[r], dtype)
        out = phalanx.reduce_scatter(x, op=op)
        close(out, _want(op, chunks, dtype)[r * 2:(r + 1) * 2], dtype, f"reduce_scatter {kind} {dtype} {op}")
        same_type(out, x, f"reduce_scatter {kind} {dtype}")


def _broadcast(r: int, n: int, kind: str, dtype: str) -> None:
    mine, everyone = _inputs(r, n, dtype)
    for root in range(n):
        x = make(kind, mine, dtype)
        out = phalanx.broadcast(x, root=root)
        close(out, everyone[root], dtype, f"broadcast {kind} {dtype} root={root}")
        close(x, everyone[root], dtype, f"broadcast {kind} {dtype} root={root} (in place)")


def _ibroadcast(r: int, n: int, kind: str, dtype: str) -> None:
    mine, everyone = _inputs(r, n, dtype)
    for root in range(n):
        out = phalanx.ibroadcast(make(kind, mine, dtype), root=root).wait()
        close(out, everyone[root], dtype, f"ibroadcast {kind} {dtype} root={root}")


def _gather(r: int, n: int, kind: str, dtype: str) -> None:
    mine, everyone = _inputs(r, n, dtype)
    for root in range(n):
        x = make(kind, mine, dtype)
        got = phalanx.gather(x, root=root)
        if r == root:
            close(got, np.stack(everyone), dtype, f"gather {kind} {dtype} root={root}")
            same_type(got, x, f"gather {kind} {dtype}")
        else:
            assert got is None, f"gather {kind} {dtype}: non-root rank got {got!r}, expected None"


def _allgather(r: int, n: int, kind: str, dtype: str) -> None:
    mine, everyone = _inputs(r, n, dtype)
    x = make(kind, mine, dtype)
    out = phalanx.allgather(x)
    close(out, np.stack(everyone), dtype, f"allgather {kind} {dtype}")
    same_type(out, x, f"allgather {kind} {dtype}")
    close(x, mine, dtype, f"allgather {kind} {dtype} leaves the input alone")


def _alltoall(r: int, n: int, kind: str, dtype: str) -> None:
    blocks = [np.concatenate([rank_input(q * 10 + j, (1, 3), dtype) for j in range(n)]) for q in range(n)]
    out = phalanx.alltoall(make(kind, blocks[r], dtype))
    close(out, np.concatenate([blocks[q][r:r + 1] for q in range(n)]), dtype, f"alltoall {kind} {dtype}")


for _kind, _dtype in CASES:
    for _name, _check in [("allreduce", _allreduce), ("reduce", _reduce), ("iallreduce", _iallreduce),
                          ("reduce_scatter", _reduce_scatter), ("broadcast", _broadcast),
                          ("ibroadcast", _ibroadcast), ("gather", _gather), ("allgather", _allgather),
                          ("alltoall", _alltoall)]:
        COLLECTIVES.add(f"{_name}-{_kind}-{_dtype}", _check, _kind, _dtype)


def collectives() -> dict[str, str | None]:
    """Every collective x container x dtype (each behaviour covering every op and root) against NumPy."""
    return COLLECTIVES.run(phalanx.rank(), phalanx.size())


SCALARS_AND_EDGES = Behaviours()
_scalar = SCALARS_AND_EDGES.behaviour


@_scalar("allreduce-of-int-returns-int")
def _(r: int, n: int) -> None:
    got = phalanx.allreduce(r)
    assert got == sum(range(n)) and type(got) is int, f"allreduce(int) -> {got!r}"


@_scalar("allreduce-avg-of-float-returns-float")
def _(r: int, n: int) -> None:
    got = phalanx.allreduce(float(r), op="avg")
    assert abs(got - sum(range(n)) / n) < 1e-12 and type(got) is float, f"allreduce(float, avg) -> {got!r}"


@_scalar("allreduce-of-numpy-scalar-keeps-its-type")
def _(r: int, n: int) -> None:
    got = phalanx.allreduce(np.float32(r + 1), op="max")
    assert got == n and isinstance(got, np.float32), f"allreduce(np.float32) -> {got!r}"


@_scalar("allreduce-max-of-bool-returns-bool")
def _(r: int, n: int) -> None:
    got = phalanx.allreduce(r == 0, op="max")
    assert got is True, f"allreduce(bool, max) -> {got!r}"


@_scalar("broadcast-of-float-returns-roots-value")
def _(r: int, n: int) -> None:
    got = phalanx.broadcast(3.5 if r == 0 else 0.0, root=0)
    assert got == 3.5 and type(got) is float, f"broadcast(float) -> {got!r}"


@_scalar("read-only-array-is-not-written")
def _(r: int, n: int) -> None:
    frozen = np.full(3, float(r + 1))
    frozen.setflags(write=False)
    out = phalanx.allreduce(frozen)
    assert np.array_equal(out, np.full(3, n * (n + 1) / 2)), out
    assert np.array_equal(frozen, np.full(3, r + 1.0)), frozen
    out = phalanx.broadcast(frozen, root=0)
    assert np.array_equal(out, np.ones(3)) and np.array_equal(frozen, np.full(3, r + 1.0)), (out, frozen)


@_scalar("empty-and-0d-arrays-work")
def _(r: int, n: int) -> None:
    empty = phalanx.allreduce(np.zeros(0, np.float32))
    assert empty.shape == (0,), empty.shape
    zero_d = phalanx.allreduce(np.array(2.0))
    assert zero_d.shape == () and float(zero_d) == 2.0 * n, zero_d
    assert phalanx.allgather(np.array(r)).tolist() == list(range(n))


@_scalar("barrier-returns")
def _(r: int, n: int) -> None:
    assert phalanx.barrier() is None


def scalars_and_edges() -> dict[str, str | None]:
    """Scalars keep their type; read-only arrays are not written; empty and 0-d arrays work."""
    return SCALARS_AND_EDGES.run(phalanx.rank(), phalanx.size())


MIXED = Behaviours()
_mixed = MIXED.behaviour


@_mixed("handles-waited-in-reverse-order-around-a-blocking-call")
def _(r: int, n: int, backend: str) -> None:
    import torch

    a = np.full(4, float(r))
    b = torch.full((8,), float(r + 1))
    c = np.full(2, float(10 * r), dtype=np.float32)
    ha, hb = phalanx.iallreduce(a), phalanx.iallreduce(b, op="max")
    hc = phalanx.ibroadcast(c, root=n - 1)
    mid = phalanx.allreduce(1)  # a blocking call while three handles are pending
    assert mid == n
    assert np.array_equal(hc.wait(), np.full(2, 10.0 * (n - 1), np.float32))
    assert torch.equal(hb.wait(), torch.full((8,), float(n)))
    assert np.array_equal(ha.wait(), np.full(4, float(sum(range(n)))))
    assert np.array_equal(a, np.full(4, float(sum(range(n))))), "iallreduce updates in place"


@_mixed("handles-tested-until-done-then-waited-in-reverse")
def _(r: int, n: int, backend: str) -> None:
    handles = [phalanx.iallreduce(np.full(3, float(i + r))) for i in range(5)]
    while not all(h.test() for h in handles):
        pass
    for i, h in enumerate(handles[::-1]):
        j = 4 - i
        assert np.array_equal(h.wait(), np.full(3, float(n * j + sum(range(n)))))


@_mixed("object-collectives-need-allow-pickle")
def _(r: int, n: int, backend: str) -> None:
    with raises(phalanx.PhalanxError, "broadcast_object without allow_pickle must raise") as raised:
        phalanx.broadcast_object({"a": 1})
    exc = raised.value
    assert "allow_pickle=True" in str(exc)


@_mixed("broadcast-object-carries-roots-value")
def _(r: int, n: int, backend: str) -> None:
    got = phalanx.broadcast_object({"from": r, "data": [1, 2]} if r == 0 else None, allow_pickle=True)
    assert got == {"from": 0, "data": [1, 2]}, got


@_mixed("allgather-object-gathers-every-ranks-value")
def _(r: int, n: int, backend: str) -> None:
    got = phalanx.allgather_object(("rank", r), allow_pickle=True)
    assert got == [("rank", q) for q in range(n)], got


@_mixed("rank-size-and-backend-are-the-launched-worlds")
def _(r: int, n: int, backend: str) -> None:
    assert phalanx.size() == n and phalanx.backend().name == backend, (phalanx.size(), phalanx.backend().name)
    ranks = phalanx.allgather(np.int64(r)).tolist()
    assert ranks == list(range(n)), f"ranks {ranks}"
    assert phalanx.initialized() and phalanx.init() is phalanx.backend()
    assert (phalanx.local_rank(), phalanx.local_size()) == (r, n), "one node"


@_mixed("print-prefixes-every-line-with-rank-and-size")
def _(r: int, n: int, backend: str) -> None:
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        phalanx.print("hello\nworld")
    assert buf.getvalue() == f"[{r}/{n}] hello\n[{r}/{n}] world\n", repr(buf.getvalue())


@_mixed("setup-logging-logs-on-rank-0-unless-all-ranks")
def _(r: int, n: int, backend: str) -> None:
    import io
    import logging

    stream = io.StringIO()
    logger = logging.getLogger(f"phalanx-test-{r}")
    handler = phalanx.setup_logging(logging.INFO, logger=logger, fmt="%(rank)d/%(size)d %(message)s")
    handler.setStream(stream)
    logger.info("from every rank?")
    logger.info("opted in", extra={"all_ranks": True})
    expected = f"{r}/{n} opted in\n" if r else f"0/{n} from every rank?\n0/{n} opted in\n"
    assert stream.getvalue() == expected, repr(stream.getvalue())


def mixed(backend: str, n: int) -> dict[str, str | None]:
    """Handles in flight, object collectives, and what a rank knows about itself (``backend``/``n``:
    the world the test asked for)."""
    return MIXED.run(phalanx.rank(), n, backend)
