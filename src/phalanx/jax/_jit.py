"""Collectives from inside ``jax.jit``: an ordered host callback into phalanx's collectives.

::

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        grads = phalanx.jax.allreduce_gradients(grads)   # traced: a callback in the compiled step
        ...

Inside a traced function the leaves of each dtype are handed to the host by
one ``jax.experimental.io_callback(..., ordered=True)`` (public API; ordered:
the callbacks of a program run in program order, so every rank makes its
collectives in the same order), reduced there in one :func:`phalanx.allreduce`
of their concatenation, and split again. The first callback of a step also
agrees on the pytree's structure, once per structure (as the eager path does).
On a GPU the leaves are copied to host memory and the results back (staged).
An ordered callback cannot be batched by ``jax.vmap`` (JAX raises): reduce
outside vmap.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ..comm import GradientOp, Op
from ._pytrees import COMPRESSIONS, agree_structure, reduce_host, structure_entries

__all__ = ["is_traced", "traced_allreduce", "traced_reduce_tree"]


def is_traced(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is a tracer (we are inside jit, grad, vmap, cond, ...)."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def traced_reduce_tree(tree: Any, op: GradientOp = "avg", group: Any = None, compression: str | None = None) -> Any:
    """``tree``'s array leaves reduced over ranks from traced code: one ordered callback per dtype.

    The leaves of a dtype go to the host as they are; the callback concatenates
    them into one buffer (the only copy on the host), reduces it in place and
    hands back views of it, which JAX copies into the outputs.
    """
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in pairs]
    wire = COMPRESSIONS[compression]
    by_dtype: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, (jax.Array, np.ndarray)):
            by_dtype.setdefault(jnp.asarray(x).dtype, []).append(i)
    # The structure check runs in the first callback (once per structure, as eagerly).
    entries: list[tuple[str, str, list[int]]] | None = structure_entries(jax, [pairs[i] for members in by_dtype.values() for i in members])
    out = list(leaves)
    for dtype, members in by_dtype.items():
        shapes = [tuple(jnp.shape(leaves[i])) for i in members]
        send = wire if (wire is not None and dtype in (jnp.float32, jnp.float64)) else None
        host = _fused_host(shapes, op, group, send, entries)
        entries = None
        results = io_callback(host, [jax.ShapeDtypeStruct(s, dtype) for s in shapes],
                              *[leaves[i] for i in members], ordered=True)
        for i, value in zip(members, results, strict=True):
            out[i] = value
    return jax.tree_util.tree_unflatten(treedef, out)


def _fused_host(shapes: list[tuple[int, ...]], op: GradientOp, group: Any, wire: str | None,
                entries: list[tuple[str, str, list[int]]] | None) -> Any:
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    ends = np.cumsum(sizes)[:-1]

    def host(*arrays: Any) -> list[np.ndarray]:
        if entries is not None:
            agree_structure(entries, op, group, "allreduce_gradients")
        flat = np.concatenate([np.asarray(a).reshape(-1) for a in arrays])  # a new, writable buffer
        reduced = reduce_host(flat, op, group, wire)
        return [part.reshape(s) for part, s in zip(np.split(reduced, ends), shapes, strict=True)]

    return host


def traced_allreduce(x: Any, op: Op = "sum", group: Any = None) -> Any:
    """``x`` (traced or not) reduced over ranks through an ordered host callback; same shape and dtype."""
    shape, dtype = jnp.shape(x), jnp.asarray(x).dtype

    def host(value: Any) -> np.ndarray:
        flat = np.asarray(value).reshape(-1)
        wire = None
        if flat.dtype.name in ("float16", "bfloat16") and op in ("sum", "avg"):
            wire, flat = flat.dtype.name, flat.astype(np.float32)  # reduce_host sends it in 16 bits
        return np.asarray(reduce_host(flat, op, group, wire), dtype=dtype).reshape(shape)

    return io_callback(host, jax.ShapeDtypeStruct(shape, dtype), x, ordered=True)
