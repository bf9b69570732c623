"""Sharded optimizer state for optax: each rank keeps the state of 1/N of the flattened parameters.

::

    tx = phalanx.jax.DistributedOptimizer(optax.adam(1e-3), shard="optimizer")
    opt_state = tx.init(params)                 # adam's moments for this rank's slice only
    updates, opt_state = tx.update(grads, opt_state, params)   # whole updates, as unsharded
    full = tx.full_state(opt_state)             # optax.adam's own state, for a checkpoint
    opt_state = tx.shard_state(full, params)    # and back (any world size)

The parameter pytree is flattened (its leaves in ``jax.tree_util`` order,
each raveled) into one vector of P elements, padded with zeros to ``N * k``
(``k = ceil(P / N)``, at least 1); rank ``r`` owns elements ``[r*k, (r+1)*k)``
(the layout of :mod:`phalanx._layout`). ``update``
flattens the gradients, reduce-scatters them (``phalanx.reduce_scatter``:
rank ``r`` receives the average of its slice), runs the transformation on the
slice (with the slice of the parameters), all-gathers the updated slices and
unflattens them into the parameters' pytree. Both collectives go through an
ordered host callback, so ``update`` works eagerly and inside ``jax.jit``.
The transformation's state is its state for a vector of ``k`` elements: 1/N
of the unsharded state. Only element-wise transformations are accepted, and
``clip_by_global_norm`` with its norm taken over every rank's slice
(:mod:`._elementwise`), so the result is the unsharded one.

``shard="gradients"`` runs the same path: JAX hands the whole gradient pytree
to ``update``, whose reduce-scatter already leaves each rank only its shard of
the reduced gradient (the unsharded path allreduces it), and the reduced
gradient is never handed back to the caller; the two values differ in name only.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback

import phalanx

from .._agreement import agree
from .._errors import CollectiveMismatchError, InvalidArgumentError, UsageError
from .._groups import world_for
from .._layout import chunk_size, offsets, padded_size, rank_range
from ..comm import GradientOp
from ._elementwise import for_shard
from ._jit import traced_allreduce

__all__ = ["ShardedState", "ShardedTransformation", "sharded"]

CALL = "phalanx.jax.DistributedOptimizer"


class ShardedState(NamedTuple):
    """The state of a sharded ``DistributedOptimizer``: the transformation's state for this rank's slice."""

    inner: Any


class ShardedTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation whose state is sharded; also converts states for checkpoints."""

    __slots__ = ()

    def full_state(self, state: ShardedState, params: Any = None) -> Any:
        """The unsharded transformation's state (as ``tx.init(params)`` gives it), on every rank.

        A collective (one allgather per parameter-shaped leaf of the state): call
        it on every rank. ``params`` is needed only if this rank has not run
        ``init``. The result loads into ``DistributedOptimizer(tx)`` (unsharded)
        or ``tx`` itself, and back with :meth:`shard_state`.
        """
        return _impl(self).full_state(state, params)

    def shard_state(self, full: Any, params: Any = None) -> ShardedState:
        """This rank's :class:`ShardedState` cut from an unsharded state ``full``.

        ``full``: the unsharded transformation's state, e.g. from :meth:`full_state`
        at any world size, or ``tx.init(params)`` of plain optax. ``params`` is
        needed only if this rank has not run ``init``; then the ranks first agree
        on the layout (one small collective), else nothing is sent. Raises
        InvalidArgumentError for a state of another transformation.
        """
        return _impl(self).shard_state(full, params)


class _Layout:
    """The flattened parameter vector: leaves, sizes, padding and this rank's slice."""

    def __init__(self, params: Any, n: int, rank: int, call: str) -> None:
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        dtypes = {str(jnp.result_type(x)) for x in leaves}
        if not leaves or len(dtypes) != 1 or not jnp.issubdtype(jnp.result_type(leaves[0]), jnp.inexact):
            raise InvalidArgumentError(
                f"{call}: sharding flattens the parameters into one vector, so they must be arrays of one "
                f"floating dtype; received {len(leaves)} leaves of dtypes {sorted(dtypes)}. Cast them to one "
                "dtype, or use shard=None.")
        self.dtype = jnp.result_type(leaves[0])
        self.shapes = [tuple(jnp.shape(x)) for x in leaves]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.total = sum(self.sizes)
        self.n, self.rank = n, rank
        self.k = chunk_size(self.total, n, minimum=1)
        self.padded = padded_size(self.total, n, minimum=1)  # n * k

    def key(self) -> list[Any]:
        return [str(self.treedef), str(self.dtype), [list(s) for s in self.shapes]]

    def check(self, tree: Any, what: str, call: str) -> list[Any]:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if str(treedef) != str(self.treedef) or [tuple(jnp.shape(x)) for x in leaves] != self.shapes:
            raise InvalidArgumentError(
                f"{call}: {what} do not have the structure and shapes of the parameters passed to "
                f"init ({self.treedef}, shapes {self.shapes}); received {treedef}, shapes "
                f"{[tuple(jnp.shape(x)) for x in leaves]}. Pass the same pytree of parameters.")
        return leaves

    def flatten(self, tree: Any, what: str, call: str, dtype: Any = None) -> Any:
        """``tree``'s leaves raveled, concatenated and zero-padded to ``n * k`` elements (``self.padded``)."""
        leaves = self.check(tree, what, call)
        dtype = self.dtype if dtype is None else dtype
        flat = [jnp.ravel(jnp.asarray(x, dtype)) for x in leaves]
        pad = self.padded - self.total
        return jnp.concatenate(flat + ([jnp.zeros(pad, dtype)] if pad else []))

    def mine(self, flat: Any) -> Any:
        lo, hi = rank_range(self.padded, self.n, self.rank)  # of the padded vector: k elements
        return flat[lo:hi]

    def unflatten(self, flat: Any) -> Any:
        ends = offsets(self.sizes)[1:]
        pieces = jnp.split(flat[:self.total], ends)
        return jax.tree_util.tree_unflatten(self.treedef, [p.reshape(s) for p, s in zip(pieces, self.shapes,
                                                                                        strict=True)])


class _Sharded:
    """The state of one sharded transformation: its layout (set by ``init``) and its collectives."""

    def __init__(self, tx: Any, shard: str, op: GradientOp, group: Any) -> None:
        self.tx, self.shard, self.op, self.group = optax.with_extra_args_support(tx), shard, op, group
        self.layout: _Layout | None = None

    def set_layout(self, params: Any, call: str) -> _Layout:
        short = call.removeprefix("phalanx.")  # the name phalanx's own messages put after "phalanx."
        world = world_for(self.group, short)
        layout = _Layout(params, world.size, world.rank, call)
        if self.layout is None or self.layout.key() != layout.key():
            tables = agree(world, short, [self.shard, self.op, layout.total, str(layout.dtype)])
            if tables is not None:
                raise CollectiveMismatchError(
                    f"{call}: the ranks disagree on (shard, op, parameter count, dtype): {tables} in rank "
                    "order, so no state was made. Pass the same shard= and the same parameters on every rank.")
            self.layout = layout
        return self.layout

    def need(self, params: Any, call: str) -> _Layout:
        if params is not None:
            return self.set_layout(params, call)
        if self.layout is None:
            raise UsageError(f"{call}: this rank has not run init(params), so the parameter layout is "
                             "unknown. Pass params=, or call init(params) first.")
        return self.layout

    def init(self, params: Any) -> ShardedState:
        layout = self.set_layout(params, f"{CALL}.init")
        return ShardedState(self.tx.init(layout.mine(layout.flatten(params, "params", f"{CALL}.init"))))

    def update(self, updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        call = f"{CALL}.update"
        if not isinstance(state, ShardedState):
            raise InvalidArgumentError(f"{call}(shard={self.shard!r}): the state is a {type(state).__name__}, "
                                       "not this optimizer's ShardedState. Pass the state its init returned, or "
                                       "convert an unsharded one with tx.shard_state(full, params).")
        layout = self.need(None, call)
        grads = self._reduce_scatter(layout.flatten(updates, "the gradients", call), layout)
        mine = None if params is None else layout.mine(layout.flatten(params, "params", call))
        step, inner = self.tx.update(grads, state.inner, mine, **extra)
        whole = self._allgather(jnp.asarray(step, layout.dtype), layout)
        return layout.unflatten(whole), ShardedState(inner)

    def _reduce_scatter(self, flat: Any, layout: _Layout) -> Any:
        def host(x: Any) -> np.ndarray:
            out = phalanx.reduce_scatter(np.asarray(x), op=self.op, group=self.group)
            return np.asarray(out, dtype=layout.dtype).reshape(layout.k)

        return io_callback(host, jax.ShapeDtypeStruct((layout.k,), layout.dtype), flat, ordered=True)

    def _allgather(self, part: Any, layout: _Layout) -> Any:
        def host(x: Any) -> np.ndarray:
            out = phalanx.allgather(np.asarray(x), group=self.group)
            return np.asarray(out, dtype=layout.dtype).reshape(layout.padded)

        return io_callback(host, jax.ShapeDtypeStruct((layout.padded,), layout.dtype), part, ordered=True)

    def _slice_template(self, layout: _Layout) -> Any:
        return jax.eval_shape(self.tx.init, jax.ShapeDtypeStruct((layout.k,), layout.dtype))

    def full_state(self, state: Any, params: Any) -> Any:
        call = f"{CALL}.full_state"
        layout = self.need(params, call)
        if not isinstance(state, ShardedState):
            raise InvalidArgumentError(f"{call}: received a {type(state).__name__}, not a ShardedState.")
        leaves, treedef = jax.tree_util.tree_flatten(state.inner)
        out = []
        for leaf in leaves:
            if jnp.shape(leaf) == (layout.k,):  # parameter-shaped: every rank's slice, unflattened
                stacked = np.asarray(phalanx.allgather(np.asarray(leaf), group=self.group)).reshape(-1)
                out.append(jax.tree_util.tree_map(jnp.asarray, layout.unflatten(stacked)))
            else:  # a scalar every rank shares (a step count)
                out.append(leaf)
        return jax.tree_util.tree_unflatten(treedef, out)

    def shard_state(self, full: Any, params: Any) -> ShardedState:
        call = f"{CALL}.shard_state"
        layout = self.need(params, call)
        template, treedef = jax.tree_util.tree_flatten(self._slice_template(layout))
        try:
            parts = cast(Any, treedef).flatten_up_to(full)  # a PyTreeDef method its stubs omit
        except (ValueError, TypeError) as exc:
            raise InvalidArgumentError(
                f"{call}: the state is not the unsharded state of this transformation ({exc}). Pass the "
                "state tx.full_state or the unsharded optimizer's init/update gave.") from None
        out = []
        for t, part in zip(template, parts, strict=True):
            if t.shape == (layout.k,):
                out.append(layout.mine(layout.flatten(part, "the state's parameter-shaped parts", call, t.dtype)))
            else:
                out.append(jnp.asarray(part, t.dtype))
        return ShardedState(jax.tree_util.tree_unflatten(treedef, out))


def sharded(tx: Any, shard: str, op: GradientOp, compression: str | None, group: Any) -> ShardedTransformation:
    """The sharded ``DistributedOptimizer(tx, shard=...)`` (module docstring); refuses what cannot shard."""
    call = f"{CALL}(shard={shard!r})"
    if compression is not None:
        raise InvalidArgumentError(f"{call}: compression={compression!r} is not supported with sharding "
                                   "(the reduce-scatter runs in the parameters' dtype). Use compression=None "
                                   "or shard=None.")
    if isinstance(tx, optax.MultiSteps):
        raise InvalidArgumentError(f"{call}: optax.MultiSteps cannot be sharded (its accumulator is the "
                                   "whole gradient). Use shard=None for gradient accumulation.")
    tx = optax.identity() if tx is None else tx
    impl = _Sharded(for_shard(tx, call, lambda x: traced_allreduce(x, "sum", group)), shard, op, group)
    return ShardedTransformation(impl.init, impl.update)


def _impl(tx: ShardedTransformation) -> _Sharded:
    impl = getattr(tx.update, "__self__", None)
    if not isinstance(impl, _Sharded):
        raise UsageError("phalanx.jax: full_state/shard_state belong to the transformation "
                         "DistributedOptimizer(..., shard=...) returned.")
    return impl
