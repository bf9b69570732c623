"""Rank bodies for CUDA tensors (run only where a GPU is present)."""

from __future__ import annotations

import numpy as np

import phalanx


def cuda_collectives() -> dict:
    """CUDA tensors through every collective: nccl natively, MPI directly or staged via the host."""
    import torch

    r, n = phalanx.rank(), phalanx.size()
    dev = phalanx.device()
    assert dev.type == "cuda", dev
    checks = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        x = torch.full((5,), float(r + 1), dtype=dtype, device=dev)
        out = phalanx.allreduce(x)
        assert out.device == dev and out.dtype == dtype
        assert torch.equal(out.cpu().double(), torch.full((5,), float(n * (n + 1) // 2)).double())
        assert out.data_ptr() == x.data_ptr(), "allreduce of a CUDA tensor is in place"
        b = phalanx.broadcast(torch.full((3,), float(r), dtype=dtype, device=dev), root=n - 1)
        assert torch.equal(b.cpu().double(), torch.full((3,), float(n - 1)).double())
        g = phalanx.allgather(torch.full((2,), float(r), dtype=dtype, device=dev))
        assert g.device == dev and g.shape == (n, 2)
        h = phalanx.iallreduce(torch.ones(4, dtype=dtype, device=dev)).wait()
        assert torch.equal(h.cpu().double(), torch.full((4,), float(n)).double())
        checks += 4
    if dtype.is_floating_point:
        avg = phalanx.allreduce(torch.full((2,), float(r), device=dev), op="avg")
        assert torch.allclose(avg.cpu(), torch.full((2,), (n - 1) / 2))
    # NumPy arrays on a GPU backend are staged through the device and come back as NumPy.
    a = phalanx.allreduce(np.full(3, float(r)))
    assert isinstance(a, np.ndarray) and np.array_equal(a, np.full(3, float(sum(range(n)))))
    return {"checks": checks + 2, "gpu_aware": getattr(phalanx.backend(), "gpu_aware", None)}
