"""Checkpoints: exact round trips, atomic writes under SIGKILL, safe loading, clear errors, StopSignal.

Single-process checks run here; the ones that need real processes (a writer
killed mid-write, a file-size limit standing in for a full disk, signals)
run in child processes. Multi-rank checks (``worlds_checkpoint``) run in one
world per backend and size: local-1, and for mpi and gloo a 3-rank world that
saves a checkpoint which a 2-rank world then restores (RNG entry ``r % 3``).
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import phalanx.train as pt
import worlds_checkpoint as bodies
from conftest import world_params
from phalanx import InvalidArgumentError, UsageError
from phalanx.train._signals import StopSignal

SRC = str(pathlib.Path(__file__).resolve().parents[1] / "src")


def _child(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


# -- exact round trip ----------------------------------------------------------------------------

def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))


def _parts(kind: str, model: torch.nn.Module) -> tuple[Any, Any, Any]:
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    return opt, sched, scaler


def _train(net: Any, opt: Any, sched: Any, scaler: Any, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(net(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()


def _draws() -> list[float]:
    return [*torch.rand(3).tolist(), *np.random.rand(3).tolist(), float(np.random.standard_normal()),
            *(random.random() for _ in range(3)), random.gauss(0, 1)]


def _scramble() -> None:
    torch.manual_seed(4242)
    np.random.seed(4242)
    random.seed(4242)


@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch")
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("wrap", ["plain", "compiled"])
def test_round_trip_resumes_exactly(tmp_path: pathlib.Path, kind: str, wrap: str) -> None:
    model = _model(1)
    net = torch.compile(model) if wrap == "compiled" else model  # only wrapped, never run compiled
    opt, sched, scaler = _parts(kind, model)
    _train(model, opt, sched, scaler, range(4))
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    random.gauss(0, 1)  # cached gaussians are RNG state too
    np.random.standard_normal()
    state = pt.capture_state(model=net, optimizer=opt, scheduler=sched, scaler=scaler,
                             progress={"epoch": 2, "step_in_epoch": np.int64(1), "lr": 0.05, "tag": "x"},
                             extra={"ema": torch.ones(3), "history": [1.5, 2.5]})
    assert list(state["model"]) == list(model.state_dict())  # no "_orig_mod." prefix
    assert state["format"] == "phalanx-checkpoint" and state["version"] == 2 and state["world_size"] == 1
    assert type(state["progress"]["step_in_epoch"]) is int
    assert state["model"]["0.weight"].data_ptr() != model[0].weight.data_ptr()  # a copy, not a view
    path = pt.save_checkpoint(tmp_path / "sub" / "c.pt", state)
    assert path == str(tmp_path / "sub" / "c.pt") and sorted(os.listdir(tmp_path / "sub")) == ["c.pt"]
    expected = _draws()
    _train(model, opt, sched, scaler, range(4, 8))

    _scramble()
    fresh = _model(2)
    fresh_net = torch.compile(fresh) if wrap == "compiled" else fresh
    fresh_opt, fresh_sched, fresh_scaler = _parts(kind, fresh)
    loaded = pt.load_checkpoint(path)
    progress = pt.restore_state(loaded, model=fresh_net, optimizer=fresh_opt, scheduler=fresh_sched,
                                scaler=fresh_scaler)
    assert progress == {"epoch": 2, "step_in_epoch": 1, "lr": 0.05, "tag": "x"}
    assert torch.equal(loaded["extra"]["ema"], torch.ones(3)) and loaded["extra"]["history"] == [1.5, 2.5]
    assert _draws() == expected
    assert fresh_scaler.get_scale() == state["scaler"]["scale"]
    _train(fresh, fresh_opt, fresh_sched, fresh_scaler, range(4, 8))  # Dropout draws from the restored RNG
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resuming"
    assert fresh_sched.get_last_lr() == sched.get_last_lr() and fresh_scaler.get_scale() == scaler.get_scale()
    assert str(fresh_opt.state_dict()) == str(opt.state_dict())


def test_restore_rng_false_leaves_generators_alone(tmp_path: pathlib.Path) -> None:
    model = _model(3)
    state = pt.capture_state(model=model)
    state["rng"] = None  # as a hand-made state might be
    target = _model(4)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    pt.restore_state(state, model=target, restore_rng=False)
    assert torch.equal(torch.get_rng_state(), before)
    with pytest.raises(pt.CheckpointError, match="restore_rng=False"):
        pt.restore_state(state, model=target)


# -- atomicity, for real ------------------------------------------------------------------------

WRITER = """
    import sys, torch
    import phalanx.train as pt
    path = sys.argv[1]
    model = torch.nn.Linear(3, 3)
    pt.save_checkpoint(path, pt.capture_state(model=model, progress={"which": "A"}))
    print("A", flush=True)
    big = {f"t{i}": torch.ones(1_000_000) for i in range(80)}  # 320 MB
    pt.save_checkpoint(path, pt.capture_state(model=model, progress={"which": "B"}, extra=big))
    print("B", flush=True)
"""


def test_sigkill_during_write_leaves_the_previous_checkpoint(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "checkpoint-000000001.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "A", child.stderr
        temp = tmp_path / f".{path.name}.tmp-{child.pid}"
        deadline = time.monotonic() + 60
        while not (temp.exists() and temp.stat().st_size > 1 << 20):  # mid-write: over 1 MB written
            assert child.poll() is None, f"the writer finished before it could be killed: {child.stderr.read()}"
            assert time.monotonic() < deadline, "the temporary file never appeared"
            time.sleep(0.0005)
        child.kill()
    finally:
        child.kill()
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    assert temp.exists(), "killed mid-write: the temporary file stays behind"
    assert pt.load_checkpoint(path)["progress"] == {"which": "A"}

    manager = pt.CheckpointManager(tmp_path)
    assert manager.paths() == [str(path)] and manager.latest() == str(path)
    assert manager.load_latest()["progress"] == {"which": "A"}
    manager.save(pt.capture_state(model=torch.nn.Linear(3, 3), progress={"which": "C"}), 2)
    assert not temp.exists(), "the next save removes temporary files left by interrupted saves"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000000001.pt", "checkpoint-000000002.pt"]


def test_disk_full_raises_and_keeps_the_previous_checkpoint(tmp_path: pathlib.Path) -> None:
    # RLIMIT_FSIZE makes writes past 1 MB fail with EFBIG, as a full disk fails with ENOSPC.
    result = _child("""
        import json, os, resource, signal, sys, torch
        import phalanx.train as pt
        path = sys.argv[1]
        pt.save_checkpoint(path, pt.capture_state(model=torch.nn.Linear(3, 3), progress={"which": "A"}))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        state = pt.capture_state(model=torch.nn.Linear(1000, 1000), progress={"which": "B"})
        try:
            pt.save_checkpoint(path, state)
            error = None
        except pt.CheckpointError as exc:
            error = str(exc)
        print(json.dumps({"error": error, "files": sorted(os.listdir(os.path.dirname(path)))}))
    """, str(tmp_path / "c.pt"))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["error"] and "could not write" in out["error"] and "unchanged" in out["error"], out
    assert out["files"] == ["c.pt"], "the temporary file must be removed"
    assert pt.load_checkpoint(tmp_path / "c.pt")["progress"] == {"which": "A"}


def test_write_failures_are_checkpoint_errors(tmp_path: pathlib.Path) -> None:
    state = pt.capture_state(model=torch.nn.Linear(2, 2), progress={"which": "A"})
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(pt.CheckpointError, match="could not write"):
        pt.save_checkpoint(tmp_path / "file" / "c.pt", state)
    (tmp_path / "dir.pt").mkdir()
    with pytest.raises(pt.CheckpointError, match="could not write"):
        pt.save_checkpoint(tmp_path / "dir.pt", state)
    assert sorted(os.listdir(tmp_path)) == ["dir.pt", "file"]  # no temporary file left
    good = pt.save_checkpoint(tmp_path / "good.pt", state)
    for bad, where in [({"f": lambda: 0}, "state['extra']['f']"), ({"n": np.float32(1)}, "NumPy scalar"),
                       ({"a": np.zeros(2)}, "NumPy array"), ({"s": frozenset()}, "frozenset")]:
        with pytest.raises(pt.CheckpointError, match="weights_only") as info:
            pt.save_checkpoint(good, {**state, "extra": bad})
        assert where in str(info.value)
    with pytest.raises(pt.CheckpointError, match="not a complete phalanx checkpoint"):
        pt.save_checkpoint(good, {"model": {}})
    assert pt.load_checkpoint(good)["progress"] == {"which": "A"}
    with pytest.raises(InvalidArgumentError, match="path must be"):
        pt.save_checkpoint(3, state)  # type: ignore[arg-type]


# -- reading: missing, corrupt, wrong format, unsafe -------------------------------------------

def test_missing_file_names_the_path_and_lists_checkpoints(tmp_path: pathlib.Path) -> None:
    state = pt.capture_state(model=torch.nn.Linear(2, 2))
    pt.save_checkpoint(tmp_path / "epoch-1.pt", state)
    pt.save_checkpoint(tmp_path / "epoch-2.pt", state)
    with pytest.raises(pt.CheckpointError) as info:
        pt.load_checkpoint(tmp_path / "epoch-3.pt")
    text = str(info.value)
    assert "epoch-3.pt" in text and "no such file" in text and "epoch-1.pt, epoch-2.pt" in text
    with pytest.raises(pt.CheckpointError, match="does not exist"):
        pt.load_checkpoint(tmp_path / "nowhere" / "c.pt")
    with pytest.raises(pt.CheckpointError, match="is a directory"):
        pt.load_checkpoint(tmp_path)


def test_truncated_and_corrupt_files(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.pt"
    pt.save_checkpoint(path, pt.capture_state(model=torch.nn.Linear(50, 50)))
    data = path.read_bytes()
    flipped = bytearray(data)
    for i in range(300, 700):
        flipped[i] ^= 0x5A
    for damaged in (b"", data[:20], data[:len(data) // 2], data[:-30], bytes(flipped), b"hello world"):
        path.write_bytes(damaged)
        with pytest.raises(pt.CheckpointError, match="not a complete phalanx checkpoint|the file is damaged"):
            pt.load_checkpoint(path)


def _flip(path: pathlib.Path, needle: bytes, count: int = 64) -> None:
    """Flip ``count`` bytes of ``path`` where ``needle`` (bytes of one stored tensor) sits."""
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0, "the tensor's bytes are not in the file"
    for i in range(at, at + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_bytes_in_weights_or_rng_are_caught_by_the_digest(tmp_path: pathlib.Path) -> None:
    # Flipped weights load without error from a plain torch.save file; the SHA-256 footer catches them.
    model = torch.nn.Linear(50, 50)
    random.seed(5)
    state = pt.capture_state(model=model)
    for name, needle in (("weights", model.weight.detach().numpy().tobytes()[:256]),
                         ("python RNG", state["rng"][0]["python"].numpy().tobytes()[16:272])):
        path = tmp_path / f"{name}.pt"
        pt.save_checkpoint(path, state)
        _flip(path, needle)
        with pytest.raises(pt.CheckpointError, match=r"damaged: its SHA-256 digest does not match") as info:
            pt.load_checkpoint(path)
        assert str(path) in str(info.value)


def test_a_damaged_rng_state_is_a_checkpoint_error_and_changes_nothing() -> None:
    # Without the digest (a state in memory, or an old file): out-of-range RNG words are refused whole.
    model = torch.nn.Linear(3, 3)
    state = pt.capture_state(model=model)
    bad = {**state, "rng": [{**state["rng"][0], "python": state["rng"][0]["python"] + 2**40}]}
    torch.manual_seed(3)
    before = torch.get_rng_state()
    with pytest.raises(pt.CheckpointError, match="not a valid RNG state"):
        pt.restore_state(bad, model=model)
    assert torch.equal(torch.get_rng_state(), before)


def test_files_without_a_footer_load_only_at_format_version_1(tmp_path: pathlib.Path) -> None:
    state = pt.capture_state(model=torch.nn.Linear(2, 2))
    path = tmp_path / "old.pt"
    torch.save({**state, "version": 1}, path)  # what phalanx wrote before the digest
    assert pt.load_checkpoint(path)["version"] == 1
    torch.save(state, path)  # version 2 without its footer: cut off or rewritten
    with pytest.raises(pt.CheckpointError, match="lacks the SHA-256 footer"):
        pt.load_checkpoint(path)


def test_wrong_format(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    with pytest.raises(pt.CheckpointError, match="plain state_dict"):
        pt.load_checkpoint(path)
    torch.save({"format": "something-else", "model": {}}, path)
    with pytest.raises(pt.CheckpointError, match="not a complete phalanx checkpoint.*'something-else'"):
        pt.load_checkpoint(path)
    torch.save([1, 2, 3], path)
    with pytest.raises(pt.CheckpointError, match="holds a list"):
        pt.load_checkpoint(path)
    state = pt.capture_state(model=torch.nn.Linear(2, 2))
    torch.save({**state, "version": 99}, path)
    with pytest.raises(pt.CheckpointError, match="version 99"):
        pt.load_checkpoint(path)
    torch.save({k: v for k, v in state.items() if k != "rng"}, path)
    with pytest.raises(pt.CheckpointError, match="lacks rng"):
        pt.load_checkpoint(path)


class Custom:
    def __init__(self) -> None:
        self.value = 1


def _touch(path: str) -> None:
    pathlib.Path(path).touch()


class Gadget:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Any:
        return (_touch, (self.marker,))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_unsafe_files_are_refused_and_never_run(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "payload-ran"
    path = tmp_path / "c.pt"
    state = pt.capture_state(model=torch.nn.Linear(2, 2))
    torch.save({**state, "extra": Custom()}, path)
    with pytest.raises(pt.CheckpointError, match=r"refused as unsafe.*test_checkpoint\.Custom"):
        pt.load_checkpoint(path)
    torch.save({**state, "extra": Gadget(marker)}, path)
    with pytest.raises(pt.CheckpointError, match=r"refused as unsafe.*test_checkpoint\._touch"):
        pt.load_checkpoint(path)
    for protocol in (2, pickle.HIGHEST_PROTOCOL):  # plain pickle, not torch.save
        with open(path, "wb") as f:
            pickle.dump({"format": "phalanx-checkpoint", "x": Gadget(marker)}, f, protocol=protocol)
        with pytest.raises(pt.CheckpointError, match=r"refused as unsafe.*test_checkpoint\._touch"):
            pt.load_checkpoint(path)
    manager = pt.CheckpointManager(tmp_path)
    torch.save({**state, "extra": Gadget(marker)}, tmp_path / "checkpoint-000000001.pt")
    with pytest.warns(RuntimeWarning, match="checkpoint-000000001.pt"), \
            pytest.raises(pt.CheckpointError, match="none of the 1 checkpoint"):
        manager.load_latest()
    assert not marker.exists(), "the payload must never run"


# -- restore: every part given exactly when saved ------------------------------------------------

def test_restore_mismatches_are_errors_and_change_nothing() -> None:
    model = _model(5)
    opt, sched, scaler = _parts("sgd", model)
    full = pt.capture_state(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    bare = pt.capture_state(model=model)
    target = _model(6)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    t_opt, t_sched, t_scaler = _parts("sgd", target)
    with pytest.raises(pt.CheckpointError, match=r"optimizer=.*holds no optimizer state"):
        pt.restore_state(bare, model=target, optimizer=t_opt)
    with pytest.raises(pt.CheckpointError, match="holds scaler state but no scaler= was given"):
        pt.restore_state(full, model=target, optimizer=t_opt, scheduler=t_sched)
    with pytest.raises(pt.CheckpointError, match="holds optimizer state but no optimizer="):
        pt.restore_state(full, model=target)
    other = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU())
    with pytest.raises(pt.CheckpointError, match=r"does not match.*in the checkpoint but not in the model: 1\."):
        pt.restore_state(bare, model=other)
    wrong_shape = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                      torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    with pytest.raises(pt.CheckpointError, match="size mismatch"):
        pt.restore_state(bare, model=wrong_shape)
    with pytest.raises(pt.CheckpointError, match="not a complete phalanx checkpoint"):
        pt.restore_state(model.state_dict(), model=target)
    for (name, a), b in zip(target.state_dict().items(), before.values(), strict=True):
        assert torch.equal(a, b), f"{name} changed although restore_state refused"
    pt.restore_state(full, model=target, optimizer=t_opt, scheduler=t_sched, scaler=t_scaler)
    with pytest.raises(InvalidArgumentError, match="torch.nn.Module"):
        pt.restore_state(full, model="model")


def test_capture_state_arguments() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError, match="plain ints"):
        pt.capture_state(model=model, progress={"when": object()})
    with pytest.raises(InvalidArgumentError, match="string keys"):
        pt.capture_state(model=model, progress={1: 2})
    with pytest.raises(InvalidArgumentError, match="expected a dict"):
        pt.capture_state(model=model, progress=[1, 2])
    with pytest.raises(InvalidArgumentError, match="has no state_dict"):
        pt.capture_state(model=model, optimizer=object())
    state = pt.capture_state(model=model, progress={"t": torch.tensor(3), "nested": {"epoch": np.int32(2)}})
    assert state["progress"] == {"t": 3, "nested": {"epoch": 2}}
    assert len(state["rng"]) == 1 and state["rng"][0]["torch"].dtype == torch.uint8
    assert state["rng"][0]["numpy"].shape == (626,) and state["rng"][0]["python"].shape == (627,)


# -- CheckpointManager ---------------------------------------------------------------------------

def test_manager_keeps_the_newest_and_falls_back(tmp_path: pathlib.Path) -> None:
    manager = pt.CheckpointManager(tmp_path / "run", keep=3, prefix="ckpt")
    assert manager.paths() == [] and manager.latest() is None and manager.load_latest() is None
    model = torch.nn.Linear(2, 2)
    for step in (5, 100, 7, 2000, 30):
        assert manager.save(pt.capture_state(model=model, progress={"step": step}), step).endswith(f"{step:09d}.pt")
    names = [os.path.basename(p) for p in manager.paths()]
    assert names == ["ckpt-000000030.pt", "ckpt-000000100.pt", "ckpt-000002000.pt"]
    (tmp_path / "run" / "notes.txt").write_text("ignored")
    (tmp_path / "run" / ".ckpt-000009999.pt.tmp-123").write_bytes(b"partial")
    (tmp_path / "run" / "other-000000001.pt").write_bytes(b"another prefix")
    assert [os.path.basename(p) for p in manager.paths()] == names
    assert manager.load_latest()["progress"] == {"step": 2000}
    newest = manager.latest()
    assert newest is not None
    with open(newest, "r+b") as f:
        f.truncate(100)
    with pytest.warns(RuntimeWarning, match=r"skipped .*ckpt-000002000\.pt"):
        assert manager.load_latest()["progress"] == {"step": 100}
    for bad in (0, -1, True, 2.5):
        with pytest.raises(InvalidArgumentError, match="keep"):
            pt.CheckpointManager(tmp_path, keep=bad)
    for bad_prefix in ("", "a/b", ".hidden"):
        with pytest.raises(InvalidArgumentError, match="prefix"):
            pt.CheckpointManager(tmp_path, prefix=bad_prefix)
    with pytest.raises(InvalidArgumentError, match="step"):
        manager.save(pt.capture_state(model=model), -3)
    keep_all = pt.CheckpointManager(tmp_path / "all", keep=None)
    for step in range(5):
        keep_all.save(pt.capture_state(model=model), step)
    assert len(keep_all.paths()) == 5


def test_manager_never_deletes_the_checkpoint_it_just_wrote(tmp_path: pathlib.Path) -> None:
    manager = pt.CheckpointManager(tmp_path, keep=1)
    model = torch.nn.Linear(2, 2)
    manager.save(pt.capture_state(model=model), 500)
    resumed = manager.save(pt.capture_state(model=model, progress={"resumed": 1}), 100)  # an older step
    assert os.path.exists(resumed) and len(manager.paths()) == 2


# -- multi-rank ----------------------------------------------------------------------------------

_DIRS: dict[str, str] = {}


def _world_dir(factory: pytest.TempPathFactory, name: str) -> str:
    """One directory per world (the world is shared by the tests of its behaviours)."""
    if name not in _DIRS:
        _DIRS[name] = str(factory.mktemp(name))
    return _DIRS[name]


@pytest.mark.parametrize("behaviour", bodies.CHECKS.names)
def test_local_world(worlds, tmp_path_factory, behaviour: str) -> None:
    worlds.check(bodies.checks, "local", 1, behaviour, timeout=180, op_timeout=30,
                 args=(_world_dir(tmp_path_factory, "local"), "plain"))


def _saved_at_three(worlds, factory: pytest.TempPathFactory, backend: str) -> tuple[str, list[Any]]:
    directory = _world_dir(factory, f"resized-{backend}")
    three = worlds.results(bodies.checks, backend, 3, timeout=240, op_timeout=30, args=(directory, "save3"))
    return directory, [done["expected"] for done in three]


@pytest.mark.parametrize("behaviour", bodies.CHECKS.names + bodies.SAVED_AT_THREE.names)
@pytest.mark.parametrize("backend,n", world_params([("mpi", 3), ("gloo", 3)]))
def test_three_ranks_save_for_two(worlds, tmp_path_factory, backend: str, n: int, behaviour: str) -> None:
    directory, expected = _saved_at_three(worlds, tmp_path_factory, backend)
    worlds.check(bodies.checks, backend, n, behaviour, timeout=240, op_timeout=30, args=(directory, "save3"))
    if behaviour in bodies.SAVED_AT_THREE.names:
        assert len({tuple(e) for e in expected}) == 3, "each rank saved its own RNG states"


@pytest.mark.parametrize("behaviour", ["saved-at-3-restored-at-2-takes-rank-r-mod-3"] + bodies.CHECKS.names)
@pytest.mark.parametrize("backend,n", world_params([("mpi", 2), ("gloo", 2)]))
def test_two_ranks_restore_what_three_saved(worlds, tmp_path_factory, backend: str, n: int,
                                            behaviour: str) -> None:
    directory, expected = _saved_at_three(worlds, tmp_path_factory, backend)
    frozen = tuple(tuple(e) for e in expected)
    worlds.check(bodies.checks, backend, n, behaviour, timeout=240, op_timeout=30,
                 args=(directory, "restore3", frozen))


# -- StopSignal ----------------------------------------------------------------------------------

SIGNALS = """
    import json, os, signal, threading, warnings
    from phalanx.train._signals import StopSignal

    out = {}
    def custom(signum, frame):
        pass
    signal.signal(signal.SIGTERM, custom)
    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    with StopSignal() as stop:
        out["installed"] = signal.getsignal(signal.SIGTERM) is not custom
        os.kill(os.getpid(), signal.SIGTERM)
        out["after_term"] = [stop.requested, stop.signal_name]
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        out["after_first_int"] = [stop.requested, stop.signal_name, stop.count]
        try:
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))
            out["second_int"] = "nothing"
        except KeyboardInterrupt:
            out["second_int"] = "KeyboardInterrupt"
            out["int_handler_back"] = signal.getsignal(signal.SIGINT) is before[1]
    out["restored"] = [signal.getsignal(signal.SIGTERM) is before[0], signal.getsignal(signal.SIGINT) is before[1]]

    with StopSignal(signals=["USR1"]) as stop:
        out["term_untouched"] = signal.getsignal(signal.SIGTERM) is custom
        os.kill(os.getpid(), signal.SIGUSR1)
        out["usr1"] = stop.signal_name
    out["usr1_restored"] = signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    with StopSignal(signals=["SIGUSR2"]):
        out["ignored_stays_ignored"] = signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN

    def in_thread():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                with StopSignal() as stop:
                    out.setdefault("thread", []).append(
                        [stop.inert, signal.getsignal(signal.SIGTERM) is custom, stop.requested])
                    stop.request("preempted")
                    out["thread"][-1] += [stop.requested, stop.signal_name]
        out["thread_warnings"] = [str(w.message) for w in caught]
    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join()
    print(json.dumps(out))
"""


def test_stop_signal_in_a_real_process() -> None:
    result = _child(SIGNALS, timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["installed"] and out["after_term"] == [True, "SIGTERM"], out
    assert out["after_first_int"] == [True, "SIGTERM", 3], out
    assert out["second_int"] == "KeyboardInterrupt" and out["int_handler_back"], out
    assert out["restored"] == [True, True] and out["term_untouched"] and out["usr1"] == "SIGUSR1", out
    assert out["usr1_restored"] and out["ignored_stays_ignored"], out
    assert out["thread"] == [[True, True, False, True, "preempted"]] * 2, out
    assert len(out["thread_warnings"]) == 1 and "main thread" in out["thread_warnings"][0], out


def test_sigint_twice_ends_a_process_stuck_in_its_loop() -> None:
    # The first Ctrl-C is recorded; a loop that never checks it is ended by the second.
    result = _child("""
        import os, signal, time
        from phalanx.train._signals import StopSignal
        with StopSignal() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            print("first:", stop.requested, flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        print("not reached")
    """, timeout=60)
    assert result.returncode != 0 and "first: True" in result.stdout and "not reached" not in result.stdout
    assert "KeyboardInterrupt" in result.stderr


def test_stop_signal_arguments() -> None:
    for bad in (["SIGKILL"], ["NOPE"], [object()], []):
        with pytest.raises(InvalidArgumentError):
            StopSignal(signals=bad)
    assert StopSignal(signals="term").signals == (signal.SIGTERM,)
    stop = StopSignal(signals=[signal.SIGUSR2])
    with stop, pytest.raises(UsageError, match="already active"):
        stop.__enter__()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
    stop.request()
    assert stop.requested and stop.signal_name == "manual" and "requested=True" in repr(stop)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with StopSignal(signals=[signal.SIGUSR2]):  # the main thread: no warning
            pass
