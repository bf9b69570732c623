"""CUDA paths: the nccl backend and CUDA tensors over MPI (GPU-aware or staged through the host).

These run only on a machine with a CUDA GPU; elsewhere they are skipped with
the reason. One GPU can show a world of one on nccl (NCCL refuses two ranks
on one device) and the MPI paths at 1 and 2 ranks.
"""

from __future__ import annotations

import pytest

import worlds_gpu as bodies
from conftest import AVAILABLE
from phalanx.testing import run_world

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


def test_nccl_world_of_one_on_cuda_tensors() -> None:
    [result] = run_world(bodies.cuda_collectives, 1, "nccl")
    assert result["checks"] > 10


@pytest.mark.skipif("mpi" not in AVAILABLE, reason="no MPI here")
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("gpu_aware", ["0", "auto"])
def test_cuda_tensors_over_mpi(n: int, gpu_aware: str) -> None:
    env = {"PHALANX_GPU_AWARE_MPI": "0"} if gpu_aware == "0" else {}
    results = run_world(bodies.cuda_collectives, n, "mpi", env=env)
    assert all(r["checks"] > 10 for r in results)
    if gpu_aware == "0":
        assert all(r["gpu_aware"] is False for r in results)
