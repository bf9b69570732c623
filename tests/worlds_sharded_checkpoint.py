"""Sharded checkpoints: each rank writes its own elements; a checkpoint loads at another N and ``shard`` level.

``phase="write"`` (at N ranks): a small GPT (tied output layer, frozen
position embedding) trains 2 steps with ``shard="parameters"`` and AdamW,
is saved with ``save_sharded``, exported with ``export_safetensors``, and
trains 2 more steps: rank 0 keeps that uninterrupted result. Also: a save
that fails for real on one rank (a file that cannot grow, a module whose
``state_dict`` raises, a manifest rank 0 cannot write) raises on every rank,
leaves no temporary directory and the previous checkpoint loadable; what a
killed save left is cleared by the next one; a damaged file is named. And
DCP both ways, converted by rank 0 alone (``convert_checkpoint``): the
checkpoint converted to DCP loads with torch's ``dcp.load`` into a plain
model and AdamW bit for bit, and back into this format; DCP checkpoints of
a plain GPT (``dcp.save``, ``torch_save_to_dcp``, ``get_state_dict``'s)
converted to this format load into a ``shard="parameters"`` model bit for
bit and train on as the plain run does. ``phase="read"`` (at another N):
the checkpoint loads into ``shard="gradients"``, ``"parameters"`` and
unwrapped models, and so does the one converted to DCP and back; 2 more
steps equal the uninterrupted run (float64, 1e-10); the DCP conversions
load at this N too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import phalanx
from behaviours import Behaviours
from helpers import raises
from worlds_param_shards import adamw, gpt, loss_of
from worlds_training import _setup

WRITE, READ = Behaviours(), Behaviours()
GLOBAL = 6  # rows per step at every N (1, 2 and 3 ranks split it evenly)
EXACT = 1e-10


def batch(torch: Any, step: int, r: int, n: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(900 + step)
    data = torch.randint(0, 11, (GLOBAL, 7), generator=g)
    mine = data[r * GLOBAL // n:(r + 1) * GLOBAL // n]
    return mine[:, :-1], mine[:, 1:]


def train(torch: Any, dp: Any, opt: Any, steps: range) -> None:
    r, n = phalanx.rank(), phalanx.size()
    for step in steps:
        x, y = batch(torch, step, r, n)
        loss_of(torch, dp, x, y).backward()
        torch.nn.utils.clip_grad_norm_(dp.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def made(shard: str | None) -> tuple[Any, Any, Any]:
    torch, pt, r, n = _setup()
    model, Block = gpt(torch, 40 + r)
    options = {"units": [Block]} if shard == "parameters" else {}
    dp = pt.DataParallel(model, shard=shard, **options)
    return torch, dp, adamw(torch, dp)


@WRITE.behaviour("a-parameter-sharded-run-saves-its-shards-and-exports-one-file")
def _(tmp: str) -> None:
    torch, dp, opt = made("parameters")
    pt = phalanx.torch
    train(torch, dp, opt, range(2))
    path = pt.save_sharded(os.path.join(tmp, "ckpt"), dp, opt)
    names = sorted(os.listdir(path))
    assert names == ["manifest.json"] + [f"rank-{q:05d}.pt" for q in range(phalanx.size())], names
    pt.export_safetensors(os.path.join(tmp, "model.safetensors"), dp)
    whole = dp.state_dict()
    plain, _ = gpt(torch, 99)
    plain.load_state_dict(pt.load_safetensors(os.path.join(tmp, "model.safetensors")))
    for name, q in plain.state_dict().items():
        assert q.equal(whole[f"module.{name}"]), f"the export's {name} differs from the model's"
    train(torch, dp, opt, range(2, 4))
    state = dp.state_dict()  # collective: every rank
    if phalanx.rank() == 0:
        torch.save(state, os.path.join(tmp, "uninterrupted.pt"))
    phalanx.barrier()


def on_rank_0(fn: Any) -> Any:
    """``fn()`` on rank 0 alone, while the others wait; its failure fails every rank (no rank is left
    waiting in a collective that rank 0 never reaches). Returns what ``fn`` returned, on rank 0."""
    result, failure = None, ""
    if phalanx.rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # reported on every rank below
            failure = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    failure = phalanx.broadcast_object(failure, allow_pickle=True)
    assert not failure, f"on rank 0: {failure}"
    return result


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """A real write failure: files of this process cannot grow past ``nbytes`` (``EFBIG``, an OSError, instead
    of the SIGXFSZ that would kill it), until the block ends."""
    import resource
    import signal

    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


@contextlib.contextmanager
def unsavable_module(dp: Any) -> Iterator[None]:
    """A real failure while a save gathers the state: a module whose ``state_dict`` raises (a user's hook)."""
    def refuse(*args: Any) -> None:
        raise RuntimeError("this module's state cannot be taken")

    handle = dp.module.ln_f.register_state_dict_post_hook(refuse)
    try:
        yield
    finally:
        handle.remove()


class Unrepresentable:
    """An optimizer-state value that rank 0 cannot write into the manifest (its repr raises)."""

    def __repr__(self) -> str:
        raise ValueError("no text for this value")


@contextlib.contextmanager
def unwritable_manifest(opt: Any) -> Iterator[None]:
    """A real failure on rank 0 after every rank's file is on disk: a value its manifest cannot hold."""
    inner = getattr(opt, "optimizer", opt)
    p = next(p for g in inner.param_groups for p in g["params"] if p in inner.state)
    inner.state[p]["note"] = Unrepresentable()
    try:
        yield
    finally:
        del inner.state[p]["note"]


def _failed_save(tmp: str, tag: str, where: int, failure: Any, match: str) -> None:
    """A save that fails for real on rank ``where`` (-1: the last) raises CheckpointError on every rank,
    naming that rank and the cause, and leaves nothing of itself; the previous checkpoint loads whole."""
    torch, dp, opt = made("parameters")
    pt = phalanx.torch
    where = where % phalanx.size()
    path = os.path.join(tmp, f"again-{tag}")
    pt.save_sharded(path, dp, opt)
    before = {k: v.clone() for k, v in dp.state_dict().items()}
    train(torch, dp, opt, range(1))
    failing = failure(dp, opt) if phalanx.rank() == where else contextlib.nullcontext()
    with raises(phalanx.CheckpointError, "a failed save raised nothing", match=f"rank {where}\\b.*{match}"):
        with failing:
            pt.save_sharded(path, dp, opt)
    phalanx.barrier()
    leftovers = [f for f in os.listdir(tmp) if f.startswith(os.path.basename(path) + ".")]
    assert not leftovers, f"a failed save left {leftovers}"
    pt.load_sharded(path, dp, opt)
    for k, v in dp.state_dict().items():
        assert v.equal(before[k]), f"{k}: the previous checkpoint did not load whole"


# torch.save reports a file that cannot grow as an OSError or as its own RuntimeError ("unexpected pos"),
# depending on where the write stops: either is this rank's failure, reported by every rank.
WRITE.add("a-save-failing-on-one-rank-raises-everywhere-and-leaves-the-previous-checkpoint", _failed_save,
          "size", -1, lambda dp, opt: file_size_limit(512), "(OSError|RuntimeError): ")
WRITE.add("a-save-whose-model-raises-on-rank-0-while-it-gathers-leaves-no-temporary-directory", _failed_save,
          "gather", 0, lambda dp, opt: unsavable_module(dp), "RuntimeError: this module's state cannot be taken")
WRITE.add("a-save-whose-manifest-rank-0-cannot-write-leaves-no-temporary-directory", _failed_save,
          "manifest", 0, lambda dp, opt: unwritable_manifest(opt), "ValueError: no text for this value")


@WRITE.behaviour("a-stale-temporary-directory-of-a-killed-save-is-removed-by-the-next-save")
def _(tmp: str) -> None:
    torch, dp, opt = made("parameters")
    pt = phalanx.torch
    path = os.path.join(tmp, "killed")
    pt.save_sharded(path, dp, opt)
    stale = [path + ".tmp-0123456789ab", path + ".tmp-fedcba987654"]
    kept = [path + ".tmp-keep", path + ".tmp-0123456789abc", path + "x.tmp-0123456789ab", path + ".tmpfile"]

    def killed_mid_save() -> None:  # what a killed job leaves: a temporary directory with a part of a file
        for d in stale:
            os.makedirs(d)
            with open(os.path.join(d, "rank-00000.pt"), "wb") as f:
                f.write(b"PK\x03\x04 half of a file")
        for d in kept:
            os.makedirs(d)

    on_rank_0(killed_mid_save)
    train(torch, dp, opt, range(1))
    pt.save_sharded(path, dp, opt)
    after = {k: v.clone() for k, v in dp.state_dict().items()}
    left = [d for d in stale if os.path.exists(d)]
    assert not left, f"the next save left the killed save's {left}"
    gone = [d for d in kept if not os.path.isdir(d)]
    assert not gone, f"the next save removed {gone}, which no save of {path} made"
    pt.load_sharded(path, dp, opt)
    for k, v in dp.state_dict().items():
        assert v.equal(after[k]), f"{k}: the checkpoint saved over a killed save's leftovers did not load"


@WRITE.behaviour("a-save-killed-mid-commit-is-undone-by-the-next-save-which-restores-the-previous-checkpoint")
def _(tmp: str) -> None:
    torch, dp, opt = made("parameters")
    pt = phalanx.torch
    path = os.path.join(tmp, "mid-commit")
    pt.save_sharded(path, dp, opt)
    before = {k: v.clone() for k, v in dp.state_dict().items()}

    def killed_between_the_renames() -> None:  # the previous checkpoint moved aside, the new one not yet in place
        os.replace(path, path + ".old-00000000abcd")
        os.makedirs(path + ".tmp-00000000abcd")

    on_rank_0(killed_between_the_renames)
    train(torch, dp, opt, range(1))
    with raises(phalanx.CheckpointError, "a failed save raised nothing", match="rank 0: RuntimeError"):
        with unsavable_module(dp) if phalanx.rank() == 0 else contextlib.nullcontext():
            pt.save_sharded(path, dp, opt)  # fails after it put the previous checkpoint back
    phalanx.barrier()
    leftovers = [f for f in os.listdir(tmp) if f.startswith("mid-commit.")]
    assert not leftovers, f"left {leftovers}"
    pt.load_sharded(path, dp, opt)
    for k, v in dp.state_dict().items():
        assert v.equal(before[k]), f"{k}: the previous checkpoint was not restored whole"


def plain_state(torch: Any, path: str) -> tuple[Any, Any]:
    """A plain (unwrapped) GPT and AdamW loaded from the phalanx checkpoint ``path`` (collective)."""
    plain, _ = gpt(torch, 71)
    opt = adamw(torch, plain)
    phalanx.torch.load_sharded(path, plain, opt)
    return plain, opt


def assert_same(model: Any, opt: Any, want_model: Any, want_opt: Any, what: str) -> None:
    """Every tensor of the two models and optimizers (plain ones) equal bit for bit, the rest equal."""
    want = want_model.state_dict()
    for name, value in model.state_dict().items():
        assert value.dtype == want[name].dtype and value.equal(want[name]), f"{what}: the model's {name} differs"
    got, expected = opt.state_dict(), want_opt.state_dict()
    assert sorted(got["state"]) == sorted(expected["state"]), f"{what}: the optimizer state's parameters differ"
    for j, entries in expected["state"].items():
        assert sorted(got["state"][j]) == sorted(entries), f"{what}: parameter {j}'s optimizer state differs"
        for key, value in entries.items():
            mine = got["state"][j][key]
            assert mine.dtype == value.dtype and mine.equal(value), f"{what}: optimizer state {j}/{key} differs"
    assert got["param_groups"] == expected["param_groups"], f"{what}: the param_groups differ"


@WRITE.behaviour("a-checkpoint-converted-to-dcp-loads-with-torch-s-dcp-into-a-plain-model-and-optimizer-bitwise")
def _(tmp: str) -> None:
    torch, pt, r, n = _setup()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    source = os.path.join(tmp, "ckpt")  # the first behaviour's: shard="parameters", AdamW, N ranks
    want, want_opt = plain_state(torch, source)

    def convert_and_load() -> None:
        out = pt.convert_checkpoint(source, os.path.join(tmp, "ckpt.dcp"), to="dcp")
        assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp"], sorted(os.listdir(out))
        model, _ = gpt(torch, 72)
        opt = adamw(torch, model)
        model_sd, optim_sd = get_state_dict(model, opt)  # torch's own names: no module. prefix
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notice that it runs in one process
            dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=out, no_dist=True)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        assert_same(model, opt, want, want_opt, "loaded with dcp.load")
        dcp_to_torch_save(out, os.path.join(tmp, "ckpt.dcp.pt"))
        whole = torch.load(os.path.join(tmp, "ckpt.dcp.pt"), weights_only=False)
        assert sorted(whole["model"]) == sorted(want.state_dict()), sorted(whole["model"])
        for name, value in want.state_dict().items():
            assert whole["model"][name].equal(value), f"dcp_to_torch_save: the model's {name} differs"
        named = dict(want.named_parameters())
        for name, entries in whole["optimizer"]["state"].items():
            for key, value in entries.items():
                assert value.equal(want_opt.state[named[name]][key]), f"dcp_to_torch_save: {name}/{key} differs"
        pt.convert_checkpoint(out, os.path.join(tmp, "ckpt-via-dcp"), to="phalanx")

    on_rank_0(convert_and_load)
    model, opt = plain_state(torch, os.path.join(tmp, "ckpt-via-dcp"))  # at N ranks, from the one rank file
    assert_same(model, opt, want, want_opt, "converted to DCP and back")


def alone(torch: Any, model: Any, opt: Any, steps: range) -> None:
    """The training of :func:`train` in one process, on the whole batch of each step."""
    for step in steps:
        x, y = batch(torch, step, 0, 1)
        loss_of(torch, model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def _saved_by_dcp(tmp: str) -> None:
    """Rank 0 trains a plain GPT 2 steps in one process and saves it with DCP three ways (``dcp.save`` of
    the model's state dict, ``torch_save_to_dcp`` of a state-dict file, and ``get_state_dict``'s model and
    optimizer), converts each to phalanx, and keeps what 2 more steps give."""
    torch, pt, r, n = _setup()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, _ = gpt(torch, 81)
    opt = adamw(torch, model)
    alone(torch, model, opt, range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notice that it runs in one process
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(tmp, "plain.dcp"), no_dist=True)
        torch.save(model.state_dict(), os.path.join(tmp, "plain.pt"))
        torch_save_to_dcp(os.path.join(tmp, "plain.pt"), os.path.join(tmp, "torch-save.dcp"))
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(tmp, "full.dcp"),
                 no_dist=True)
    for name in ("plain", "torch-save", "full"):
        source = os.path.join(tmp, f"{name}.dcp")
        pt.convert_checkpoint(source, os.path.join(tmp, f"{name}-from-dcp"), to="phalanx")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    alone(torch, model, opt, range(2, 4))
    torch.save({"saved": saved, "continued": model.state_dict()}, os.path.join(tmp, "dcp-reference.pt"))


def _loads_from_dcp(tmp: str) -> None:
    """The three conversions load into a ``shard="parameters"`` model at this N equal to the saved weights bit
    for bit, and the one with the optimizer trains on to what the plain run gave (float64, 1e-10)."""
    torch, pt, r, n = _setup()
    reference = torch.load(os.path.join(tmp, "dcp-reference.pt"))
    for name in ("plain", "torch-save", "full"):
        _, dp, opt = made("parameters")
        pt.load_sharded(os.path.join(tmp, f"{name}-from-dcp"), dp, opt if name == "full" else None)
        for key, value in dp.state_dict().items():
            want = reference["saved"][key.removeprefix("module.")]
            assert value.equal(want), f"{name}: {key} differs from the DCP checkpoint's"
        if name == "full":
            train(torch, dp, opt, range(2, 4))
            for key, value in dp.state_dict().items():
                err = (value - reference["continued"][key.removeprefix("module.")]).abs().max().item()
                assert err <= EXACT, f"resumed from DCP at {n} ranks: {key} differs from the plain run by {err:.3g}"
        dp.close()


@WRITE.behaviour("a-dcp-checkpoint-converted-to-phalanx-loads-into-a-parameter-sharded-model-at-n-ranks")
def _(tmp: str) -> None:
    on_rank_0(lambda: _saved_by_dcp(tmp))
    _loads_from_dcp(tmp)


@WRITE.behaviour("a-damaged-rank-file-is-named-on-load")
def _(tmp: str) -> None:
    torch, dp, opt = made("parameters")
    pt = phalanx.torch
    path = pt.save_sharded(os.path.join(tmp, "damaged"), dp, opt)
    phalanx.barrier()
    if phalanx.rank() == 0:
        shutil.copytree(path, path + "-copy")
        with open(os.path.join(path + "-copy", "rank-00000.pt"), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    phalanx.barrier()
    with raises(phalanx.CheckpointError, "a damaged file loaded", match="rank-00000.pt is missing or damaged"):
        pt.load_sharded(path + "-copy", dp, opt)


def _resumed(tmp: str, shard: str | None, name: str = "ckpt") -> None:
    torch, dp, opt = made(shard)
    phalanx.torch.load_sharded(os.path.join(tmp, name), dp, opt)
    train(torch, dp, opt, range(2, 4))
    want = torch.load(os.path.join(tmp, "uninterrupted.pt"))
    for name, p in dp.state_dict().items():
        err = (p - want[name]).abs().max().item()
        assert err <= EXACT, f"shard={shard}: {name} differs from the uninterrupted run by {err:.3g}"
    dp.close()


for _shard in ("gradients", "parameters", None):
    READ.add(f"resumed-with-shard={_shard}-at-another-n-equals-the-uninterrupted-run",
             lambda tmp, s=_shard: _resumed(tmp, s))
READ.add("resumed-from-the-checkpoint-converted-to-dcp-and-back-at-another-n-equals-the-uninterrupted-run",
         lambda tmp: _resumed(tmp, "parameters", "ckpt-via-dcp"))
READ.add("a-dcp-checkpoint-converted-to-phalanx-loads-at-another-n", _loads_from_dcp)


@READ.behaviour("the-model-loads-into-an-unwrapped-model")
def _(tmp: str) -> None:
    torch, pt, r, n = _setup()
    plain, _ = gpt(torch, 5)
    pt.load_sharded(os.path.join(tmp, "ckpt"), plain)
    x, y = batch(torch, 0, 0, 1)
    assert loss_of(torch, plain, x, y).isfinite(), "the loaded model computes nothing"


def checkpoints(tmp: str, phase: str) -> dict[str, str | None]:
    """The world body: the write or read phase's behaviours, on every rank."""
    return (WRITE if phase == "write" else READ).run(tmp)
