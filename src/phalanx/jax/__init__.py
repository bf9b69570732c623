"""phalanx for JAX: pytrees, optax and jit on phalanx's collectives (Lux DistributedUtils in Python).

::

    import phalanx.jax as px
    px.init()
    params = px.synchronize(params)                      # root's pytree on every rank
    tx = px.DistributedOptimizer(optax.adam(1e-3))       # gradients averaged before adam
    opt_state = tx.init(params)
    data = px.DistributedDataContainer(dataset)          # this rank's share

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)   # reduces inside jit
        return optax.apply_updates(params, updates), opt_state

Importing this module imports jax (``import phalanx`` does not); optax is imported
when ``DistributedOptimizer`` or ``distributed`` is first used, so the collectives
and ``phalanx.allreduce_gradients`` on JAX pytrees need only jax.
``synchronize``, the collectives and ``DistributedDataContainer`` are phalanx's
own (they accept JAX arrays and pytrees); ``allreduce`` and
``allreduce_gradients`` also work inside ``jax.jit``. ``initialize_distributed``
sets up ``jax.distributed`` from phalanx's launch, for ``jax.lax.psum`` on XLA's
collectives. See docs/jax.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import (
    DistributedDataContainer,
    allgather,
    alltoall,
    barrier,
    broadcast,
    gather,
    iallreduce,
    ibroadcast,
    init,
    local_rank,
    local_size,
    rank,
    reduce,
    reduce_scatter,
    size,
    synchronize,
)
from ._api import allreduce, allreduce_gradients
from ._distributed import initialize_distributed, process_mesh

if TYPE_CHECKING:  # imported on first use (below): optax is needed only for these two
    from ._optax import DistributedOptimizer, distributed

_OPTAX_NAMES = ("DistributedOptimizer", "distributed")


def __getattr__(name: str) -> Any:
    # Python's module protocol: an unknown attribute must raise AttributeError (hasattr, import *).
    if name in _OPTAX_NAMES:
        from . import _optax

        return getattr(_optax, name)
    raise AttributeError(f"module 'phalanx.jax' has no attribute {name!r}")

__all__ = [
    "DistributedDataContainer",
    "DistributedOptimizer",
    "allgather",
    "allreduce",
    "allreduce_gradients",
    "alltoall",
    "barrier",
    "broadcast",
    "distributed",
    "gather",
    "iallreduce",
    "ibroadcast",
    "init",
    "initialize_distributed",
    "local_rank",
    "local_size",
    "process_mesh",
    "rank",
    "reduce",
    "reduce_scatter",
    "size",
    "synchronize",
]
