"""CUDA paths: the nccl backend and CUDA tensors over MPI (GPU-aware or staged through the host).

These run only on a machine with a CUDA GPU; elsewhere they are skipped with
the reason. One GPU can show a world of one on nccl (NCCL refuses two ranks
on one device) and the MPI paths at 1 and 2 ranks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import worlds_gpu as bodies  # noqa: E402
from conftest import world_params  # noqa: E402
from helpers import requires_cuda  # noqa: E402

pytestmark = requires_cuda()


@pytest.mark.parametrize("behaviour", bodies.CUDA.names)
@pytest.mark.parametrize("backend,n", world_params([("nccl", 1)]))
def test_nccl_world_of_one_on_cuda_tensors(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.cuda_collectives, backend, n, behaviour)


@pytest.mark.parametrize("behaviour", bodies.CUDA.names)
@pytest.mark.parametrize("gpu_aware", ["0", "auto"])
@pytest.mark.parametrize("backend,n", world_params([("mpi", 1), ("mpi", 2)]))
def test_cuda_tensors_over_mpi(worlds, backend: str, n: int, gpu_aware: str, behaviour: str) -> None:
    env = {"PHALANX_GPU_AWARE_MPI": "0"} if gpu_aware == "0" else {}
    worlds.check(bodies.cuda_collectives, backend, n, behaviour, env=env)
