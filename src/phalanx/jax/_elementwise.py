"""Which optax transformations may run on a shard: the element-wise ones, recognised by name.

::

    check_elementwise(optax.adamw(1e-3), "phalanx.jax.DistributedOptimizer(shard='optimizer')")  # passes
    check_elementwise(optax.lamb(1e-3), ...)     # InvalidArgumentError naming scale_by_trust_ratio

A sharded optimizer runs the transformation on this rank's slice of the
flattened parameters; that equals the unsharded update only if each element's
update depends on that element alone (its gradient, its state, its parameter)
and on scalars every rank shares (the step count, a schedule). optax exposes
no such property, and its transformations are plain ``(init, update)`` pairs,
so phalanx recognises them by the qualified name of their update function
(``scale_by_adam.<locals>.update_fn`` is ``scale_by_adam``, from a module of
the ``optax`` package) and looks inside ``optax.chain`` (its ``update_fns``)
and optax's extra-args wrapper (its ``tx``). Every part must be on
:data:`ELEMENTWISE` or be ``clip_by_global_norm`` (:func:`for_shard` replaces
it by the same clip over the norm of every rank's shard); anything else — a
norm over the elements of a shard (``lamb``, ``lars``, ``novograd``), factored or per-dimension moments
(``adafactor``, ``sm3``), masks and per-leaf labels (``masked``,
``multi_transform``), per-leaf random keys (``add_noise``), wrappers phalanx
does not know (``MultiSteps``, ``inject_hyperparams``) and transformations
defined outside optax — is refused, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import InvalidArgumentError

__all__ = ["ELEMENTWISE", "check_elementwise", "for_shard", "parts"]

ELEMENTWISE = frozenset({
    "identity", "scale", "scale_by_schedule", "scale_by_learning_rate", "trace", "ema",
    "scale_by_adam", "scale_by_adamax", "scale_by_amsgrad", "scale_by_rms", "scale_by_rss",
    "scale_by_stddev", "scale_by_belief", "scale_by_lion", "scale_by_radam", "scale_by_yogi",
    "scale_by_sign", "scale_by_adadelta", "scale_by_rprop", "scale_by_adan",
    "add_decayed_weights", "clip", "keep_params_nonnegative",
})
"""optax constructors whose update is element-wise (optax's own names, as in ``optax.<name>``)."""

_CONTAINERS = {"chain": "update_fns", "with_extra_args_support": "tx"}


def parts(tx: Any) -> list[tuple[str, bool]]:
    """``(name, from optax)`` of each leaf transformation of ``tx``, looking inside chains."""
    return _walk(tx.update, 0)


def _walk(fn: Any, depth: int) -> list[tuple[str, bool]]:
    qualname = getattr(fn, "__qualname__", type(fn).__name__)
    name = qualname.split(".<locals>", 1)[0]
    module = getattr(fn, "__module__", "") or ""
    from_optax = module == "optax" or module.startswith("optax.")
    field = _CONTAINERS.get(name)
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if from_optax and field and code is not None and closure and depth < 32:
        cells = dict(zip(code.co_freevars, closure, strict=False))
        if field in cells:
            try:
                inner = cells[field].cell_contents
            except ValueError:  # an empty cell: not the layout this reads
                return [(name, False)]
            if field == "tx":
                return _walk(inner.update, depth + 1)
            return [p for f in inner for p in _walk(f, depth + 1)]
    return [(name, from_optax)]


def for_shard(tx: Any, call: str, global_sum: Callable[[Any], Any]) -> Any:
    """``tx`` to run on one rank's shard: ``clip_by_global_norm`` parts made global, the rest checked.

    ``optax.clip_by_global_norm(max_norm)`` computes the norm of what it sees, a
    shard; its replacement sums the shard's squares across ranks
    (``global_sum``, a collective every rank makes in the same place) and clips
    exactly as optax does. Chains are rebuilt from their parts (the same state
    structure); any other part must be element-wise (:func:`check_elementwise`).
    """
    if not any(name == "clip_by_global_norm" and from_optax for name, from_optax in parts(tx)):
        check_elementwise(tx, call)
        return tx
    name, cells = _cells(tx.update)
    if name == "with_extra_args_support":
        return for_shard(cells["tx"], call, global_sum)
    if name == "chain":
        _, init_cells = _cells(tx.init)
        pairs = zip(init_cells["init_fns"], cells["update_fns"], strict=True)
        import optax

        return optax.chain(*[for_shard(optax.GradientTransformation(i, u), call, global_sum) for i, u in pairs])
    if name == "clip_by_global_norm":
        return _global_clip(cells["max_norm"], global_sum)
    check_elementwise(tx, call)  # a wrapper phalanx does not open: refused, naming it
    return tx


def _cells(fn: Any) -> tuple[str, dict[str, Any]]:
    name = fn.__qualname__.split(".<locals>", 1)[0]
    return name, {k: c.cell_contents for k, c in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False)}


def _global_clip(max_norm: Any, global_sum: Callable[[Any], Any]) -> Any:
    """optax.clip_by_global_norm's update (optax 0.2's formula) with the norm over every rank's shard."""
    import jax
    import jax.numpy as jnp
    import optax

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        del params
        g_norm = jnp.sqrt(global_sum(jnp.sum(jnp.square(updates))))
        trigger = jnp.squeeze(g_norm < max_norm)
        return jax.lax.select(trigger, updates, (updates / g_norm.astype(updates.dtype)) * max_norm), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def check_elementwise(tx: Any, call: str) -> None:
    """Raise InvalidArgumentError naming the first part of ``tx`` that is not element-wise."""
    for name, from_optax in parts(tx):
        if from_optax and name in ELEMENTWISE:
            continue
        what = f"optax's {name}" if from_optax else f"the transformation {name!r} (not from optax)"
        raise InvalidArgumentError(
            f"{call}: {what} is not an element-wise transformation phalanx knows, so its update of one "
            "rank's shard of the parameters could differ from the update of the whole (norms over "
            "elements as in lamb and lars; factored moments as in adafactor; masks and "
            "per-leaf labels). Sharding runs only element-wise optax transformations (sgd, adam, adamw, "
            "rmsprop, adagrad, lion, ... and chains of them, with clip_by_global_norm; see docs/jax.md). Use shard=None for this "
            "transformation.")
