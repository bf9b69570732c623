"""Horovod's own PyTorch test suite passes on ``phalanx.horovod.torch``, unmodified but for its import.

::

    PHALANX_HOROVOD_TESTS=/path/to/horovod/test .venv/bin/python -m pytest -q tests/test_horovod_suite.py

``PHALANX_HOROVOD_TESTS`` names the ``test`` folder of Horovod's repository
(release 0.28.1; Apache License 2.0): ``parallel/test_torch.py`` and
``utils/common.py`` are read from it unchanged; this repository does not carry
them and nothing is fetched, so without the variable the file is skipped. The test
copies both into a temporary folder, replaces ``import horovod.torch as hvd`` by
``import phalanx.horovod.torch as hvd`` (and checks that nothing else differs),
adds the one function ``common.py`` imports from Horovod's runner
(``horovod.runner.util.threads.in_thread``) as a tiny module beside it, and runs
the whole file, in one process per rank, under ``phalanx run`` at 2 and 3 ranks on
mpi and gloo. Every test must pass or be skipped by Horovod's own conditions,
except those in :data:`EXPECTED_FAILURES`, which fail because of the environment,
not phalanx (each with its reason). ``common.py`` needs ``mock`` and ``cloudpickle``.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import AVAILABLE

pytest.importorskip("torch")
SOURCE = os.environ.get("PHALANX_HOROVOD_TESTS", "")
if not SOURCE:
    pytest.skip("set PHALANX_HOROVOD_TESTS to the `test` folder of Horovod's repository (holding "
                "parallel/test_torch.py and utils/common.py) to run Horovod's PyTorch suite on phalanx",
                allow_module_level=True)
if not all(os.path.isfile(os.path.join(SOURCE, f)) for f in ("parallel/test_torch.py", "utils/common.py")):
    raise RuntimeError(f"PHALANX_HOROVOD_TESTS={SOURCE!r} does not hold parallel/test_torch.py and utils/common.py "
                       "(Horovod's test folder): fix the path or unset the variable")
for needed in ("mock", "cloudpickle"):  # asked for explicitly: a missing dependency is a failure, not a skip
    __import__(needed)

#: Horovod's tests that fail here because of the environment, with the reason (one place).
EXPECTED_FAILURES = {
    "test_broadcast_state": "builds every torch.optim.Optimizer subclass; torch >= 2.9's Muon refuses the "
                            "model's 1-d parameters (ValueError), so Horovod itself fails it on this torch",
    "test_broadcast_state_options": "the same: every Optimizer subclass, Muon included",
    "test_force_allreduce": "the same: every Optimizer subclass, Muon included",
}
#: Failing at 3 ranks only: the float16 case compares a float16 sum of 3 terms with tolerance 0 (the test's
#: own for up to 3 ranks) against the float32 product ``3 * half(f * x)``, which float16 cannot hold for most
#: elements (any float16 result, Horovod's included, fails; docs/horovod.md).
EXPECTED_AT_3 = {name: "float16 sum of 3 terms compared exactly with a float32 product"
                 for name in ("test_horovod_allreduce_prescale", "test_horovod_reducescatter_prescale",
                              "test_horovod_grouped_reducescatter_prescale")}
IMPORT = ("import horovod.torch as hvd\n", "import phalanx.horovod.torch as hvd\n")
IN_THREAD = '''import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Horovod's horovod.runner.util.threads.in_thread: run target(*args) in a started thread."""
    def run(*a):
        try:
            target(*a)
        except BaseException:
            if not silent:
                raise
    thread = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
'''
LIMIT_S = 1200  # each run must finish within 20 minutes
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(b not in AVAILABLE, reason=f"backend {b!r} is not available"))
            for b in ("mpi", "gloo")]


def _prepare(folder: str) -> str:
    """Horovod's test_torch.py and common.py in ``folder`` (only the import changed) and the shim."""
    with open(os.path.join(SOURCE, "parallel", "test_torch.py")) as f:
        upstream = f.readlines()
    changed = [IMPORT[1] if line == IMPORT[0] else line for line in upstream]
    diff = [d for d in difflib.unified_diff(upstream, changed, n=0) if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    assert diff == ["-" + IMPORT[0], "+" + IMPORT[1]], diff
    with open(os.path.join(folder, "test_torch.py"), "w") as f:
        f.writelines(changed)
    with open(os.path.join(SOURCE, "utils", "common.py")) as f, open(os.path.join(folder, "common.py"), "w") as g:
        g.write(f.read())
    shim = os.path.join(folder, "horovod", "runner", "util")
    os.makedirs(shim)
    for part in ("horovod", "horovod/runner", "horovod/runner/util"):
        open(os.path.join(folder, part, "__init__.py"), "w").close()
    with open(os.path.join(shim, "threads.py"), "w") as f:
        f.write(IN_THREAD)
    return os.path.join(folder, "test_torch.py")


def _outcomes(log: str) -> dict[str, list[str]]:
    """The test names of one rank's pytest ``-rA`` summary, by outcome (passed, failed, error)."""
    found: dict[str, list[str]] = {"PASSED": [], "FAILED": [], "ERROR": []}
    for line in log.splitlines():
        line = re.sub(r"^\[\d+\] ", "", line)
        for outcome in found:
            prefix = f"{outcome} test_torch.py::TorchTests::"
            if line.startswith(prefix):
                found[outcome].append(line[len(prefix):].split()[0])
    return found


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [2, 3])
def test_horovod_test_torch_passes_but_for_the_muon_tests(tmp_path, ranks, backend):
    script = _prepare(str(tmp_path))
    logs = tmp_path / "logs"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HOME=str(tmp_path))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", str(ranks), "--backend", backend,
                           "--log-dir", str(logs), "--no-echo", "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=LIMIT_S)
    took = time.monotonic() - start
    for rank in range(ranks):
        log = (logs / f"rank.{rank}.log").read_text()
        found = _outcomes(log)
        assert found["PASSED"], f"rank {rank} ran no test:\n{log[-4000:]}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        expected = set(EXPECTED_FAILURES) | (set(EXPECTED_AT_3) if ranks == 3 else set())
        unexpected = sorted(set(found["FAILED"] + found["ERROR"]) - expected)
        assert not unexpected, f"rank {rank}: {unexpected} failed:\n{log[-8000:]}"
    assert took < LIMIT_S
