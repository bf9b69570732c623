"""How the gradient engine lays parameters out into buckets, once, at construction.

::

    buckets, bucket_of, views = lay_out(params, cap_mb=25, first_mb=1.0, wire_dtype=None)
    views[i]                  # parameter i's gradient: a view into buckets[bucket_of[i]].flat

Parameters go in reverse order (autograd makes their gradients roughly in
that order), one run of buckets per (dtype, device); the first bucket of each
run closes at ``min(first_mb, cap_mb)`` so communication starts early, the
others at ``cap_mb``. Buckets are numbered in the order their runs opened.
Each flat buffer holds the gradients, one presence slot per parameter and one
non-finite flag (:class:`~._bucket_hot.Bucket`); a 16-bit copy is made for
``wire_dtype`` unless the gradients are 16-bit already. With ``pad`` (sharding
over ``pad`` ranks) each flat buffer is padded to ``pad`` equal chunks, the
layout of :mod:`phalanx._layout` (:func:`~phalanx._layout.padded_size`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._layout import padded_size
from ._bucket_hot import Bucket

__all__ = ["lay_out"]

_Key = tuple[torch.dtype, torch.device]


def lay_out(params: Sequence[torch.Tensor], *, cap_mb: float, first_mb: float,
            wire_dtype: torch.dtype | None, pad: int | None = None) -> tuple[list[Bucket], list[int], list[torch.Tensor]]:
    """The buckets of ``params``, the bucket of each parameter, and each parameter's gradient view.

    ``pad`` (a reduce-scatter over ``pad`` ranks): each flat buffer holds only the gradients,
    zero-padded to a multiple of ``pad``; its presence slots and flag are a separate ``tail``; and
    its memory is not allocated until the engine first writes it (:meth:`Bucket.revive`); and a
    parameter of at least ``cap_mb`` starts a bucket of its own."""
    groups: dict[_Key, list[int]] = {}
    sizes: dict[_Key, int] = {}
    made: dict[_Key, int] = {}
    closed: list[tuple[int, list[int]]] = []  # (order of opening, indices)
    opened: dict[_Key, int] = {}
    serial = 0
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        if pad is not None and groups.get(key) and nbytes >= cap_mb * 2**20:
            closed.append((opened[key], groups.pop(key)))  # a parameter of a bucket's size gets its own:
            made[key] = made.get(key, 0) + 1  # the sharding reducer then reduces its gradient in place
        if key not in groups:
            groups[key], sizes[key], opened[key] = [], 0, serial
            serial += 1
        groups[key].append(i)
        sizes[key] += p.numel() * p.element_size()
        limit = (min(first_mb, cap_mb) if made.get(key, 0) == 0 else cap_mb) * 2**20
        if sizes[key] >= limit:
            closed.append((opened[key], groups.pop(key)))
            made[key] = made.get(key, 0) + 1
    closed.extend((opened[k], g) for k, g in groups.items())
    closed.sort(key=lambda t: t[0])
    buckets: list[Bucket] = []
    bucket_of = [0] * len(params)
    views: list[torch.Tensor] = [torch.empty(0)] * len(params)
    for b, (_, indices) in enumerate(closed):
        first = params[indices[0]]
        numel = sum(params[i].numel() for i in indices)
        if pad is not None:  # views need a tensor of the full size; empty() touches no memory before release
            flat = torch.empty(padded_size(numel, pad), dtype=first.dtype, device=first.device)
            tail = torch.zeros(len(indices) + 1, dtype=first.dtype, device=first.device)
        else:
            flat, tail = torch.zeros(numel + len(indices) + 1, dtype=first.dtype, device=first.device), None
        offset = 0
        for i in indices:
            p = params[i]
            views[i] = flat[offset:offset + p.numel()].view(p.shape)
            bucket_of[i] = b
            offset += p.numel()
        compress = wire_dtype is not None and first.dtype.itemsize > 2
        wire = torch.empty(flat.numel(), dtype=wire_dtype, device=first.device) if compress else None
        buckets.append(Bucket(indices, flat, numel, wire, tail))
        if pad is not None:
            buckets[-1].release()
    return buckets, bucket_of, views
