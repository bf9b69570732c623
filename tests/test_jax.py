"""phalanx.jax: JAX arrays through the collectives, pytrees, optax, jit (skipped without jax).

One world per backend and size runs every behaviour of ``worlds_jax.JAX``
(collectives against NumPy, synchronize of every kind of pytree and its
mismatch errors, N ranks equal one process for flax and equinox models with
SGD, Adam, a jitted step, MultiSteps and compression).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

if os.environ.get("PHALANX_REQUIRE_JAX"):  # CI's run on the oldest JAX: a package that fails to import fails
    import equinox  # noqa: F401
    import flax  # noqa: F401
    import jax  # noqa: F401
    import optax  # noqa: F401
pytest.importorskip("jax")
pytest.importorskip("optax")
pytest.importorskip("flax")
pytest.importorskip("equinox")

import worlds_jax as bodies  # noqa: E402
from conftest import MULTI_WORLDS, world_params  # noqa: E402
from phalanx.testing import WorldFailed, run_world  # noqa: E402

JAX_WORLDS = [("mpi", 1), ("mpi", 2), ("mpi", 3), ("gloo", 2)]  # mpi, the JAX user's transport, at every size
# XLA compiles the same reference steps in every world: a compilation cache shared by this session's
# worlds (steps with host callbacks are never cached, so the distributed ones still compile).
CACHE = tempfile.mkdtemp(prefix="phalanx-jax-cache-")
atexit.register(shutil.rmtree, CACHE, True)
ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
       "JAX_COMPILATION_CACHE_DIR": CACHE, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


@pytest.mark.parametrize("behaviour", bodies.JAX.names)
@pytest.mark.parametrize("backend,n", world_params(JAX_WORLDS))
def test_jax(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.jax_world, backend, n, behaviour, op_timeout=30, timeout=150, env=ENV)


@pytest.mark.parametrize("backend,n", world_params(MULTI_WORLDS[:1] + MULTI_WORLDS[2:3]))
def test_a_rank_that_raises_inside_a_jitted_step_ends_the_job_with_its_traceback(backend: str, n: int) -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailed) as failed:
        run_world(bodies.raises_in_jitted_step, n, backend, op_timeout=60, timeout=90, env=ENV)
    assert time.monotonic() - start < 50, "the job waited for the peers' timeout instead of ending at the error"
    report = str(failed.value)
    assert "rank 1" in report and "boom on rank 1 inside the jitted step" in report, report


@pytest.mark.parametrize("backend,n", world_params([("mpi", 2), ("gloo", 3)]))
def test_initialize_distributed_lets_jax_pmean_over_the_processes(backend: str, n: int) -> None:
    results = run_world(bodies.psum_world, n, backend, op_timeout=30, timeout=90, env=ENV)
    assert results == [[(n + 1) / 2] * 3] * n, results


def test_import_phalanx_jax_imports_jax_but_import_phalanx_does_not_and_optax_waits_for_its_names() -> None:
    code = ("import sys, phalanx; assert 'jax' not in sys.modules, 'phalanx imported jax'; "
            "import phalanx.jax; assert 'jax' in sys.modules and 'optax' not in sys.modules, 'optax at import'; "
            "tx = phalanx.jax.DistributedOptimizer(); assert 'optax' in sys.modules; "
            "from phalanx.jax import distributed; assert distributed is sys.modules['phalanx.jax._optax'].distributed; "
            "assert not hasattr(phalanx.jax, 'no_such_name')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_demo_with_jax_matches_one_process_and_the_packaged_script_is_the_example() -> None:
    root = Path(__file__).resolve().parents[1]
    example = root / "examples" / "jax_digits.py"  # a link to the packaged script, as examples/digits.py
    assert example.is_symlink() and example.resolve() == root / "src" / "phalanx" / "examples" / "jax_digits.py"
    pytest.importorskip("sklearn")
    done = subprocess.run([sys.executable, "-m", "phalanx", "demo", "--framework", "jax", "--epochs", "3"],
                          capture_output=True, text=True, timeout=240, env={**os.environ, **ENV})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "Same accuracy: data-parallel training on 2 processes matches 1 process" in out, out[-3000:]
    assert "equinox MLP" in out and "epoch   3/3" in out, out[-3000:]
