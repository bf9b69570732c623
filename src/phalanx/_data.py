"""Split a dataset across ranks: every rank sees one contiguous part of it.

::

    train = phalanx.DistributedDataContainer(train_set)            # remainder="pad" (default)
    x, y = phalanx.DistributedDataContainer((X, Y))[0]             # a tuple of arrays splits by sample
    val = phalanx.DistributedDataContainer(val_set, remainder="exact")

``remainder`` says what happens when ``size()`` does not divide the number of
samples N (and it is never an error, not even for N < ``size()``):

* ``"pad"`` (training): every rank gets ceil(N/size) samples; the last parts
  are filled up by repeating samples from the start. Every rank takes the
  same number of steps, and every sample is seen at least once.
* ``"drop"`` (training): every rank gets floor(N/size) samples; the last
  N mod size samples are not used.
* ``"exact"`` (evaluation): every sample exactly once; part sizes differ by
  at most one, so ranks take different numbers of steps. Make no collective
  per batch; reduce sums and counts once at the end, e.g.
  ``total, count = phalanx.allreduce(np.array([loss_sum, n_samples]))`` and
  ``mean = total / count`` (a mean of per-rank means would weight ranks wrongly).

Parts are contiguous and in rank order: rank 0 holds the first part, so
concatenating the ranks' outputs in rank order gives the dataset order.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ._arrays import UnsupportedArgumentError
from ._errors import InvalidArgumentError
from ._layout import chunk_size
from ._world import current

__all__ = ["REMAINDERS", "DistributedDataContainer", "partition", "resolve_rank_size"]

REMAINDERS = ("pad", "drop", "exact")


def partition(n: int, rank: int, size: int, remainder: str = "pad") -> range | list[int]:
    """The indices into ``range(n)`` that rank ``rank`` of ``size`` holds (see module docstring).

    A ``range`` when the part is contiguous, a ``list`` when ``pad`` wraps
    around to the start: ``partition(5, 2, 3)`` is ``[4, 0]``.
    """
    if remainder == "pad":
        if n == 0:
            return range(0)
        per = chunk_size(n, size)  # ceil(n / size): the layout's chunk (phalanx._layout)
        start = rank * per
        if start + per <= n:
            return range(start, start + per)
        return [(start + i) % n for i in range(per)]
    if remainder == "drop":
        per = n // size
        return range(rank * per, (rank + 1) * per)
    if remainder == "exact":
        per, extra = divmod(n, size)
        start = rank * per + min(rank, extra)
        return range(start, start + per + (rank < extra))
    raise InvalidArgumentError(f"remainder={remainder!r}: use one of {', '.join(map(repr, REMAINDERS))}")


def resolve_rank_size(call: str, rank: int | None, size: int | None) -> tuple[int, int]:
    """``(rank, size)``: the given ones, validated; missing ones from the initialized world."""
    if rank is None or size is None:
        world = current(call)
        rank = world.rank if rank is None else rank
        size = world.size if size is None else size
    bad = UnsupportedArgumentError(f"phalanx.{call}: rank={rank!r} and size={size!r} must be ints, e.g. "
                                   "rank=0, size=2 (or leave them out for the world's).")
    if isinstance(rank, bool) or isinstance(size, bool):
        raise bad
    try:
        rank, size = operator.index(rank), operator.index(size)
    except TypeError:
        raise bad from None
    if size < 1 or not 0 <= rank < size:
        raise InvalidArgumentError(f"phalanx.{call}: rank={rank}, size={size} is not a rank of a "
                                   "world (need size >= 1 and 0 <= rank < size).")
    return rank, size


def check_remainder(call: str, remainder: Any) -> str:
    if remainder not in REMAINDERS:
        raise InvalidArgumentError(
            f"phalanx.{call}: remainder={remainder!r} is not a policy; use 'pad' or 'drop' for training "
            "(every rank the same number of samples) or 'exact' for evaluation (every sample once).")
    return remainder


class _Columns:
    """A tuple (or dict) of equally long arrays, indexed by sample: item ``i`` is the ``i``-th rows."""

    def __init__(self, columns: tuple[Any, ...] | Mapping[Any, Any]) -> None:
        self.columns = columns
        items = list(columns.items()) if isinstance(columns, Mapping) else list(enumerate(columns))
        lengths = {}
        for key, column in items:
            try:
                lengths[key] = len(column)
            except TypeError:
                raise UnsupportedArgumentError(
                    f"phalanx.DistributedDataContainer: a {type(columns).__name__} is split by sample, as "
                    f"columns of equal length, but element {key!r} ({type(column).__name__}) has no len(). "
                    "To split the elements themselves, pass `list(data)`.") from None
        if len(set(lengths.values())) > 1:
            raise InvalidArgumentError(
                f"phalanx.DistributedDataContainer: a {type(columns).__name__} is split by sample, so its "
                f"arrays need the same first dimension; got lengths {lengths}. To split the elements "
                "themselves, pass `list(data)`.")
        self.length = next(iter(lengths.values()), 0)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        c = self.columns
        if isinstance(c, Mapping):
            return {k: v[i] for k, v in c.items()}
        if hasattr(type(c), "_fields"):  # a namedtuple keeps its type
            return type(c)(*(v[i] for v in c))
        return tuple(v[i] for v in c)


class DistributedDataContainer(Sequence[Any]):
    """This rank's contiguous part of ``data``, as a read-only sequence; rank 0 holds the first part.

    ::

        train = phalanx.DistributedDataContainer(train_set)                 # remainder="pad"
        x, y = phalanx.DistributedDataContainer((X, Y))[0]                  # split by sample
        val = phalanx.DistributedDataContainer(val_set, remainder="exact")

    Arguments:
        data: anything with ``len()`` and integer indexing (a list, a NumPy array, a
            torch ``Dataset``), or a tuple/dict of equally long arrays, which is split
            by sample (``container[i]`` is then a tuple/dict of rows).
        remainder: what happens when ``size`` does not divide the N samples (never an
            error, even for N < size): ``"pad"`` (training; every rank gets
            ceil(N/size) samples, the last parts repeat samples from the start),
            ``"drop"`` (training; floor(N/size) each, the last N mod size unused) or
            ``"exact"`` (evaluation; every sample once, part sizes differ by at most
            one, so make no collective per batch: reduce sums and counts at the end).
        rank, size: default to ``phalanx.rank()``/``phalanx.size()``.

    Supports ``len()``, indexing (negative too; a slice gives a list), iteration, and
    ``.indices`` (positions in ``data``: a ``range``, or a ``list`` when ``pad``
    wraps around). Raises InvalidArgumentError (unknown remainder, columns of
    different lengths, rank/size out of range), UnsupportedArgumentError (data
    without ``len()``, non-int rank/size or index), NotInitializedError (rank/size
    left out before ``phalanx.init()``).
    """

    def __init__(self, data: Any, *, remainder: str = "pad", rank: int | None = None,
                 size: int | None = None) -> None:
        self.remainder = check_remainder("DistributedDataContainer", remainder)
        self.rank, self.size = resolve_rank_size("DistributedDataContainer", rank, size)
        self.data = data
        self._source = _Columns(data) if isinstance(data, (tuple, Mapping)) else data
        try:
            n = len(self._source)
        except TypeError:
            raise UnsupportedArgumentError(
                f"phalanx.DistributedDataContainer: {type(data).__name__} has no len(); pass a sequence, "
                "an array or a map-style Dataset (an iterable dataset must split itself).") from None
        self.num_total = n
        self._indices = partition(n, self.rank, self.size, self.remainder)

    @property
    def indices(self) -> range | list[int]:
        """The positions in ``data`` this rank holds, in order."""
        return self._indices

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._source[j] for j in self._indices[i]]
        try:
            k = operator.index(i)
        except TypeError:
            raise UnsupportedArgumentError(f"phalanx.DistributedDataContainer[{i!r}]: indices must be "
                                           f"integers or slices, not {type(i).__name__}.") from None
        n = len(self._indices)
        if not -n <= k < n:
            raise IndexError(f"phalanx.DistributedDataContainer index {k} is out of range: rank "
                             f"{self.rank} of {self.size} holds {n} of the {self.num_total} samples")
        return self._source[self._indices[k]]

    def __iter__(self) -> Iterator[Any]:
        source = self._source
        for j in self._indices:
            yield source[j]

    def __repr__(self) -> str:
        return (f"DistributedDataContainer({len(self)} of {self.num_total} samples, rank {self.rank} of "
                f"{self.size}, remainder={self.remainder!r})")
