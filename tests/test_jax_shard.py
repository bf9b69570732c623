"""phalanx.jax.DistributedOptimizer(tx, shard=...): sharded optax state (skipped without jax/optax).

One world per backend and size runs every behaviour of ``worlds_jax_shard.SHARD``
(float64: N ranks equal one process to 1e-10 for sgd with momentum, adam,
adamw and a chain, both shard values, a parameter count 3 does not divide;
the other element-wise optax optimizers; refusals; checkpoints between
sharded and unsharded states; ranks that disagree).
"""

from __future__ import annotations

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

import worlds_jax_shard as bodies  # noqa: E402
from conftest import world_params  # noqa: E402
from test_jax import ENV  # noqa: E402

# One rank on local, 2 and 3 on mpi (the JAX user's transport, as with mpi4jax), 2 on gloo.
JAX_WORLDS = [("local", 1), ("mpi", 2), ("mpi", 3), ("gloo", 2)]


@pytest.mark.parametrize("behaviour", bodies.SHARD.names)
@pytest.mark.parametrize("backend,n", world_params(JAX_WORLDS))
def test_jax_shard(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.shard_world, backend, n, behaviour, op_timeout=30, timeout=240, env=ENV)
