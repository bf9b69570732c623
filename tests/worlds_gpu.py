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


TRAIN = Behaviours()
_VARIANTS = {  # name: (wrapper, wrapper options, SyncBatchNorm)
    "DistributedOptimizer": ("opt", {}, False),
    "DataParallel": ("dp", {}, False),
    "bf16": ("dp", {"compression": "bf16"}, False),
    "PowerSGD": ("opt", {"compression": "powersgd-1"}, False),
    "SyncBatchNorm": ("dp", {}, True),
}


def _net(torch, seed: int, bn: bool):  # noqa: ANN001, ANN202
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(12, 32), torch.nn.BatchNorm1d(32) if bn else torch.nn.Identity(), torch.nn.ReLU(),
              torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)]
    return torch.nn.Sequential(*layers)


def _fit(variant: str, device, steps: int = 4):  # noqa: ANN001, ANN202
    """This rank's parameters (on the CPU) after ``steps`` steps of ``variant`` on ``device``."""
    import torch

    import phalanx.torch as pt

    wrap, options, bn = _VARIANTS[variant]
    options = dict(options)
    if options.get("compression") == "powersgd-1":
        options["compression"] = pt.PowerSGD(rank=1, warmup_steps=1, min_compression_rate=0.0)
    model = _net(torch, 0, bn).to(device)
    if bn:
        model = pt.convert_sync_batchnorm(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if wrap == "dp":
        model = pt.DataParallel(model, **options)
    else:
        opt = pt.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **options)
    r, n = phalanx.rank(), phalanx.size()
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8 * n, 12, generator=g), torch.randn(8 * n, 4, generator=g)
        x, y = x[8 * r:8 * (r + 1)].to(device), y[8 * r:8 * (r + 1)].to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


for _variant in _VARIANTS:
    @TRAIN.behaviour(f"{_variant}-on-cuda-equals-{_variant}-on-the-cpu")
    def _(variant: str = _variant) -> None:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        on_gpu = _fit(variant, phalanx.device())
        on_cpu = _fit(variant, torch.device("cpu"))
        tol = 2e-2 if variant == "bf16" else 1e-4
        for a, b in zip(on_gpu, on_cpu, strict=True):
            assert torch.allclose(a, b, atol=tol, rtol=tol), f"max difference {(a - b).abs().max():.3g}"


@TRAIN.behaviour("cuda-buckets-stage-through-pinned-twins-where-the-transport-reduces-on-the-host")
def _() -> None:
    import torch

    import phalanx.torch as pt
    from phalanx.comm._staging import stages_cuda
    from phalanx.torch._staged import StagedReducer

    model = pt.DataParallel(_net(torch, 0, False).to(phalanx.device()))
    staged = isinstance(model.engine.reducer, StagedReducer)
    assert staged == (phalanx.size() > 1 and stages_cuda(phalanx.backend())), (staged, phalanx.backend())
    if staged:
        assert all(b.flat.is_pinned() for b in model.engine.reducer.host.buckets)
    model.close()


def cuda_training() -> dict[str, str | None]:
    """CUDA training equals the same training on CPU tensors, on every wrapper and compression."""
    return TRAIN.run()


def nccl_shared_gpu() -> None:
    """Only starts a world (init fails when its ranks share a GPU)."""
