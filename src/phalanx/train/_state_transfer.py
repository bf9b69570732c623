"""A training state sent from one rank to every rank: what ``fit(elastic=True)`` gives a replacement.

The state is a tree (dicts, lists, tuples) of tensors and plain values. Its structure goes as bytes
loaded with ``torch.load(weights_only=True)`` (nothing a peer sends is unpickled beyond plain values),
each dense tensor replaced by a placeholder. The tensors' bytes go apart, one buffer per top-level
entry (the model's, the optimizer's, ...), each received in place: the receiver's tensors are views of
that buffer, so a 1 GB state costs one copy into the buffer on the sender and one broadcast, not a
``torch.save`` into a growing byte string and two copies more. A buffer whose tensors the receiver
keeps (an optimizer's state, which ``load_state_dict`` does not copy) is the state itself; one that
is copied out (the model's parameters) is freed once loaded.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from .._collectives import broadcast

__all__ = ["broadcast_state"]

_MARK = "__phalanx_tensor__"  # (mark, index): a tensor sent in its entry's buffer
_ALIGN = 64  # each tensor's offset in a buffer: any dtype's view of it is aligned


def broadcast_state(state: dict[str, Any] | None, root: int, rank: int) -> tuple[dict[str, Any], int]:
    """``state`` (given on ``root``, ``None`` elsewhere) on every rank, and the bytes sent (collective)."""
    if rank == root:
        assert state is not None  # internal invariant: the root holds the state it sends
        entries: dict[str, tuple[Any, list[torch.Tensor]]] = {}
        for key, value in state.items():
            tensors: list[torch.Tensor] = []
            entries[key] = (_strip(value, tensors), tensors)
        layout = {key: _layout(tensors) for key, (_, tensors) in entries.items()}
        out = io.BytesIO()
        torch.save({"skeleton": {key: skeleton for key, (skeleton, _) in entries.items()}, "layout": layout}, out)
        header = np.frombuffer(out.getvalue(), np.uint8).copy()
        size = broadcast(np.array([header.size], np.int64), root=root)
    else:
        size = broadcast(np.zeros(1, np.int64), root=root)
        header = np.empty(int(size[0]), np.uint8)
    header = broadcast(header, root=root)
    if rank != root:
        head = torch.load(io.BytesIO(header.tobytes()), map_location="cpu", weights_only=True)
        layout = head["layout"]
    sent = int(size[0])
    received: dict[str, Any] = {}
    for key, (metas, total) in layout.items():
        sent += total
        if rank == root:
            buffer = torch.empty(total, dtype=torch.uint8)
            for t, (_, _, offset, nbytes) in zip(entries[key][1], metas, strict=True):
                if nbytes:
                    buffer[offset:offset + nbytes].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
            if total:
                broadcast(buffer.numpy(), root=root)
            continue
        data = np.empty(total, np.uint8)
        if total:
            data = broadcast(data, root=root)
        flat = torch.from_numpy(data)
        tensors = [flat[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)
                   for dtype, shape, offset, nbytes in metas]
        received[key] = _fill(head["skeleton"][key], tensors)
    return (state if rank == root else received), sent  # type: ignore[return-value]


def _layout(tensors: list[torch.Tensor]) -> tuple[list[tuple[str, list[int], int, int]], int]:
    """Each tensor's (dtype, shape, offset, bytes) in its buffer, and the buffer's size."""
    metas, total = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append((str(t.dtype).removeprefix("torch."), list(t.shape), total, nbytes))
        total += -(-nbytes // _ALIGN) * _ALIGN
    return metas, total


def _sendable(x: Any) -> bool:
    return (isinstance(x, torch.Tensor) and x.layout == torch.strided and not x.is_quantized
            and type(x) in (torch.Tensor, torch.nn.Parameter))


def _strip(x: Any, tensors: list[torch.Tensor]) -> Any:
    """``x`` with each dense tensor replaced by a placeholder (appended to ``tensors``)."""
    if _sendable(x):
        tensors.append(x)
        return (_MARK, len(tensors) - 1)
    if isinstance(x, dict):
        return _like(x, ((k, _strip(v, tensors)) for k, v in x.items()))
    if isinstance(x, list):
        return [_strip(v, tensors) for v in x]
    if type(x) is tuple:
        return tuple(_strip(v, tensors) for v in x)
    return x


def _fill(x: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`_strip`."""
    if type(x) is tuple and len(x) == 2 and x[0] == _MARK and isinstance(x[1], int):
        return tensors[x[1]]
    if isinstance(x, dict):
        return _like(x, ((k, _fill(v, tensors)) for k, v in x.items()))
    if isinstance(x, list):
        return [_fill(v, tensors) for v in x]
    if type(x) is tuple:
        return tuple(_fill(v, tensors) for v in x)
    return x


def _like(x: dict[Any, Any], items: Any) -> dict[Any, Any]:
    """A dict of ``items`` of ``x``'s kind: an OrderedDict keeps its attributes (a module's state_dict
    carries ``_metadata``, which ``load_state_dict`` reads), any other dict becomes a plain one."""
    if isinstance(x, OrderedDict):
        out: dict[Any, Any] = OrderedDict(items)
        out.__dict__.update(vars(x))
        return out
    return dict(items)
