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

__all__ = ["BY_KEY", "DDP", "DEFAULT", "MODELS", "MORE_VARIANTS", "VARIANTS", "WORLDS", "Variant", "build_model",
           "make_step", "settle_allocator", "worker"]

WORLDS = ("single", "mpi", "gloo")


@dataclass(frozen=True)
class Variant:
    """One way of training: ``world`` says which world runs it, ``label`` how the table names it.

    ``solo``: the variant may end its process (torch's PowerSGD hook aborts on gloo), so a
    driver runs it in a world of its own, where that end is recorded as its result.
    """

    key: str
    world: str
    label: str
    solo: bool = False


VARIANTS = [
    Variant("single", "single", "1 process, no communication (T_1)"),
    Variant("mpi/none", "mpi", "N ranks, no communication"),
    Variant("mpi/DistributedOptimizer", "mpi", "phalanx DistributedOptimizer, mpi"),
    Variant("mpi/DistributedOptimizer+bf16", "mpi", "phalanx DistributedOptimizer, mpi, bf16"),
    Variant("mpi/DataParallel", "mpi", "phalanx DataParallel, mpi"),
    Variant("mpi/DataParallel+bf16", "mpi", "phalanx DataParallel, mpi, bf16"),
    Variant("mpi/hand", "mpi", "hand loop: one fused mpi4py Allreduce"),
    Variant("mpi/DDP", "mpi", "torch DDP on the 'phalanx' backend, mpi"),
    Variant("gloo/DistributedOptimizer", "gloo", "phalanx DistributedOptimizer, gloo"),
    Variant("gloo/DistributedOptimizer+bf16", "gloo", "phalanx DistributedOptimizer, gloo, bf16"),
    Variant("gloo/DataParallel", "gloo", "phalanx DataParallel, gloo"),
    Variant("gloo/DataParallel+bf16", "gloo", "phalanx DataParallel, gloo, bf16"),
    Variant("gloo/DDP", "gloo", "torch DDP, gloo"),
    Variant("gloo/DDP+bf16", "gloo", "torch DDP, gloo, bf16 compress hook"),
]
# beside train_step.py's set: benchmarks/multihost.py measures these too (fp16, PowerSGD, the Horovod API)
MORE_VARIANTS = [
    Variant("mpi/DistributedOptimizer+fp16", "mpi", "phalanx DistributedOptimizer, mpi, fp16"),
    Variant("mpi/DistributedOptimizer+powersgd", "mpi", "phalanx DistributedOptimizer, mpi, PowerSGD"),
    Variant("mpi/hvd", "mpi", "Horovod API (phalanx.horovod.torch), mpi"),
    # DataParallel's per-step agreement (check_steps, on by default) turned off: its cost by difference
    Variant("mpi/DataParallel+nocheck", "mpi", "phalanx DataParallel, mpi, check_steps=False"),
    Variant("gloo/DataParallel+nocheck", "gloo", "phalanx DataParallel, gloo, check_steps=False"),
    Variant("gloo/DistributedOptimizer+fp16", "gloo", "phalanx DistributedOptimizer, gloo, fp16"),
    Variant("gloo/DistributedOptimizer+powersgd", "gloo", "phalanx DistributedOptimizer, gloo, PowerSGD"),
    Variant("gloo/hvd", "gloo", "Horovod API (phalanx.horovod.torch), gloo"),
    Variant("gloo/DDP+fp16", "gloo", "torch DDP, gloo, fp16_compress_hook"),
    Variant("gloo/DDP+powersgd", "gloo", "torch DDP, gloo, powerSGD_hook", solo=True),
]
BY_KEY = {v.key: v for v in VARIANTS + MORE_VARIANTS}
DDP = "gloo/DDP"
DEFAULT = "mpi/DistributedOptimizer"  # phalanx's default: DistributedOptimizer, default backend, no compression
MODELS = {"mlp": "MLP 512→1024→4×1024→10", "cnn": "CNN 3×(conv3×3, ReLU, maxpool)→128→10",
          "resnet_tiny": "resnet_tiny (BasicBlocks [1, 1, 1, 1]) on 3×32×32"}
POWERSGD_RANK = 4  # columns of PowerSGD's factors, phalanx's and torch DDP's hook alike (phalanx's default)
# reductions sent plain before PowerSGD compresses, both alike (torch's start_powerSGD_iter; the least it
# allows with error feedback): fewer than --warmup, so every timed step is compressed
POWERSGD_PLAIN_STEPS = 2


# -- models ---------------------------------------------------------------------------------------

def build_model(name: str, width: int) -> Any:
    """The benchmark model ``name`` ("mlp", "cnn" or "resnet_tiny"), same weights on every call.

    ``width`` scales it: the MLP's hidden size (1024 in the benchmark), the
    CNN's and resnet_tiny's first channel count (16; then 2×, 4× (and 8×)).
    """
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    if name == "resnet_tiny":
        from phalanx.train.models import resnet_tiny

        return resnet_tiny(num_classes=10, width=width)
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
    """(one training step of variant ``key`` as a user would write it, the model it trains).

    Raises ``NotAvailable`` when this phalanx has no such compression (built before any communication,
    so every rank raises it alike).
    """
    import torch

    import phalanx.torch as pt

    loss_fn = torch.nn.functional.cross_entropy
    model = build_model(model_name, width)
    kind, _, compression = key.split("/")[-1].partition("+")
    opt: Any
    if kind == "DistributedOptimizer":
        opt = _phalanx_optimizer(pt, torch.optim.SGD(model.parameters(), lr=1e-3), compression or None)
    elif kind == "DataParallel":
        if compression == "nocheck":
            model = pt.DataParallel(model, check_steps=False)
        else:
            model = pt.DataParallel(model, compression=compression or None)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    elif kind == "DDP":
        if key.startswith("mpi/"):  # torch.distributed over MPI: the "phalanx" backend as torch's default group
            pt.init_process_group()
        model = torch.nn.parallel.DistributedDataParallel(model)
        if compression:
            model.register_comm_hook(*_ddp_hook(compression))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    elif kind == "hvd":
        opt = _horovod_optimizer(model)
    elif kind == "hand":
        return _hand_loop(model, x, y), model
    else:  # "single", "none": the plain step, no communication
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step, model


class NotAvailable(Exception):
    """A variant this installation cannot build (a compression phalanx does not have yet)."""


def _phalanx_optimizer(pt: Any, sgd: Any, compression: str | None) -> Any:
    from phalanx import InvalidArgumentError

    if compression == "powersgd":
        if not hasattr(pt, "PowerSGD"):
            raise NotAvailable("this phalanx has no phalanx.torch.PowerSGD")
        compression = pt.PowerSGD(rank=POWERSGD_RANK, warmup_steps=POWERSGD_PLAIN_STEPS)
    try:
        return pt.DistributedOptimizer(sgd, compression=compression)
    except InvalidArgumentError as e:
        if compression and "compression" in str(e):
            raise NotAvailable(str(e)) from e
        raise


def _horovod_optimizer(model: Any) -> Any:
    """Horovod's recipe (as benchmarks/horovod_step.py): broadcast the state, wrap with named_parameters."""
    import torch

    import phalanx.horovod.torch as hvd

    hvd.init()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    return hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())


def _ddp_hook(compression: str) -> tuple[Any, Any]:
    """(state, hook) of DDP's compression ``compression``: bf16 (its body), fp16, powersgd (torch's hooks)."""
    if compression == "bf16":
        return None, _ddp_bf16_hook
    if compression == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return None, default_hooks.fp16_compress_hook
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                        start_powerSGD_iter=POWERSGD_PLAIN_STEPS)
    return state, powerSGD_hook.powerSGD_hook


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
    iface = getattr(args, "count_iface", None)  # multihost.py: the host's link, whose sent bytes are counted
    for model_name, key in items:
        results[f"{model_name}:{key}"] = _time_variant(args, model_name, key, rank, iface)
        gc.collect()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": world, "backend": backend, "ranks": size, "order": [f"{m}:{k}" for m, k in items],
                       "results": results, "versions": _versions(backend)}, f)
    phalanx.shutdown()
    return 0


def _time_variant(args: argparse.Namespace, model_name: str, key: str, rank: int,
                  iface: str | None) -> dict[str, Any]:
    """Build variant ``key`` on ``model_name``, warm it up, time ``args.steps`` steps: its result entry."""
    import numpy as np
    import torch

    import phalanx

    x, y = batch(model_name, args.batch, seed=rank)
    built = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step, model = make_step(key, model_name, _width(args, model_name), x, y)
        except NotAvailable as e:
            return {"status": "not available", "reason": str(e)[:300]}
        for _ in range(args.warmup):
            step()
    built = time.perf_counter() - built
    phalanx.barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    sent = _sent_bytes(iface)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    mine = (time.perf_counter() - start) / args.steps
    sent = (_sent_bytes(iface) - sent) / args.steps if iface else float("nan")
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
    per_rank = phalanx.allgather(np.array([mine, sent]))
    with torch.no_grad():  # did the replicas stay identical (they do whenever gradients are reduced)?
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    agree = len({float(v) for v in phalanx.allgather(np.array(checksum))}) == 1
    notes = sorted({f"{w.category.__name__}: {str(w.message)[:300]}" for w in caught})
    entry = {"status": "ok", "rank_s": [float(v[0]) for v in per_rank], "notes": notes,
             "setup_s": round(built, 3), "replicas_agree": agree, "page_faults_per_step": round(faults, 1)}
    if iface:
        entry["sent_bytes_per_step"] = [round(float(v[1])) for v in per_rank]
    return entry


def _sent_bytes(iface: str | None) -> int:
    """Bytes sent so far on ``iface`` of this process's network namespace (0 without an interface)."""
    if not iface:
        return 0
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == iface:
                return int(fields.split()[8])  # receive: 8 fields; then transmit bytes
    raise SystemExit(f"train_step_worker: no interface {iface!r} in /proc/self/net/dev")


def _width(args: argparse.Namespace, model_name: str) -> int:
    return args.mlp_width if model_name == "mlp" else args.cnn_width
