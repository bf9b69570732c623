"""The rank program of ``benchmarks/train_step.py``: the variants, the models, and timing them in one world.

The driver (``train_step.py``) starts each world as ``phalanx run ... train_step.py --worker ...``
and that runs :func:`worker` here, on every rank; it also uses :data:`VARIANTS` and
:func:`build_model` to describe and count what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["BY_KEY", "DDP", "DEFAULT", "MODELS", "VARIANTS", "WORLDS", "Variant", "build_model", "make_step",
           "settle_allocator", "worker"]

WORLDS = ("single", "mpi", "gloo")


@dataclass(frozen=True)
class Variant:
    """One way of training: ``world`` says which world runs it, ``label`` how the table names it."""

    key: str
    world: str
    label: str


VARIANTS = [
    Variant("single", "single", "1 process, no communication (T_1)"),
    Variant("mpi/none", "mpi", "N ranks, no communication"),
    Variant("mpi/DistributedOptimizer", "mpi", "phalanx DistributedOptimizer, mpi"),
    Variant("mpi/DistributedOptimizer+bf16", "mpi", "phalanx DistributedOptimizer, mpi, bf16"),
    Variant("mpi/DataParallel", "mpi", "phalanx DataParallel, mpi"),
    Variant("mpi/DataParallel+bf16", "mpi", "phalanx DataParallel, mpi, bf16"),
    Variant("mpi/hand", "mpi", "hand loop: one fused mpi4py Allreduce"),
    Variant("gloo/DistributedOptimizer", "gloo", "phalanx DistributedOptimizer, gloo"),
    Variant("gloo/DistributedOptimizer+bf16", "gloo", "phalanx DistributedOptimizer, gloo, bf16"),
    Variant("gloo/DataParallel", "gloo", "phalanx DataParallel, gloo"),
    Variant("gloo/DataParallel+bf16", "gloo", "phalanx DataParallel, gloo, bf16"),
    Variant("gloo/DDP", "gloo", "torch DDP, gloo"),
    Variant("gloo/DDP+bf16", "gloo", "torch DDP, gloo, bf16 compress hook"),
]
BY_KEY = {v.key: v for v in VARIANTS}
DDP = "gloo/DDP"
DEFAULT = "mpi/DistributedOptimizer"  # phalanx's default: DistributedOptimizer, default backend, no compression
MODELS = {"mlp": "MLP 512→1024→4×1024→10", "cnn": "CNN 3×(conv3×3, ReLU, maxpool)→128→10"}


# -- models ---------------------------------------------------------------------------------------

def build_model(name: str, width: int) -> Any:
    """The benchmark model ``name`` ("mlp" or "cnn"), same weights on every call.

    ``width`` scales it: the MLP's hidden size (1024 in the benchmark), the
    CNN's first channel count (16; then 2× and 4×).
    """
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    if name == "mlp":
        layers: list[Any] = [nn.Linear(512, width), nn.ReLU()]
        for _ in range(4):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 10))
    c = width
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4 * c * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))


def batch(name: str, size: int, seed: int) -> tuple[Any, Any]:
    """A fixed random batch (inputs, labels) for ``name``; each rank passes its own ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (size, 512) if name == "mlp" else (size, 3, 32, 32)
    return torch.randn(*shape, generator=g), torch.randint(0, 10, (size,), generator=g)


# -- inside a world ----------------------------------------------------------------------------------

def make_step(key: str, model_name: str, width: int, x: Any, y: Any) -> tuple[Callable[[], None], Any]:
    """(one training step of variant ``key`` as a user would write it, the model it trains)."""
    import torch

    import phalanx.torch as pt

    loss_fn = torch.nn.functional.cross_entropy
    model = build_model(model_name, width)
    kind = key.split("/")[-1]
    compression = "bf16" if kind.endswith("+bf16") else None
    if kind.startswith("DistributedOptimizer"):
        opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), compression=compression)
    elif kind.startswith("DataParallel"):
        model = pt.DataParallel(model, compression=compression)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    elif kind.startswith("DDP"):
        model = torch.nn.parallel.DistributedDataParallel(model)
        if compression:
            model.register_comm_hook(None, _ddp_bf16_hook)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    elif kind == "hand":
        return _hand_loop(model, x, y), model
    else:  # "single", "none": the plain step, no communication
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step, model


def _ddp_bf16_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
    """torch's ``bf16_compress_hook``, verbatim: DDP refuses that function by name without CUDA/NCCL."""
    import torch
    import torch.distributed as dist

    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut: Any) -> Any:
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def _hand_loop(model: Any, x: Any, y: Any) -> Callable[[], None]:
    """Backward, then the gradients copied into one flat buffer, one mpi4py Allreduce, copied back."""
    import torch
    from mpi4py import MPI

    import phalanx

    comm = MPI.COMM_WORLD
    params = [p for p in model.parameters() if p.requires_grad]
    phalanx.synchronize(model, root=0)
    opt = torch.optim.SGD(params, lr=1e-3)
    flat = torch.empty(sum(p.numel() for p in params))
    view = flat.numpy()
    scale = 1.0 / comm.Get_size()
    loss_fn = torch.nn.functional.cross_entropy

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        grads = [p.grad for p in params]
        torch.cat([g.reshape(-1) for g in grads], out=flat)
        comm.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)
        flat.mul_(scale)
        torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads,
                                                                    strict=True)])
        opt.step()

    return step


def _versions(backend: str) -> dict[str, str]:
    import numpy as np
    import torch

    import phalanx

    found = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
             "phalanx": phalanx.__version__}
    if backend == "mpi":
        import mpi4py
        from mpi4py import MPI

        found["mpi4py"] = mpi4py.__version__
        found["mpi_library"] = MPI.Get_library_version().strip().split("\n")[0]
    return found


def settle_allocator() -> None:
    """Put glibc's malloc in the state a long-running process reaches, the same for every variant.

    A fresh process gives freed memory back to the system (``munmap``, heap
    trimming) and page-faults it in again on the next step: thousands of page
    faults per step for the MLP, several ms. Freeing one large mmapped block
    raises glibc's dynamic mmap threshold to its size (at most 32 MiB) and the
    trim threshold to twice that, after which step-sized blocks are reused.
    Otherwise the variants a process ran before decide which regime it
    measures (a 1-process baseline in a fresh process measures slower than
    each of two ranks that ran other variants first).
    """
    import torch

    block = torch.empty(31 << 18)  # 31 MiB of float32, never touched: mmapped, then freed
    del block


def worker(args: argparse.Namespace) -> int:
    """Run inside one world: time every variant of this world on every model; rank 0 writes ``--out``."""
    import numpy as np
    import torch

    import phalanx

    torch.set_num_threads(1)
    if not args.fresh_allocator:
        settle_allocator()
    phalanx.init()
    world, rank, size = args.world, phalanx.rank(), phalanx.size()
    backend = phalanx.backend().name
    expected = "local" if world == "single" else world
    if backend != expected or (world == "single") != (size == 1):
        raise SystemExit(f"train_step.py --worker --world {world}: started as {backend} with {size} ranks")
    keys = [k for k in args.variants if BY_KEY[k].world == world]
    items = [(m, k) for m in args.models for k in keys]
    shift = args.round % len(items) if items else 0
    items = items[shift:] + items[:shift]
    results: dict[str, Any] = {}
    for model_name, key in items:
        x, y = batch(model_name, args.batch, seed=rank)
        built = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step, model = make_step(key, model_name, _width(args, model_name), x, y)
            for _ in range(args.warmup):
                step()
        built = time.perf_counter() - built
        phalanx.barrier()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        mine = (time.perf_counter() - start) / args.steps
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
        per_rank = phalanx.allgather(np.array(mine))
        with torch.no_grad():  # did the replicas stay identical (they do whenever gradients are reduced)?
            checksum = float(sum(p.double().sum() for p in model.parameters()))
        agree = len({float(v) for v in phalanx.allgather(np.array(checksum))}) == 1
        notes = sorted({f"{w.category.__name__}: {str(w.message)[:300]}" for w in caught})
        results[f"{model_name}:{key}"] = {"rank_s": [float(v) for v in per_rank], "notes": notes,
                                          "setup_s": round(built, 3), "replicas_agree": agree,
                                          "page_faults_per_step": round(faults, 1)}
        del step, model
        gc.collect()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": world, "backend": backend, "ranks": size, "order": [f"{m}:{k}" for m, k in items],
                       "results": results, "versions": _versions(backend)}, f)
    phalanx.shutdown()
    return 0


def _width(args: argparse.Namespace, model_name: str) -> int:
    return args.mlp_width if model_name == "mlp" else args.cnn_width
