"""Single-process behaviour: initialization rules, settings (import weight: tests/test_layers.py)."""

from __future__ import annotations

import numpy as np
import pytest

import phalanx


@pytest.mark.parametrize("call", [
    lambda: phalanx.rank(), lambda: phalanx.size(), lambda: phalanx.local_rank(),
    lambda: phalanx.local_size(), lambda: phalanx.backend(), lambda: phalanx.allreduce(1.0),
    lambda: phalanx.broadcast(np.ones(2)), lambda: phalanx.barrier(), lambda: phalanx.print("x"),
    lambda: phalanx.iallreduce(np.ones(2)),
])
def test_anything_before_init_says_to_call_init(call) -> None:
    assert not phalanx.initialized()
    with pytest.raises(phalanx.NotInitializedError, match=r"phalanx.init\(\)"):
        call()


def test_local_world_init_is_idempotent_and_shuts_down() -> None:
    backend = phalanx.init("local")
    try:
        assert phalanx.init() is backend and phalanx.init("local") is backend
        assert (phalanx.rank(), phalanx.size(), backend.name) == (0, 1, "local")
        with pytest.raises(phalanx.PhalanxError, match="already initialized"):
            phalanx.init("mpi")
    finally:
        phalanx.shutdown()
    assert not phalanx.initialized()
    phalanx.shutdown()  # idempotent


def test_auto_detection_reads_the_launcher_environment() -> None:
    from phalanx.comm._detect import detect_backend

    assert detect_backend({}) == "local"
    assert detect_backend({"PMI_SIZE": "2", "PMI_RANK": "0"}) == "mpi"
    assert detect_backend({"OMPI_COMM_WORLD_SIZE": "4"}) == "mpi"
    assert detect_backend({"SLURM_NTASKS": "8", "SLURM_PROCID": "3"}) == "mpi"
    assert detect_backend({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == "local"
    assert detect_backend({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x"}) == "torch"
    assert detect_backend({"PHALANX_BACKEND": "gloo", "PMI_SIZE": "2"}) == "gloo"


def test_settings_come_from_the_environment(monkeypatch) -> None:
    from phalanx._settings import Settings

    monkeypatch.setenv("PHALANX_TIMEOUT", "12.5")
    monkeypatch.setenv("PHALANX_CHECK", "0")
    monkeypatch.setenv("PHALANX_GPU_AWARE_MPI", "off")
    s = Settings()
    assert (s.timeout, s.check, s.gpu_aware_mpi, s.debug) == (12.5, False, False, False)


def test_device_is_cpu_without_gpus() -> None:
    torch = pytest.importorskip("torch")
    phalanx.init("local")
    try:
        expected = "cuda" if torch.cuda.is_available() else "cpu"
        assert phalanx.device().type == expected
    finally:
        phalanx.shutdown()
