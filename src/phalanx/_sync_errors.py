"""The error of a failed ``phalanx.synchronize`` agreement: which rank holds what, where, and the fix.

Every rank builds the same error from every rank's table of entries (``[path, kind,
dtype, shape, place, note]``, gathered by ``_sync._agree``), so every rank raises alike.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ._agreement import first_difference
from ._errors import CollectiveMismatchError

__all__ = ["mismatch_error"]


def mismatch_error(tables: list[dict[str, Any]]) -> CollectiveMismatchError:
    """The CollectiveMismatchError naming the first difference between the ranks' ``tables``
    (``{"root": int, "entries": [...]}`` per rank, in rank order)."""
    roots = [t["root"] for t in tables]
    if len(set(roots)) > 1:
        lines = [f"  rank {r}: root={x}" for r, x in enumerate(roots)]
        return CollectiveMismatchError("phalanx.synchronize: the ranks passed different roots, so nothing "
                                       "was sent:\n" + "\n".join(lines) + "\nEvery rank must pass the same "
                                       "`root`.")
    found = first_difference([t["entries"] for t in tables], lambda _r, e: _describe(e),
                             key=lambda e: e[0], compare=lambda e: e[:5])
    if found is not None:
        path, entries, shown = found
        return CollectiveMismatchError(
            f"phalanx.synchronize: the ranks' objects differ at {path}, so nothing was sent:\n"
            + shown + "\n" + _hint(path, entries))
    lines = [f"  rank {r}: {[e[0] for e in t['entries']][:8]}" for r, t in enumerate(tables)]
    return CollectiveMismatchError(
        "phalanx.synchronize: the ranks hold the same entries in a different order, so nothing was "
        "sent:\n" + "\n".join(lines) + "\nBuild the model and optimizer the same way on every rank.")


def _describe(entry: list[Any] | None) -> str:
    if entry is None:
        return "nothing (no such entry)"
    _path, kind, dtype, shape, place, note = entry
    if kind == "skip":
        return f"{note} (not synchronized)"
    if kind == "unsupported":
        return f"{note} (cannot be sent)"
    if kind == "jax":
        return f"a {dtype}{shape} JAX array"
    if kind in ("tensor", "ndarray"):
        where = f" on {'the CPU' if place == 'host' else place}" if kind == "tensor" else ""
        return f"a {dtype}{shape} {'torch tensor' if kind == 'tensor' else 'NumPy array'}{where}"
    if kind == "npscalar":
        return f"a NumPy scalar of dtype {np.dtype(dtype).name}"
    return f"a Python {kind}"


def _hint(path: str, found: list[list[Any] | None]) -> str:
    present = [e for e in found if e is not None]
    if len(present) < len(found):
        if ".state[" in path:
            return ("An optimizer has state only after its first step(): synchronize it before the first "
                    "step on every rank, or after a step on every rank.")
        return ("Every rank must hold the same keys, fields and list lengths: build the object the same "
                "way on every rank.")
    kinds, dtypes, shapes = ({json.dumps(e[i]) for e in present} for i in (1, 2, 3))
    if len(kinds) > 1:
        return "Every rank must hold the same kind of value here (e.g. a float, not an int, on every rank)."
    if len(dtypes) > 1:
        return "Every rank must hold the same dtype here: cast on the ranks that differ (e.g. `model.float()`)."
    if len(shapes) > 1:
        return "Every rank must hold the same shape here: build the model with the same configuration."
    return ("Tensors must be on the same kind of device on every rank (all on the CPU, or all on a GPU): "
            "move them with `.to(phalanx.device())` first.")


