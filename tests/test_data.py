"""Splitting data across ranks: the partition rules (in-process, explicit rank/size), the
container, the DataLoader sampler, and one multi-rank world per backend that checks the split
with real ranks and a DataLoader with worker processes (forkserver under MPI).
"""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
import pytest

import phalanx
import worlds_data as bodies
from conftest import world_params
from phalanx import DistributedDataContainer
from phalanx._data import partition

CASES = [(n, size) for n in range(8) for size in (1, 2, 3)]


def parts(n: int, size: int, remainder: str) -> list[list[int]]:
    return [list(partition(n, r, size, remainder)) for r in range(size)]


@pytest.mark.parametrize("n,size", CASES)
def test_pad_gives_every_rank_ceil_n_over_size_repeating_from_the_start(n: int, size: int) -> None:
    split = parts(n, size, "pad")
    per = math.ceil(n / size)
    assert [len(p) for p in split] == [per] * size
    flat = [i for p in split for i in p]
    assert flat == [i % n for i in range(per * size)] if n else flat == []  # contiguous, then wraps
    assert set(flat) == set(range(n)), "every sample at least once"


@pytest.mark.parametrize("n,size", CASES)
def test_drop_gives_every_rank_floor_n_over_size(n: int, size: int) -> None:
    split = parts(n, size, "drop")
    assert [len(p) for p in split] == [n // size] * size
    assert [i for p in split for i in p] == list(range(n // size * size)), "the tail is dropped"


@pytest.mark.parametrize("n,size", CASES)
def test_exact_covers_every_sample_once_sizes_within_one(n: int, size: int) -> None:
    split = parts(n, size, "exact")
    lengths = [len(p) for p in split]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
    assert [i for p in split for i in p] == list(range(n)), "rank order is dataset order"


def test_partition_examples_and_types() -> None:
    assert partition(5, 2, 3, "pad") == [4, 0]
    assert partition(1, 2, 3, "pad") == [0], "fewer samples than ranks is not an error"
    assert partition(10, 1, 3, "pad") == range(4, 8)
    assert partition(10, 2, 3, "exact") == range(7, 10)
    assert partition(2, 2, 3, "drop") == range(0)
    with pytest.raises(ValueError, match="remainder='even'"):
        partition(3, 0, 1, "even")


# -- the container --------------------------------------------------------------------------------

def test_container_indexes_iterates_and_reports_its_indices() -> None:
    data = [f"s{i}" for i in range(7)]
    part = DistributedDataContainer(data, rank=2, size=3)  # pad: [6, 0, 1]
    assert len(part) == 3 and part.indices == [6, 0, 1] and list(part) == ["s6", "s0", "s1"]
    assert part[0] == "s6" and part[-1] == "s1" and part[-3] == "s6" and part[np.int64(1)] == "s0"
    assert part[1:] == ["s0", "s1"]
    for bad in (3, -4):
        with pytest.raises(IndexError, match="rank 2 of 3 holds 3 of the 7 samples"):
            part[bad]
    with pytest.raises(TypeError, match="integers or slices"):
        part["0"]
    middle = DistributedDataContainer(data, rank=1, size=3, remainder="exact")
    assert middle.indices == range(3, 5) and list(middle) == ["s3", "s4"]
    empty = DistributedDataContainer([], rank=0, size=3)
    assert len(empty) == 0 and list(empty) == [] and "0 of 0 samples" in repr(empty)
    assert len(DistributedDataContainer(np.zeros((5, 2)), rank=1, size=2, remainder="drop")) == 2


def test_a_tuple_or_dict_of_arrays_is_split_by_sample() -> None:
    x, y = np.arange(10).reshape(5, 2), np.arange(5) * 10
    part = DistributedDataContainer((x, y), rank=1, size=2, remainder="exact")  # samples 3, 4
    assert len(part) == 2
    row, label = part[0]
    assert row.tolist() == [6, 7] and label == 30
    XY = namedtuple("XY", "x y")
    assert part.data[1] is y
    sample = DistributedDataContainer(XY(x, y), rank=0, size=1)[4]
    assert type(sample) is XY and sample.x.tolist() == [8, 9] and sample.y == 40
    columns = DistributedDataContainer({"x": x, "y": y}, rank=0, size=2)
    assert [d["y"] for d in columns] == [0, 10, 20]
    samples = DistributedDataContainer([x[0], x[1], x[2]], rank=0, size=3)  # a list is samples
    assert len(samples) == 1 and samples[0].tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"same first dimension.*list\(data\)"):
        DistributedDataContainer((x, y[:3]), rank=0, size=1)
    with pytest.raises(TypeError, match=r"has no len\(\).*list\(data\)"):
        DistributedDataContainer((1, 2, 3), rank=0, size=1)


def test_container_argument_errors() -> None:
    with pytest.raises(phalanx.NotInitializedError, match="DistributedDataContainer"):
        DistributedDataContainer([1, 2])  # rank/size from a world that does not exist
    with pytest.raises(phalanx.PhalanxError, match="remainder='even'.*'pad' or 'drop'.*'exact'"):
        DistributedDataContainer([1], remainder="even", rank=0, size=1)
    with pytest.raises(phalanx.PhalanxError, match="rank=3, size=3"):
        DistributedDataContainer([1], rank=3, size=3)
    with pytest.raises(TypeError, match="has no len"):
        DistributedDataContainer(iter([1]), rank=0, size=1)
    phalanx.init("local")
    try:
        part = DistributedDataContainer(list(range(3)))
        assert (part.rank, part.size, list(part)) == (0, 1, [0, 1, 2])
    finally:
        phalanx.shutdown()


# -- the sampler ------------------------------------------------------------------------------------

def test_sampler_shuffles_identically_on_every_rank_and_differently_per_epoch() -> None:
    torch = pytest.importorskip("torch")
    from phalanx.torch import DistributedSampler

    dataset = list(range(10))
    samplers = [DistributedSampler(dataset, seed=7, rank=r, size=3) for r in range(3)]
    assert isinstance(samplers[0], torch.utils.data.Sampler)
    epochs = []
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        split = [list(s) for s in samplers]
        assert [len(p) for p in split] == [4, 4, 4] and [len(s) for s in samplers] == [4, 4, 4]
        perm = torch.randperm(10, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
        assert [i for p in split for i in p] == [perm[i % 10] for i in range(12)], "contiguous parts"
        assert split[0] == list(samplers[0]), "the same epoch gives the same order again"
        epochs.append(split)
    assert epochs[0] != epochs[1] != epochs[2]
    plain = [DistributedSampler(dataset, shuffle=False, remainder=rem, rank=1, size=3)
             for rem in ("pad", "drop", "exact")]
    assert [list(s) for s in plain] == [[4, 5, 6, 7], [3, 4, 5], [4, 5, 6]], "like the container"
    with pytest.raises(ValueError, match="remainder="):
        DistributedSampler(dataset, remainder="wrap", rank=0, size=1)
    with pytest.raises(TypeError, match="seed"):
        DistributedSampler(dataset, seed=1.5, rank=0, size=1)


def test_sampler_state_resumes_mid_epoch() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from phalanx.torch import DistributedSampler

    dataset = list(range(23))
    full = DistributedSampler(dataset, seed=1, rank=1, size=2)
    full.set_epoch(4)
    whole = list(full)  # 12 samples
    run = DistributedSampler(dataset, seed=1, rank=1, size=2)
    run.set_epoch(4)
    it = iter(run)
    first = [next(it) for _ in range(5)]
    state = run.state_dict()
    assert state["epoch"] == 4 and state["offset"] == 5 and state["seed"] == 1
    resumed = DistributedSampler(dataset, seed=99, rank=1, size=2)
    resumed.load_state_dict(state)  # restores the seed too
    resumed.set_epoch(4)  # the usual loop calls set_epoch(epoch) again: the position stays
    assert len(resumed) == 7
    rest = list(resumed)
    assert first + rest == whole
    assert len(resumed) == 12 and list(resumed) == whole, "the next pass is a whole epoch again"
    resumed.load_state_dict(state)
    resumed.set_epoch(5)  # another epoch starts from its beginning
    assert len(list(resumed)) == 12 and resumed.state_dict()["offset"] == 12
    # Through a DataLoader (no workers: the sampler's count is exact).
    loader_sampler = DistributedSampler(dataset, seed=1, rank=1, size=2)
    loader_sampler.set_epoch(4)
    loader = iter(DataLoader(torch.tensor(dataset), batch_size=3, sampler=loader_sampler))
    got = [next(loader).tolist(), next(loader).tolist()]
    assert loader_sampler.state_dict()["offset"] == 6
    assert loader_sampler.state_dict(offset=3)["offset"] == 3, "an explicit offset (workers prefetch)"
    again = DistributedSampler(dataset, rank=1, size=2)
    again.load_state_dict(loader_sampler.state_dict())
    assert sum(got, []) + list(again) == whole
    # A state from another configuration means other samples: refused with the reason.
    with pytest.raises(phalanx.PhalanxError, match=r"size=2 \(here 3\)"):
        DistributedSampler(dataset, rank=1, size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples=23 \\(here 5\\)"):
        DistributedSampler(list(range(5)), rank=1, size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="offset=13"):
        DistributedSampler(dataset, rank=1, size=2).load_state_dict({**state, "offset": 13})


def test_dataloader_context_without_mpi_is_the_default() -> None:
    pytest.importorskip("torch")
    from phalanx.torch import dataloader_context

    assert dataloader_context(4) is None  # not initialized, no MPI here
    phalanx.init("local")
    try:
        assert dataloader_context(4) is None and dataloader_context(0) is None
    finally:
        phalanx.shutdown()


@pytest.mark.parametrize("behaviour", bodies.DATA.names)
@pytest.mark.parametrize("backend,n", world_params([("mpi", 2), ("gloo", 3)]))
def test_split_and_dataloader_workers_on_real_ranks(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.data_world, backend, n, behaviour, args=(backend, n), op_timeout=30)
