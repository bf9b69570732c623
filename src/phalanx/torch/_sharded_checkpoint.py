"""Checkpoints that scale: each rank writes its own shards, and no rank assembles the whole state.

::

    phalanx.torch.save_sharded("ckpt/step-1000", model, optimizer)   # collective: every rank
    phalanx.torch.load_sharded("ckpt/step-1000", model, optimizer)   # at any N, any shard level
    phalanx.torch.export_safetensors("model.safetensors", model)      # one file, for one process
    phalanx.torch.convert_checkpoint("ckpt/step-1000", "dcp/step-1000", to="dcp")   # torch's DCP, and back

A checkpoint is a directory: ``rank-<r>.pt`` per rank (``torch.save`` of a
dict of 1-D tensors: this rank's elements of every sharded parameter and
optimizer-state entry; rank 0 also writes the tensors every rank holds
whole) and ``manifest.json`` (rank 0): every tensor's shape, dtype and
pieces (file, first and last element), the optimizer's non-tensor state,
its param_groups and the model's name of each of its parameters, and the
SHA-256 of every rank file. The save goes to a temporary directory
``<path>.tmp-<token>`` beside the target, renamed into place by rank 0 only
when every rank's file is on disk and the manifest is written: a crash
mid-save leaves the previous checkpoint under ``path`` as it was. A save
that fails (any exception on any rank: a write, the state of a module, the
manifest) raises CheckpointError on every rank, naming the rank and the
cause, after rank 0 has removed the temporary directory; what a killed job
left (``<path>.tmp-<token>``, and ``<path>.old-<token>`` if it was killed
mid-commit, which is then the previous checkpoint and is put back) is
cleared by rank 0 when the next save to ``path`` starts
(``_checkpoint_files``). Loading checks the digest of each file it reads and
takes from each piece the elements its new layout needs (the files are
memory-mapped), so a checkpoint loads at another number of ranks and
another ``shard`` level, or into an unwrapped model. The directory must be
one that every rank can read and write (a shared filesystem across hosts).

The format is phalanx's own: torch's distributed checkpoint (DCP) needs a
torch.distributed process group to plan and commit a save, which MPI worlds
do not have. ``convert_checkpoint`` (``phalanx convert``; ``_dcp``) turns a
checkpoint into a DCP one that ``torch.distributed.checkpoint.load`` reads
into a plain model and optimizer, and a DCP one into this format, in one
process; ``export_safetensors`` writes a file that any safetensors reader
(``safetensors.torch.load_file``) or ``phalanx.torch.load_safetensors`` loads.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np
import torch

from .._collectives import broadcast
from .._errors import CheckpointError
from .._files import write_atomically
from .._objects import allgather_object, broadcast_object
from ._checkpoint_files import clear_leftovers, commit, discard, staging
from ._shard_state import local_states
from ._shard_tensor import ShardedTensor

__all__ = ["load_sharded", "save_sharded"]

FORMAT, VERSION = "phalanx-sharded", 1
MANIFEST = "manifest.json"


def _plain(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # a DistributedOptimizer's torch optimizer


def _entries(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Every tensor of the state by key: ``model/<name>`` (the plain module's state-dict names, so wrapped
    and unwrapped models share checkpoints) and ``optim/<index>/<key>``; sharded ones as ShardedTensors."""
    out: dict[str, Any] = {}
    with local_states():  # this rank's shards, not whole tensors
        for name, value in _plain(model).state_dict(keep_vars=True).items():
            out[f"model/{name}"] = value
    if optimizer is not None:
        inner = _inner(optimizer)
        params = [p for g in inner.param_groups for p in g["params"]]
        for j, p in enumerate(params):
            for key, value in inner.state.get(p, {}).items():
                out[f"optim/{j}/{key}"] = value
    return out


def _file(r: int) -> str:
    return f"rank-{r:05d}.pt"


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _param_names(model: torch.nn.Module, inner: Any) -> list[str | None]:
    """The plain module's name of each of the optimizer's parameters, in its order (the first name of
    a tied one, as ``named_parameters`` gives it; None for one not in the model)."""
    names = {id(p): name for name, p in _plain(model).named_parameters()}
    return [names.get(id(p)) for g in inner.param_groups for p in g["params"]]


def _shards(model: torch.nn.Module, optimizer: Any, r: int) -> tuple[dict[str, torch.Tensor], dict[str, Any],
                                                                     dict[str, Any]]:
    """This rank's tensors to write, every tensor's layout, and the non-tensor values."""
    mine: dict[str, torch.Tensor] = {}
    layout: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for key, value in _entries(model, optimizer).items():
        if isinstance(value, ShardedTensor):
            spec = value._spec
            local = value.to_local().detach()  # torch.save writes a storage once, however many views share it:
            mine[key] = local if spec.owner.private_storage else local.clone()  # a slice of a whole: copied
            layout[key] = {"shape": list(spec.shape), "dtype": str(value.dtype)[6:],
                           "pieces": [[_file(q), a, b] for q, (a, b) in enumerate(spec.bounds) if b > a]}
        elif isinstance(value, torch.Tensor):
            if r == 0:
                mine[key] = value.detach().reshape(-1).clone()
            layout[key] = {"shape": list(value.shape), "dtype": str(value.dtype)[6:],
                           "pieces": [[_file(0), 0, value.numel()]] if value.numel() else []}
        else:
            objects[key] = value
    return mine, layout, objects


def _write(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """``torch.save`` into a new file, on disk before it returns (no directory is made: a save whose
    temporary directory was removed under it fails instead of bringing it back)."""
    with open(path, "xb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())


@torch.no_grad()
def save_sharded(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None) -> str:
    """Write ``model``'s (and ``optimizer``'s) state to the directory ``path``, each rank its own elements
    (collective: every rank calls it with the same path); return the path.

    Arguments:
        path: the checkpoint directory (replaced as a whole; its parent is created). What a killed
            save to it left beside it (``<path>.tmp-<token>``) is removed first.
        model: a :class:`DataParallel` (any ``shard``) or a plain module.
        optimizer: the torch optimizer (or :class:`DistributedOptimizer`) made on the model's parameters,
            or None.

    Returns:
        The absolute path of the checkpoint directory.

    Raises:
        CheckpointError: a rank could not gather or write its part, or rank 0 the manifest (every rank
            raises, naming the rank and the cause; ``path`` is unchanged and this save's temporary
            directory is removed).

    Example::

        phalanx.torch.save_sharded("ckpt/step-1000", model, optimizer)   # on every rank
    """
    from .._world import rank, size

    target = os.path.abspath(os.fspath(path))
    call = f"phalanx.torch.save_sharded({target!r})"
    r, n = rank(), size()
    token = f"{int(broadcast(np.frombuffer(os.urandom(8), dtype=np.int64).copy(), root=0)[0]) & (2**48 - 1):012x}"
    temp = staging(target, token)
    problem = ""
    if r == 0:
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            clear_leftovers(target)
            os.makedirs(temp)
        except OSError as exc:
            problem = f"rank 0 could not make {temp!r}: {exc}"
    problem = broadcast_object(problem, allow_pickle=True)  # also: the directory exists before a rank writes
    if problem:
        raise CheckpointError(f"{call}: {problem}. Save to a directory every rank can write; the previous "
                              "checkpoint there, if any, is unchanged.")
    try:
        mine, layout, objects = _shards(model, optimizer, r)
        _write(os.path.join(temp, _file(r)), mine)
        digest, error = _digest(os.path.join(temp, _file(r))), ""
    except Exception as exc:  # every rank learns of it below, and raises alike
        digest, error = "", f"rank {r}: {type(exc).__name__}: {exc}"
    try:
        digests = allgather_object((digest, error), allow_pickle=True)
        failed = [e for _, e in digests if e]
        if r == 0:
            if not failed:
                try:
                    groups = names = None
                    if optimizer is not None:
                        with local_states():  # rank 0 alone: nothing gathered
                            groups = _inner(optimizer).state_dict()["param_groups"]
                        names = _param_names(model, _inner(optimizer))
                    manifest = {"format": FORMAT, "version": VERSION, "world_size": n, "tensors": layout,
                                "objects": {k: _jsonable(v) for k, v in objects.items()}, "param_groups": groups,
                                "param_names": names, "digests": {_file(q): d for q, (d, _) in enumerate(digests)}}
                    with write_atomically(os.path.join(temp, MANIFEST), "w") as f:
                        json.dump(manifest, f)
                    commit(temp, target, token)
                except Exception as exc:
                    failed = [f"rank 0 (the manifest and the commit): {type(exc).__name__}: {exc}"]
            if failed:
                discard(temp)
        failed = broadcast_object(failed, allow_pickle=True)  # when it raises, nothing of this save is left
    except BaseException:  # a collective that failed, an interrupt: rank 0 still removes what it made
        if r == 0:
            discard(temp)
        raise
    if failed:
        raise CheckpointError(f"{call}: {'; '.join(failed)}. The previous checkpoint there, if any, is "
                              "unchanged, and nothing of this save is left; fix the cause and save again.")
    return target


def _jsonable(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


class _Reader:
    """The rank files of one checkpoint, opened (memory-mapped) and digest-checked on first use."""

    def __init__(self, directory: str, manifest: dict[str, Any], call: str | None = None) -> None:
        self.directory, self.manifest = directory, manifest
        self.call = call or f"phalanx.torch.load_sharded({directory!r})"  # what the errors name
        self.files: dict[str, dict[str, torch.Tensor]] = {}

    def open(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self.files:
            path = os.path.join(self.directory, name)
            want = self.manifest["digests"].get(name)
            if not os.path.exists(path) or _digest(path) != want:
                raise CheckpointError(
                    f"{self.call}: {name} is missing or damaged (its SHA-256 "
                    "differs from the manifest's). Load an earlier checkpoint.")
            self.files[name] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self.files[name]

    def open_pieces(self, key: str, start: int = 0, stop: int | None = None) -> None:
        """Open (and check) the files holding elements ``[start, stop)`` of ``key`` (all when ``stop`` is None)."""
        for name, a, b in self.manifest["tensors"][key]["pieces"]:
            if stop is None or max(a, start) < min(b, stop):
                self.open(name)

    def elements(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key``, from whichever pieces hold them."""
        entry = self.manifest["tensors"][key]
        parts = []
        for name, a, b in entry["pieces"]:
            lo, hi = max(a, start), min(b, stop)
            if hi > lo:
                parts.append(self.open(name)[key][lo - a:hi - a])
        dtype = getattr(torch, entry["dtype"])
        out = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
        if out.numel() != stop - start:
            raise CheckpointError(f"{self.call}: {key} has no elements "
                                  f"[{start}, {stop}) in its pieces {entry['pieces']}; the manifest is damaged.")
        return out


@torch.no_grad()
def load_sharded(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None) -> None:
    """Load a checkpoint written by :func:`save_sharded` into ``model`` (and ``optimizer``), at any number of
    ranks and any ``shard`` level: each rank reads only the elements it keeps.

    Arguments:
        path: the checkpoint directory.
        model: a :class:`DataParallel` (any ``shard``) or a plain module, with the saved names and shapes.
        optimizer: the optimizer to restore (made on the model's parameters, in the saved order), or None.

    Raises:
        CheckpointError: no checkpoint there, a damaged file (named), or a name or shape that differs; on
            every rank (the files are checked before anything is loaded, so nothing is changed then).

    Example::

        phalanx.torch.load_sharded("ckpt/step-1000", model, optimizer)   # on every rank, at any N
    """
    directory = os.path.abspath(os.fspath(path))
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"phalanx.torch.load_sharded({directory!r}): no readable {MANIFEST} there ({exc}); "
                              "was the save interrupted? The previous checkpoint directory is the one to load.") \
            from exc
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"phalanx.torch.load_sharded({directory!r}): not a phalanx sharded checkpoint.")
    reader = _Reader(directory, manifest)
    entries = _entries(model, None)
    problem = ""
    try:  # first every file this rank needs, checked, before anything is changed
        for key, target in entries.items():
            _check(reader, key, target)
        if optimizer is not None:
            for key in manifest["tensors"]:
                if key.startswith("optim/"):
                    reader.open_pieces(key)
    except CheckpointError as exc:
        problem = str(exc)
    problems = [p for p in allgather_object(problem, allow_pickle=True) if p]
    if problems:  # every rank raises, and nothing was loaded anywhere
        raise CheckpointError(problems[0] if len(set(problems)) == 1 else "; ".join(sorted(set(problems))))
    for key, target in entries.items():
        _load_into(reader, key, target)
    if optimizer is not None:
        _load_optimizer(reader, _inner(optimizer))


def _check(reader: _Reader, key: str, target: Any) -> None:
    """CheckpointError unless ``key`` is in the checkpoint with ``target``'s shape and the files holding
    the elements this rank needs are whole."""
    entry = reader.manifest["tensors"].get(key)
    if entry is None or list(entry["shape"]) != list(target.shape):
        have = None if entry is None else entry["shape"]
        raise CheckpointError(f"phalanx.torch.load_sharded({reader.directory!r}): {key} has shape "
                              f"{list(target.shape)} here and {have} in the checkpoint.")
    start, stop = (target._spec.start, target._spec.stop) if isinstance(target, ShardedTensor) \
        else (0, target.numel())
    reader.open_pieces(key, start, stop)


def _load_into(reader: _Reader, key: str, target: Any) -> None:
    if isinstance(target, ShardedTensor):
        spec = target._spec
        target.to_local().copy_(reader.elements(key, spec.start, spec.stop))
    else:
        target.copy_(reader.elements(key, 0, target.numel()).view(target.shape))


def _load_optimizer(reader: _Reader, inner: torch.optim.Optimizer) -> None:
    params = [p for g in inner.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for key, entry in reader.manifest["tensors"].items():
        if not key.startswith("optim/"):
            continue
        _, j, name = key.split("/", 2)
        p = params[int(j)]
        shape = list(entry["shape"])
        if isinstance(p, ShardedTensor) and shape == list(p.shape):
            spec = p._spec
            value: Any = ShardedTensor(reader.elements(key, spec.start, spec.stop).clone(), spec)
        else:
            count = 1
            for d in shape:
                count *= d
            value = reader.elements(key, 0, count).clone().view(shape)
        state.setdefault(int(j), {})[name] = value
    for key, value in reader.manifest["objects"].items():
        if key.startswith("optim/"):
            _, j, name = key.split("/", 2)
            state.setdefault(int(j), {})[name] = value
    groups = reader.manifest["param_groups"]
    if groups is None:
        raise CheckpointError(f"phalanx.torch.load_sharded({reader.directory!r}): the checkpoint holds no "
                              "optimizer state; load without optimizer=.")
    inner.load_state_dict({"state": state, "param_groups": groups})
