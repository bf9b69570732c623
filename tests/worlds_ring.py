"""Rank bodies of ``test_mpi_ring.py``: mpi's ring allreduce (``PHALANX_MPI_RING=1``) against NumPy."""

from __future__ import annotations

import os

import numpy as np
import torch

import phalanx
import phalanx.torch as pt
from behaviours import Behaviours
from phalanx import _world

RING = Behaviours()
OPS = {"sum": np.sum, "avg": np.mean, "min": np.min, "max": np.max, "prod": np.prod}


def _data(k: int, count: int, dtype: type) -> np.ndarray:
    return np.random.default_rng(k).standard_normal(count).astype(dtype)


def _expect(n: int, count: int, dtype: type, op: str) -> np.ndarray:
    return OPS[op](np.stack([_data(k, count, dtype).astype(np.float64) for k in range(n)]), axis=0)


@RING.behaviour("large-buffers-take-the-ring-small-ones-do-not")
def _(r: int, n: int) -> None:
    backend = _world.current("test").backend
    assert (backend._ring is not None) == (n > 1), backend._ring
    if n == 1:
        return
    rings = backend._ring
    want = os.environ.get("PHALANX_TEST_RING_LEVELS", os.environ.get("PHALANX_HIERARCHICAL", "0")) == "1"
    assert (rings.levels is not None) == want, rings.levels
    before = rings._count
    phalanx.allreduce(np.ones(1000, np.float32))
    assert rings._count == before
    phalanx.allreduce(np.ones(1 << 18, np.float32))
    assert rings._count == before + 1 and not rings.live


@RING.behaviour("float32-and-float64-every-op-equal-numpy-one-ring-and-several-uneven")
def _(r: int, n: int) -> None:
    for count in (1 << 18, 1_310_721):  # 1 MiB of float32 (one ring); 5 MB, split unevenly into several
        for dtype in (np.float32, np.float64):
            for op in OPS:
                got = phalanx.allreduce(_data(r, count, dtype), op=op)
                assert got.dtype == dtype
                np.testing.assert_allclose(got, _expect(n, count, dtype, op), rtol=1e-5, atol=1e-5)


@RING.behaviour("results-land-in-the-callers-buffer-and-a-copy-leaves-it-alone")
def _(r: int, n: int) -> None:
    x = np.full(1 << 18, r + 1.0, np.float32)
    got = phalanx.allreduce(x)
    assert np.shares_memory(got, x) and (x == n * (n + 1) / 2).all()
    t = torch.full((1 << 18,), r + 1.0)
    got = phalanx.allreduce(t)
    assert got.data_ptr() == t.data_ptr() and (t == n * (n + 1) / 2).all()
    backend = _world.current("test").backend  # the backend's not-in-place form (immutable inputs use it)
    y = np.full(1 << 18, r + 1.0, np.float32)
    phalanx.barrier()
    out = backend.allreduce(y, "sum", False, 30.0)
    assert out is not y and (y == r + 1).all() and (out == n * (n + 1) / 2).all()


@RING.behaviour("bf16-and-fp16-travel-as-16-bits-summed-in-float32-rounded-per-hop")
def _(r: int, n: int) -> None:
    count = 3 << 19
    for dtype in (torch.bfloat16, torch.float16):
        for op in ("sum", "avg"):
            mine = torch.from_numpy(_data(r, count, np.float32)).to(dtype)
            every = torch.stack([torch.from_numpy(_data(k, count, np.float32)).to(dtype).float() for k in range(n)])
            want = every.sum(0) / (n if op == "avg" else 1)
            got = phalanx.allreduce(mine, op=op)
            assert got.dtype == dtype
            assert torch.allclose(got.float(), want, rtol=2e-2, atol=3e-2), (got.float() - want).abs().max()
    nan = torch.zeros(1 << 19, dtype=torch.bfloat16)
    nan[7] = float("nan")
    assert torch.isnan(phalanx.allreduce(nan)[7]) and not torch.isnan(phalanx.allreduce(nan)[8])


@RING.behaviour("nonblocking-handles-waited-in-reverse-order")
def _(r: int, n: int) -> None:
    handles = [phalanx.iallreduce(np.full(1 << 18, float(r + k), np.float32)) for k in range(3)]
    for k in reversed(range(3)):
        got = handles[k].wait()
        assert (got == sum(range(n)) + n * k).all(), (k, got[:3])


@RING.behaviour("handles-waited-in-a-different-order-on-each-rank-and-around-a-small-allreduce")
def _(r: int, n: int) -> None:
    handles = [phalanx.iallreduce(np.full(1 << 18, float(r + k), np.float32)) for k in range(3)]
    assert phalanx.allreduce(np.ones(4, np.float32))[0] == n  # MPI's own, while the rings are in flight
    for i in range(3):
        k = (r + i) % 3  # rank 0 waits 0, 1, 2; rank 1 waits 1, 2, 0; ...
        got = handles[k].wait()
        assert (got == sum(range(n)) + n * k).all(), (k, got[:3])


@RING.behaviour("distributed-optimizer-gradients-equal-the-single-process-average")
def _(r: int, n: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb=1)
    xs = torch.randn(n, 8, 256, generator=torch.Generator().manual_seed(1))
    model(xs[r]).square().mean().backward()
    reference = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    reference.load_state_dict(model.state_dict())
    for k in range(n):
        reference(xs[k]).square().mean().div(n).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    opt.zero_grad()


def ring() -> dict[str, str | None]:
    return RING.run(phalanx.rank(), phalanx.size())
