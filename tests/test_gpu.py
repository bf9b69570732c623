"""CUDA paths: the nccl backend and CUDA tensors over MPI (GPU-aware or staged through the host).

These run only on a machine with a CUDA GPU; elsewhere they are skipped with
the reason (but the check of ``available_backends()``). One GPU can show a
world of one on nccl (NCCL refuses two ranks on one device: init says so, naming
the ranks), the MPI paths at 1 and 2 ranks, and training on CUDA tensors equal
to the same training on CPU tensors (DistributedOptimizer, DataParallel, bf16,
PowerSGD, SyncBatchNorm) with two ranks sharing the GPU on mpi (staged) and
gloo, and one rank on nccl.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import worlds_gpu as bodies  # noqa: E402
from conftest import world_params  # noqa: E402
from helpers import requires_cuda  # noqa: E402
from phalanx.testing import WorldFailed, run_world  # noqa: E402

NEEDS_CUDA = requires_cuda()


def test_available_backends_lists_nccl_exactly_where_torch_has_nccl_and_a_gpu() -> None:
    import torch
    import torch.distributed as dist

    from phalanx.testing import available_backends

    expected = dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()
    assert ("nccl" in available_backends()) == expected, available_backends()


@NEEDS_CUDA
@pytest.mark.parametrize("behaviour", bodies.CUDA.names)
@pytest.mark.parametrize("backend,n", world_params([("nccl", 1)]))
def test_nccl_world_of_one_on_cuda_tensors(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.cuda_collectives, backend, n, behaviour)


@NEEDS_CUDA
@pytest.mark.parametrize("behaviour", bodies.CUDA.names)
@pytest.mark.parametrize("gpu_aware", ["0", "auto"])
@pytest.mark.parametrize("backend,n", world_params([("mpi", 1), ("mpi", 2)]))
def test_cuda_tensors_over_mpi(worlds, backend: str, n: int, gpu_aware: str, behaviour: str) -> None:
    env = {"PHALANX_GPU_AWARE_MPI": "0"} if gpu_aware == "0" else {}
    worlds.check(bodies.cuda_collectives, backend, n, behaviour, env=env)


@NEEDS_CUDA
@pytest.mark.parametrize("behaviour", bodies.TRAIN.names)
@pytest.mark.parametrize("backend,n", world_params([("mpi", 2), ("gloo", 2), ("nccl", 1)]))
def test_cuda_training_equals_cpu_training(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.cuda_training, backend, n, behaviour,
                 env={"PHALANX_GPU_AWARE_MPI": "0"} if backend == "mpi" else {})


@NEEDS_CUDA
@pytest.mark.parametrize("backend,n", world_params([("nccl", 2)]))
def test_nccl_ranks_sharing_a_gpu_fail_at_init_naming_ranks_device_and_fix(backend: str, n: int) -> None:
    with pytest.raises(WorldFailed) as failed:
        run_world(bodies.nccl_shared_gpu, n, backend, timeout=60, env={"CUDA_VISIBLE_DEVICES": "0"})
    text = str(failed.value)
    assert "ranks share a GPU" in text and "[0, 1]" in text and "cuda:0" in text, text
    assert "devices=" in text and "gloo" in text and "firewall" not in text, text


def _meet(rank: int, size: int, port: int, uuid: str, results: object, done: object) -> None:
    """One rank of a rendezvous whose GPU has identity ``uuid`` (no GPU needed: only its UUID is read).
    It stays until every rank has its answer (``done``, a barrier): rank 0 serves the store they read."""
    import os
    import types

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from phalanx.comm._torchsetup import Rendezvous, check_own_gpus

    torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(uuid=uuid)
    meeting = Rendezvous(dist, rank, size, 20.0, 1)
    try:
        check_own_gpus(meeting, "cuda:0")
        results.put((rank, "ok"))  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}"))  # type: ignore[attr-defined]
    done.wait(30)  # type: ignore[attr-defined]


@pytest.mark.parametrize("shared", [True, False], ids=["shared-gpu-is-a-usage-error", "own-gpus-pass"])
def test_nccl_init_checks_each_rank_has_its_own_gpu_by_uuid(shared: bool) -> None:
    import multiprocessing
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results, done = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_meet, args=(r, 2, port, "GPU-1" if shared else f"GPU-{r}", results, done))
             for r in range(2)]
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(30)
    for rank in (0, 1):
        if not shared:
            assert got[rank] == "ok", got
            continue
        text = got[rank]
        assert text.startswith("UsageError:") and "ranks [0, 1] on cuda:0" in text, text
        assert "devices=" in text and "gloo" in text and "firewall" not in text, text


def test_gpu_step_benchmark_without_cuda_exits_2_saying_it_needs_cuda(tmp_path) -> None:  # noqa: ANN001
    import os
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: benchmarks/gpu_check.sh runs the benchmark itself")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_step.py")
    done = subprocess.run([sys.executable, script, "--json", str(tmp_path / "out.json")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "needs CUDA" in done.stderr, (done.returncode, done.stderr)
    assert not (tmp_path / "out.json").exists()
