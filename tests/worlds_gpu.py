"""Rank bodies for CUDA tensors (run only where a GPU is present)."""

from __future__ import annotations

import os

import numpy as np

import phalanx
from behaviours import Behaviours

CUDA = Behaviours()
DTYPES = ("float32", "float16", "bfloat16", "int64")


def _collectives_on(dtype_name: str) -> None:
    """allreduce (in place), broadcast, allgather and iallreduce of CUDA tensors of one dtype."""
    import torch

    r, n = phalanx.rank(), phalanx.size()
    dev = phalanx.device()
    dtype = getattr(torch, dtype_name)
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


@CUDA.behaviour("the-rank-device-is-a-gpu")
def _device() -> None:
    dev = phalanx.device()
    assert dev.type == "cuda", dev


for _dtype in DTYPES:
    CUDA.add(f"cuda-{_dtype}-tensors-through-allreduce-broadcast-allgather-iallreduce", _collectives_on, _dtype)


@CUDA.behaviour("avg-of-a-cuda-float-tensor")
def _avg() -> None:
    import torch

    r, n = phalanx.rank(), phalanx.size()
    avg = phalanx.allreduce(torch.full((2,), float(r), device=phalanx.device()), op="avg")
    assert torch.allclose(avg.cpu(), torch.full((2,), (n - 1) / 2))


@CUDA.behaviour("numpy-arrays-on-a-gpu-backend-come-back-as-numpy")
def _numpy() -> None:
    r, n = phalanx.rank(), phalanx.size()
    a = phalanx.allreduce(np.full(3, float(r)))
    assert isinstance(a, np.ndarray) and np.array_equal(a, np.full(3, float(sum(range(n)))))


@CUDA.behaviour("PHALANX_GPU_AWARE_MPI=0-stages-through-the-host")
def _gpu_aware_setting() -> None:
    aware = getattr(phalanx.backend(), "gpu_aware", None)
    if os.environ.get("PHALANX_GPU_AWARE_MPI") == "0":
        assert aware is False, aware


def cuda_collectives() -> dict[str, str | None]:
    """CUDA tensors through every collective: nccl natively, MPI directly or staged via the host."""
    return CUDA.run()
