"""Sharded checkpoints (``save_sharded``/``load_sharded``/``export_safetensors``): written at N ranks, read at another.

The write world (N ranks) saves a ``shard="parameters"`` GPT and keeps the
uninterrupted result; the read world (another N) loads it under each
``shard`` level and unwrapped, and continues to the same result. Both also
convert to and from torch's DCP (``convert_checkpoint``). The converter's
command, ``phalanx convert``, runs here in plain processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from typing import Any

import pytest

import phalanx
import worlds_sharded_checkpoint as bodies
from conftest import world_params

SIZES = [("local", 1, 1), ("mpi", 2, 3), ("gloo", 3, 2)]
_DIRS: dict[str, str] = {}


@pytest.mark.parametrize("phase,behaviour", [("write", b) for b in bodies.WRITE.names]
                         + [("read", b) for b in bodies.READ.names])
@pytest.mark.parametrize("backend,written_at,read_at", [
    pytest.param(b, w, r, id=f"{b}-{w}-{r}", marks=world_params([(b, w)])[0].marks) for b, w, r in SIZES])
def test_sharded_checkpoint(worlds, tmp_path_factory, backend: str, written_at: int, read_at: int, phase: str,
                            behaviour: str) -> None:
    if backend not in _DIRS:
        _DIRS[backend] = str(tmp_path_factory.mktemp(f"sharded-{backend}"))
    directory = _DIRS[backend]
    written = behaviour if phase == "write" else bodies.WRITE.names[0]
    worlds.check(bodies.checkpoints, backend, written_at, written, timeout=180, op_timeout=60,
                 args=(directory, "write"))
    if phase == "read":
        worlds.check(bodies.checkpoints, backend, read_at, behaviour, timeout=180, op_timeout=60,
                     args=(directory, "read"))


# -- the converter in one plain process: `phalanx convert` and convert_checkpoint's refusals ------------

def _phalanx_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "phalanx", *args], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})


def _trained(torch: Any, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    return model, opt


def test_the_convert_command_turns_a_dcp_checkpoint_into_phalanx_and_back_bitwise(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _trained(torch, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notice that it runs in one process
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    there = _phalanx_command("convert", "--from", "dcp", str(tmp_path / "src"), str(tmp_path / "mid"))
    assert there.returncode == 0, there.stderr
    assert sorted(os.listdir(tmp_path / "mid")) == ["manifest.json", "rank-00000.pt"], os.listdir(tmp_path / "mid")
    back = _phalanx_command("convert", "--to", "dcp", str(tmp_path / "mid"), str(tmp_path / "out"))
    assert back.returncode == 0, back.stderr
    assert "wrote" in back.stdout and str(tmp_path / "out") in back.stdout, back.stdout
    again, again_opt = _trained(torch, 2)
    model_sd, optim_sd = get_state_dict(again, again_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    set_state_dict(again, again_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for name, value in model.state_dict().items():
        assert again.state_dict()[name].equal(value), name
    want, got = opt.state_dict(), again_opt.state_dict()
    for j, entries in want["state"].items():
        for key, value in entries.items():
            assert got["state"][j][key].equal(value), (j, key)
    assert [{k: v for k, v in g.items() if k != "betas"} for g in got["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "betas"} for g in want["param_groups"]]
    assert [list(g["betas"]) for g in got["param_groups"]] == [list(g["betas"]) for g in want["param_groups"]]
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f or ".old-" in f], os.listdir(tmp_path)


def test_the_convert_command_names_what_it_cannot_convert(tmp_path) -> None:
    pytest.importorskip("torch")
    missing = _phalanx_command("convert", "--to", "dcp", str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert missing.returncode == 1 and "convert_checkpoint" in missing.stderr and "manifest.json" in missing.stderr, \
        missing.stderr
    assert not (tmp_path / "out").exists()
    unknown = _phalanx_command("convert", "--to", "safetensors", str(tmp_path / "a"), str(tmp_path / "b"))
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr, unknown.stderr


def test_convert_checkpoint_refuses_an_unknown_format_and_converting_in_place(tmp_path) -> None:
    pytest.importorskip("torch")
    import phalanx.torch as pt

    with pytest.raises(phalanx.InvalidArgumentError, match=r"convert_checkpoint\(.*to='safetensors'\).*to='dcp'"):
        pt.convert_checkpoint(tmp_path / "a", tmp_path / "b", to="safetensors")
    with pytest.raises(phalanx.InvalidArgumentError, match="the same directory"):
        pt.convert_checkpoint(tmp_path / "a", tmp_path / "a", to="dcp")
    with pytest.raises(phalanx.CheckpointError, match=r"has no \.metadata"):
        pt.convert_checkpoint(tmp_path / "a", tmp_path / "b", to="phalanx")


def test_convert_checkpoint_refuses_an_optimizer_state_it_cannot_number(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import phalanx.torch as pt

    model, opt = _trained(torch, 3)
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp_path / "flat"), no_dist=True)
    with pytest.raises(phalanx.CheckpointError, match="get_state_dict's default options"):
        pt.convert_checkpoint(tmp_path / "flat", tmp_path / "out", to="phalanx")
    assert sorted(os.listdir(tmp_path)) == ["flat"], os.listdir(tmp_path)


def test_convert_checkpoint_warns_of_what_it_leaves_out_and_refuses_unnamed_or_damaged_state(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import phalanx.torch as pt

    model, opt = _trained(torch, 4)
    model_sd, optim_sd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model_sd, "optimizer": optim_sd, "scheduler": {"last_epoch": 3}},
                 checkpoint_id=str(tmp_path / "src"), no_dist=True)
    with pytest.warns(UserWarning, match=r"left out the DCP checkpoint's entries \['scheduler'\]"):
        mid = pt.convert_checkpoint(tmp_path / "src", tmp_path / "mid", to="phalanx")
    manifest_path = os.path.join(mid, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    assert manifest["param_names"] == [n for n, _ in model.named_parameters()], manifest["param_names"]
    manifest["param_names"] = None  # what a phalanx from before the names wrote
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(phalanx.CheckpointError, match=r"convert_checkpoint\(.*has no parameter name.*save it again"):
        pt.convert_checkpoint(mid, tmp_path / "out", to="dcp")
    with open(os.path.join(mid, "rank-00000.pt"), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(phalanx.CheckpointError, match=r"convert_checkpoint\(.*rank-00000.pt is missing or damaged"):
        pt.convert_checkpoint(mid, tmp_path / "out", to="dcp")
    assert not (tmp_path / "out").exists() and not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
