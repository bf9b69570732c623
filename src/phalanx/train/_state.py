"""The training state as a plain dict: :func:`capture_state` builds it, :func:`restore_state` loads it.

A state holds the plain model's ``state_dict`` (wrappers looked through), the
optimizer's, scheduler's and scaler's, ``progress`` (plain numbers and
strings), ``extra`` (tensors and plain containers) and every rank's RNG
states (:mod:`phalanx.train._rng`); ``docs/training.md`` ("Checkpoints")
describes it in full.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

import phalanx

from .._errors import CheckpointError, InvalidArgumentError
from .._world import initialized, rank, size
from . import _rng
from ._rng import gather_rng

__all__ = ["FORMAT", "VERSION", "capture_state", "check_format", "fspath", "identity", "restore_state",
           "unstorable"]

FORMAT = "phalanx-checkpoint"
VERSION = 2  # 2: files end with a SHA-256 footer (phalanx.train._checkpoint)
_PARTS = ("optimizer", "scheduler", "scaler")
_REQUIRED = ("model", "optimizer", "scheduler", "scaler", "progress", "rng", "world_size")


def identity() -> tuple[int, int]:
    """(rank, size) of this process; a process that never called phalanx.init() is a world of one."""
    if initialized():
        return rank(), size()
    return 0, 1


def fspath(path: Any, call: str) -> str:
    try:
        text = os.fspath(path)
    except TypeError:
        raise InvalidArgumentError(
            f"phalanx.train.{call}: path must be a str or os.PathLike, got {type(path).__name__} "
            f"{path!r}."
        ) from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text:
        raise InvalidArgumentError(f"phalanx.train.{call}: path is empty; pass a file name such as 'ckpt/last.pt'.")
    return text


def _unwrap(model: Any, call: str) -> torch.nn.Module:
    """The plain module inside DataParallel / DDP / torch.compile wrappers (any nesting)."""
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(
            f"phalanx.train.{call}(model=...): expected a torch.nn.Module, got "
            f"{type(model).__module__}.{type(model).__qualname__}."
        )
    from ..torch import DataParallel

    wrappers = (DataParallel, torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, torch.nn.Module):
            model = inner
        elif isinstance(model, wrappers) and isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            return model


def _cpu_copy(obj: Any) -> Any:
    """A copy of ``obj`` with every tensor detached and copied to the CPU; containers rebuilt."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[key] = _cpu_copy(value)
        metadata = getattr(obj, "_metadata", None)  # Module.state_dict's per-module versions
        if metadata is not None and isinstance(out, OrderedDict):
            out._metadata = _cpu_copy(metadata)  # type: ignore[attr-defined]
        return out
    if type(obj) is list:
        return [_cpu_copy(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_cpu_copy(v) for v in obj)
    if type(obj) is set:
        return set(obj)
    return obj


_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def unstorable(obj: Any, where: str) -> str | None:
    """Where in ``obj`` something sits that ``torch.load(weights_only=True)`` would refuse, or None."""
    kind = type(obj)
    if kind in _PLAIN_LEAVES or kind is torch.Tensor or kind is torch.nn.Parameter:
        return None
    if kind is dict or kind is OrderedDict:
        for key, value in obj.items():
            bad = unstorable(key, f"{where} (a key)") or unstorable(value, f"{where}[{key!r}]")
            if bad:
                return bad
        return None
    if kind in (list, tuple, set):
        for i, value in enumerate(obj):
            bad = unstorable(value, f"{where}[{i}]")
            if bad:
                return bad
        return None
    hint = ""
    if isinstance(obj, np.generic):
        hint = " (a NumPy scalar: store `x.item()`)"
    elif isinstance(obj, np.ndarray):
        hint = " (a NumPy array: store `torch.from_numpy(x)`)"
    elif isinstance(obj, torch.Tensor):
        hint = " (a tensor subclass: store a plain tensor)"
    elif isinstance(obj, tuple):
        hint = " (a namedtuple: store a tuple or a dict)"
    elif callable(obj):
        hint = " (a function or callable object: checkpoints hold data, not code)"
    return f"{where} is a {kind.__module__}.{kind.__qualname__}{hint}"


def _plain(value: Any, where: str) -> Any:
    """``value`` as plain numbers / strings / lists / dicts (NumPy and 0-d tensor scalars converted)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) in (list, tuple):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidArgumentError(
                    f"phalanx.train.capture_state(progress=...): {where} has the key {key!r}; use string keys."
                )
            out[key] = _plain(item, f"{where}[{key!r}]")
        return out
    raise InvalidArgumentError(
        f"phalanx.train.capture_state(progress=...): {where} is a {type(value).__qualname__}; progress "
        "holds plain ints, floats, strings and bools (and lists/dicts of them), e.g. "
        "{'epoch': 3, 'global_step': 1200}. Put other data in extra=."
    )


def check_format(state: Any, what: str) -> None:
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        if isinstance(state, Mapping) and state and all(isinstance(v, torch.Tensor) for v in state.values()):
            detail = ("it holds a plain state_dict of tensors: load that with "
                      "`model.load_state_dict(torch.load(path))`")
        elif isinstance(state, Mapping):
            detail = f"its format is {state.get('format')!r}, not {FORMAT!r}"
        else:
            detail = f"it holds a {type(state).__qualname__}, not a dict"
        raise CheckpointError(f"{what} is not a complete phalanx checkpoint: {detail}.")
    version = state.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(
            f"{what} has checkpoint format version {version!r}; this phalanx ({phalanx.__version__}) reads "
            f"version {VERSION}. Upgrade phalanx to load it."
        )
    missing = [key for key in _REQUIRED if key not in state]
    if missing:
        raise CheckpointError(f"{what} is not a complete phalanx checkpoint: it lacks {', '.join(missing)}.")
    world_size = state["world_size"]
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise CheckpointError(f"{what} is not a complete phalanx checkpoint: world_size is {world_size!r}.")


def _whole(state: dict[str, Any]) -> dict[str, Any]:
    """A module's state with sharded parameters (``shard="parameters"``) whole (collective then)."""
    if "phalanx.torch._shard_tensor" not in sys.modules:  # nothing can be sharded
        return state
    from ..torch._shard_state import full_state_dict

    return full_state_dict(state)


def capture_state(*, model: Any, optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                  progress: Mapping[str, Any] | None = None, extra: Any = None) -> dict[str, Any]:
    """The complete training state of this run as a plain dict, ready for :func:`save_checkpoint`.

    **Collective** when phalanx is initialized with more than one rank: every
    rank calls it (rank 0 gathers every rank's RNG states). Tensors are
    detached CPU copies, so training may go on while the state is written.

    Arguments:
        model: its plain ``state_dict`` is stored (DataParallel, DDP and ``torch.compile`` wrappers
            are looked through, so keys never carry ``module.``/``_orig_mod.``).
        optimizer, scheduler, scaler: anything with ``state_dict()`` (a
            :class:`phalanx.torch.DistributedOptimizer` too), or ``None``.
        progress: plain numbers and strings, e.g. ``{"epoch": 2, "global_step": 850}``; returned by
            :func:`restore_state`.
        extra: your own tensors and plain containers.

    Returns:
        ``{"format", "version", "model", "optimizer", "scheduler", "scaler", "progress", "rng",
        "extra", "world_size", "phalanx_version", "torch_version", "time"}``. ``rng`` holds the
        torch (CPU and CUDA), NumPy and ``random`` states of every rank on rank 0 (elsewhere only
        this rank's entry; the others are ``None``).

    Raises:
        InvalidArgumentError: ``model`` is not a module, a part has no ``state_dict()``, or
            ``progress`` holds something other than plain values.
        CheckpointError: NumPy's global generator is not the legacy MT19937.
    """
    call = "capture_state"
    plain = _unwrap(model, call)
    parts = {}
    for name, obj in zip(_PARTS, (optimizer, scheduler, scaler), strict=True):
        if obj is not None and not callable(getattr(obj, "state_dict", None)):
            raise InvalidArgumentError(
                f"phalanx.train.{call}({name}=...): a {type(obj).__qualname__} has no state_dict(); pass "
                f"the {name} object itself (or None)."
            )
        parts[name] = None if obj is None else _cpu_copy(obj.state_dict())
    if progress is not None and not isinstance(progress, Mapping):
        raise InvalidArgumentError(
            f"phalanx.train.{call}(progress=...): expected a dict such as {{'epoch': 3, 'global_step': 1200}}, "
            f"got {type(progress).__qualname__}."
        )
    plain_progress = _plain(dict(progress or {}), "progress")
    r, n = identity()
    state: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "model": _cpu_copy(_whole(plain.state_dict())),
        **parts,
        "progress": plain_progress,
        "rng": None,
        "extra": _cpu_copy(extra),
        "world_size": n,
        "phalanx_version": str(phalanx.__version__),
        "torch_version": str(torch.__version__),
        "time": time.time(),
    }
    state["rng"] = gather_rng(r, n)
    return state


def restore_state(state: Mapping[str, Any], *, model: Any, optimizer: Any = None, scheduler: Any = None,
                  scaler: Any = None, restore_rng: bool = True) -> dict[str, Any]:
    """Load a training state into the objects given and return its ``progress`` dict. Not collective.

    Arguments:
        state: from :func:`load_checkpoint` or :func:`capture_state`.
        model: loaded strictly; DataParallel, DDP and ``torch.compile`` wrappers are looked through.
        optimizer, scheduler, scaler: each must be given exactly when the state holds its part (one
            given but not saved, or saved but not given, would not resume exactly). To load only the
            weights use ``model.load_state_dict(state["model"])``.
        restore_rng: set this rank's torch/CUDA/NumPy/``random`` generators to those saved: saved rank
            ``r`` at the same worker count, saved rank ``r % saved_size`` at another (then a warning:
            same epoch and sample position, different per-rank randomness).

    Returns:
        The checkpoint's ``progress`` dict.

    Raises:
        CheckpointError: the state is not a phalanx checkpoint, a part is missing or does not fit,
            or the RNG states are damaged. Everything is checked before anything is changed, except
            that a part that fails to load leaves the parts loaded before it.
    """
    call = "restore_state"
    check_format(state, f"phalanx.train.{call}: the state")
    plain = _unwrap(model, call)
    objects = dict(zip(_PARTS, (optimizer, scheduler, scaler), strict=True))
    _check_parts(state, objects, call)
    _check_model_keys(plain, state["model"], call)
    saved_size, (r, n) = int(state["world_size"]), identity()
    index = r if n == saved_size else r % saved_size
    entry = _rng_entry(state, index, saved_size, call) if restore_rng else None
    _load_part("model", lambda sd: plain.load_state_dict(sd, strict=True), state["model"], call)
    for name, obj in objects.items():
        if obj is not None:
            _load_part(name, obj.load_state_dict, state[name], call)
    if entry is not None:
        _rng.restore_rng(entry, f"the RNG entry of saved rank {index}")
        if n != saved_size and r == 0:
            warnings.warn(
                f"phalanx.train.restore_state: the checkpoint was saved by {saved_size} rank(s) and is "
                f"restored on {n}; rank r takes saved rank r % {saved_size}'s RNG states, so per-rank "
                "randomness differs from an uninterrupted run (epoch and sample position are exact).",
                RuntimeWarning, stacklevel=2)
    return dict(state["progress"])


def _check_parts(state: Mapping[str, Any], objects: dict[str, Any], call: str) -> None:
    for name, obj in objects.items():
        saved = state.get(name)
        if obj is not None and saved is None:
            raise CheckpointError(
                f"phalanx.train.{call}({name}=...): the checkpoint holds no {name} state (it was captured "
                f"without one), so the {name} would not resume. Pass {name}=None to keep it as it is."
            )
        if obj is None and saved is not None:
            raise CheckpointError(
                f"phalanx.train.{call}: the checkpoint holds {name} state but no {name}= was given; pass "
                f"the {name} so the run resumes exactly (to load only the weights, use "
                "`model.load_state_dict(state['model'])`)."
            )


def _rng_entry(state: Mapping[str, Any], index: int, saved_size: int, call: str) -> Any:
    rng = state.get("rng")
    if not isinstance(rng, list) or len(rng) != saved_size:
        raise CheckpointError(
            f"phalanx.train.{call}: the checkpoint's rng holds "
            f"{len(rng) if isinstance(rng, list) else type(rng).__name__} entries for a world of "
            f"{saved_size}; pass restore_rng=False to restore everything else."
        )
    entry = rng[index]
    if entry is None:
        raise CheckpointError(
            f"phalanx.train.{call}: this state holds no RNG states of rank {index} (a state captured on "
            "a rank other than 0 keeps only its own); restore from the file rank 0 saved."
        )
    return entry


def _load_part(what: str, load: Any, saved: Any, call: str) -> None:
    try:
        load(saved)
    except Exception as exc:
        raise CheckpointError(
            f"phalanx.train.{call}: the checkpoint's {what} state does not fit the {what} given "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _check_model_keys(model: torch.nn.Module, saved: Any, call: str) -> None:
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"phalanx.train.{call}: the checkpoint's model state is a "
                              f"{type(saved).__name__}, not a state_dict.")
    have, got = set(model.state_dict().keys()), set(saved.keys())
    if have == got:
        return
    missing, unexpected = sorted(have - got), sorted(got - have)

    def show(keys: list[str]) -> str:
        return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")

    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {show(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the model: {show(unexpected)}")
    hint = ""
    if any(k.startswith(("module.", "_orig_mod.")) for k in got):
        hint = (" The checkpoint's keys carry a wrapper prefix ('module.' / '_orig_mod.'): it was not made "
                "by capture_state, which saves the plain model.")
    raise CheckpointError(
        f"phalanx.train.{call}: the checkpoint's model does not match the model given ({'; '.join(parts)}). "
        f"Build the same architecture as the run that saved it.{hint}"
    )
