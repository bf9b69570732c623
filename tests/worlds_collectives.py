"""Test bodies run on every rank of a world (imported by the rank processes).

Each body checks many things against a NumPy reference and returns a small
summary; an AssertionError on any rank fails the world with every rank's output.
The inputs are deterministic functions of the rank, so every rank can compute
what every other rank sent and therefore the expected result.
"""

from __future__ import annotations

import numpy as np

import phalanx
from behaviours import Behaviours

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


def collectives() -> dict[str, int]:
    """Every collective x container x dtype x op against NumPy; returns counts of checks."""
    r, n = phalanx.rank(), phalanx.size()
    checks = 0
    cases = [("numpy", d) for d in NUMPY_DTYPES] + [("torch", d) for d in TORCH_DTYPES]
    shape = (2, 3)
    for kind, dtype in cases:
        mine = rank_input(r, shape, dtype)
        everyone = [rank_input(q, shape, dtype) for q in range(n)]
        label = f"{kind} {dtype}"
        for op in OPS_FOR.get(dtype, FLOAT_OPS):
            x = make(kind, mine, dtype)
            out = phalanx.allreduce(x, op=op)
            want = reference(op, everyone)
            if dtype == "bool":
                want = want.astype(bool).astype(np.float64)
            close(out, want, dtype, f"allreduce {label} {op}")
            close(x, want, dtype, f"allreduce {label} {op} (in place)")
            same_type(out, x, f"allreduce {label}")
            root = n - 1
            x = make(kind, mine, dtype)
            out = phalanx.reduce(x, op=op, root=root)
            close(out, want if r == root else mine, dtype, f"reduce {label} {op} root={root}")
            x = make(kind, mine, dtype)
            h = phalanx.iallreduce(x, op=op)
            close(h.wait(), want, dtype, f"iallreduce {label} {op}")
            assert h.test(), "a completed handle must test() True"
            checks += 4
            if op in ("sum", "max", "avg") or dtype == "bool":
                chunks = [np.concatenate([e] * n) for e in everyone]  # first axis n*2
                x = make(kind, chunks[r], dtype)
                out = phalanx.reduce_scatter(x, op=op)
                full = reference(op, chunks)
                if dtype == "bool":
                    full = full.astype(bool).astype(np.float64)
                close(out, full[r * 2:(r + 1) * 2], dtype, f"reduce_scatter {label} {op}")
                same_type(out, x, f"reduce_scatter {label}")
                checks += 1
        for root in range(n):
            x = make(kind, mine, dtype)
            out = phalanx.broadcast(x, root=root)
            close(out, everyone[root], dtype, f"broadcast {label} root={root}")
            close(x, everyone[root], dtype, f"broadcast {label} root={root} (in place)")
            out = phalanx.ibroadcast(make(kind, mine, dtype), root=root).wait()
            close(out, everyone[root], dtype, f"ibroadcast {label} root={root}")
            x = make(kind, mine, dtype)
            got = phalanx.gather(x, root=root)
            if r == root:
                close(got, np.stack(everyone), dtype, f"gather {label} root={root}")
                same_type(got, x, f"gather {label}")
            else:
                assert got is None, f"gather {label}: non-root rank got {got!r}, expected None"
            checks += 3
        x = make(kind, mine, dtype)
        out = phalanx.allgather(x)
        close(out, np.stack(everyone), dtype, f"allgather {label}")
        same_type(out, x, f"allgather {label}")
        close(x, mine, dtype, f"allgather {label} leaves the input alone")
        blocks = [np.concatenate([rank_input(q * 10 + j, (1, 3), dtype) for j in range(n)]) for q in range(n)]
        x = make(kind, blocks[r], dtype)
        out = phalanx.alltoall(x)
        close(out, np.concatenate([blocks[q][r:r + 1] for q in range(n)]), dtype, f"alltoall {label}")
        checks += 2
    return {"checks": checks}


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


def nonblocking_order() -> int:
    """Several handles in flight, waited in reverse order, mixed with blocking calls."""
    import torch

    r, n = phalanx.rank(), phalanx.size()
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
    handles = [phalanx.iallreduce(np.full(3, float(i + r))) for i in range(5)]
    while not all(h.test() for h in handles):
        pass
    for i, h in enumerate(handles[::-1]):
        j = 4 - i
        assert np.array_equal(h.wait(), np.full(3, float(n * j + sum(range(n)))))
    return 6


def objects() -> list:
    """Object collectives are opt-in, then carry any picklable value."""
    r = phalanx.rank()
    try:
        phalanx.broadcast_object({"a": 1})
    except phalanx.PhalanxError as exc:
        assert "allow_pickle=True" in str(exc)
    else:
        raise AssertionError("broadcast_object without allow_pickle must raise")
    got = phalanx.broadcast_object({"from": r, "data": [1, 2]} if r == 0 else None, allow_pickle=True)
    assert got == {"from": 0, "data": [1, 2]}, got
    return phalanx.allgather_object(("rank", r), allow_pickle=True)


def identity() -> dict:
    """What a rank knows about itself."""
    import io
    import logging
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        phalanx.print("hello\nworld")
    r, n = phalanx.rank(), phalanx.size()
    assert buf.getvalue() == f"[{r}/{n}] hello\n[{r}/{n}] world\n", repr(buf.getvalue())
    stream = io.StringIO()
    logger = logging.getLogger(f"phalanx-test-{r}")
    handler = phalanx.setup_logging(logging.INFO, logger=logger, fmt="%(rank)d/%(size)d %(message)s")
    handler.setStream(stream)
    logger.info("from every rank?")
    logger.info("opted in", extra={"all_ranks": True})
    return {
        "rank": r, "size": n, "backend": phalanx.backend().name, "local_rank": phalanx.local_rank(),
        "local_size": phalanx.local_size(), "initialized": phalanx.initialized(), "log": stream.getvalue(),
        "same_backend_again": phalanx.init() is phalanx.backend(),
    }


def mixed() -> dict:
    return {"order": nonblocking_order(), "objects": objects(), "identity": identity()}
