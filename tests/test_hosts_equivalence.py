"""Training across hosts equals one process on the same global batch (3 simulated hosts).

``phalanx run --hosts ... --rsh RSH program_hosts_equal.py DIR`` from host 0, on
2 hosts x 2 ranks and 3 hosts x 1 rank, for mpi (MPICH, and Open MPI where
``.venv-ompi`` exists beside this environment) and gloo. Every rank trains with
``fit(global_batch_size=12)`` and with a ``DistributedOptimizer`` loop and
reports how far its parameters are from the one-process run (float64): at most
``TOL`` on every rank, on the hosts the job was given.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import AVAILABLE
from helpers import requires_hosts
from phalanx.testing import SimulatedHosts, simulated_hosts

pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "program_hosts_equal.py"
VENV = Path(sys.executable).parent.parent
OMPI = Path(os.environ.get("PHALANX_OMPI_VENV", str(VENV.parent / ".venv-ompi")))
TOL = 1e-9
JOB_TIMEOUT = 120  # seconds; each job ends within ~10

pytestmark = requires_hosts

LAYOUTS = {"2x2": ("h0:2,h1:2", ["h0", "h0", "h1", "h1"]), "3x1": ("h0:1,h1:1,h2:1", ["h0", "h1", "h2"])}
RUNS = [
    pytest.param(VENV, "mpi", id="mpi-mpich", marks=pytest.mark.skipif(
        "mpi" not in AVAILABLE, reason="backend 'mpi' is not available here (see `phalanx info`)")),
    pytest.param(OMPI, "mpi", id="mpi-openmpi", marks=pytest.mark.skipif(
        not (OMPI / "bin" / "phalanx").exists(), reason=f"no Open MPI environment at {OMPI}")),
    pytest.param(VENV, "gloo", id="gloo", marks=pytest.mark.skipif(
        "gloo" not in AVAILABLE, reason="backend 'gloo' is not available here (see `phalanx info`)")),
]


@pytest.fixture(scope="module")
def hosts() -> Iterator[SimulatedHosts]:
    with simulated_hosts(3) as made:
        yield made


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("venv,backend", RUNS)
def test_fit_and_distributed_optimizer_across_hosts_equal_one_process(
        hosts: SimulatedHosts, venv: Path, backend: str, layout: str, tmp_path: Path) -> None:
    host_list, placed = LAYOUTS[layout]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "OMPI_", "PMI", "MASTER_"))}
    cmd = [str(venv / "bin" / "python"), "-m", "phalanx", "run", "--backend", backend, "--hosts", host_list,
           "--rsh", hosts.rsh, "--timeout", "60", str(SCRIPT), str(tmp_path)]
    done = hosts.run(0, cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(len(placed))]
    assert [r["host"] for r in results] == placed, results
    assert {(r["size"], r["backend"]) for r in results} == {(len(placed), backend)}, results
    for rank, result in enumerate(results):
        assert result["fit"] <= TOL, f"rank {rank}: fit differs from one process by {result['fit']:.3g}"
        assert result["optimizer"] <= TOL, (
            f"rank {rank}: DistributedOptimizer differs from one process by {result['optimizer']:.3g}")
    deadline = time.monotonic() + 10  # remote helpers (hydra's proxy, the rsh) may take a moment to exit
    while any(hosts.pids(i) for i in range(3)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(hosts.pids(i) for i in range(3)), {f"h{i}": hosts.pids(i) for i in range(3)}
