"""Training step time on one CUDA GPU: plain torch, phalanx and DDP (``benchmarks/README.md``, "GPU").

    python benchmarks/gpu_step.py [--json FILE] [--variants plain,phalanx-nccl-1,...]

The model and settings of the GPU table: a 25.2M-parameter MLP (Linear(1024,2048),
5 x Linear(2048,2048), Linear(2048,1000), ReLU between), batch 256 per rank, SGD,
TF32 allowed; the step time is the median of 7 blocks of 5 steps after 5 warm-up
steps (the GPU synchronized around each block). Variants: plain torch in one process;
phalanx and DDP on nccl at one rank; phalanx on mpi (staged through the host) and on
gloo (staged by phalanx, and handed to gloo directly: ``PHALANX_GLOO_CUDA=direct``), and
DDP on gloo, with two ranks sharing the GPU. Each world is started with
``phalanx.testing.run_world`` (DDP uses the process group phalanx made). Without CUDA
it exits with status 2 saying so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

VARIANTS = {  # name: (framework, backend, ranks)
    "plain": ("plain", None, 1),
    "phalanx-nccl-1": ("phalanx", "nccl", 1),
    "ddp-nccl-1": ("ddp", "nccl", 1),
    "phalanx-mpi-2": ("phalanx", "mpi", 2),
    "phalanx-gloo-2": ("phalanx", "gloo", 2),
    "phalanx-gloo-2-direct": ("phalanx", "gloo", 2),  # PHALANX_GLOO_CUDA=direct: gloo stages CUDA itself
    "ddp-gloo-2": ("ddp", "gloo", 2),
}
WARMUP, BLOCKS, STEPS, BATCH = 5, 7, 5, 256


def _model(torch: Any) -> Any:
    torch.manual_seed(0)
    layers: list[Any] = [torch.nn.Linear(1024, 2048), torch.nn.ReLU()]
    for _ in range(5):
        layers += [torch.nn.Linear(2048, 2048), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(2048, 1000))
    return torch.nn.Sequential(*layers)


def measure(framework: str, kind: str = "cuda") -> float:
    """The median step time in ms of ``framework`` on this process's GPU (inside a world but for plain);
    ``kind="cpu"`` runs the same code on the CPU (``--smoke-on-cpu``: checks the script, measures nothing)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if framework == "plain" or kind == "cpu":
        device = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
    else:
        import phalanx

        device = phalanx.device() if phalanx.backend().name == "nccl" else torch.device("cuda", 0)
    sync = torch.cuda.synchronize if kind == "cuda" else (lambda device: None)
    if kind == "cuda":
        torch.cuda.set_device(device)
    model = _model(torch).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if framework == "phalanx":
        import phalanx.torch as pt

        model = pt.DataParallel(model)
    elif framework == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index]
                                                          if device.type == "cuda" and _nccl() else None)
    x = torch.randn(BATCH, 1024, device=device)
    y = torch.randint(0, 1000, (BATCH,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    warmup, blocks, steps = (WARMUP, BLOCKS, STEPS) if kind == "cuda" else (1, 1, 1)
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def _nccl() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and "nccl" in str(dist.get_backend())


def _in_world(framework: str, kind: str) -> float:
    return measure(framework, kind)


def run(variant: str, kind: str = "cuda") -> float:
    """The step time in ms of one variant (started in its own world of processes)."""
    framework, backend, ranks = VARIANTS[variant]
    if backend is None:
        return measure(framework, kind)
    from phalanx.testing import run_world

    env = {"PHALANX_GPU_AWARE_MPI": "0"} if backend == "mpi" else {}
    if variant.endswith("-direct"):
        env["PHALANX_GLOO_CUDA"] = "direct"
    times = run_world(_in_world, ranks, backend, timeout=300, args=(framework, kind), env=env)
    return max(times)


def main(argv: list[str] | None = None) -> int:
    """Measure the variants; print a table, and write ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--smoke-on-cpu", action="store_true",
                        help="run every variant but nccl once on the CPU (checks the script; no figures)")
    args = parser.parse_args(argv)
    import torch

    if args.smoke_on_cpu:
        for name in (v for v in args.variants.split(",") if v and "nccl" not in v):
            print(f"{name:22s} ran on the CPU ({run(name, 'cpu'):.1f} ms)", flush=True)
        return 0
    if not torch.cuda.is_available():
        print("gpu_step.py needs CUDA: torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}); run it on a machine with a CUDA GPU.", file=sys.stderr)
        return 2
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    card = torch.cuda.get_device_name(0)
    results: dict[str, Any] = {"card": card, "torch": torch.__version__, "steps": f"median of {BLOCKS} x {STEPS}",
                               "batch_per_rank": BATCH, "ms": {}}
    for name in names:
        try:
            results["ms"][name] = round(run(name), 3)
        except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
            results["ms"][name] = None
            results.setdefault("errors", {})[name] = str(exc)[-2000:]
        print(f"{name:22s} {results['ms'][name]} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if "errors" not in results else 1


if __name__ == "__main__":
    sys.exit(main())
