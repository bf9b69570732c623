"""Sparse gradients in Horovod's DistributedOptimizer (phalanx.horovod.torch): reduced sparse as
allgathers of indices and values (Horovod's path), accumulated over backward passes, or dense with
``sparse_as_dense=True``, each equal to one process on the combined batch, at 1, 2 and 3 ranks."""

from __future__ import annotations

import pytest

import worlds_horovod_sparse as bodies
from conftest import world_params

WORLDS = [("mpi", 1), ("mpi", 2), ("gloo", 3)]


@pytest.mark.parametrize("behaviour", bodies.SPARSE.names)
@pytest.mark.parametrize("backend,n", world_params(WORLDS))
def test_horovod_sparse_gradients(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.sparse, backend, n, behaviour, op_timeout=20, timeout=90)
