"""Horovod's own PyTorch examples run on phalanx with only their ``import horovod…`` lines changed.

::

    PHALANX_HOROVOD_EXAMPLES=/path/to/horovod/examples/pytorch .venv-tv/bin/python -m pytest -q tests/test_horovod_upstream.py

The scripts are ``pytorch_synthetic_benchmark.py`` and ``pytorch_mnist.py``
from Horovod's ``examples/pytorch`` (Apache License 2.0), read unchanged from
the folder named by ``PHALANX_HOROVOD_EXAMPLES``; this repository does not
carry them, and nothing is fetched at run time. The test copies each one, replaces
``import horovod.torch as hvd`` by ``import phalanx.horovod.torch as hvd`` and
``import horovod`` by ``import phalanx.horovod as horovod`` (and checks that
nothing else differs), then runs it under ``phalanx run -np 2`` on mpi and
gloo, and the MNIST one also through its own ``horovod.run`` path
(``--num-proc 2``). The MNIST files are generated beforehand in the raw
IDX format torchvision's ``datasets.MNIST`` reads (``DATA/MNIST/raw``), so its
``download=True`` finds them and downloads nothing. The scripts import
torchvision, which does not import with every torch build (torchvision 0.28
fails against the CPU build of torch 2.13); the test skips, saying why, where
it does not import — run it from an environment with a matching pair, such as
``pip install torch==2.14.1 torchvision==0.29.1``.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import AVAILABLE

pytest.importorskip("torch")
SOURCE = os.environ.get("PHALANX_HOROVOD_EXAMPLES", "")
if SOURCE and not all(os.path.isfile(os.path.join(SOURCE, f))
                      for f in ("pytorch_synthetic_benchmark.py", "pytorch_mnist.py")):
    raise RuntimeError(f"PHALANX_HOROVOD_EXAMPLES={SOURCE!r} does not hold pytorch_synthetic_benchmark.py and "
                       "pytorch_mnist.py (Horovod's examples/pytorch): fix the path or unset the variable")
try:
    import torchvision  # noqa: F401
except Exception as error:  # noqa: BLE001  # torchvision built for another torch fails with RuntimeError
    if SOURCE:  # asked for explicitly: a broken torchvision is a failure, not a skip
        raise
    pytest.skip(f"torchvision does not import here ({type(error).__name__}: {str(error)[:200]}); Horovod's "
                "examples need it: run this file from an environment with a matching torch and torchvision, "
                "e.g. `pip install torch==2.14.1 torchvision==0.29.1`", allow_module_level=True)

if not SOURCE:
    pytest.skip("set PHALANX_HOROVOD_EXAMPLES to a folder holding Horovod's examples/pytorch scripts "
                "(pytorch_synthetic_benchmark.py, pytorch_mnist.py) to run them on phalanx",
                allow_module_level=True)

BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(b not in AVAILABLE, reason=f"backend {b!r} is not available"))
            for b in ("mpi", "gloo")]
IMPORTS = {"import horovod.torch as hvd\n": "import phalanx.horovod.torch as hvd\n",
           "import horovod\n": "import phalanx.horovod as horovod\n"}


def _changed_copy(name: str, folder: str) -> str:
    """Horovod's script ``name`` copied into ``folder`` with only its Horovod imports changed; the copy's path."""
    source = os.path.join(SOURCE, name)
    if not os.path.exists(source):
        pytest.skip(f"{source} does not exist")
    with open(source) as f:
        upstream = f.readlines()
    changed = [IMPORTS.get(line, line) for line in upstream]
    diff = [d for d in difflib.unified_diff(upstream, changed, n=0) if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    assert diff and all(d[1:] in IMPORTS or d[1:] in IMPORTS.values() for d in diff), diff
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.writelines(changed)
    return path


def _run(cmd: list[str], home: str, timeout: float = 150) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HOME=home)  # FileLock("~/.horovod_lock")
    env.pop("PHALANX_BACKEND", None)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=home)
    assert done.returncode == 0, f"{' '.join(cmd)}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _phalanx_run(backend: str, script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", "run", "-np", "2", "--backend", backend, script, *args]


def write_mnist(root: str, train: int = 2000, test: int = 500, seed: int = 0) -> None:
    """MNIST-shaped data in torchvision's raw IDX files under ``root/MNIST/raw``: a learnable pattern per class."""
    rng = np.random.default_rng(seed)
    patterns = rng.integers(0, 2, (10, 28, 28)) * 200
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for prefix, count in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, count).astype(np.uint8)
        images = (patterns[labels] + rng.integers(0, 56, (count, 28, 28))).astype(np.uint8)
        with open(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), "wb") as f:
            f.write(np.array([0x803, count, 28, 28], dtype=">i4").tobytes() + images.tobytes())
        with open(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), "wb") as f:
            f.write(np.array([0x801, count], dtype=">i4").tobytes() + labels.tobytes())


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> dict[str, str]:
    folder = str(tmp_path_factory.mktemp("horovod-examples"))
    write_mnist(os.path.join(folder, "data"))
    return {"folder": folder, "data": os.path.join(folder, "data"),
            **{name: _changed_copy(name, folder) for name in ("pytorch_synthetic_benchmark.py", "pytorch_mnist.py")}}


@pytest.mark.parametrize("backend", BACKENDS)
def test_horovod_synthetic_benchmark_runs_unchanged(backend: str, scripts: dict[str, str]) -> None:
    out = _run(_phalanx_run(backend, scripts["pytorch_synthetic_benchmark.py"], "--model", "mobilenet_v3_small",
                            "--batch-size", "4", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
                            "--num-iters", "2", *(["--fp16-allreduce"] if backend == "gloo" else [])),
               scripts["folder"])
    assert "Number of CPUs: 2" in out and out.count("Iter #") == 2, out  # rank 0's log lines only
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+", out), out


TEST_LINE = re.compile(r"Test set: Average loss: ([\d.]+), Accuracy: ([\d.]+)%")


@pytest.mark.parametrize("backend", BACKENDS)
def test_horovod_mnist_runs_unchanged(backend: str, scripts: dict[str, str]) -> None:
    out = _run(_phalanx_run(backend, scripts["pytorch_mnist.py"], "--epochs", "2", "--lr", "0.03",
                            "--data-dir", scripts["data"]),
               scripts["folder"])
    tests = TEST_LINE.findall(out)
    assert len(tests) == 2, out  # one per epoch, rank 0 only
    assert float(tests[-1][1]) > 50, tests  # 10 classes: chance is 10%
    assert "Train Epoch: 2 [0/1000" in out, out  # DistributedSampler: 2000 images, 1000 per rank


def test_horovod_mnist_through_horovod_run(scripts: dict[str, str]) -> None:
    backend = "gloo" if "gloo" in AVAILABLE else "mpi"
    out = _run([sys.executable, scripts["pytorch_mnist.py"], "--epochs", "1", "--data-dir", scripts["data"],
                "--num-proc", "2", "--communication", backend], scripts["folder"])
    assert "Running training through horovod.run" in out, out
    assert len(TEST_LINE.findall(out)) == 1, out
