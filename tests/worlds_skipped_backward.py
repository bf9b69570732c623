"""Bodies for test_skipped_backward.py: a DataParallel rank that skips a backward (a "skip this bad
batch" branch), caught before gradients of different steps are mixed."""

from __future__ import annotations

import time
from typing import Any


def skipped_backward(check_steps: bool | None, logging: bool) -> dict[str, Any]:
    """Rank 1 skips step 1's backward; returns what each rank raised, where, and how fast."""
    import torch

    import phalanx
    import phalanx.torch

    torch.manual_seed(0)
    model = phalanx.torch.DataParallel(torch.nn.Linear(4, 3), **(
        {} if check_steps is None else {"check_steps": check_steps}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    for step in range(4):
        opt.zero_grad()
        loss = model(torch.ones(2, 4) * (step + 1)).square().sum()
        weights = model.module.weight.detach().clone()
        try:
            if not (step == 1 and phalanx.rank() == 1):
                loss.backward()
                opt.step()
            if logging:
                phalanx.allreduce(loss.detach(), op="avg")
        except phalanx.CollectiveMismatchError as exc:
            return {"type": "CollectiveMismatchError", "step": step, "message": str(exc),
                    "seconds": time.monotonic() - start,
                    "unchanged": bool(torch.equal(weights, model.module.weight.detach()))}
    return {"type": None, "step": None, "message": "", "seconds": time.monotonic() - start, "unchanged": True}
