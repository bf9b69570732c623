"""One file for inference from a model trained sharded: ``export_safetensors`` and ``load_safetensors``.

::

    phalanx.torch.export_safetensors("gpt.safetensors", model)        # collective; rank 0 writes
    model.load_state_dict(phalanx.torch.load_safetensors("gpt.safetensors"))   # one process, unwrapped

The file is in the safetensors format (an 8-byte little-endian header
length, a JSON header of names, dtypes, shapes and byte offsets, then the
raw bytes), so ``safetensors.torch.load_file`` reads it too. It is written
tensor by tensor: each sharded parameter is gathered whole (collective),
appended by rank 0 and dropped before the next, so no rank holds more than
one whole parameter beyond its training state. Names are the unwrapped
module's ``state_dict()`` names; tied weights are written under each name.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import torch

from .._collectives import barrier
from .._errors import CheckpointError
from .._files import write_atomically
from ._shard_state import local_states
from ._shard_tensor import ShardedTensor

__all__ = ["export_safetensors", "load_safetensors"]

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_BACK = {v: k for k, v in _DTYPES.items()}


@torch.no_grad()
def export_safetensors(path: str | os.PathLike[str], model: torch.nn.Module) -> str:
    """Write ``model``'s whole state (parameters and persistent buffers) to one safetensors file that an
    unwrapped model loads in one process (collective: every rank calls it; rank 0 writes; when it returns
    the file is complete); return the path.

    Arguments:
        path: the file to write (replaced atomically).
        model: a :class:`DataParallel` (any ``shard``) or a plain module.

    Returns:
        the path written.
    """
    from .._world import rank

    inner = getattr(model, "module", None)
    plain = inner if isinstance(inner, torch.nn.Module) else model
    with local_states():  # this rank's shards: gathered one tensor at a time below
        state = plain.state_dict(keep_vars=True)
    header: dict[str, Any] = {}
    at = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    target = os.fspath(path)
    writer = write_atomically(target) if rank() == 0 else None
    f = writer.__enter__() if writer is not None else None
    try:
        if f is not None:
            f.write(struct.pack("<Q", len(head)) + head)
        for t in state.values():
            whole = t.full_tensor() if isinstance(t, ShardedTensor) else t.detach()  # collective when sharded
            if f is not None:
                f.write(whole.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)  # no copy
            del whole
    except BaseException as exc:
        if writer is not None:
            writer.__exit__(type(exc), exc, exc.__traceback__)
        raise
    if writer is not None:
        writer.__exit__(None, None, None)
    barrier()  # on return the file is there for every rank
    return target


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, by name (a ``state_dict`` for ``load_state_dict``).

    Arguments:
        path: a file written by :func:`export_safetensors` (or any safetensors file of these dtypes).

    Raises:
        CheckpointError: the file is not in the safetensors format.
    """
    with open(os.fspath(path), "rb") as f:
        data = f.read()
    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length])
    except (struct.error, ValueError) as exc:
        raise CheckpointError(f"phalanx.torch.load_safetensors({os.fspath(path)!r}): not a safetensors file "
                              f"({exc}).") from exc
    base, out = 8 + length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        a, b = entry["data_offsets"]
        raw = torch.frombuffer(bytearray(data[base + a:base + b]), dtype=torch.uint8)
        out[name] = raw.view(_BACK[entry["dtype"]]).reshape(entry["shape"])
    return out
