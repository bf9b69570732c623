"""Rank bodies: under ``phalanx.horovod.torch`` a rank's extra blocking operation fails on that rank
alone; the majority's call is matched with the rank's next one and the world stays usable."""

from __future__ import annotations

from typing import Any

import torch

import phalanx
import phalanx.horovod.torch as hvd


def _extra_then(r: int, extra: int, then: Any) -> dict[str, Any]:
    """Rank ``extra`` makes one blocking allreduce the others never make, then every rank runs
    ``then()``: what each rank saw."""
    seen: dict[str, Any] = {"extra": None}
    if r == extra:
        try:
            hvd.allreduce(torch.ones(3), name="only-on-one-rank")
            seen["extra"] = "completed"
        except phalanx.PhalanxError as exc:
            seen["extra"] = type(exc).__name__
    seen["then"] = then()
    return seen


def extra_operation_fails_alone() -> dict[str, Any]:
    """3 ranks: rank 2's extra allreduce against the others' next named allreduce, then rank 1's
    against the others' add_process_set (phalanx.new_group's agreement); each time the extra call
    raises on its rank only and the others' call completes with every rank's contribution."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    summed = _extra_then(r, 2, lambda: hvd.allreduce(torch.full((2,), float(r)), name="next", op=hvd.Sum).tolist())

    def process_set() -> list[int]:
        ps = hvd.add_process_set([0, 1])
        try:
            return list(ps.ranks)
        finally:
            hvd.remove_process_set(ps)

    grouped = _extra_then(r, 1, process_set)
    after = hvd.allreduce(torch.ones(1), name="after", op=hvd.Sum).item()
    return {"summed": summed, "grouped": grouped, "after": after, "n": n}
