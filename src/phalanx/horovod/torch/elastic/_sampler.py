"""``hvd.elastic.ElasticSampler``: a distributed sampler that resumes mid-epoch after a restart."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

import phalanx

from ...._errors import InvalidArgumentError

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Partitions a dataset across ranks and skips the samples already processed this epoch.

    Like ``DistributedSampler``, but it counts the samples processed (:meth:`record_batch`), so
    that a job restarted from a ``TorchState`` commit holding it continues the epoch where the
    commit left it, split over the ranks the new job has. Call :meth:`set_epoch` at the *end* of
    each epoch (it clears the count).

    Arguments:
        dataset: the dataset (of constant size).
        shuffle: shuffle the indices, the same way on every rank (default True).
        seed: the shuffle's seed, the same on every rank (default 0); epoch ``e`` uses ``seed + e``.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new shuffle, and no sample processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of ``batch_size`` samples as processed on every rank (call it on every rank)."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Any) -> None:
        """Count the samples of ``indices`` (this rank's batch) as processed on every rank."""
        self.processed_num += len(indices) * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "processed_num"}``: where the epoch stands (the same on every rank)."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s position, split over the current ranks."""
        try:
            self.epoch = int(state_dict["epoch"])
            self.processed_num = int(state_dict["processed_num"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"phalanx.horovod.torch.elastic.ElasticSampler.load_state_dict({state_dict!r}): expected "
                "{'epoch': int, 'processed_num': int}, as state_dict() returns.") from exc
        self.reset()

    def reset(self) -> None:
        """Recompute this rank's share of the samples not yet processed this epoch."""
        self.num_replicas = phalanx.size() if phalanx.initialized() else 1
        self.rank = phalanx.rank() if phalanx.initialized() else 0
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices[:]
        indices += indices[:self.total_size - len(indices)]  # pad to a multiple of the ranks
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
