"""Body for the 16-bit allreduce test: large float16/bfloat16 sums, checked against float32 arithmetic.

On MPI, buffers from 64 KiB travel as 16-bit words (phalanx's own
reduce-scatter + allgather, ``phalanx.comm._halfsum``); elsewhere the backend
sums them natively. Either way the result must be the sum of every rank's
values computed in float32 and rounded to 16 bits (up to summation order).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import phalanx


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


def sums() -> dict[str, int]:
    import torch

    from phalanx.comm import _halfsum

    used = {"n": 0}
    original = _halfsum.HalfSum

    class Counted(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            used["n"] += 1
            super().__init__(*args, **kwargs)

    _halfsum.HalfSum = Counted
    rank, size = phalanx.rank(), phalanx.size()
    once = phalanx.backend().name in ("mpi", "local") or size == 1  # MPI: phalanx adds in float32
    checks = 0
    try:
        for n in (100_003, 65_536, 40_000 * 3):  # not divisible by 2 or 3, and divisible
            for dtype in (torch.bfloat16, torch.float16):
                for op in ("sum", "avg"):
                    everyone = [_data(torch, r, n, dtype).float() for r in range(size)]
                    div = size if op == "avg" else 1
                    want, absum = sum(everyone) / div, sum(e.abs() for e in everyone) / div
                    x = _data(torch, rank, n, dtype)
                    got = phalanx.allreduce(x, op=op)
                    assert got.data_ptr() == x.data_ptr() and got.dtype == dtype  # in place
                    assert _close(torch, got, want, absum, dtype, once, size), (n, dtype, op)
                    handle = phalanx.iallreduce(_data(torch, rank, n, dtype), op=op)
                    assert _close(torch, handle.wait(), want, absum, dtype, once, size), (n, dtype, op)
                    checks += 2
            # NumPy float16, not in place (a read-only array gets a new result)
            x = _data(torch, rank, n, torch.float16).numpy()
            x.setflags(write=False)
            got = phalanx.allreduce(x)
            everyone = [_data(torch, r, n, torch.float16).float() for r in range(size)]
            assert got is not x and got.dtype == np.float16
            assert _close(torch, got.astype(np.float32), sum(everyone), sum(e.abs() for e in everyone),
                          torch.float16, once, size)
            checks += 1
        small = phalanx.allreduce(torch.ones(10, dtype=torch.bfloat16))  # below 64 KiB: the float32 path
        assert torch.equal(small, torch.full((10,), float(size), dtype=torch.bfloat16))
    finally:
        _halfsum.HalfSum = original
    mpi = phalanx.backend().name == "mpi" and size > 1
    assert (used["n"] > 0) == mpi, (used, phalanx.backend().name, size)
    return {"checks": checks, "sixteen_bit": used["n"]}
