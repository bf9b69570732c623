"""Horovod's training API (phalanx.horovod.torch): DistributedOptimizer against one process on the
combined batch (SGD, Adam, backward_passes_per_step, fp16, gradient_predivide_factor, Sum, Adasum),
its class and Horovod's errors, the broadcasts, Compression and SyncBatchNorm, at 1, 2 and 3 ranks
on mpi and gloo (one world per backend and size, one test id per behaviour)."""

from __future__ import annotations

import atexit
import shutil
import tempfile

import pytest

import worlds_horovod_training as bodies
from conftest import world_params

COMMITS = tempfile.mkdtemp(prefix="hvd-elastic-")  # TorchState.commit() writes here
atexit.register(shutil.rmtree, COMMITS, True)
WORLDS = [("mpi", 1), ("mpi", 2), ("gloo", 2), ("gloo", 3)]  # every size and backend, not every pair


@pytest.mark.parametrize("behaviour", bodies.TRAINING.names)
@pytest.mark.parametrize("backend,n", world_params(WORLDS))
def test_horovod_training(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.training, backend, n, behaviour, op_timeout=20, timeout=90,
                 env={"PHALANX_ELASTIC_DIR": COMMITS})
