"""torch.distributed on the ``"phalanx"`` backend: DDP, FSDP2, ZeRO, DCP and every operation, equal to gloo.

Each world runs every behaviour of ``worlds_torch_distributed`` (see its
docstring); the 2- and 3-rank worlds of a backend share a directory, so the
3-rank world loads the checkpoint the 2-rank world saved.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import worlds_torch_distributed as bodies
from conftest import AVAILABLE, world_params
from phalanx.testing import WorldFailed, run_world

WORLDS = [("local", 1), ("mpi", 2), ("mpi", 3), ("gloo", 2), ("gloo", 3)]
_DIRS: dict[str, str] = {}
GRACE = 5.0


def _results(worlds, tmp_path_factory, backend: str, n: int) -> list[dict]:
    if backend not in _DIRS:
        _DIRS[backend] = str(tmp_path_factory.mktemp(f"dcp-{backend}"))
    if n == 3:  # the 3-rank world loads what the 2-rank world saved
        worlds.results(bodies.torch_distributed, backend, 2, args=(_DIRS[backend],), timeout=240, op_timeout=30)
    return worlds.results(bodies.torch_distributed, backend, n, args=(_DIRS[backend],), timeout=240,
                          op_timeout=30)


@pytest.mark.parametrize("behaviour", bodies.TORCH_DIST.names)
@pytest.mark.parametrize("backend,n", world_params(WORLDS))
def test_torch_distributed(worlds, tmp_path_factory, backend: str, n: int, behaviour: str) -> None:
    _results(worlds, tmp_path_factory, backend, n)
    worlds.check(bodies.torch_distributed, backend, n, behaviour, args=(_DIRS[backend],), timeout=240,
                 op_timeout=30)


@pytest.mark.parametrize("library", ["ddp", "fsdp2", "zero", "functional", "ops", "p2p", "hsdp"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.skipif("mpi" not in AVAILABLE or "gloo" not in AVAILABLE, reason="needs mpi and gloo")
def test_mpi_world_equals_gloo_world(worlds, tmp_path_factory, n: int, library: str) -> None:
    """The same script on "phalanx" over mpi and on torch's gloo (the gloo world's native group gives
    what its "phalanx" group gives: checked in the world), rank by rank, to 1e-10."""
    on_mpi = _results(worlds, tmp_path_factory, "mpi", n)
    on_gloo = _results(worlds, tmp_path_factory, "gloo", n)
    for rank, (a, b) in enumerate(zip(on_mpi, on_gloo, strict=True)):
        x, y = a["results"].get(library), b["results"].get(library)
        assert x is not None and y is not None, f"rank {rank}: {library} was not computed on both"
        assert len(x) == len(y) and max(abs(u - v) for u, v in zip(x, y, strict=True)) <= bodies.EXACT, \
            f"rank {rank}: {library} on mpi differs from gloo"


@pytest.mark.parametrize("backend,n", world_params([("mpi", 2), ("gloo", 2)]))
def test_a_stopped_peer_is_a_timeout_naming_it(backend: str, n: int) -> None:
    with pytest.raises(WorldFailed) as failed:
        run_world(bodies.peer_stops, n, backend, op_timeout=2.0, timeout=60)
    report = str(failed.value)
    raised = re.search(r"TIMES raised=([0-9.]+)", report)
    assert raised, report
    assert float(raised.group(1)) < 2.0 + GRACE, report
    assert "timed out after 2 s" in report and f"rank {n - 1}" in report, report


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fsdp2_gpt.py"


@pytest.mark.skipif("mpi" not in AVAILABLE or "gloo" not in AVAILABLE, reason="needs mpi and gloo")
def test_an_fsdp2_script_written_for_torchrun_runs_over_mpi_equal_to_gloo(tmp_path) -> None:
    """examples/fsdp2_gpt.py (nanoGPT's setup, FSDP2, no phalanx import) under `phalanx run --backend mpi`
    with init_process_group("phalanx"), and on torch's gloo: the same losses and weights in float64."""
    runs = {}
    for launcher, backend in (("mpi", "phalanx"), ("gloo", "gloo")):
        out = tmp_path / f"{backend}.json"
        done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "2", "--backend", launcher, str(EXAMPLE),
                               "--backend", backend, "--steps", "4", "--json", str(out)],
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "step 3: loss" in done.stdout, done.stdout
        runs[backend] = json.loads(out.read_text())
    mpi, gloo = runs["phalanx"], runs["gloo"]
    assert max(abs(a - b) for a, b in zip(mpi["losses"], gloo["losses"], strict=True)) <= 1e-10, (mpi, gloo)
    assert abs(mpi["checksum"] - gloo["checksum"]) <= 1e-10 * max(1.0, abs(gloo["checksum"])), (mpi, gloo)
    assert mpi["losses"][-1] < mpi["losses"][0], mpi  # it trains
