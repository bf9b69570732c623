"""Gradient reduction for JAX pytrees: one fused allreduce per dtype, a new pytree back.

::

    grads = jax.grad(loss)(params, batch)
    grads = phalanx.allreduce_gradients(grads)     # a new pytree: the mean over ranks

Used by :func:`phalanx.allreduce_gradients` when the leaves are JAX arrays (and
by :mod:`phalanx.jax`); it sits in the gradients layer, below ``phalanx.jax``'s
other modules, and imports neither jax nor optax itself. The leaves of each dtype are concatenated on the host
(no copy for a single CPU leaf), reduced in one call, split, and put back on
each leaf's device as new arrays; leaves that are not arrays are left alone.

Before the first reduction of a structure, the ranks agree on it (every
array leaf's path, dtype and shape: :func:`phalanx._agreement.agree`, one small
allreduce); a difference raises
the same :class:`CollectiveMismatchError` on every rank, naming the first
differing leaf. Later calls with a structure already agreed skip the check:
a rank whose structure changed then makes that check while the others reduce,
which the per-call agreement of :func:`phalanx.allreduce` turns into a
CollectiveMismatchError on every rank too. Inside ``jax.jit``
(:mod:`phalanx.jax`) the first callback of a compiled step makes the same
check.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from .._agreement import agree, first_difference
from .._arrays import jax_host_view
from .._collectives import allreduce
from .._errors import CollectiveMismatchError
from .._groups import world_for
from ..comm import GradientOp, Op

__all__ = ["COMPRESSIONS", "agree_structure", "reduce_host", "reduce_jax_tree", "structure_entries"]

COMPRESSIONS = {None: None, "none": None, "fp16": "float16", "bf16": "bfloat16"}
_agreed: dict[tuple[Any, ...], None] = {}  # structures the ranks agreed on (bounded)


def reduce_jax_tree(tree: Any, op: GradientOp = "avg", group: Any = None, compression: str | None = None,
                    call: str = "allreduce_gradients") -> Any:
    """A new pytree: ``tree``'s array leaves reduced over ranks with ``op``, one allreduce per dtype.

    Arguments: ``tree`` (any JAX pytree of concrete arrays), ``op`` (``"avg"`` or
    ``"sum"``), ``group`` (a phalanx group, None for the world), ``compression``
    (None, ``"fp16"`` or ``"bf16"``: float leaves travel in that dtype and come
    back in their own), ``call`` (the name used in error messages).

    Raises CollectiveMismatchError (ranks hold different structures, shapes or
    dtypes: on every rank, before any data moves), UnsupportedArgumentError (a
    traced leaf: inside jit use :mod:`phalanx.jax`), and what
    :func:`phalanx.allreduce` raises.
    """
    jax = sys.modules["jax"]
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in pairs]
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]
    _agree_once(jax, treedef, pairs, arrays, op, group, call)
    wire = COMPRESSIONS[compression]
    by_dtype: dict[str, list[int]] = {}
    for i in arrays:
        by_dtype.setdefault(str(leaves[i].dtype), []).append(i)
    out = list(leaves)
    for dtype, members in by_dtype.items():
        hosts = [jax_host_view(leaves[i], call) if not isinstance(leaves[i], np.ndarray) else leaves[i]
                 for i in members]
        flat = hosts[0].reshape(-1) if len(hosts) == 1 else np.concatenate([h.reshape(-1) for h in hosts])
        send = wire if (wire is not None and dtype in ("float32", "float64")) else None
        reduced = reduce_host(flat, op, group, send)
        offset = 0
        for i, h in zip(members, hosts, strict=True):
            part = reduced[offset:offset + h.size].reshape(h.shape)
            offset += h.size
            x = leaves[i]
            if isinstance(x, np.ndarray):
                out[i] = part.astype(x.dtype, copy=True)
            else:
                out[i] = jax.device_put(part.astype(x.dtype, copy=False), next(iter(x.sharding.device_set)))
    return jax.tree_util.tree_unflatten(treedef, out)


def reduce_host(flat: np.ndarray, op: Op, group: Any = None, wire: str | None = None) -> np.ndarray:
    """``flat`` (a 1-d host array) reduced over ranks; ``wire``: a 16-bit float dtype to send it in.

    bfloat16 (as data or as wire) is reduced in float32, since no MPI has it;
    float16 travels as 16 bits. An average in 16 bits divides before the sum
    (as torch's fp16 hooks do), so the sum cannot overflow.
    """
    dtype = flat.dtype
    if wire == "float16":
        send = flat.astype(np.float16)
        if op == "avg":
            send /= np.float16(_size(group))
            return allreduce(send, op="sum", group=group).astype(dtype)
        return allreduce(send, op=op, group=group).astype(dtype)
    if wire == "bfloat16":  # rounded to bfloat16, reduced in float32
        rounded = flat.astype(sys.modules["ml_dtypes"].bfloat16).astype(np.float32)
        return allreduce(rounded, op=op, group=group).astype(dtype)
    if dtype.name == "bfloat16":
        return allreduce(flat.astype(np.float32), op=op, group=group).astype(dtype)
    if not flat.flags.writeable:
        flat = flat.copy()  # reduced in place: one copy instead of a new result plus this view
    return allreduce(flat, op=op, group=group)


def _size(group: Any) -> int:
    return world_for(group, "allreduce_gradients").size


def _agree_once(jax: Any, treedef: Any, pairs: list[tuple[Any, Any]], arrays: list[int], op: str,
                group: Any, call: str) -> None:
    fast = (id(group), treedef, op, tuple((pairs[i][1].shape, str(pairs[i][1].dtype)) for i in arrays))
    if fast in _agreed:  # this structure was agreed on before: no paths to build, no call
        return
    agree_structure(structure_entries(jax, [pairs[i] for i in arrays]), op, group, call)
    _agreed[fast] = None


def structure_entries(jax: Any, pairs: list[tuple[Any, Any]]) -> list[tuple[str, str, list[int]]]:
    """``(path, dtype, shape)`` of each ``(key path, array)`` pair: what the ranks compare."""
    return [(jax.tree_util.keystr(path), str(x.dtype), [int(d) for d in x.shape]) for path, x in pairs]


def agree_structure(entries: list[tuple[str, str, list[int]]], op: str, group: Any, call: str) -> None:
    """Once per structure: one small allreduce; a difference raises the same error on every rank.

    Raises CollectiveMismatchError naming the first leaf whose path, dtype or
    shape differs (or the op), and what :func:`phalanx.allreduce` raises.
    """
    key = (id(group), op, json.dumps(entries))
    if key in _agreed:
        return
    tables = agree(world_for(group, call), call, [op, entries])
    if tables is not None:
        raise _mismatch(call, tables)
    if len(_agreed) > 128:
        _agreed.clear()
    _agreed[key] = None


def _mismatch(call: str, tables: list[Any]) -> CollectiveMismatchError:
    """The error naming the op, or the first leaf, that differs between the ranks' ``[op, entries]``."""
    ops = [t[0] for t in tables]
    if len(set(ops)) > 1:
        return CollectiveMismatchError(
            f"phalanx.{call}: the ranks passed different ops ({ops}, in rank order), so nothing was "
            "reduced. Pass the same `op` on every rank.")
    found = first_difference([t[1] for t in tables], lambda _r, s: f"a {s[1]}{s[2]} array" if s else
                             "nothing (no such leaf)", key=lambda e: e[0])
    if found is not None:
        path, _, lines = found
        return CollectiveMismatchError(
            f"phalanx.{call}: the ranks' gradient pytrees differ at {path or 'the root'}, so nothing "
            f"was reduced:\n{lines}\nEvery rank must pass the same structure, shapes and dtypes: "
            "build the model the same way on every rank and synchronize it.")
    return CollectiveMismatchError(
        f"phalanx.{call}: the ranks' gradient pytrees hold the same leaves in a different structure, so "
        "nothing was reduced. Build the model the same way on every rank.")
