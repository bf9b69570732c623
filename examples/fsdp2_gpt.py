"""A GPT trained with FSDP2, written for torchrun as nanoGPT writes it; only the backend's name is phalanx's.

    phalanx run -n 2 --backend mpi examples/fsdp2_gpt.py               # FSDP2 over MPI
    phalanx run -n 2 --backend gloo examples/fsdp2_gpt.py --backend gloo   # the same on torch's gloo
    torchrun --nproc-per-node 2 examples/fsdp2_gpt.py                    # or under torchrun

Nothing here imports phalanx: ``init_process_group("phalanx")`` finds the
backend that phalanx registers with torch, and ``phalanx run`` sets
torchrun's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` on MPI too. The data are
random tokens from a fixed seed, so every run on every backend trains on the
same global batch; rank 0 prints the loss of each step and, with ``--json``,
writes the losses and a float64 checksum of the final weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812 - the usual name
from torch.distributed import destroy_process_group, init_process_group
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, layers: int, d: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="phalanx")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--dtype", default="float64")
    parser.add_argument("--json", default="", help="rank 0 writes the losses and a checksum here")
    args = parser.parse_args()

    # nanoGPT's setup, unchanged
    init_process_group(backend=args.backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0

    torch.manual_seed(1337)
    dtype = getattr(torch, args.dtype)
    model = GPT(vocab=64, block_size=16, layers=3, d=32, heads=4).to(dtype)
    for block in model.h:
        fully_shard(block)
    fully_shard(model)

    # nanoGPT's configure_optimizers: decay the matrices, not biases and norms
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))

    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)  # the global batch of this step: the same on every backend
        data = torch.randint(0, 64, (args.accumulate, ddp_world_size * args.batch, 17), generator=g)
        lr = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for micro in range(args.accumulate):
            mine = data[micro, ddp_rank * args.batch:(ddp_rank + 1) * args.batch]
            loss = model(mine[:, :-1].contiguous(), mine[:, 1:].contiguous()) / args.accumulate
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)  # this rank's; printed by rank 0
        if master_process:
            print(f"step {step}: loss {total:.6f}")

    weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
    checksum = sum(float((w.double() * (i + 1)).sum()) for i, (_, w) in enumerate(sorted(weights.items())))
    if master_process and args.json:
        with open(args.json, "w") as f:
            json.dump({"losses": losses, "checksum": checksum, "backend": args.backend}, f)
    destroy_process_group()


if __name__ == "__main__":
    main()
