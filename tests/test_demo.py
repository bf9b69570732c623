"""``phalanx demo`` and the training script it runs (``examples/digits.py``).

The script runs as a user runs it: ``python examples/digits.py`` (a world of
one), ``phalanx run -n N --backend B examples/digits.py`` on 1, 2 and 3 ranks
of mpi and gloo, and ``-m phalanx.examples.digits`` (through the demo). Every
run must reach the same test accuracy, with progress from rank 0 only; the
demo must say so and exit 0, and ``phalanx demo --smoke`` still checks the
collectives.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import AVAILABLE

pytest.importorskip("torch")
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "digits.py"
EPOCHS = 3  # enough to learn (accuracy > 0.8); the runs are mostly start-up
BATCH = 48  # splits evenly over 1, 2 and 3 ranks
EPOCH_LINE = re.compile(r"^(\[\d+\] )?epoch +\d+/\d+  train loss \d\.\d{4}  \(\d+\.\d s\)$", re.MULTILINE)


def phalanx_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "phalanx", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The script under plain ``python`` (a world of one, no launcher)."""
    out = tmp_path_factory.mktemp("reference") / "result.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(EPOCH_LINE.findall(run.stdout)) == EPOCHS, run.stdout
    result = json.loads(out.read_text())
    assert result["ranks"] == 1 and result["backend"] == "local" and result["total"] == 359, result
    assert f"test accuracy {result['accuracy']:.4f} ({result['correct']} of 359 correct)" in run.stdout
    assert result["accuracy"] > 0.8, result  # it learns (chance is 0.1)
    return result


def test_examples_folder_shows_the_packaged_script() -> None:
    assert SCRIPT.is_symlink()
    assert SCRIPT.resolve() == ROOT / "src" / "phalanx" / "examples" / "digits.py"


@pytest.mark.parametrize("backend", [
    pytest.param(b, marks=[] if b in AVAILABLE else
                 [pytest.mark.skip(reason=f"backend {b!r} is not available here (see `phalanx info`)")])
    for b in ("mpi", "gloo")
])
def test_every_world_size_reaches_the_same_accuracy(backend: str, reference: dict[str, object],
                                                    tmp_path: Path) -> None:
    for n in (1, 2, 3) if backend == "mpi" else (3,):  # gloo: its largest world only
        logs, out = tmp_path / f"logs-{n}", tmp_path / f"result-{n}.json"
        run = phalanx_cli("run", "-n", str(n), "--backend", backend, "--log-dir", str(logs), str(SCRIPT),
                          "--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--json", str(out))
        where = f"{backend}-{n}:\n{run.stdout}\n{run.stderr}"
        assert run.returncode == 0, where
        result = json.loads(out.read_text())
        assert (result["ranks"], result["backend"]) == (n, backend), result
        assert f"{result['accuracy']:.4f}" == f"{reference['accuracy']:.4f}", where
        assert result["correct"] == reference["correct"], where
        # Progress and results come from rank 0 only: its log has every epoch, the others nothing.
        rank0 = (logs / "rank.0.log").read_text()
        assert len(EPOCH_LINE.findall(rank0)) == EPOCHS, rank0
        assert f"global batch {BATCH} = {n} x {BATCH // n}" in rank0 and "test accuracy" in rank0
        for rank in range(1, n):
            assert (logs / f"rank.{rank}.log").read_text().strip() == "", f"rank {rank} printed ({where})"
        assert len(EPOCH_LINE.findall(run.stdout)) == EPOCHS, where  # the console echo: rank 0's lines


def test_demo_trains_on_one_and_two_processes_and_they_agree() -> None:
    run = phalanx_cli("demo", "--epochs", str(EPOCHS))  # as the README runs it, with fewer epochs
    text = run.stdout + run.stderr
    assert run.returncode == 0, text
    assert len(EPOCH_LINE.findall(run.stdout)) == 2 * EPOCHS, text  # rank 0 of each run, shown as it runs
    one = re.search(r"^1 process:   test accuracy (\d\.\d{4}) \(global batch 64, " + str(EPOCHS) + r" epochs, trained in "
                    r"\d+\.\d s\)$", run.stdout, re.MULTILINE)
    two = re.search(r"^2 processes: test accuracy (\d\.\d{4}) \(global batch 64 = 2 x 32, (mpi|gloo), "
                    r"trained in \d+\.\d s\)$", run.stdout, re.MULTILINE)
    assert one and two, text
    assert one.group(1) == two.group(1)
    assert ("Same accuracy: data-parallel training on 2 processes matches 1 process on the same global batch."
            in run.stdout), text


def test_demo_smoke_checks_the_collectives() -> None:
    run = phalanx_cli("demo", "--smoke", timeout=90)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"OK: 2 processes agreed on every collective \(backend (mpi|gloo)\)", run.stdout), run.stdout


@pytest.mark.parametrize("args,message", [
    (["-n", "1"], "-n 1: give at least 2 processes"),
    (["-n", "3", "--batch-size", "64"], "--batch-size 64 does not split evenly over 3 processes"),
    (["--epochs", "0"], "--epochs 0: give at least 1"),
])
def test_demo_rejects_bad_options_before_starting_anything(args: list[str], message: str) -> None:
    run = phalanx_cli("demo", *args, timeout=30)
    assert run.returncode == 2 and message in run.stderr, run.stdout + run.stderr
    assert "--- 1 process" not in run.stdout
