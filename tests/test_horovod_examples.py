"""The Horovod-style examples (``examples/horovod/``) run as a Horovod user runs them, and train what 1 rank trains.

::

    python -m pytest -q tests/test_horovod_examples.py

Each script is written as Horovod's own PyTorch examples are, with
``import phalanx.horovod.torch as hvd`` as the only change. Each runs under
``phalanx run -np 2`` (horovodrun's flag), each on one backend and the two backends shared among
them (Horovod's ops are checked on both in ``test_horovod_ops.py``), and where the
arithmetic allows it the test checks that 2 ranks train the model 1 rank
trains on the same global batch: the synthetic benchmark (``DistributedOptimizer``
with ``backward_passes_per_step=2``, ``hvd.SyncBatchNorm``, fp16 compression),
the MNIST loop (torch's ``DistributedSampler(num_replicas=hvd.size(),
rank=hvd.rank())``, metrics through ``hvd.allreduce``, and its ``horovod.run``
path), and the ResNet loop (LR warm-up scaled by ``hvd.size()``, a checkpoint
per epoch from rank 0, and a resume that broadcasts the epoch, the weights and
the optimizer state: a resumed job ends where one that ran straight through
ends). The step benchmark (``benchmarks/horovod_step.py``), shrunk, also shows
``hvd.DistributedOptimizer`` training bit-for-bit what phalanx's own does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import AVAILABLE

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "horovod")


def _on(b: str) -> list[object]:
    return [pytest.param(b, marks=pytest.mark.skipif(b not in AVAILABLE, reason=f"backend {b!r} is not available"))]


def _run(script: str, *args: str, np: int | None = None, backend: str | None = None,
         timeout: float = 120) -> str:
    """Run an example (on ``np`` ranks through ``phalanx run -np``, else as a plain process); its stdout."""
    path = os.path.join(EXAMPLES, script)
    if np is None:
        cmd = [sys.executable, path, *args]
    else:
        cmd = [sys.executable, "-m", "phalanx", "run", "-np", str(np), "--backend", str(backend), path, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PHALANX_BACKEND", None)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(cmd)}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _assert_same_model(path_a: str, path_b: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    a, b = torch.load(path_a), torch.load(path_b)
    a, b = a.get("model", a), b.get("model", b)
    assert list(a) == list(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


# -- synthetic benchmark: DistributedOptimizer, broadcasts, SyncBatchNorm, backward_passes_per_step, fp16 ----------

SYNTHETIC = ["--batches-per-allreduce", "2", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
             "--num-iters", "2"]


@pytest.fixture(scope="module")
def synthetic_one_rank(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("synthetic") / "one.pt")
    out = _run("synthetic_benchmark.py", *SYNTHETIC, "--batch-size", "16", "--lr", "0.02", "--save-model", path)
    assert "Number of CPUs: 1" in out, out
    return path


@pytest.mark.parametrize("backend", _on("gloo"))
def test_synthetic_benchmark_two_ranks_equal_one(backend: str, synthetic_one_rank: str, tmp_path) -> None:
    path = str(tmp_path / "two.pt")
    out = _run("synthetic_benchmark.py", *SYNTHETIC, "--batch-size", "8", "--save-model", path,
               np=2, backend=backend)
    assert "Number of CPUs: 2" in out and out.count("Total img/sec on 2 CPU(s)") == 1, out  # rank 0 logs
    # float32: 2 x 8 samples and 1 x 16 sum the conv gradients in another order, and oneDNN picks its
    # kernels per CPU; after the 5 steps one weight of 432 differed by 1.2e-6 on one machine. A wrong
    # average (or a missed step) moves the weights by ~1e-2, far outside this tolerance.
    _assert_same_model(path, synthetic_one_rank, atol=1e-5)


@pytest.mark.parametrize("backend", _on("mpi"))
def test_synthetic_benchmark_fp16_allreduce_close_to_one_rank(backend: str, synthetic_one_rank: str,
                                                             tmp_path) -> None:
    path = str(tmp_path / "fp16.pt")
    _run("synthetic_benchmark.py", *SYNTHETIC, "--batch-size", "8", "--fp16-allreduce", "--save-model", path,
         np=2, backend=backend)
    # fp16 keeps ~3 significant digits of each averaged gradient: close to the uncompressed run, not equal
    _assert_same_model(path, synthetic_one_rank, rtol=2e-2, atol=2e-3)


# -- MNIST: DistributedSampler, metric_average through hvd.allreduce, horovod.run -------------------------------

MNIST = ["--epochs", "2", "--train-size", "1280", "--test-size", "256", "--test-batch-size", "64", "--dropout", "0",
         "--log-interval", "100"]
TEST_LINE = re.compile(r"Test set: Average loss: ([\d.]+), Accuracy: ([\d.]+)%")


@pytest.fixture(scope="module")
def mnist_one_rank(tmp_path_factory) -> tuple[str, list[tuple[str, str]]]:
    path = str(tmp_path_factory.mktemp("mnist") / "one.pt")
    out = _run("mnist.py", *MNIST, "--batch-size", "64", "--lr", "0.05", "--save-model", path)
    return path, TEST_LINE.findall(out)


@pytest.mark.parametrize("backend", _on("gloo"))
def test_mnist_two_ranks_equal_one(backend: str, mnist_one_rank: tuple[str, list], tmp_path) -> None:
    path = str(tmp_path / "two.pt")
    out = _run("mnist.py", *MNIST, "--batch-size", "32", "--lr", "0.025", "--save-model", path,
               np=2, backend=backend)
    _assert_same_model(path, mnist_one_rank[0])
    tests = TEST_LINE.findall(out)
    assert len(tests) == 2, out  # one line per epoch, from rank 0 only
    one = mnist_one_rank[1]
    for (loss, acc), (loss1, acc1) in zip(tests, one, strict=True):  # metric_average: the global figures
        assert abs(float(loss) - float(loss1)) <= 2e-4 and abs(float(acc) - float(acc1)) <= 0.01, (tests, one)
    assert float(tests[-1][1]) > 50, tests  # 10 classes: it learned


@pytest.mark.parametrize("backend", _on("mpi"))
def test_mnist_through_horovod_run(backend: str, mnist_one_rank: tuple[str, list], tmp_path) -> None:
    path = str(tmp_path / "run.pt")
    out = _run("mnist.py", *MNIST, "--batch-size", "32", "--lr", "0.025", "--save-model", path,
               "--num-proc", "2", "--communication", backend)
    assert "Running training through horovod.run" in out, out
    results = out.split("Results by rank: ", 1)[1]
    assert re.findall(r"'rank': (\d)", results) == ["0", "1"], results  # per-rank results, in rank order
    _assert_same_model(path, mnist_one_rank[0])


# -- ResNet: LR warm-up, checkpoint on rank 0, resume by broadcast ----------------------------------------------

RESNET = ["--train-size", "256", "--val-size", "64", "--batch-size", "16", "--warmup-epochs", "1",
          "--lr-decay-epochs", "2", "--base-lr", "0.05"]
LR_LINE = re.compile(r"Train Epoch +#(\d+): .* lr ([\d.]+) -> ([\d.]+)")


def _resnet(tmp: str, epochs: int, backend: str) -> str:
    return _run("imagenet_resnet.py", *RESNET, "--epochs", str(epochs),
                "--checkpoint-format", os.path.join(tmp, "checkpoint-{epoch}.pth.tar"), np=2, backend=backend)


@pytest.fixture(scope="module")
def resnet_straight(tmp_path_factory) -> str:
    """Three epochs in one job on 2 ranks (the first backend available): checkpoint-3 to compare with."""
    backend = next((b for b in ("mpi", "gloo") if b in AVAILABLE), None)
    if backend is None:
        pytest.skip("no multi-process backend")
    tmp = str(tmp_path_factory.mktemp("resnet-straight"))
    _resnet(tmp, 3, backend)
    return os.path.join(tmp, "checkpoint-3.pth.tar")


@pytest.mark.parametrize("backend", _on("gloo"))
def test_resnet_warmup_checkpoint_and_resume(backend: str, resnet_straight: str, tmp_path) -> None:
    tmp = str(tmp_path)
    first = _resnet(tmp, 2, backend)
    assert sorted(os.listdir(tmp)) == ["checkpoint-1.pth.tar", "checkpoint-2.pth.tar"]  # rank 0 writes them
    lrs = {int(e): (float(a), float(b)) for e, a, b in LR_LINE.findall(first)}
    steps = 256 // (2 * 16)
    # warm-up from base_lr to base_lr × size() over epoch 1, then size() × base_lr, divided by 10 after epoch 2
    assert lrs[1] == pytest.approx((0.05 * (1 + 1 / steps), 0.1), rel=1e-4), first
    assert lrs[2] == pytest.approx((0.1, 0.1), rel=1e-4), first

    again = _resnet(tmp, 3, backend)
    assert "Resuming from epoch 2" in again and "#1:" not in again and "#2:" not in again, again
    assert {int(e) for e, _, _ in LR_LINE.findall(again)} == {3}
    assert LR_LINE.findall(again)[0][1:] == ("0.010000", "0.010000"), again
    # resumed on the broadcast weights and momentum: where the job that ran straight through ended
    _assert_same_model(os.path.join(tmp, "checkpoint-3.pth.tar"), resnet_straight, rtol=1e-4, atol=1e-5)


# -- the benchmark of the Horovod API against phalanx's own (benchmarks/horovod_step.py), in miniature -------------

@pytest.mark.parametrize("backend", _on("gloo"))
def test_horovod_step_benchmark_trains_what_phalanx_trains(backend: str) -> None:
    script = os.path.join(ROOT, "benchmarks", "horovod_step.py")
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--backend", backend, script, "--rounds", "1",
           "--blocks", "1", "--steps", "2", "--warmup", "1", "--mlp-width", "32"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    # the same weights, batches and steps through hvd.DistributedOptimizer and phalanx's: bit-for-bit equal models
    assert "models equal in every round: True" in done.stdout, done.stdout
