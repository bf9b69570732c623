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

Importing this module imports jax and optax (``import phalanx`` does not).
``synchronize``, the collectives and ``DistributedDataContainer`` are phalanx's
own (they accept JAX arrays and pytrees); ``allreduce`` and
``allreduce_gradients`` also work inside ``jax.jit``. ``initialize_distributed``
sets up ``jax.distributed`` from phalanx's launch, for ``jax.lax.psum`` on XLA's
collectives. See docs/jax.md.
"""

from __future__ import annotations

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
from ._optax import DistributedOptimizer, distributed

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
