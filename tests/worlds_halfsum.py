"""Body for the 16-bit allreduce test: large float16/bfloat16 sums, checked against float32 arithmetic.

On MPI, buffers from 64 KiB travel as 16-bit words (phalanx's own
reduce-scatter + allgather, ``phalanx.comm._halfsum``); elsewhere the backend
sums them natively. Either way the result must be the sum of every rank's
values computed in float32 and rounded to 16 bits (up to summation order).
Each behaviour also checks which path each call took: the 16-bit one exactly
on MPI with more than one rank, for every large call, and never below 64 KiB.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import phalanx
from behaviours import Behaviours

SUMS = Behaviours()
LENGTHS = (100_003, 65_536, 40_000 * 3)  # not divisible by 2 or 3, and divisible


class _World:
    """What every behaviour needs: the rank, the world, and how many HalfSum reductions have started."""

    def __init__(self, backend: str, size: int) -> None:
        self.rank, self.size = phalanx.rank(), size
        self.once = backend in ("mpi", "local") or size == 1  # MPI: phalanx adds in float32
        self.sixteen_bit = backend == "mpi" and size > 1
        self.started = 0

    def expect_paths(self, before: int, large_calls: int) -> None:
        """Since ``before``, ``large_calls`` calls took the 16-bit path on MPI with >1 rank, none elsewhere."""
        want = large_calls if self.sixteen_bit else 0
        assert self.started - before == want, f"{self.started - before} 16-bit reductions, expected {want}"


def _data(torch: Any, rank: int, n: int, dtype: Any) -> Any:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(n, generator=g) * (rank + 1)).to(dtype)


def _close(torch: Any, got: Any, want: Any, absum: Any, dtype: Any, one_rounding: bool, size: int) -> bool:
    """Rounded once from the float32 sum (phalanx on MPI), or, for a backend that adds in 16 bits
    (gloo), within one rounding per addition of the magnitudes involved."""
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    err = (torch.as_tensor(got).float() - want).abs()
    if one_rounding:
        bound = eps * want.abs() + 1e-6 * absum + 1e-7
    else:
        bound = size * eps * absum + 1e-7
    return bool((err <= bound).all())


def _torch_sum(w: _World, n: int, dtype_name: str, op: str) -> None:
    import torch

    dtype = getattr(torch, dtype_name)
    everyone = [_data(torch, r, n, dtype).float() for r in range(w.size)]
    div = w.size if op == "avg" else 1
    want, absum = sum(everyone) / div, sum(e.abs() for e in everyone) / div
    before = w.started
    x = _data(torch, w.rank, n, dtype)
    got = phalanx.allreduce(x, op=op)
    assert got.data_ptr() == x.data_ptr() and got.dtype == dtype, "in place"
    assert _close(torch, got, want, absum, dtype, w.once, w.size), (n, dtype, op)
    handle = phalanx.iallreduce(_data(torch, w.rank, n, dtype), op=op)
    assert _close(torch, handle.wait(), want, absum, dtype, w.once, w.size), (n, dtype, op, "iallreduce")
    w.expect_paths(before, 2)


def _numpy_read_only(w: _World, n: int) -> None:
    """NumPy float16, not in place (a read-only array gets a new result)."""
    import torch

    before = w.started
    x = _data(torch, w.rank, n, torch.float16).numpy()
    x.setflags(write=False)
    got = phalanx.allreduce(x)
    everyone = [_data(torch, r, n, torch.float16).float() for r in range(w.size)]
    assert got is not x and got.dtype == np.float16
    assert _close(torch, got.astype(np.float32), sum(everyone), sum(e.abs() for e in everyone),
                  torch.float16, w.once, w.size)
    w.expect_paths(before, 1)


for _n in LENGTHS:
    for _dtype in ("bfloat16", "float16"):
        for _op in ("sum", "avg"):
            SUMS.add(f"torch-{_dtype}-{_op}-of-{_n}", _torch_sum, _n, _dtype, _op)
    SUMS.add(f"numpy-float16-read-only-sum-of-{_n}", _numpy_read_only, _n)


@SUMS.behaviour("below-64-KiB-takes-the-float32-path")
def _(w: _World) -> None:
    import torch

    before = w.started
    small = phalanx.allreduce(torch.ones(10, dtype=torch.bfloat16))
    assert torch.equal(small, torch.full((10,), float(w.size), dtype=torch.bfloat16))
    assert w.started == before, f"{w.started - before} 16-bit reductions for 20 bytes"


def sums(backend: str, n: int) -> dict[str, str | None]:
    """Every behaviour of SUMS, counting HalfSum reductions (``backend``/``n``: the world asked for)."""
    from phalanx.comm import _halfsum

    assert phalanx.backend().name == backend and phalanx.size() == n, (phalanx.backend().name, phalanx.size())
    world = _World(backend, n)
    original = _halfsum.HalfSum

    class Counted(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            world.started += 1
            super().__init__(*args, **kwargs)

    _halfsum.HalfSum = Counted
    try:
        return SUMS.run(world)
    finally:
        _halfsum.HalfSum = original
