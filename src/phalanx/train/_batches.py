"""The order in which :func:`phalanx.train.fit` visits samples: global batches, independent of the world size.

Each epoch ``e`` the sample indices are permuted once, the same way on every
rank (``torch.Generator().manual_seed(seed + e)``). The permuted order is cut
into *global* micro-batches of ``G = batch_size x ranks x replicas`` samples;
micro-batch ``s`` is ``order[start + s*G : start + (s+1)*G]`` and rank ``r``
takes its ``r``-th contiguous part. So:

- the samples of global step ``s`` are the same at any world size (1 process
  with ``batch_size=64`` sees what 2 processes with ``batch_size=32`` see
  together), which is what makes N-rank training equal 1-rank training;
- the position in an epoch is one number, the samples consumed
  (``start + s*G``), which means the same thing at any world size: a
  checkpoint written at N workers resumes at M workers on the next unseen
  sample;
- a trailing part of the epoch smaller than one global batch is dropped, so
  every rank runs the same number of steps.

The sampler yields ``(epoch, index)`` pairs; :class:`SeededSamples` turns
them into ``dataset[index]`` with the random number generators seeded from
``(seed, epoch, index)``, so random augmentation gives the same result for a
sample whatever the worker count, the DataLoader worker that loads it, or a
resume in the middle of the epoch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

__all__ = ["GlobalBatches", "SeededSamples", "epoch_order"]


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The order of the sample indices ``0..n-1`` in ``epoch`` (the same on every rank)."""
    if not shuffle:
        return list(range(n))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator).tolist()


class GlobalBatches(Sampler[list[Any]]):
    """Batch sampler: this rank's ``local`` indices of each global micro-batch of ``local * parts``.

    ``parts`` is the number of workers (ranks x replicas); this rank holds
    parts ``first .. first + local // per_part - 1`` (the replicas of one
    process are consecutive parts). ``start`` is the number of samples of
    the epoch already consumed (a resumed position).
    """

    def __init__(self, n: int, *, local: int, parts_before: int, total: int, epoch: int, seed: int,
                 shuffle: bool, start: int = 0) -> None:
        super().__init__()
        self.n, self.local, self.before, self.total = n, local, parts_before, total
        self.epoch, self.seed, self.shuffle, self.start = epoch, seed, shuffle, start

    def __len__(self) -> int:
        return max(0, (self.n - self.start) // self.total)

    def __iter__(self) -> Iterator[list[Any]]:
        order = epoch_order(self.n, self.epoch, self.seed, self.shuffle)
        for s in range(len(self)):
            lo = self.start + s * self.total + self.before
            yield [(self.epoch, i) for i in order[lo:lo + self.local]]


class SeededSamples(Dataset[Any]):
    """``dataset[index]`` for ``(epoch, index)`` keys, with torch/NumPy/``random`` seeded per sample."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        """A batch of samples (DataLoader fetches whole batches this way): the random states are
        saved and restored once per batch, and seeded for each sample."""
        # The CPU generator itself: torch.manual_seed would also queue a CUDA seeding that records a
        # stack trace (about 1 ms a sample). Data pipelines draw from the CPU generator.
        cpu = torch.default_generator
        torch_state, np_state, py_state = cpu.get_state(), np.random.get_state(), random.getstate()
        try:
            samples = []
            for epoch, index in keys:
                s = _mix(self.seed, epoch, index)
                cpu.manual_seed(s)
                np.random.seed(s & 0xFFFFFFFF)
                random.seed(s)
                samples.append(self.dataset[index])
            return samples
        finally:  # the training loop's own random streams are not disturbed
            cpu.set_state(torch_state)
            np.random.set_state(np_state)
            random.setstate(py_state)


def _mix(seed: int, epoch: int, index: int) -> int:
    """A 61-bit mix of (seed, epoch, index): distinct samples get unrelated streams."""
    s = seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB
    return (s ^ (s >> 31)) & ((1 << 61) - 1)


def sized(call: str, name: str, data: Any) -> Any:
    """``data`` as a map-style dataset: a tuple of equally long arrays/tensors is split by sample."""
    from .._data import _Columns
    from .._errors import InvalidArgumentError

    if isinstance(data, tuple) and data and all(hasattr(c, "shape") and len(c.shape) for c in data):
        return _Columns(data)  # (X, Y): sample i is (X[i], Y[i]), as DistributedDataContainer does
    if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
        raise InvalidArgumentError(
            f"phalanx.train.{call}({name}={type(data).__name__}): give a map-style dataset (with len() and "
            "indexing), e.g. a torch Dataset, a list of (input, target) pairs, or a tuple of tensors "
            "(X, Y) split by sample.")
    return data
