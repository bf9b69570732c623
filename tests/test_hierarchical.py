"""gloo's hierarchical allreduce on simulated hosts: ``phalanx run --hosts h0:2,h1:2 --rsh RSH --backend gloo``.

Real ranks in real namespaces (skipped without them, ``requires_hosts``); one job per test:

* 2 hosts x 2 ranks with ``PHALANX_HIERARCHICAL=1``: the hierarchy is made (leaders 0 and 2) and used (its count of calls
  grows), and every op (sum/avg/min/max/prod) on every dtype gives the flat answer, blocking
  and non-blocking, in place or not, with handles (in chunks) waited in reverse order, and the gradient
  bucket engine (``DistributedOptimizer``, several buckets in flight) averages gradients;
* one rank per host, one host (with ``PHALANX_HIERARCHICAL=1``), and ``PHALANX_HIERARCHICAL`` unset (the
  default, off for now): no hierarchy (flat), still right;
* ranks that resolve ``PHALANX_HIERARCHICAL`` differently: InvalidSettingError at init;
* a rank SIGKILLed mid-loop: every other rank ends with a phalanx error or is stopped by the
  launcher, and the launcher exits non-zero, within a bound.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import AVAILABLE
from helpers import requires_hosts
from phalanx.testing import SimulatedHosts, simulated_hosts

pytestmark = [requires_hosts, pytest.mark.skipif("gloo" not in AVAILABLE, reason="no gloo backend here")]

JOB_TIMEOUT = 60  # seconds any one job may take, end to end
S = 5.0           # --timeout of the failure test
END_GRACE = 12.0  # from the kill to the launcher's end, beyond S (diagnosis, SIGTERM's grace, reporting)

CHECKS = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    import phalanx
    import phalanx.torch as pt

    phalanx.init()
    r, n = phalanx.rank(), phalanx.size()
    hier = phalanx.backend().hierarchy
    vals = np.arange(1, n + 1, dtype=np.float64)
    want = {"sum": vals.sum(), "avg": vals.mean(), "min": vals.min(), "max": vals.max(), "prod": vals.prod()}
    bad = []
    for op, expected in want.items():
        for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                   torch.int16, torch.uint8):
            if op == "avg" and not dt.is_floating_point:
                continue
            x = torch.full((1001,), r + 1).to(dt)
            y = phalanx.allreduce(x.clone(), op)                     # in place
            ro = x.numpy().copy() if dt != torch.bfloat16 else x.float().numpy()
            ro.flags.writeable = False                               # not in place: a new array
            z = phalanx.allreduce(ro, op)
            for got in (y, torch.as_tensor(z)):
                if not torch.allclose(got.double(), torch.full((1001,), expected).double(), rtol=1e-2):
                    bad.append(f"{op} {dt} {got[:2].tolist()}")
    flags = phalanx.allreduce(torch.tensor([r % 2 == 0, True]), "max")
    if flags.tolist() != [True, True]:
        bad.append(f"bool max {flags}")
    handles = [phalanx.iallreduce(torch.full((1_000_000,), float(r + i))) for i in range(6)]  # 4 MB: chunks
    for i in reversed(range(6)):  # waited in the reverse order of the calls
        got = handles[i].wait()
        if not torch.all(got == vals.sum() - n + n * i):
            bad.append(f"iallreduce {i} {got[:2].tolist()}")
    torch.manual_seed(0)  # the same model everywhere; each rank its own data
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), bucket_cap_mb=0.02)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + r)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        local = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), list(model.parameters()))
        everyone = [phalanx.allgather(t) for t in local]          # allgather: never hierarchical
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        for p, all_ in zip(model.parameters(), everyone):
            if not torch.allclose(p.grad, all_.mean(0), atol=1e-6):
                bad.append(f"gradient step {step}")
    info = {"rank": r, "bad": bad, "leaders": list(hier.leaders) if hier else None,
            "leader": hier.leader if hier else None, "calls": hier.calls if hier else 0}
    sys.stdout.write("RESULT " + json.dumps(info) + "\\n")
    sys.stdout.flush()
""")

LOOP = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    import phalanx

    phalanx.init()
    r = phalanx.rank()
    x = np.ones(1 << 18, np.float32)
    try:
        for i in range(10_000):
            phalanx.allreduce(x)
            sys.stdout.write(f"ITER {i} {time.time():.3f} hier={phalanx.backend().hierarchy is not None}\\n")
            sys.stdout.flush()
            if r == 3 and i == 20:
                os.kill(os.getpid(), signal.SIGKILL)
    except phalanx.PhalanxError as exc:
        sys.stdout.write(f"RAISED {time.time():.3f} {type(exc).__name__}\\n")
        sys.stdout.flush()
        raise
""")


@pytest.fixture(scope="module")
def hosts() -> Iterator[SimulatedHosts]:
    with simulated_hosts(2) as made:
        yield made


def _script(tmp: Path, text: str) -> Path:
    path = tmp / "job.py"
    path.write_text(text)
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "MASTER_"))}
    return env | extra


def _run(hosts: SimulatedHosts, spec: str, job: Path, **env: str) -> dict[int, dict]:
    argv = [sys.executable, "-m", "phalanx", "run", "--hosts", spec, "--rsh", hosts.rsh, "--backend", "gloo",
            "--timeout", "30", str(job)]
    done = hosts.run(0, argv, capture_output=True, text=True, timeout=JOB_TIMEOUT, env=_env(**env))
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rows = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return {row["rank"]: row for row in rows}


def test_two_hosts_of_two_ranks_reduce_hierarchically_and_exactly(hosts: SimulatedHosts, tmp_path: Path) -> None:
    found = _run(hosts, "h0:2,h1:2", _script(tmp_path, CHECKS), PHALANX_HIERARCHICAL="1")
    assert sorted(found) == [0, 1, 2, 3], found
    for rank, row in found.items():
        assert row["bad"] == [], (rank, row["bad"])
        assert row["leaders"] == [0, 2] and row["leader"] == (rank in (0, 2)), row
        assert row["calls"] > 80, row  # every allreduce above went through the hierarchy


@pytest.mark.parametrize("spec,env", [("h0:1,h1:1", {"PHALANX_HIERARCHICAL": "1"}), ("h0:2", {"PHALANX_HIERARCHICAL": "1"}),
                                        ("h0:2,h1:2", {})], ids=["one-rank-per-host", "one-host", "default"])
def test_without_a_hierarchy_to_use_allreduce_is_flat(hosts: SimulatedHosts, tmp_path: Path, spec: str,
                                                      env: dict[str, str]) -> None:
    found = _run(hosts, spec, _script(tmp_path, CHECKS), **env)
    assert len(found) == sum(int(h.split(":")[1]) for h in spec.split(",")), found
    for rank, row in found.items():
        assert row["bad"] == [] and row["leaders"] is None and row["calls"] == 0, (rank, row)


def test_a_rank_killed_mid_loop_ends_the_job_with_phalanx_errors_in_bounded_time(
        hosts: SimulatedHosts, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    argv = [sys.executable, "-m", "phalanx", "run", "--hosts", "h0:2,h1:2", "--rsh", hosts.rsh, "--backend", "gloo",
            "--timeout", f"{S:g}", "--log-dir", str(logs), "--no-echo", str(_script(tmp_path, LOOP))]
    done = hosts.run(0, argv, capture_output=True, text=True, timeout=JOB_TIMEOUT,
                     env=_env(PHALANX_HIERARCHICAL="1"))
    ended = time.time()
    texts = {r: (logs / f"rank.{r}.log").read_text(errors="replace") for r in range(4)}
    assert done.returncode != 0, done.stderr[-3000:]
    assert all("hier=True" in texts[r] for r in range(4)), texts  # the loop ran hierarchically
    last, died = re.findall(r"^ITER (\d+) (\S+)", texts[3], re.M)[-1]
    assert last == "20", texts[3]  # rank 3 died where it was told to
    raised = {r: re.search(r"^RAISED \S+ (\w+)", texts[r], re.M) for r in range(3)}
    assert any(raised.values()), (texts, done.stderr[-3000:])  # its peers saw it as a phalanx error
    for m in raised.values():
        assert m is None or m[1] in ("RankFailedError", "CollectiveTimeoutError"), m
    took = ended - float(died)
    assert took < S + END_GRACE, f"the job took {took:.1f} s to end after rank 3 died"
    assert "rank 3" in done.stderr, done.stderr[-3000:]


def test_ranks_that_resolve_the_setting_differently_are_refused_at_init(hosts: SimulatedHosts,
                                                                        tmp_path: Path) -> None:
    job = _script(tmp_path, textwrap.dedent("""
        import os
        import phalanx

        phalanx.settings.hierarchical = os.environ["RANK"] != "3"
        phalanx.init()
    """))
    argv = [sys.executable, "-m", "phalanx", "run", "--hosts", "h0:2,h1:2", "--rsh", hosts.rsh, "--backend", "gloo",
            "--timeout", "30", str(job)]
    done = hosts.run(0, argv, capture_output=True, text=True, timeout=JOB_TIMEOUT, env=_env())
    assert done.returncode != 0, done.stderr[-3000:]
    assert "InvalidSettingError" in done.stderr and "set the same value on every rank" in done.stderr, \
        done.stderr[-3000:]
