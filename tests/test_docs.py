"""The documents in ``docs/`` say what the code does.

* Every ``phalanx.xxx`` name that ``docs/seeds.md``, ``docs/training.md`` and
  ``docs/slow-links.md`` mention exists (``phalanx.torch.xxx``, ``phalanx.train.xxx``, methods and
  modules too), and every keyword argument they write in a call of one of
  them, ``phalanx.init(timeout=...)``, is a parameter of it.
* Every parameter of ``phalanx.train.fit`` is described in the training guide.
* Repository paths (``tests/test_fit.py``; not the seeds' ``.jl`` files) and
  ``PHALANX_*`` variables named in the documents exist.
* The seeds document maps every feature of the four seed systems.
* The Python blocks of ``docs/training.md`` marked ``<!-- run -->`` run, in
  order, as one session, in a fresh ``python`` process started without a
  launcher (a world of one) in an empty directory. A traceback points at the
  line of the document.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SEEDS = ROOT / "docs" / "seeds.md"
TRAINING = ROOT / "docs" / "training.md"
SLOW_LINKS = ROOT / "docs" / "slow-links.md"
DOCS = [SEEDS, TRAINING, SLOW_LINKS]

NAME = re.compile(r"(?<![\w./-])phalanx(?:\.[A-Za-z_]\w*)+")
KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=(?!=)")
PATH = re.compile(r"`((?:src|tests|examples|docs|benchmarks)/[\w./-]*\w)`")
VARIABLE = re.compile(r"\bPHALANX_[A-Z][A-Z_]*[A-Z]\b")
RUN_MARK = "<!-- run -->"

# Launcher variables that would make the documents' session join some job instead of a world of one.
_LAUNCH_VARS = ("PHALANX_BACKEND", "PHALANX_JOB_DIR", "PHALANX_DATASETS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS",
                "SLURM_PROCID", "MPI_LOCALNRANKS", "I_MPI_HYDRA_TOPOLIB")
_LAUNCH_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "MV2_", "HYDRA_")

# What the seed systems offer (their public functions, types, files and launchers): docs/seeds.md maps each.
SEED_FEATURES = {
    "FluxMPI.jl": [
        "FluxMPI.Init", "Initialized", "local_rank", "total_workers", "fluxmpi_print", "fluxmpi_println",
        "FluxMPINotInitializedError", "disable_cudampi_support", "allreduce!", "bcast!", "reduce!",
        "Iallreduce!", "Ibcast!", "DistributedDataContainer", "DistributedOptimizer", "allreduce_gradients",
        "synchronize!", "FluxMPIFluxModel", "ComponentArray", "DataParallelFluxModel",
        "DataParallelDataLoader", "mpiexecjl", "JULIA_MPI_TEST_NPROCS",
    ],
    "FluxDistributed.jl": [
        "prepare_training", "train_step", "sync_buffer", "update", "train(", "syncgrads", "getgrads",
        "start(", "4.f0", "sched", "buffersize", "HOST", "minibatch", "train_solutions", "makepaths",
        "topkaccuracy", "showpreds", "log_loss_and_acc", "Data.toml", "WandbLogger", "BSON",
        "OutOfGPUMemoryError", "num_missed", "check_nans", "ensure_synced", "destruct", "markbuffer!",
        "getbuffer!", "addprocs", "RemoteChannel", "Threads.@spawn", "with replacement",
    ],
    "Lux DistributedUtils": [
        "MPIBackend", "NCCLBackend", "DistributedUtils.initialize", "initialized", "get_distributed_backend",
        "synchronize!!", "DistributedUtils.avg", "cuda_aware_mpi", "rocm_aware_mpi", "cuda_devices",
        "amdgpu_devices", "force_cuda", "Lux#983", "AverageMeter", "JLD2", "ParameterSchedulers",
        "Iterators.cycle", "should_log",
    ],
    "Conflux.jl": [
        "replicate", "Replicas", "withdevices", "async=true", "allreduce!(op, arrays", "allreduce!(op, xs",
        "zip", "COMMS", "CUDA_VISIBLE_DEVICES", "reducefirst!", "transfer_to_device", "add!", "mul!",
        "manual-transfer", "Conflux.reduce!",
    ],
}


# -- reading the documents -------------------------------------------------------------------------

def _text(path: Path) -> str:
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    return path.read_text(encoding="utf-8")


def _resolve(name: str) -> Any:
    """The object ``name`` (``phalanx.a.b``) names: attributes first, then submodules."""
    parts = name.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            module = ".".join(parts[:i])
            try:
                obj = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name != module:
                    raise
                raise AttributeError(f"{name}: {'.'.join(parts[:i - 1])} has no {part!r}") from None
    return obj


def _call_arguments(text: str, start: int) -> str | None:
    """The text between the parenthesis at ``text[start]`` and its match (None if there is none)."""
    if start >= len(text) or text[start] != "(":
        return None
    depth, quote = 0, None
    for i in range(start, len(text)):
        c = text[i]
        if quote:
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        elif c == "\n" and text[i + 1:i + 2] == "\n":
            return None  # a paragraph ended first: prose, not a call
    return None


def _top_level_pieces(arguments: str) -> list[str]:
    pieces, depth, quote, current = [], 0, None, []
    for c in arguments:
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            pieces.append("".join(current))
            current = []
            continue
        current.append(c)
    pieces.append("".join(current))
    return pieces


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _runnable_blocks(path: Path) -> list[dict[str, Any]]:
    """The ```python blocks preceded by the run mark: their code and first line number."""
    lines = _text(path).split("\n")
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != RUN_MARK:
            continue
        fence = lines[i + 1].strip() if i + 1 < len(lines) else ""
        assert fence == "```python", f"{path.name}:{i + 1}: {RUN_MARK} must be followed by a ```python block"
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{path.name}:{i + 2}: the code block never closes"
        blocks.append({"path": str(path), "line": i + 3, "code": "\n".join(lines[i + 2:end]) + "\n"})
    return blocks


# -- names and signatures --------------------------------------------------------------------------

@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_phalanx_name_exists_and_takes_the_keywords_written(doc: Path) -> None:
    text = _text(doc)
    problems, seen = [], set()
    for match in NAME.finditer(text):
        name = match.group(0)
        where = f"{doc.name}:{_line(text, match.start())}"
        try:
            obj = _resolve(name)
        except (AttributeError, ImportError) as exc:
            problems.append(f"{where}: {name} does not exist ({exc})")
            continue
        seen.add(name)
        arguments = _call_arguments(text, match.end())
        if arguments is None or not callable(obj):
            continue
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        for piece in _top_level_pieces(arguments):
            keyword = KEYWORD.match(piece)
            if keyword and keyword.group(1) not in params:
                problems.append(f"{where}: {name}() has no parameter {keyword.group(1)!r} "
                                f"(it takes {', '.join(params)})")
    assert not problems, "\n".join(problems)
    least = 8 if doc == SLOW_LINKS else 20  # one feature's page names fewer than the guides
    assert len(seen) >= least, f"{doc.name} names only {sorted(seen)}"


def test_the_guide_describes_every_argument_of_fit() -> None:
    import phalanx.train

    text = _text(TRAINING)
    missing = [p for p in inspect.signature(phalanx.train.fit).parameters if not re.search(rf"`{p}\b", text)]
    assert not missing, f"docs/training.md does not describe fit's {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_paths_and_variables_named_exist(doc: Path) -> None:
    text = _text(doc)
    missing = [p for p in PATH.findall(text) if not p.endswith(".jl") and not (ROOT / p).exists()]  # .jl: seeds
    assert not missing, f"{doc.name} names files that do not exist: {missing}"
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "src").rglob("*.py"))
    unknown = sorted({v for v in VARIABLE.findall(text) if v not in source})
    assert not unknown, f"{doc.name} names variables phalanx never reads: {unknown}"


@pytest.mark.parametrize("seed", sorted(SEED_FEATURES))
def test_the_seeds_document_maps_every_seed_feature(seed: str) -> None:
    text = _text(SEEDS)
    assert f"\n## {seed}\n" in text, f"docs/seeds.md has no section '## {seed}'"
    missing = [feature for feature in SEED_FEATURES[seed] if feature not in text]
    assert not missing, f"docs/seeds.md does not map {seed}'s {missing}"


# -- the runnable blocks -----------------------------------------------------------------------------

_DRIVER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
session = {"__name__": "__main__"}
for block in blocks:
    # Blank lines first, so that a traceback's line numbers are the document's.
    exec(compile("\\n" * (block["line"] - 1) + block["code"], block["path"], "exec"), session)
import phalanx
assert phalanx.backend().name == "local" and phalanx.size() == 1, phalanx.backend()
print(f"ran {len(blocks)} blocks")
"""


def _world_of_one_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_the_guide_code_runs_in_a_world_of_one(tmp_path: Path) -> None:
    blocks = _runnable_blocks(TRAINING)
    assert len(blocks) >= 10, f"only {len(blocks)} blocks of docs/training.md are marked {RUN_MARK}"
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(blocks))
    work = tmp_path / "work"
    work.mkdir()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _DRIVER, str(spec)], cwd=work, env=_world_of_one_env(),
                          capture_output=True, text=True, timeout=180)
    seconds = time.monotonic() - started
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    assert f"ran {len(blocks)} blocks" in proc.stdout, proc.stdout
    # What the blocks leave behind: the checkpoints, metrics and curves they say they write.
    assert (work / "runs" / "quick" / "curves.png").is_file()
    assert len(list((work / "runs" / "manual").glob("checkpoint-*.pt"))) == 2
    assert (work / "runs" / "log" / "metrics.jsonl").is_file() and (work / "runs" / "log" / "again.png").is_file()
    assert seconds < 120, f"the guide's code took {seconds:.0f} s"
