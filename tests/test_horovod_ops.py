"""hvd collectives (phalanx.horovod.torch) against NumPy references, on 1, 2 and 3 ranks of mpi and gloo.

One world per backend and size runs every behaviour of ``worlds_horovod_ops.OPS``:
Horovod's defaults (Average), ops and scale factors, uneven allgather/alltoall/
reducescatter, grouped, in-place and asynchronous variants, autograd, Adasum,
process sets, join, and the errors Horovod users catch.
"""

from __future__ import annotations

import pytest

import worlds_horovod_ops as bodies
from conftest import TRAINING_WORLDS, world_params

pytest.importorskip("torch")

WORLDS = TRAINING_WORLDS


@pytest.mark.parametrize("behaviour", bodies.OPS.names)
@pytest.mark.parametrize("backend,n", world_params(WORLDS))
def test_hvd_collectives(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.ops, backend, n, behaviour, op_timeout=20)
