"""Collectives from inside ``jax.jit``: an ordered host callback into phalanx's collectives.

::

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        grads = phalanx.jax.allreduce_gradients(grads)   # traced: a callback in the compiled step
        ...

Inside a traced function the leaves of each dtype are concatenated on the
device, handed to the host by ``jax.experimental.io_callback(...,
ordered=True)`` (public API; ordered: the callbacks of a program run in
program order, so every rank makes its collectives in the same order), reduced
there by :func:`phalanx.allreduce`, and split again. On a GPU the callback's
operand is copied to host memory and the result back (staged). An ordered
callback cannot be batched by ``jax.vmap`` (JAX raises): reduce outside vmap.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from .._pytrees import COMPRESSIONS, reduce_host

__all__ = ["is_traced", "traced_allreduce", "traced_reduce_tree"]


def is_traced(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is a tracer (we are inside jit, grad, vmap, cond, ...)."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def traced_reduce_tree(tree: Any, op: str = "avg", group: Any = None, compression: str | None = None) -> Any:
    """``tree``'s array leaves reduced over ranks from traced code: one ordered callback per dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    wire = COMPRESSIONS[compression]
    by_dtype: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, (jax.Array, np.ndarray)):
            by_dtype.setdefault(jnp.asarray(x).dtype, []).append(i)
    out = list(leaves)
    for dtype, members in by_dtype.items():
        parts = [jnp.ravel(leaves[i]) for i in members]
        flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        send_dtype = wire if (wire is not None and dtype in (jnp.float32, jnp.float64)) else None
        if send_dtype is not None:  # cast on the device: the host copy is 16 bits too
            flat = flat.astype(send_dtype)
        reduced = traced_allreduce(flat, op, group).astype(dtype)
        offset = 0
        for i in members:
            size = int(np.prod(jnp.shape(leaves[i]), dtype=np.int64))
            out[i] = reduced[offset:offset + size].reshape(jnp.shape(leaves[i]))
            offset += size
    return jax.tree_util.tree_unflatten(treedef, out)


def traced_allreduce(x: Any, op: str = "sum", group: Any = None) -> Any:
    """``x`` (traced or not) reduced over ranks through an ordered host callback; same shape and dtype."""
    shape, dtype = jnp.shape(x), jnp.asarray(x).dtype

    def host(value: Any) -> np.ndarray:
        flat = np.asarray(value).reshape(-1)
        wire = None
        if flat.dtype.name in ("float16", "bfloat16") and op in ("sum", "avg"):
            wire, flat = flat.dtype.name, flat.astype(np.float32)  # reduce_host sends it in 16 bits
        return np.asarray(reduce_host(flat, op, group, wire), dtype=dtype).reshape(shape)

    return io_callback(host, jax.ShapeDtypeStruct(shape, dtype), x, ordered=True)
