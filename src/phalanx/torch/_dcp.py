"""Converting checkpoints between phalanx's sharded format and torch.distributed.checkpoint (DCP), in one process.

::

    phalanx.torch.convert_checkpoint("ckpt/step-1000", "dcp/step-1000", to="dcp")      # for torchtitan, FSDP2
    phalanx.torch.convert_checkpoint("dcp/step-1000", "ckpt/step-1000", to="phalanx")  # then load_sharded
    phalanx convert --to dcp ckpt/step-1000 dcp/step-1000                              # the same, from a shell

The DCP checkpoint holds ``{"model": ..., "optimizer": ...}``, each as torch's
``get_state_dict(model, optimizer)`` gives it for the plain model: the
model's state-dict names (no ``module.``), the optimizer's state keyed by
parameter name (a tied parameter by its first name) and its ``param_groups``
listing names. So torch loads it with its own API, in one process or in any
number::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id="dcp/step-1000")
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

Back to phalanx, a DCP checkpoint in that layout converts, and so does one
whose top level is the model's state dict (``dcp.save(model.state_dict())``,
``torch_save_to_dcp`` of a state-dict file); other top-level entries (a
scheduler, a data loader) have no place in the phalanx format and are left
out with a warning. The result is a phalanx checkpoint of one rank file,
which ``load_sharded`` loads at any number of ranks and any ``shard`` level;
its optimizer state is in the order of the DCP ``param_groups``, so the
optimizer to load it into is made the same way as the one that saved it.

Both directions run in one plain process (DCP's ``no_dist``: no process
group, no phalanx world) and hold the whole state in memory once; every
value is copied bit for bit. The destination directory is written beside
itself and renamed into place, as ``save_sharded`` does. Converting a DCP
checkpoint unpickles its non-tensor values (DCP's own loader does too):
convert only checkpoints you trust.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .._errors import CheckpointError, InvalidArgumentError, MissingDependencyError
from .._files import write_atomically
from ._checkpoint_files import clear_leftovers, commit, discard, staging
from ._sharded_checkpoint import FORMAT, MANIFEST, VERSION, _digest, _file, _jsonable, _Reader, _write

__all__ = ["convert_checkpoint"]

DCP_METADATA = ".metadata"


def convert_checkpoint(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, to: str) -> str:
    """Convert the checkpoint directory ``src`` to ``to``'s format at ``dst``, in this one process; return ``dst``.

    Arguments:
        src: a phalanx checkpoint (``save_sharded``'s directory) when ``to="dcp"``; a DCP checkpoint
            directory (one with ``.metadata``) when ``to="phalanx"``.
        dst: the directory to write (replaced as a whole; its parent is created).
        to: ``"dcp"`` (torch.distributed.checkpoint: ``{"model": ..., "optimizer": ...}`` as torch's
            ``get_state_dict`` gives them) or ``"phalanx"`` (what ``load_sharded`` loads at any N).

    Returns:
        The absolute path of ``dst``.

    Raises:
        InvalidArgumentError: ``to`` is neither ``"dcp"`` nor ``"phalanx"``, or ``src`` is ``dst``.
        CheckpointError: ``src`` is no checkpoint of the other format, a file of it is damaged, its
            optimizer state cannot be named or numbered, or ``dst`` could not be written (``dst`` is
            then unchanged).

    Example::

        phalanx.torch.convert_checkpoint("ckpt/step-1000", "dcp/step-1000", to="dcp")
        phalanx.torch.convert_checkpoint("dcp/step-1000", "ckpt/step-1000", to="phalanx")
    """
    source, target = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    call = f"phalanx.torch.convert_checkpoint({source!r}, {target!r}, to={to!r})"
    if to not in ("dcp", "phalanx"):
        raise InvalidArgumentError(f"{call}: unknown format; use to='dcp' or to='phalanx'.")
    if source == target:
        raise InvalidArgumentError(f"{call}: the source and the destination are the same directory; "
                                   "write the conversion to another path.")
    read = _read_phalanx if to == "dcp" else _read_dcp
    state = read(call, source)
    token = os.urandom(6).hex()
    temp = staging(target, token)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        clear_leftovers(target)
        os.makedirs(temp)
        (_write_dcp if to == "dcp" else _write_phalanx)(temp, state)
        commit(temp, target, token)
    except Exception as exc:
        discard(temp)
        raise CheckpointError(f"{call}: could not write the conversion ({type(exc).__name__}: {exc}); "
                              f"{target!r} is unchanged.") from exc
    return target


# -- phalanx -> DCP -------------------------------------------------------------------------------

def _read_phalanx(call: str, source: str) -> dict[str, Any]:
    """The whole state of a phalanx checkpoint, in the layout of torch's ``get_state_dict``."""
    try:
        with open(os.path.join(source, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{call}: no readable {MANIFEST} in {source!r} ({exc}); to='dcp' converts a "
                              "directory that phalanx.torch.save_sharded wrote.") from exc
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{call}: {source!r} is not a phalanx sharded checkpoint "
                              f"(its manifest's format is {manifest.get('format')!r}).")
    reader = _Reader(source, manifest, call)
    model: dict[str, Any] = {}
    optim: dict[int, dict[str, Any]] = {}
    for key, entry in manifest["tensors"].items():
        count = 1
        for d in entry["shape"]:
            count *= d
        value = reader.elements(key, 0, count).reshape(entry["shape"])  # a copy: torch.cat's, of the mapped file
        _place(model, optim, key, value)
    for key, value in manifest["objects"].items():
        _place(model, optim, key, value)
    state: dict[str, Any] = {"model": model}
    groups = manifest.get("param_groups")
    if groups is not None:
        names = manifest.get("param_names")
        listed = set(optim) | {j for g in groups for j in g["params"]}
        unnamed = sorted(j for j in listed if names is None or j >= len(names) or names[j] is None)
        if unnamed or names is None:
            raise CheckpointError(
                f"{call}: the optimizer state of parameters {unnamed or 'all'} has no parameter name in "
                f"{source!r} (saved by an older phalanx, or the optimizer holds tensors the model does not). "
                "Load it with load_sharded and save it again with this phalanx, from the model and the "
                "optimizer made on its parameters.")
        state["optimizer"] = {
            "state": {names[j]: optim[j] for j in sorted(optim)},
            "param_groups": [{**g, "params": [names[j] for j in g["params"]]} for g in groups]}
    return state


def _place(model: dict[str, Any], optim: dict[int, dict[str, Any]], key: str, value: Any) -> None:
    kind, _, rest = key.partition("/")
    if kind == "model":
        model[rest] = value
    else:
        j, _, name = rest.partition("/")
        optim.setdefault(int(j), {})[name] = value


def _dcp() -> Any:
    """torch.distributed.checkpoint, quiet about running in one process (that is the point here)."""
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as exc:
        raise MissingDependencyError(
            "phalanx.torch.convert_checkpoint needs torch.distributed.checkpoint, which this torch build "
            f"lacks ({exc}); install a torch build with torch.distributed (the PyPI wheels have it).") from exc
    return dcp


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP's notice that it runs in one process, silenced: that is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        yield


def _write_dcp(temp: str, state: dict[str, Any]) -> None:
    dcp = _dcp()
    with _one_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(temp), no_dist=True)


# -- DCP -> phalanx -------------------------------------------------------------------------------

def _read_dcp(call: str, source: str) -> dict[str, Any]:
    """The whole state of a DCP checkpoint, nested as it was saved."""
    if not os.path.isfile(os.path.join(source, DCP_METADATA)):
        raise CheckpointError(f"{call}: {source!r} has no {DCP_METADATA}; to='phalanx' converts a directory "
                              "that torch.distributed.checkpoint.save wrote.")
    dcp = _dcp()
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(source)
    flat: dict[str, Any] = {}
    try:
        with _one_process():
            metadata = reader.read_metadata()
            for key, md in metadata.state_dict_metadata.items():  # a tensor's storage; a value is unpickled
                flat[key] = torch.empty(md.size, dtype=md.properties.dtype) \
                    if isinstance(md, TensorStorageMetadata) else None
            dcp.load(flat, storage_reader=reader, no_dist=True)
    except Exception as exc:
        raise CheckpointError(f"{call}: could not read the DCP checkpoint {source!r} "
                              f"({type(exc).__name__}: {exc}).") from exc
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        _put(nested, tuple(paths.get(key, (key,))), value)
    return _phalanx_layout(call, source, nested)


def _put(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, making dicts (a str key) and lists (an int) on the way."""
    node: Any = root
    for step, after in zip(path, path[1:], strict=False):
        empty: Any = [] if isinstance(after, int) else {}
        if isinstance(node, list):
            while len(node) <= step:
                node.append(None)
            if node[step] is None:
                node[step] = empty
        elif step not in node:
            node[step] = empty
        node = node[step]
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _phalanx_layout(call: str, source: str, nested: dict[str, Any]) -> dict[str, Any]:
    """The tensors and values of a phalanx checkpoint (``model/<name>``, ``optim/<index>/<key>``) and its
    ``param_groups`` and ``param_names``."""
    optim_key = next((k for k in ("optimizer", "optim") if isinstance(nested.get(k), dict)), None)
    optim = nested[optim_key] if optim_key else None
    if isinstance(nested.get("model"), dict):  # get_state_dict's layout
        model, taken = nested["model"], {"model", optim_key}
    else:  # the model's state dict at the top level
        model = {k: v for k, v in nested.items() if not isinstance(v, (dict, list))}
        taken = set(model) | {optim_key}
    left = sorted(k for k in nested if k not in taken)
    if left:
        warnings.warn(f"{call}: left out the DCP checkpoint's entries {left} (the phalanx format holds a "
                      "model and an optimizer only).", stacklevel=3)
    if not any(isinstance(v, torch.Tensor) for v in model.values()):
        raise CheckpointError(f"{call}: {source!r} holds no model tensors, neither under 'model' nor at its "
                              f"top level (its entries: {sorted(nested)}).")
    values: dict[str, Any] = {f"model/{k}": v for k, v in model.items()}
    groups = names = None
    if optim is not None:
        state, raw_groups = optim.get("state"), optim.get("param_groups")
        names = [p for g in raw_groups or [] if isinstance(g, dict) for p in g.get("params", [])]
        if not isinstance(state, dict) or not isinstance(raw_groups, list) or \
                not all(isinstance(p, str) for p in names):
            raise CheckpointError(
                f"{call}: the optimizer state in {source!r} is not {{'state': {{name: ...}}, 'param_groups': "
                "[{..., 'params': [name, ...]}]}, as torch's get_state_dict gives it (flattened, or keyed by "
                "index). Save it with get_state_dict's default options, or convert the model alone.")
        index = {name: j for j, name in enumerate(names)}
        stray = sorted(set(state) - set(index))
        if stray:
            raise CheckpointError(f"{call}: the optimizer state in {source!r} holds {stray}, which no "
                                  "param_group lists; the checkpoint is inconsistent.")
        for name, entries in state.items():
            for key, value in entries.items():
                values[f"optim/{index[name]}/{key}"] = value
        groups = [{**g, "params": [index[p] for p in g["params"]]} for g in raw_groups]
    return {"values": values, "param_groups": groups, "param_names": names}


def _write_phalanx(temp: str, state: dict[str, Any]) -> None:
    """A phalanx checkpoint of one rank file: every tensor whole in ``rank-00000.pt``."""
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for key, value in state["values"].items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value.detach().reshape(-1).contiguous()
            layout[key] = {"shape": list(value.shape), "dtype": str(value.dtype)[6:],
                           "pieces": [[_file(0), 0, value.numel()]] if value.numel() else []}
        else:
            objects[key] = _jsonable(value)
    path = os.path.join(temp, _file(0))
    _write(path, tensors)
    manifest = {"format": FORMAT, "version": VERSION, "world_size": 1, "tensors": layout, "objects": objects,
                "param_groups": state["param_groups"], "param_names": state["param_names"],
                "digests": {_file(0): _digest(path)}}
    with write_atomically(os.path.join(temp, MANIFEST), "w") as f:
        json.dump(manifest, f)
