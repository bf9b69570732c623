"""A ``DataLoader`` sampler that gives each rank its part of every epoch.

::

    sampler = phalanx.torch.DistributedSampler(dataset, seed=42)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=4,
                        multiprocessing_context=phalanx.torch.dataloader_context(4))
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)          # a new order each epoch, the same on every rank
        for x, y in loader: ...
"""

from __future__ import annotations

import multiprocessing
import operator
import sys
from collections.abc import Iterator, Sized
from multiprocessing.context import BaseContext
from typing import Any

import torch
from torch.utils.data import Sampler

from .. import _reconfigure
from .._data import check_remainder, partition, resolve_rank_size
from .._epochs import Epoch
from .._errors import InvalidArgumentError, UnsupportedArgumentError, UsageError
from .._world import backend, initialized

__all__ = ["DistributedSampler", "dataloader_context"]


class DistributedSampler(Sampler[int]):
    """A ``DataLoader`` sampler yielding this rank's part of each epoch's order of the dataset's indices.

    ::

        sampler = phalanx.torch.DistributedSampler(dataset, seed=42)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)        # a new order each epoch, the same on every rank

    Each epoch the indices ``0..N-1`` are permuted with
    ``torch.Generator().manual_seed(seed + epoch)`` (the same permutation on
    every rank) and rank ``r`` takes the ``r``-th *contiguous* part, exactly as
    :class:`phalanx.DistributedDataContainer` splits data (torch's sampler is
    strided; after a shuffle both are equally random, and contiguous parts keep
    ``shuffle=False`` reads sequential and concatenate back into dataset order).

    Arguments:
        dataset: anything with ``len()``.

    Order:
        shuffle: permute each epoch (default True); False keeps dataset order.
        seed: the permutation's seed (plus the epoch); the same on every rank.

    Splitting:
        remainder: when ``size`` does not divide N: ``"pad"`` (default:
            repeat from the start, every rank ceil(N/size) samples), ``"drop"``
            (floor(N/size) each) or ``"exact"`` (each sample once, sizes within
            one: for evaluation).
        rank, size: this rank's part; default the current world's, which the
            sampler then follows when :func:`phalanx.reform` re-forms it
            (:meth:`rebind`).

    ``len()`` is the number of indices the next ``iter()`` yields.
    ``state_dict()``/``load_state_dict()`` save and restore the epoch, the seed
    and the position in the epoch, so a resumed run continues mid-epoch with
    exactly the samples it had not seen; with ``pad``/``drop`` the state is the
    same on every rank, so rank 0's checkpoint serves them all.

    Raises:
        InvalidArgumentError: an unknown ``remainder``, or a rank outside ``size``.
        UnsupportedArgumentError: ``seed``, ``rank`` or ``size`` is not an int.
    """

    def __init__(self, dataset: Sized, *, shuffle: bool = True, seed: int = 0, remainder: str = "pad",
                 rank: int | None = None, size: int | None = None) -> None:
        super().__init__()
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = _int("seed", seed)
        self.remainder = check_remainder("torch.DistributedSampler", remainder)
        self.rank, self.size = resolve_rank_size("torch.DistributedSampler", rank, size)
        self.epoch = 0
        self._start = 0  # where the next iter() begins (set by load_state_dict)
        self._yielded = 0  # indices handed out so far in this epoch
        self._follows = rank is None and size is None  # the world's part: it follows a re-formed world
        if self._follows:
            _reconfigure.register(self)

    def rebind(self, epoch: Epoch) -> None:
        """Take this rank's part of the re-formed world ``epoch`` (:func:`phalanx.reform` calls it for a
        sampler made without ``rank=``/``size=``): its rank and size. The epoch's order is kept; the next
        ``iter()`` yields the new part of the current epoch from its start (a position within the old
        split means other samples in the new one). Local. UsageError for a sampler given ``rank=`` or
        ``size=``: make a new one for the new world."""
        if not self._follows:
            raise UsageError(
                f"phalanx.torch.DistributedSampler.rebind: this sampler was made with rank={self.rank}, "
                f"size={self.size} given, so it does not follow the re-formed world (rank {epoch.rank} of "
                f"{epoch.size}). Make a new sampler for it, or leave rank= and size= out to follow the world.")
        self.rank, self.size = epoch.rank, epoch.size
        self._start = self._yielded = 0

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next ``iter()`` on. Setting the epoch a resumed
        state is in keeps its position; any other epoch starts from its beginning."""
        epoch = _int("epoch", epoch)
        if epoch != self.epoch:
            self.epoch, self._start, self._yielded = epoch, 0, 0

    def epoch_indices(self) -> list[int]:
        """This rank's indices for the whole current epoch, in the order they are yielded."""
        n = len(self.dataset)
        positions = partition(n, self.rank, self.size, self.remainder)
        if not self.shuffle:
            return list(positions)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=generator).tolist()
        return [order[p] for p in positions]

    def __iter__(self) -> Iterator[int]:
        indices = self.epoch_indices()
        start, self._start = self._start, 0  # a resumed position is used once
        self._yielded = start
        return self._yield(indices[start:])

    def _yield(self, indices: list[int]) -> Iterator[int]:
        for i in indices:
            self._yielded += 1
            yield i

    def __len__(self) -> int:
        return len(partition(len(self.dataset), self.rank, self.size, self.remainder)) - self._start

    def state_dict(self, offset: int | None = None) -> dict[str, Any]:
        """The position to resume from. ``offset``: samples this rank has consumed in the epoch;
        by default the number the sampler has handed out, which is exact with ``num_workers=0``.
        Worker processes prefetch batches ahead of the training loop, so then pass
        ``offset=batches_done * batch_size``."""
        return {"epoch": self.epoch, "offset": self._yielded if offset is None else _int("offset", offset),
                "seed": self.seed, "shuffle": self.shuffle, "remainder": self.remainder,
                "size": self.size, "num_samples": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next ``iter()`` yields the rest of its epoch."""
        mine = self.state_dict()
        changed = {k: (state.get(k), mine[k]) for k in ("shuffle", "remainder", "size", "num_samples")
                   if state.get(k) != mine[k]}
        if changed:
            saved = ", ".join(f"{k}={a!r} (here {b!r})" for k, (a, b) in changed.items())
            raise InvalidArgumentError(
                f"phalanx.torch.DistributedSampler.load_state_dict: the state was saved with {saved}, so "
                "its position means other samples here. Resume with the same dataset, world size and "
                "sampler settings, or start the epoch afresh.")
        per_rank = len(partition(mine["num_samples"], self.rank, self.size, self.remainder))
        offset = _int("offset", state["offset"])
        if not 0 <= offset <= per_rank:
            raise InvalidArgumentError(f"phalanx.torch.DistributedSampler.load_state_dict: offset={offset} "
                                       f"is outside this rank's epoch of {per_rank} samples.")
        self.epoch = _int("epoch", state["epoch"])
        self.seed = _int("seed", state["seed"])
        self._start = self._yielded = offset

    def __repr__(self) -> str:
        return (f"DistributedSampler({len(self.dataset)} samples, rank {self.rank} of {self.size}, "
                f"epoch {self.epoch}, shuffle={self.shuffle}, seed={self.seed}, "
                f"remainder={self.remainder!r})")


def _int(name: str, value: Any) -> int:
    try:
        if not isinstance(value, bool):
            return operator.index(value)  # ints, NumPy and torch integers; not floats
    except TypeError:
        pass
    raise UnsupportedArgumentError(
        f"phalanx.torch.DistributedSampler: {name}={value!r} is a {type(value).__name__}; pass an int "
        f"(e.g. {name}=int(...)).")


def dataloader_context(num_workers: int = 1) -> BaseContext | None:
    """The ``multiprocessing_context`` for a DataLoader's worker processes: one that is safe under MPI.

    ::

        DataLoader(ds, num_workers=n, multiprocessing_context=phalanx.torch.dataloader_context(n))

    Arguments:
        num_workers: the DataLoader's ``num_workers``.

    Returns:
        A ``"forkserver"`` context (``"spawn"`` where there is none) when this
        process runs MPI: forking a process that has initialized MPI is unsafe
        (the child inherits the MPI library's threads, sockets and registered
        memory). ``None`` (torch's default) otherwise, and when
        ``num_workers == 0``, because DataLoader rejects a context without workers.

    With forkserver/spawn, the dataset, ``collate_fn`` and ``worker_init_fn``
    must be picklable (defined at module level), and every worker imports
    your script again: keep ``phalanx.init()`` and the training loop under
    ``if __name__ == "__main__":``, or each worker would start MPI too.
    """
    if num_workers == 0 or not _runs_mpi():
        return None
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # Workers fork from a server that has imported torch once: ~4 s to start them instead of ~11 s.
    context.set_forkserver_preload(["torch"])
    return context


def _runs_mpi() -> bool:
    if initialized():
        return backend().name == "mpi"
    mpi = sys.modules.get("mpi4py.MPI")  # MPI initialized by the user, without phalanx.init()
    return mpi is not None and bool(mpi.Is_initialized()) and not bool(mpi.Is_finalized())
