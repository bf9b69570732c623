"""The random number generators' states of every rank, as tensors (no pickled objects).

One rank's entry (:func:`local_rng`) holds torch's CPU state, the CUDA states
(when this process has initialized CUDA), NumPy's global MT19937 and Python's
``random``, each with its cached gaussian. :func:`gather_rng` collects every
rank's entry on rank 0 with phalanx's array collectives (so it is
collective); :func:`restore_rng` sets this process's generators from one
entry, checking it whole before anything is changed.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch

from .._collectives import allgather, gather
from .._errors import CheckpointError

__all__ = ["gather_rng", "local_rng", "restore_rng"]

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


def local_rng() -> dict[str, torch.Tensor]:
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


def gather_rng(r: int, n: int) -> list[dict[str, torch.Tensor] | None]:
    """Every rank's RNG states on rank 0 (a list in rank order); elsewhere only this rank's entry."""
    entry = local_rng()
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


def _parse(entry: Any) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...], tuple[Any, ...]]:
    """(torch state, CUDA states, NumPy state, Python state) of an entry, checked whole; raises on any flaw
    (CheckpointError saying which part for the flaws checked here; a missing key or a state torch, NumPy or
    ``random`` reject raise what they raise)."""
    torch_state = entry["torch"]
    if not isinstance(torch_state, torch.Tensor) or torch_state.dtype != torch.uint8:
        raise CheckpointError(f"the torch state is a {type(torch_state).__name__}, not a uint8 tensor")
    probe = torch.Generator()
    probe.set_state(torch_state)  # rejects a state of the wrong size or content
    cuda = entry["cuda"]
    numbers = [int(v) for v in entry["numpy"].tolist()]
    keys, pos, has_gauss = numbers[:-2], numbers[-2], numbers[-1]
    if len(keys) != 624 or not all(0 <= k < 2**32 for k in keys) or not 0 <= pos <= 624 or has_gauss not in (0, 1):
        raise CheckpointError("the NumPy MT19937 state is out of range")
    numpy_state = ("MT19937", np.asarray(keys, dtype=np.uint32), pos, has_gauss,
                   float(entry["numpy_gauss"][0]))
    version, has_next, *internal = (int(v) for v in entry["python"].tolist())
    if has_next not in (0, 1) or len(internal) != 625 or not all(0 <= k < 2**32 for k in internal):
        raise CheckpointError("the Python random state is out of range")
    gauss = float(entry["python_gauss"][0]) if has_next else None
    python_state = (version, tuple(internal), gauss)
    random.Random().setstate(python_state)  # rejects what random.setstate would
    np.random.RandomState().set_state(numpy_state)
    return torch_state, cuda, numpy_state, python_state


def restore_rng(entry: Any, where: str) -> None:
    """Set this process's generators to ``entry`` (from :func:`gather_rng`); nothing changes if it is invalid.

    Raises :class:`CheckpointError` naming ``where`` for a damaged or foreign entry.
    """
    try:
        torch_state, cuda, numpy_state, python_state = _parse(entry)
    except Exception as exc:  # any flaw of a damaged entry (KeyError, OverflowError, ...) is the same error
        reason = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        raise CheckpointError(
            f"phalanx.train.restore_state: {where} is not a valid RNG state ({reason}). "
            "The checkpoint is damaged or was not written by phalanx; pass restore_rng=False to restore "
            "everything else."
        ) from exc
    torch.set_rng_state(torch_state)
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    saved_devices = int(cuda.shape[0]) if isinstance(cuda, torch.Tensor) and cuda.dim() == 2 else 0
    if saved_devices:
        here = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for device in range(min(saved_devices, here)):
            torch.cuda.set_rng_state(cuda[device], device)
        if here != saved_devices:
            warnings.warn(
                f"phalanx.train.restore_state: {where} holds CUDA RNG states for {saved_devices} "
                f"device(s) but this process sees {here}; restored {min(saved_devices, here)}, so "
                "CUDA randomness does not continue exactly.", RuntimeWarning, stacklevel=3)
