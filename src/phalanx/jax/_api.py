"""The JAX entry points that also work inside ``jax.jit``: ``allreduce`` and ``allreduce_gradients``."""

from __future__ import annotations

from typing import Any

import phalanx

from .._errors import InvalidArgumentError
from .._gradients import GradientOp, check_gradient_op, has_jax_leaves
from ._jit import is_traced, traced_allreduce, traced_reduce_tree
from ._pytrees import COMPRESSIONS, reduce_jax_tree

__all__ = ["allreduce", "allreduce_gradients"]


def allreduce_gradients(grads: Any, op: GradientOp = "avg", *, group: Any = None,
                        compression: str | None = None) -> Any:
    """A new pytree: ``grads``' arrays averaged (or summed) across ranks, one fused reduction per dtype.

    >>> grads = phalanx.jax.allreduce_gradients(jax.grad(loss)(params, batch))

    Arguments:
        grads: any JAX pytree (non-array leaves left alone), the same structure,
            shapes and dtypes on every rank; also torch modules and lists/dicts of
            NumPy arrays, as :func:`phalanx.allreduce_gradients`.
        op: ``"avg"`` (default) or ``"sum"``.
        group: a phalanx group; None is the whole world.
        compression: None, ``"fp16"`` or ``"bf16"`` (see :func:`phalanx.jax.distributed`).

    Works eagerly and inside ``jax.jit`` (traced leaves: an ordered host callback
    per dtype, so every rank reduces in the same order). Returns the new pytree.
    Raises InvalidArgumentError (another op or compression), CollectiveMismatchError
    (ranks differ in structure, shape or dtype; on every rank), CollectiveTimeoutError,
    RankFailedError.
    """
    check_gradient_op("jax.allreduce_gradients", op)
    if compression not in COMPRESSIONS:
        raise InvalidArgumentError(f"phalanx.jax.allreduce_gradients(compression={compression!r}): use "
                                   "None, 'fp16' or 'bf16'.")
    if is_traced(grads):
        return traced_reduce_tree(grads, op, group, compression)
    if has_jax_leaves(grads):
        return reduce_jax_tree(grads, op, group, compression)
    return phalanx.allreduce_gradients(grads, op, group=group)


def allreduce(x: Any, op: phalanx.Op = "sum", *, group: Any = None, step: int | None = None) -> Any:
    """``x`` reduced over ranks with ``op``, eagerly or inside ``jax.jit`` (an ordered host callback).

    Arguments: ``x`` (a JAX or NumPy array or scalar, alike on every rank), ``op``
    (``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"avg"``), ``group``, ``step``
    (eager calls only: an int label). Returns a new array. Raises what
    :func:`phalanx.allreduce` raises.
    """
    if is_traced(x):
        return traced_allreduce(x, op, group)
    return phalanx.allreduce(x, op, step=step, group=group)
