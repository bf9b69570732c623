"""Per-rank memory and step time of a 134M-parameter GPT: replicated, ``shard="gradients"``,
``shard="parameters"`` (ZeRO-3; also built on the meta device, and with bf16 compute) and torch's FSDP2
(``fully_shard`` per block, on gloo, and on the ``"phalanx"`` torch.distributed backend over MPI:
``fsdp2-mpi``), in one run.

::

    python benchmarks/gpt.py --ranks 2,4 --json benchmarks/results/gpt.json

The model is a GPT-2-small shape: 12 blocks, d=768, 12 heads, vocabulary
32000, sequence 128, an untied output layer (134.0M float32 parameters),
AdamW (lr 1e-4, weight decay 0.1), batch 2 per rank, one thread per rank,
gloo (``fsdp2-mpi``: mpi). One world (``phalanx run -n N --backend gloo``)
per (N, variant), fresh processes each. In every rank:

1. take the resident set (``/proc/self/statm``) before the model is built:
   the base; a sampling thread (every millisecond) records the highest
   resident set from then on;
2. build the model on the CPU (same seed on every rank; ``parameters-meta``:
   on the meta device, materialized unit by unit by the wrapper) and wrap it
   (phalanx: ``DataParallel``, ``"parameters"`` with its default units: each
   block, the embeddings, the final norm and the output layer;
   ``parameters-bf16``: ``param_dtype=torch.bfloat16, reduce_dtype=torch.float32``;
   FSDP2: ``fully_shard`` on every block, then on the model), make AdamW on its
   parameters, run 2 warm-up steps;
3. reset the peak, run ``--steps`` timed steps (zero_grad, forward,
   cross-entropy, backward, step): the *training peak* is the highest
   resident set over them minus the base, the step time their median;
4. the *whole-run peak* is the highest resident set from the base to the
   end, minus the base (building the whole model on the CPU first counts).

A figure is the maximum over ranks (memory) or the slowest rank's median
(time). Every rank runs with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB (``--malloc default``: glibc's own settings), so
memory freed leaves the resident set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from memory import MIB, Sampler, rss  # the same resident-set sampling as the MLP benchmark

VARIANTS = ("replicated", "gradients", "parameters", "parameters-meta", "parameters-bf16", "fsdp2", "fsdp2-mpi")
VOCAB, SEQ, D, LAYERS, HEADS, BATCH = 32000, 128, 768, 12, 12, 2


def gpt(torch: Any) -> tuple[Any, Any]:
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.attn, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.fc, self.fc_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            q, k, v = self.attn(self.ln_1(x)).split(D, dim=2)
            q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in (q, k, v))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
            return x + self.fc_proj(torch.nn.functional.gelu(self.fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
            self.h = nn.ModuleList([Block() for _ in range(LAYERS)])
            self.ln_f = nn.LayerNorm(D)
            self.lm_head = nn.Linear(D, VOCAB, bias=False)

        def forward(self, idx: Any) -> Any:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    torch.manual_seed(0)
    return GPT(), Block


def worker(args: argparse.Namespace) -> None:
    import torch

    import phalanx
    import phalanx.torch as pt

    torch.set_num_threads(1)
    phalanx.init()
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # torch.optim's first use imports ~70 MiB of code
    import gc

    gc.collect()
    base = rss()
    sampler = Sampler()
    sampler.start()
    if args.variant == "parameters-meta":
        with torch.device("meta"):
            net, Block = gpt(torch)
    else:
        net, Block = gpt(torch)
    params = sum(p.numel() for p in net.parameters())
    if args.variant.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if args.variant == "fsdp2-mpi":  # the same FSDP2 over MPI: the "phalanx" torch.distributed backend
            pt.init_process_group()
        mesh = init_device_mesh("cpu", (phalanx.size(),))
        for block in net.h:
            fully_shard(block, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    else:
        shard = None if args.variant == "replicated" else args.variant.split("-")[0]
        mixed = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if args.variant.endswith("bf16") \
            else {}
        model = pt.DataParallel(net, shard=shard, **mixed)  # "parameters": the default units (blocks, embeddings,
        # final norm, output layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(phalanx.rank())
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)

    def step() -> None:
        opt.zero_grad()
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1)).backward()
        opt.step()

    for _ in range(2):
        step()
    whole_run = sampler.peak
    sampler.reset()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    train_peak = max(sampler.peak, rss())
    save_peak = 0
    if args.save and args.variant.startswith("parameters"):  # a sharded checkpoint and the export, after training
        import shutil

        sampler.reset()
        where = phalanx.broadcast_object(tempfile.mkdtemp(), root=0, allow_pickle=True)
        pt.save_sharded(os.path.join(where, "ckpt"), model, opt)
        pt.export_safetensors(os.path.join(where, "model.safetensors"), model)
        save_peak = max(sampler.peak, rss()) - base
        phalanx.barrier()
        if phalanx.rank() == 0:
            shutil.rmtree(where)
    sampler.stop()
    row = {"rank": phalanx.rank(), "train_peak": train_peak - base, "whole_run_peak": max(whole_run, train_peak) - base,
           "step_s": statistics.median(times), "params": params, "save_peak": save_peak}
    rows = phalanx.allgather_object(row, allow_pickle=True)
    if phalanx.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    phalanx.shutdown()


def run_world(args: argparse.Namespace, n: int, variant: str) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        inner = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--out", out,
                 "--steps", str(args.steps), *(["--save"] if args.save else [])]
        backend = "mpi" if variant == "fsdp2-mpi" else "gloo"
        cmd = [sys.executable, "-m", "phalanx", "run", "-n", str(n), "--backend", backend, "--timeout", "600", *inner]
        env = dict(os.environ)
        if args.malloc == "threshold":
            env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
        else:  # glibc's default settings (its threshold rises with the blocks freed)
            env.pop("MALLOC_MMAP_THRESHOLD_", None)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800,
                              env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"n={n} {variant}: failed\n{proc.stdout[-3000:]}", file=sys.stderr)
            return None
        with open(out) as f:
            rows = json.load(f)
    return {"ranks": n, "variant": variant, "params": rows[0]["params"],
            "train_peak_mib": max(r["train_peak"] for r in rows) / MIB,
            "whole_run_peak_mib": max(r["whole_run_peak"] for r in rows) / MIB,
            "step_ms": max(r["step_s"] for r in rows) * 1e3, "rows": rows,
            "save_peak_mib": max(r.get("save_peak", 0) for r in rows) / MIB}


def table(results: list[dict[str, Any]]) -> str:
    fsdp = {r["ranks"]: r for r in results if r["variant"] == "fsdp2"}
    lines = ["| N | variant | training peak MiB/rank | × FSDP2 | whole-run peak MiB/rank | step ms | × FSDP2 |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        ref = fsdp.get(r["ranks"])
        mem = f"{r['train_peak_mib'] / ref['train_peak_mib']:.2f}" if ref else "–"
        t = f"{r['step_ms'] / ref['step_ms']:.2f}" if ref else "–"
        lines.append(f"| {r['ranks']} | {r['variant']} | {r['train_peak_mib']:.0f} | {mem} | "
                     f"{r['whole_run_peak_mib']:.0f} | {r['step_ms']:.0f} | {t} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, default="replicated")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated (default 2,4)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="variants, comma-separated")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after 2 warm-up steps (default 3)")
    parser.add_argument("--save", action="store_true",
                        help="after the timed steps, the parameter-sharded variants write a sharded checkpoint and "
                             "the safetensors export: their peak (minus the base) is save_peak_mib")
    parser.add_argument("--malloc", choices=("threshold", "default"), default="threshold",
                        help="glibc's allocator in every rank: MALLOC_MMAP_THRESHOLD_ at 1 MiB (default), or "
                             "glibc's own default settings")
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = []
    for n in (int(v) for v in args.ranks.split(",")):
        for variant in args.variants.split(","):
            result = run_world(args, n, variant)
            if result is not None:
                results.append(result)
                print(f"N={n} {variant}: training peak {result['train_peak_mib']:.0f} MiB, whole run "
                      f"{result['whole_run_peak_mib']:.0f} MiB, {result['step_ms']:.0f} ms/step, saving "
                      f"{result['save_peak_mib']:.0f} MiB", flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
