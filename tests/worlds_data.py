"""Test body for the data container, the sampler and DataLoader workers on real ranks.

Each behaviour is named (``behaviours.Behaviours``) and reported on its own.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import phalanx
from behaviours import Behaviours

DATA = Behaviours()


@DATA.behaviour("every-rank-is-in-the-world-asked-for-with-its-launched-rank")
def _(r: int, n: int, backend: str) -> None:
    assert phalanx.backend().name == backend and phalanx.size() == n, (phalanx.backend().name, phalanx.size())
    assert phalanx.allgather(np.int64(r)).tolist() == list(range(n))


def _container_split(r: int, n: int, backend: str, remainder: str) -> None:
    part = phalanx.DistributedDataContainer(list(range(10)), remainder=remainder)
    assert (part.rank, part.size) == (r, n)
    counts = phalanx.allgather(np.array([len(part)]))[:, 0].tolist()
    total = phalanx.allreduce(float(sum(part)))
    if remainder == "exact":
        assert sum(counts) == 10 and max(counts) - min(counts) <= 1 and total == 45.0, (counts, total)
    else:
        assert len(set(counts)) == 1, f"{remainder}: every rank the same length, got {counts}"


for _remainder in ("pad", "drop", "exact"):
    DATA.add(f"container-{_remainder}-splits-with-the-worlds-rank-and-size", _container_split, _remainder)


def _sampler() -> tuple[Any, Any]:
    """(11 samples valued 10 * index, a shuffling sampler over them)."""
    import torch
    from torch.utils.data import TensorDataset

    import phalanx.torch as pt

    dataset = TensorDataset(torch.arange(11) * 10)
    return dataset, pt.DistributedSampler(dataset, seed=3)


def _epoch_order(sampler: Any, epoch: int) -> list[int]:
    """Every rank's part of ``epoch``, in rank order; checked against the seeded permutation."""
    import torch

    sampler.set_epoch(epoch)
    order = phalanx.allgather(np.array(list(sampler))).reshape(-1).tolist()  # pad: every rank the same length
    perm = torch.randperm(11, generator=torch.Generator().manual_seed(3 + epoch)).tolist()
    assert order == [perm[i % 11] for i in range(len(order))], order
    return order


@DATA.behaviour("sampler-parts-tile-the-same-permutation-on-every-rank")
def _(r: int, n: int, backend: str) -> None:
    _epoch_order(_sampler()[1], 0)


@DATA.behaviour("sampler-new-order-each-epoch")
def _(r: int, n: int, backend: str) -> None:
    sampler = _sampler()[1]
    assert _epoch_order(sampler, 0) != _epoch_order(sampler, 1), "a new order each epoch"


@DATA.behaviour("dataloader-context-is-forkserver-under-mpi-else-none")
def _(r: int, n: int, backend: str) -> None:
    import phalanx.torch as pt

    context = pt.dataloader_context(2)
    if backend == "mpi":
        assert context is not None and context.get_start_method() == "forkserver", context
    else:
        assert context is None, context
    assert pt.dataloader_context(0) is None


@DATA.behaviour("dataloader-workers-read-exactly-the-samplers-indices")
def _(r: int, n: int, backend: str) -> None:
    from torch.utils.data import DataLoader

    import phalanx.torch as pt

    dataset, sampler = _sampler()
    sampler.set_epoch(5)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2,
                        multiprocessing_context=pt.dataloader_context(2))
    seen = [int(v) for (batch,) in loader for v in batch]
    sampler.set_epoch(5)
    assert seen == [10 * i for i in sampler.epoch_indices()], (seen, sampler.epoch_indices())
    assert len(seen) == math.ceil(11 / n), len(seen)


def data_world(backend: str, n: int) -> dict[str, str | None]:
    """The container, sampler and DataLoader workers with real ranks (``backend``/``n``: the world
    the test asked for)."""
    return DATA.run(phalanx.rank(), n, backend)
