"""``phalanx.jax.DistributedOptimizer(tx)``: an optax transformation that averages gradients first.

::

    tx = phalanx.jax.DistributedOptimizer(optax.adam(1e-3))      # or phalanx.jax.distributed(...)
    tx = optax.MultiSteps(phalanx.jax.distributed(optax.adam(1e-3)), every_k_schedule=4)

Its ``update`` reduces the gradients across ranks (one fused allreduce per
dtype; inside ``jax.jit`` through an ordered host callback) and hands them to
``tx``.

Gradient accumulation: wrap ``optax.MultiSteps`` from the *outside*,
``distributed(optax.MultiSteps(tx, k))``. MultiSteps runs its inner
transformation on every micro-step and keeps its result only on the last one
(``jnp.where``, not a branch), so a reduction placed inside it
(``MultiSteps(distributed(tx), k)``) communicates on every micro-step: correct,
k times the traffic. From the outside, the wrapper asks MultiSteps (through its
public ``has_updated``) whether this micro-step applies the update, and only
then (a ``lax.cond`` branch) reduces the micro-step's gradient together with
the accumulator in the state, in one fused call; the accumulation is linear,
so the inner transformation sees the mean over ranks of the whole window.
Micro-steps that do not apply communicate nothing.
"""

from __future__ import annotations

from typing import Any

import optax

from .._errors import InvalidArgumentError
from .._gradients import GradientOp, check_gradient_op
from ._api import allreduce_gradients
from ._pytrees import COMPRESSIONS

__all__ = ["DistributedOptimizer", "distributed"]

SHARDS = (None, "optimizer", "gradients")


def distributed(tx: Any = None, op: GradientOp = "avg", compression: str | None = None,
                group: Any = None, shard: str | None = None) -> Any:
    """An ``optax.GradientTransformation``: gradients reduced across ranks, then ``tx``.

    Arguments:
        tx: the optax transformation to apply to the reduced gradients (any
            ``GradientTransformation``, extra-args ones included); None gives the
            reduction alone, for ``optax.chain(phalanx.jax.distributed(), ...)``.
        op: ``"avg"`` (default: the mean over ranks, as Lux) or ``"sum"`` (FluxMPI's).
        compression: None, ``"fp16"`` or ``"bf16"``: float32/float64 gradients
            travel in 16 bits (fp16: divided by the world size before the sum,
            so it cannot overflow; 16 bits on the wire on MPI and gloo) and come
            back in their dtype. bf16 is rounded to bfloat16 and reduced in
            float32 (no MPI has bfloat16).
        group: a phalanx group to reduce over; None is the whole world.
        shard: None (default: every rank keeps the whole state), ``"optimizer"``
            or ``"gradients"``: the parameters are flattened into one vector and
            each rank keeps the state of its 1/N slice; gradients are
            reduce-scattered, ``tx`` updates the slice, the updates are
            all-gathered (the two values run the same path in JAX: the reduced
            gradient is never handed back). Only element-wise optax
            transformations (sgd, adam, adamw, ... and chains of them, with
            ``clip_by_global_norm`` over the whole gradient's norm); the
            result is then a ``ShardedTransformation`` whose ``full_state`` and
            ``shard_state`` convert states for checkpoints (docs/jax.md,
            "Sharded optimizer state").

    Returns a ``GradientTransformationExtraArgs`` whose state is ``tx``'s. Works
    inside ``jax.jit``. For gradient accumulation wrap ``optax.MultiSteps`` from
    the outside, ``distributed(optax.MultiSteps(tx, k))``: it then communicates
    only on the micro-steps that apply the update, reducing that micro-step's
    gradient and the accumulator together (inside, ``MultiSteps(distributed(tx), k)``
    is correct but sends on every micro-step). Raises InvalidArgumentError for
    another op, compression or shard, for a transformation that is not element-wise
    with a shard, and CollectiveMismatchError (at ``init``) when ranks disagree on ``shard``.

    Example::

        tx = phalanx.jax.distributed(optax.adam(1e-3))
        updates, opt_state = tx.update(grads, opt_state, params)   # grads averaged, then adam
    """
    check_gradient_op("jax.distributed", op)
    if compression not in COMPRESSIONS:
        raise InvalidArgumentError(f"phalanx.jax.distributed(compression={compression!r}): use None, "
                                   "'fp16' or 'bf16'.")
    if shard not in SHARDS:
        raise InvalidArgumentError(f"phalanx.jax.DistributedOptimizer(shard={shard!r}): use None, 'optimizer' "
                                   "or 'gradients'.")
    if shard is not None:
        from ._shard import sharded

        return sharded(tx, shard, op, compression, group)
    if isinstance(tx, optax.MultiSteps):
        return _around_multisteps(tx, op, compression, group)
    inner = optax.with_extra_args_support(tx if tx is not None else optax.identity())

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        reduced = allreduce_gradients(updates, op, group=group, compression=compression)
        return inner.update(reduced, state, params, **extra)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def DistributedOptimizer(tx: Any = None, op: GradientOp = "avg", compression: str | None = None,  # noqa: N802
                         group: Any = None, shard: str | None = None) -> Any:
    return distributed(tx, op, compression, group, shard)


# One text for both names: Lux's name leads, then distributed's own documentation.
DistributedOptimizer.__doc__ = ("Lux's ``DistributedOptimizer`` in optax terms: the same as "
                                "``phalanx.jax.distributed``.\n\n    " + (distributed.__doc__ or ""))


def _around_multisteps(ms: Any, op: GradientOp, compression: str | None, group: Any) -> Any:
    """MultiSteps with the reduction on its applying micro-steps only (module docstring)."""
    import jax

    def reduce_both(pair: Any) -> Any:
        return allreduce_gradients(pair, op, group=group, compression=compression)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        _, probe = ms.update(updates, state, params, **extra)  # only its step counters are used
        applies = ms.has_updated(probe)
        pair = (updates, state.acc_grads)
        if isinstance(applies, jax.core.Tracer):
            updates, acc = jax.lax.cond(applies, reduce_both, lambda p: p, pair)
        else:
            updates, acc = reduce_both(pair) if bool(applies) else pair
        return ms.update(updates, state._replace(acc_grads=acc), params, **extra)

    return optax.GradientTransformationExtraArgs(ms.init, update)
