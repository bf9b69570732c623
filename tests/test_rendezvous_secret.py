"""A one-host gloo job started by the launcher (or run_world) guards its rendezvous with a per-job
secret: another local process cannot read or write the store; a hand-started one warns."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import worlds_rendezvous_secret as bodies
from conftest import AVAILABLE, world_params
from phalanx.launch._spawn import free_port
from phalanx.testing import run_world


@pytest.mark.parametrize("backend,n", world_params([("gloo", 2)]))
def test_an_outside_client_cannot_read_or_write_a_one_host_gloo_rendezvous(backend: str, n: int) -> None:
    outcome = run_world(bodies.outside_client, n, backend, op_timeout=10, timeout=60)[0]
    print(f"\n{backend}-{n}: outside client: {outcome}")
    assert str(outcome["read"]).startswith("refused") and str(outcome["wrote"]).startswith("refused"), outcome


@pytest.mark.skipif("gloo" not in AVAILABLE, reason="no gloo backend here")
def test_a_hand_started_one_host_gloo_world_without_a_secret_works_with_one_warning_line() -> None:
    port = str(free_port())
    code = "import phalanx; phalanx.init(); print('sum', phalanx.allreduce(1), flush=True); phalanx.shutdown()"
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_SECRET"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(
        env, PHALANX_BACKEND="gloo", RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all("sum 2" in o for o, _ in outs), outs
    warnings = [line for _, e in outs for line in e.splitlines() if "PHALANX_SECRET is not set" in line]
    assert len(warnings) == 1, outs
