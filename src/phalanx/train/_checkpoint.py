"""Checkpoints: capture the exact training state, write it atomically on rank 0, resume exactly.

::

    import phalanx.train as pt

    # every rank calls these two (they are collective in a multi-rank world)
    state = pt.capture_state(model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                             progress={"epoch": epoch, "global_step": step})
    pt.save_checkpoint("ckpt/last.pt", state)       # rank 0 writes; every rank returns or raises

    state = pt.load_checkpoint("ckpt/last.pt")      # every rank reads the file itself
    progress = pt.restore_state(state, model=model, optimizer=opt, scheduler=sched, scaler=scaler)

    manager = pt.CheckpointManager("ckpt", keep=3)  # ckpt/checkpoint-000001200.pt, ...
    manager.save(pt.capture_state(model=model, optimizer=opt, progress=progress), step=1200)
    state = manager.load_latest()                   # None before the first save

**What a checkpoint holds.** A plain dict: the model's ``state_dict`` (of
the plain model: :class:`phalanx.torch.DataParallel`, DDP and
``torch.compile`` wrappers are looked through, so the keys never carry
``module.`` or ``_orig_mod.``), the optimizer's, LR scheduler's and
``GradScaler``'s state dicts, ``progress`` (epoch, position in the epoch,
global step, ...: plain numbers and strings), ``extra`` (anything made of
tensors and plain containers), and the random number generator states of
**every rank**: torch CPU, CUDA (when this process has initialized CUDA),
NumPy's global generator and Python's ``random``. The RNG states are stored
as tensors (no pickled objects) and gathered to rank 0 with phalanx's array
collectives, so :func:`capture_state` and :func:`save_checkpoint` are
**collective**: every rank must call them, in the same order. Tensors are
detached CPU copies, so training may go on while the state is written.
Everything but the RNG states is rank 0's: data parallelism keeps
parameters and optimizer state equal on every rank, and state that differs
per rank (BatchNorm statistics without ``SyncBatchNorm`` or DataParallel's
buffer broadcast) resumes as rank 0's on every rank.

**Atomic.** Rank 0 writes ``torch.save`` output to a temporary file in the
target's directory (``.<name>.tmp-<pid>``), flushes and fsyncs it, reads it
back (weights-only, memory-mapped) to prove it loads, renames it onto the
target with ``os.replace`` and fsyncs the directory. A crash at any moment
leaves either the previous complete file or the new one, never a partial
one; a failure (read-only directory, disk full, an object that cannot be
stored) removes the temporary file, leaves the previous checkpoint as it
was, and raises :class:`CheckpointError` on **every** rank: rank 0
broadcasts its outcome, so no rank is left waiting. The other ranks wait for
that broadcast within the collective timeout (``phalanx.init(timeout=...)``,
``PHALANX_TIMEOUT``), which therefore has to cover writing the file.

**Safe.** :func:`load_checkpoint` uses ``torch.load(weights_only=True)``:
tensors, numbers, strings and plain containers only. A file that holds
other objects (a pickled class, a ``__reduce__`` gadget) is refused as
unsafe, never unpickled. :func:`save_checkpoint` refuses, before writing,
any state that such a load would refuse, naming where in the state it is.

**Every rank reads.** Each rank loads the file itself, so the checkpoint
directory must be on a filesystem every rank sees (or be copied to each
node first).

**Exact resume.** :func:`restore_state` loads every part it is given and
sets this rank's RNG states to those it had when the state was captured.
At another worker count, rank ``r`` gets saved rank ``r % saved_size``'s
RNG states: training continues at the same epoch and sample position, but
per-rank randomness (dropout, augmentation) then differs from a run that
never changed size.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import pickletools
import random
import re
import time
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

import phalanx

from .._collectives import allgather, broadcast, gather
from .._errors import CheckpointError, InvalidArgumentError
from .._world import initialized, rank, size

__all__ = [
    "CheckpointError", "CheckpointManager", "capture_state", "load_checkpoint", "restore_state",
    "save_checkpoint",
]

FORMAT = "phalanx-checkpoint"
VERSION = 1
_PARTS = ("optimizer", "scheduler", "scaler")
_REQUIRED = ("model", "optimizer", "scheduler", "scaler", "progress", "rng", "world_size")
_STATUS_BYTES = 1024  # rank 0's outcome of a save, broadcast to every rank: [failed, utf-8 message...]
_SUFFIXES = (".pt", ".pth", ".ckpt", ".tar", ".bin")


# -- identity and small helpers ------------------------------------------------------------------

def _identity() -> tuple[int, int]:
    """(rank, size) of this process; a process that never called phalanx.init() is a world of one."""
    if initialized():
        return rank(), size()
    return 0, 1


def _fspath(path: Any, call: str) -> str:
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


def _unstorable(obj: Any, where: str) -> str | None:
    """Where in ``obj`` something sits that ``torch.load(weights_only=True)`` would refuse, or None."""
    kind = type(obj)
    if kind in _PLAIN_LEAVES or kind is torch.Tensor or kind is torch.nn.Parameter:
        return None
    if kind is dict or kind is OrderedDict:
        for key, value in obj.items():
            bad = _unstorable(key, f"{where} (a key)") or _unstorable(value, f"{where}[{key!r}]")
            if bad:
                return bad
        return None
    if kind in (list, tuple, set):
        for i, value in enumerate(obj):
            bad = _unstorable(value, f"{where}[{i}]")
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


# -- random number generators --------------------------------------------------------------------

# One rank's RNG states as fixed-layout tensors: (name, dtype). "cuda" is (devices, bytes per state).
_RNG_PARTS: tuple[tuple[str, torch.dtype], ...] = (
    ("torch", torch.uint8),          # torch.get_rng_state()
    ("cuda", torch.uint8),           # torch.cuda.get_rng_state_all(), stacked; (0, 0) without CUDA
    ("numpy", torch.int64),          # MT19937 keys (624), pos, has_gauss
    ("numpy_gauss", torch.float64),  # cached gaussian
    ("python", torch.int64),         # version, has gauss_next, internal state (625)
    ("python_gauss", torch.float64),  # gauss_next
)


def _local_rng() -> dict[str, torch.Tensor]:
    """This process's RNG states (see _RNG_PARTS)."""
    cuda: list[torch.Tensor] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [s.to("cpu") for s in torch.cuda.get_rng_state_all()]
    np_state = np.random.get_state()
    if not isinstance(np_state, tuple) or np_state[0] != "MT19937":
        raise CheckpointError(
            "phalanx.train.capture_state: NumPy's global generator is not the legacy MT19937 "
            f"(np.random.get_state() gave {type(np_state).__name__}); its state cannot be saved."
        )
    _, keys, pos, has_gauss, cached = np_state
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state().clone(),
        "cuda": torch.stack(cuda) if cuda else torch.zeros((0, 0), dtype=torch.uint8),
        "numpy": torch.from_numpy(np.concatenate([np.asarray(keys, np.int64), [pos, has_gauss]])),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "python": torch.tensor([version, gauss_next is not None, *internal], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss_next is None else gauss_next], dtype=torch.float64),
    }


def _encode(entry: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """(header: two dims per part, -1 for none; blob: every part's bytes, in _RNG_PARTS order)."""
    header = np.full(2 * len(_RNG_PARTS), -1, dtype=np.int64)
    chunks = []
    for i, (name, dtype) in enumerate(_RNG_PARTS):
        t = entry[name].to(dtype).contiguous()
        header[2 * i:2 * i + t.dim()] = t.shape
        chunks.append(t.reshape(-1).view(torch.uint8).numpy())
    return header, np.concatenate(chunks)


def _decode(header: np.ndarray, blob: np.ndarray) -> dict[str, torch.Tensor]:
    entry, offset = {}, 0
    for i, (name, dtype) in enumerate(_RNG_PARTS):
        shape = tuple(int(d) for d in header[2 * i:2 * i + 2] if d >= 0)
        count = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        raw = torch.from_numpy(np.array(blob[offset:offset + count], dtype=np.uint8))
        entry[name] = raw.view(dtype).reshape(shape)
        offset += count
    return entry


def _byte_count(header: np.ndarray) -> int:
    total = 0
    for i, (_, dtype) in enumerate(_RNG_PARTS):
        shape = [int(d) for d in header[2 * i:2 * i + 2] if d >= 0]
        total += int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    return total


def _gather_rng(r: int, n: int) -> list[dict[str, torch.Tensor] | None]:
    """Every rank's RNG states on rank 0 (a list in rank order); elsewhere only this rank's entry."""
    entry = _local_rng()
    if n == 1:
        return [entry]
    header, blob = _encode(entry)
    headers = allgather(header)  # (n, 12): how many bytes each rank sends
    sizes = [_byte_count(h) for h in headers]
    padded = np.zeros(max(sizes), dtype=np.uint8)
    padded[:blob.size] = blob
    blobs = gather(padded, root=0)
    if r != 0:
        return [entry if i == r else None for i in range(n)]
    return [_decode(headers[i], blobs[i][:sizes[i]]) for i in range(n)]


def _restore_rng(entry: Any, where: str) -> None:
    try:
        torch.set_rng_state(entry["torch"])
        cuda = entry["cuda"]
        saved_devices = int(cuda.shape[0]) if cuda.dim() == 2 else 0
        if saved_devices:
            here = torch.cuda.device_count() if torch.cuda.is_available() else 0
            for device in range(min(saved_devices, here)):
                torch.cuda.set_rng_state(cuda[device], device)
            if here != saved_devices:
                warnings.warn(
                    f"phalanx.train.restore_state: {where} holds CUDA RNG states for {saved_devices} "
                    f"device(s) but this process sees {here}; restored {min(saved_devices, here)}, so "
                    "CUDA randomness does not continue exactly.", RuntimeWarning, stacklevel=3)
        numbers = entry["numpy"].tolist()
        np.random.set_state(("MT19937", np.asarray(numbers[:-2], dtype=np.uint32), int(numbers[-2]),
                             int(numbers[-1]), float(entry["numpy_gauss"][0])))
        version, has_gauss, *internal = entry["python"].tolist()
        gauss = float(entry["python_gauss"][0]) if has_gauss else None
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as exc:
        raise CheckpointError(
            f"phalanx.train.restore_state: {where} is not a valid RNG state ({type(exc).__name__}: {exc}). "
            "Pass restore_rng=False to restore everything else."
        ) from exc


# -- capture and restore -------------------------------------------------------------------------

def capture_state(*, model: Any, optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                  progress: Mapping[str, Any] | None = None, extra: Any = None) -> dict[str, Any]:
    """The complete training state as a plain dict, ready for :func:`save_checkpoint`.

    **Collective** when phalanx is initialized with more than one rank: every
    rank must call it (rank 0 gathers every rank's RNG states). ``model`` is
    unwrapped (DataParallel, DDP, ``torch.compile``); ``optimizer`` may be a
    :class:`phalanx.torch.DistributedOptimizer`; ``scheduler`` and ``scaler``
    anything with ``state_dict()``. ``progress``: plain numbers and strings
    (e.g. ``{"epoch": 2, "step_in_epoch": 50, "global_step": 850}``),
    returned by :func:`restore_state`. ``extra``: tensors and plain
    containers of your own. Tensors are detached CPU copies.

    The result: ``{"format", "version", "model", "optimizer", "scheduler",
    "scaler", "progress", "rng", "extra", "world_size", "phalanx_version",
    "torch_version", "time"}``; ``rng`` holds one entry per rank on rank 0
    (on other ranks only their own entry is filled, the rest are ``None``).
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
    r, n = _identity()
    state: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "model": _cpu_copy(plain.state_dict()),
        **parts,
        "progress": plain_progress,
        "rng": None,
        "extra": _cpu_copy(extra),
        "world_size": n,
        "phalanx_version": str(phalanx.__version__),
        "torch_version": str(torch.__version__),
        "time": time.time(),
    }
    state["rng"] = _gather_rng(r, n)
    return state


def restore_state(state: Mapping[str, Any], *, model: Any, optimizer: Any = None, scheduler: Any = None,
                  scaler: Any = None, restore_rng: bool = True) -> dict[str, Any]:
    """Load ``state`` (from :func:`load_checkpoint` or :func:`capture_state`) into the objects given.

    The model is loaded strictly (unwrapped like in :func:`capture_state`).
    Each of ``optimizer``/``scheduler``/``scaler`` must be given exactly when
    the checkpoint holds its state: one given but not saved, or saved but not
    given, is a :class:`CheckpointError` (a resumed run that silently dropped
    one would not continue exactly); to load only the weights use
    ``model.load_state_dict(state["model"])``. Everything is checked before
    anything is changed. With ``restore_rng`` (default) this rank's RNG
    states are restored: saved rank ``r`` at the same worker count, saved
    rank ``r % saved_size`` at another (same epoch and sample position,
    different per-rank randomness). Not collective.

    Returns the checkpoint's ``progress`` dict.
    """
    call = "restore_state"
    _check_format(state, f"phalanx.train.{call}: the state")
    plain = _unwrap(model, call)
    for name, obj in zip(_PARTS, (optimizer, scheduler, scaler), strict=True):
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
    _check_model_keys(plain, state["model"], call)
    entry, saved_size, r, n = None, int(state["world_size"]), *_identity()
    if restore_rng:
        rng = state.get("rng")
        if not isinstance(rng, list) or len(rng) != saved_size:
            raise CheckpointError(
                f"phalanx.train.{call}: the checkpoint's rng holds "
                f"{len(rng) if isinstance(rng, list) else type(rng).__name__} entries for a world of "
                f"{saved_size}; pass restore_rng=False to restore everything else."
            )
        index = r if n == saved_size else r % saved_size
        entry = rng[index]
        if entry is None:
            raise CheckpointError(
                f"phalanx.train.{call}: this state holds no RNG states of rank {index} (a state captured on "
                "a rank other than 0 keeps only its own); restore from the file rank 0 saved."
            )

    def attempt(what: str, fn: Any, saved: Any) -> None:
        try:
            fn(saved)
        except Exception as exc:
            raise CheckpointError(
                f"phalanx.train.{call}: the checkpoint's {what} state does not fit the {what} given "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    attempt("model", lambda sd: plain.load_state_dict(sd, strict=True), state["model"])
    for name, obj in zip(_PARTS, (optimizer, scheduler, scaler), strict=True):
        if obj is not None:
            attempt(name, obj.load_state_dict, state[name])
    if entry is not None:
        _restore_rng(entry, f"the RNG entry of saved rank {r if n == saved_size else r % saved_size}")
        if n != saved_size and r == 0:
            warnings.warn(
                f"phalanx.train.restore_state: the checkpoint was saved by {saved_size} rank(s) and is "
                f"restored on {n}; rank r takes saved rank r % {saved_size}'s RNG states, so per-rank "
                "randomness differs from an uninterrupted run (epoch and sample position are exact).",
                RuntimeWarning, stacklevel=2)
    return dict(state["progress"])


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


# -- files ---------------------------------------------------------------------------------------

def _check_format(state: Any, what: str) -> None:
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


def _fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (best effort: some filesystems cannot fsync a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_name(target: str) -> str:
    directory, base = os.path.split(target)
    return os.path.join(directory, f".{base}.tmp-{os.getpid()}")


def _write(target: str, state: Any) -> None:
    """Rank 0's atomic write (see the module docstring); raises CheckpointError/OSError on failure."""
    call = "phalanx.train.save_checkpoint"
    _check_format(state, f"{call}: the state")
    bad = _unstorable(state, "state")
    if bad:
        raise CheckpointError(
            f"{call}({target!r}): {bad}, which load_checkpoint (torch.load with weights_only=True) would "
            "refuse. Checkpoints hold tensors, numbers, strings and plain dicts/lists/tuples only."
        )
    directory = os.path.dirname(target) or "."
    os.makedirs(directory, exist_ok=True)
    temp = _temp_name(target)
    try:
        with open(temp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        try:  # prove it loads (mmap: no second copy of the tensors in memory)
            torch.load(temp, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise CheckpointError(f"{call}({target!r}): the file written does not load back ({exc})") from exc
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_directory(directory)


def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any]) -> str:
    """Write ``state`` (from :func:`capture_state`) to ``path`` atomically on rank 0; returns ``path``.

    **Collective** when phalanx is initialized with more than one rank: every
    rank calls it; only rank 0's ``state`` is written (other ranks may pass
    theirs or ``None``). Parent directories are created. Every rank either
    returns ``path`` or raises :class:`CheckpointError` (rank 0 broadcasts its
    outcome); on failure the previous file at ``path`` is unchanged and no
    temporary file is left.
    """
    call = "save_checkpoint"
    r, n = _identity()
    error: BaseException | None = None
    target = ""
    try:
        target = _fspath(path, call)
    except InvalidArgumentError as exc:
        error = exc
    if r == 0 and error is None:
        try:
            _write(target, state)
        except CheckpointError as exc:
            error = exc
        except Exception as exc:
            error = CheckpointError(
                f"phalanx.train.{call}({target!r}): rank 0 could not write the checkpoint "
                f"({type(exc).__name__}: {exc}). The previous file at that path, if any, is unchanged. "
                "Check that the directory is writable and has free space."
            )
            error.__cause__ = exc
    if n > 1:
        status = np.zeros(_STATUS_BYTES, dtype=np.uint8)
        if r == 0 and error is not None:
            message = str(error).encode("utf-8")[:_STATUS_BYTES - 1]
            status[0] = 1
            status[1:1 + len(message)] = np.frombuffer(message, dtype=np.uint8)
        status = broadcast(status, root=0)
        if r != 0 and status[0] and error is None:
            reason = bytes(status[1:]).rstrip(b"\0").decode("utf-8", errors="ignore")
            error = CheckpointError(f"phalanx.train.{call}: rank 0 failed to write the checkpoint, so no rank "
                                    f"has a new one. Rank 0 reported: {reason}")
    if error is not None:
        raise error
    return target


def _listing(directory: str) -> str:
    try:
        names = sorted(
            name for name in os.listdir(directory)
            if not name.startswith(".") and name.endswith(_SUFFIXES)
            and os.path.isfile(os.path.join(directory, name))
        )
    except FileNotFoundError:
        return f"the directory {directory!r} does not exist"
    except OSError as exc:
        return f"the directory {directory!r} cannot be listed ({exc})"
    if not names:
        return f"{directory!r} holds no checkpoint files ({', '.join('*' + s for s in _SUFFIXES)})"
    shown = ", ".join(names[-10:])
    more = f" (the newest 10 of {len(names)})" if len(names) > 10 else ""
    return f"checkpoints in {directory!r}{more}: {shown}"


_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
               "SHORT_BINSTRING"}
_SCAN_LIMIT = 64 << 20


def _pickle_globals(target: str) -> list[str] | None:
    """The globals a pickle names, read without unpickling (pickletools); None if it does not parse."""
    try:
        if zipfile.is_zipfile(target):
            with zipfile.ZipFile(target) as archive:
                member = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                if member is None or archive.getinfo(member).file_size > _SCAN_LIMIT:
                    return None
                data = archive.read(member)
        else:
            if os.path.getsize(target) > _SCAN_LIMIT:
                return None
            with open(target, "rb") as f:
                data = f.read()
        names: list[str] = []
        strings: list[str] = []
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL":
                names.append(".".join(strings[-2:]) if len(strings) >= 2 else "an object")
            elif op.name in _STRING_OPS:
                strings.append(str(arg))
        return list(dict.fromkeys(names))
    except Exception:
        return None


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (safely: ``torch.load(weights_only=True)``).

    Not collective: every rank reads the file itself, so it must be on a
    filesystem every rank sees. Raises :class:`CheckpointError` for a missing
    file (listing the checkpoints that do exist there), a truncated or
    corrupt file or another format ("not a complete phalanx checkpoint"),
    and a file holding objects other than tensors and plain containers
    ("refused as unsafe": it is never unpickled).
    """
    call = "load_checkpoint"
    target = _fspath(path, call)
    where = f"phalanx.train.{call}({target!r})"
    if not os.path.exists(target):
        raise CheckpointError(f"{where}: no such file; {_listing(os.path.dirname(target) or '.')}.")
    if os.path.isdir(target):
        raise CheckpointError(f"{where}: this is a directory; pass a checkpoint file "
                              "(e.g. CheckpointManager(directory).latest()).")
    try:
        state = torch.load(target, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        found = sorted(set(re.findall(r"GLOBAL ([\w.]+)", text)))
        if "Weights only load failed" in text and not found:
            # "Unsupported operand": a damaged pickle, or a well-formed one using what weights-only refuses
            scanned = _pickle_globals(target)
            if scanned is None:
                raise CheckpointError(
                    f"{where}: not a complete phalanx checkpoint: the file is corrupt (its pickle data "
                    "does not parse)."
                ) from exc
            found = [name for name in scanned if not name.startswith(("torch.", "collections."))]
        if "Weights only load failed" in text:
            what = f" ({', '.join(found[:5])}{', ...' if len(found) > 5 else ''})" if found else ""
            raise CheckpointError(
                f"{where}: refused as unsafe: the file holds objects other than tensors and plain "
                f"containers{what}, which could run arbitrary code when unpickled. phalanx loads "
                "checkpoints with torch.load(weights_only=True) only; inspect the file yourself "
                "(torch.load(path, weights_only=False)) only if you trust where it came from."
            ) from None
        raise CheckpointError(f"{where}: not a complete phalanx checkpoint (corrupt: {text})") from exc
    except (PermissionError, IsADirectoryError) as exc:
        raise CheckpointError(f"{where}: cannot read the file ({exc}).") from exc
    except Exception as exc:
        detail = str(exc).split(". ")[0] or type(exc).__name__
        raise CheckpointError(
            f"{where}: not a complete phalanx checkpoint: the file is truncated or corrupt "
            f"({type(exc).__name__}: {detail}). A crash during a phalanx save cannot cause this (writes are "
            "atomic); the file was damaged or written by something else."
        ) from exc
    _check_format(state, where)
    return state


# -- a directory of numbered checkpoints ---------------------------------------------------------

class CheckpointManager:
    """Numbered checkpoints in ``directory``: ``<prefix>-<step:09d>.pt``, the newest ``keep`` kept.

    ``save`` is collective like :func:`save_checkpoint`; afterwards rank 0
    deletes the oldest checkpoints beyond ``keep`` (``None``: keep all) and
    temporary files left by interrupted saves. ``paths`` lists complete
    checkpoints only (temporary files are hidden ``.<name>.tmp-<pid>``
    files), oldest first by step. ``load_latest`` reads the newest and falls
    back to older ones, with a warning naming each file skipped, when it is
    unreadable; it raises if none can be read and returns ``None`` when
    there is none.
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int | None = 3,
                 prefix: str = "checkpoint") -> None:
        call = "CheckpointManager"
        self.directory = _fspath(directory, call)
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise InvalidArgumentError(
                f"phalanx.train.{call}(keep={keep!r}): keep is how many checkpoints to keep, an int >= 1 "
                "(or None to keep all)."
            )
        if not isinstance(prefix, str) or not re.fullmatch(r"[\w\-][\w.\-]*", prefix):
            raise InvalidArgumentError(
                f"phalanx.train.{call}(prefix={prefix!r}): use a plain file-name prefix of letters, digits, "
                "'_', '-' and '.' (not starting with '.'), e.g. 'checkpoint'."
            )
        self.keep = keep
        self.prefix = prefix
        self._complete = re.compile(rf"{re.escape(prefix)}-(\d+)\.pt")
        self._temporary = re.compile(rf"\.{re.escape(prefix)}-\d+\.pt\.tmp-\d+")

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, keep={self.keep!r}, prefix={self.prefix!r})"

    def path(self, step: int) -> str:
        """The file name of step ``step``'s checkpoint."""
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise InvalidArgumentError(
                f"phalanx.train.CheckpointManager.save(step={step!r}): step must be an int >= 0 "
                "(the global step or epoch the checkpoint belongs to)."
            )
        return os.path.join(self.directory, f"{self.prefix}-{int(step):09d}.pt")

    def save(self, state: Mapping[str, Any], step: int) -> str:
        """Write ``state`` as step ``step``'s checkpoint (collective); prune on rank 0; return its path."""
        target = save_checkpoint(self.path(step), state)
        if _identity()[0] == 0:
            self._prune(target)
        return target

    def _prune(self, just_saved: str) -> None:
        doomed = []
        if self.keep is not None:
            doomed = [p for p in self.paths()[:-self.keep] if os.path.abspath(p) != os.path.abspath(just_saved)]
        try:
            names = os.listdir(self.directory)
        except OSError:
            names = []
        doomed += [os.path.join(self.directory, n) for n in names if self._temporary.fullmatch(n)]
        for path in doomed:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                warnings.warn(f"phalanx.train.CheckpointManager: could not delete {path!r} ({exc}).",
                              RuntimeWarning, stacklevel=3)

    def paths(self) -> list[str]:
        """Complete checkpoints in the directory, oldest (lowest step) first."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            match = self._complete.fullmatch(name)
            if match:
                found.append((int(match.group(1)), os.path.join(self.directory, name)))
        return [p for _, p in sorted(found)]

    def latest(self) -> str | None:
        """The newest checkpoint's path, or ``None`` when there is none."""
        paths = self.paths()
        return paths[-1] if paths else None

    def load_latest(self, map_location: Any = "cpu") -> dict[str, Any] | None:
        """The newest readable checkpoint (see the class docstring), or ``None`` when there is none."""
        paths = self.paths()
        failures = []
        for path in reversed(paths):
            try:
                state = load_checkpoint(path, map_location=map_location)
            except CheckpointError as exc:
                failures.append(str(exc))
                warnings.warn(f"phalanx.train.CheckpointManager.load_latest: skipped {path!r}, which cannot "
                              f"be loaded: {exc}", RuntimeWarning, stacklevel=2)
                continue
            return state
        if failures:
            raise CheckpointError(
                f"phalanx.train.CheckpointManager.load_latest: none of the {len(paths)} checkpoint(s) in "
                f"{self.directory!r} can be loaded:\n  " + "\n  ".join(failures)
            )
        return None
