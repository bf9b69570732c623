"""The sharding layout, written once: ``n`` elements split in ``N`` equal chunks of ``k = ceil(n / N)``.

Every sharded path (``phalanx.jax``'s sharded optimizer state, the torch
engine's sharded buckets and its flat parameter shards) lays its elements end
to end and splits them the same way: rank ``r`` owns elements
``[r*k, (r+1)*k)`` of the whole padded to ``N * k``, so its real elements
are that range clipped to ``[0, n)`` (the last ranks' may be shorter or
empty). A parameter at ``offset`` with ``numel`` elements holds, on rank
``r``, the part of itself inside that range: ``(start, stop)`` of its own
flattened elements. Pure Python: no torch, jax or numpy (only phalanx's errors).

::

    >>> chunk_size(10, 3), padded_size(10, 3)        # 3 ranks, 10 elements: chunks of 4, padded to 12
    (4, 12)
    >>> [rank_range(10, 3, r) for r in range(3)]
    [(0, 4), (4, 8), (8, 10)]
    >>> offsets([3, 5, 2])                           # three parameters laid end to end
    [0, 3, 8]
    >>> param_bounds(3, 5, 10, 3)                    # the second parameter on each rank
    ((0, 1), (1, 5), (5, 5))
    >>> rank_bounds([0, 3, 8], [3, 5, 2], 10, 3, 2)  # rank 2's part of each parameter
    [(3, 3), (5, 5), (0, 2)]
"""

from __future__ import annotations

from collections.abc import Sequence

from ._errors import InvalidArgumentError

__all__ = ["chunk_size", "offsets", "padded_size", "param_bounds", "rank_bounds", "rank_range"]


def chunk_size(n: int, ranks: int, *, minimum: int = 0) -> int:
    """The elements each of ``ranks`` ranks owns of ``n``: ``k = max(minimum, ceil(n / ranks))``.

    Arguments:
        n: the elements split (non-negative).
        ranks: the ranks they are split across (at least 1).
        minimum: the least ``k``; ``1`` gives an empty whole (``n = 0``) chunks of one element,
            for callers that always move a non-empty buffer.

    Returns:
        ``k``, so that ``ranks * k >= n``.
    """
    if ranks < 1:
        raise InvalidArgumentError(f"phalanx._layout.chunk_size(n={n}, ranks={ranks}): a layout splits elements "
                                   "across at least 1 rank; pass the world's (or group's) size.")
    return max(minimum, -(-n // ranks))


def padded_size(n: int, ranks: int, *, minimum: int = 0) -> int:
    """``n`` padded to ``ranks`` equal chunks: ``ranks * chunk_size(n, ranks, minimum=minimum)``.

    Arguments:
        n: the elements split (non-negative).
        ranks: the ranks they are split across (at least 1).
        minimum: the least chunk size, as for :func:`chunk_size`.

    Returns:
        the smallest multiple of ``ranks`` at least ``n`` (with ``minimum=1``: at least ``ranks``).
    """
    return ranks * chunk_size(n, ranks, minimum=minimum)


def rank_range(n: int, ranks: int, rank: int) -> tuple[int, int]:
    """The elements ``[start, stop)`` of ``n`` that ``rank`` owns: ``[r*k, (r+1)*k)`` clipped to ``[0, n)``.

    Arguments:
        n: the elements split (non-negative). On a whole already padded (``n = padded_size(...)``)
            the range is the unclipped chunk ``[r*k, (r+1)*k)``.
        ranks: the ranks they are split across (at least 1).
        rank: the rank, ``0 <= rank < ranks``.

    Returns:
        ``(start, stop)`` with ``start <= stop``; empty (``start == stop == n``) for a rank past the
        end. The same for either ``minimum`` of :func:`chunk_size`: the ranks' ranges cover
        ``[0, n)`` exactly once, in rank order.
    """
    k = chunk_size(n, ranks)
    return min(rank * k, n), min((rank + 1) * k, n)


def offsets(numels: Sequence[int]) -> list[int]:
    """Where each of the parameters (``numels``, in order) starts when they are laid end to end.

    Arguments:
        numels: each parameter's number of elements.

    Returns:
        one offset per parameter: ``0``, then the running sum of the ``numels`` before it.
    """
    out, at = [], 0
    for m in numels:
        out.append(at)
        at += m
    return out


def _part(start: int, stop: int, offset: int, numel: int) -> tuple[int, int]:
    """The part of the parameter ``[offset, offset + numel)`` inside ``[start, stop)``, in its own elements."""
    a = min(max(start - offset, 0), numel)
    return a, max(a, min(max(stop - offset, 0), numel))


def param_bounds(offset: int, numel: int, n: int, ranks: int) -> tuple[tuple[int, int], ...]:
    """Every rank's ``(start, stop)`` of one parameter's flattened elements, in rank order.

    Arguments:
        offset: where the parameter starts in the whole (see :func:`offsets`).
        numel: its number of elements (``offset + numel <= n``).
        n: the elements of the whole, all parameters together.
        ranks: the ranks the whole is split across (at least 1).

    Returns:
        ``ranks`` pairs ``(start, stop)``, ``0 <= start <= stop <= numel``: the part of the
        parameter inside each rank's :func:`rank_range`; they cover ``[0, numel)`` once, in order.
    """
    return tuple(_part(*rank_range(n, ranks, r), offset, numel) for r in range(ranks))


def rank_bounds(offsets: Sequence[int], numels: Sequence[int], n: int, ranks: int,
                rank: int) -> list[tuple[int, int]]:
    """``rank``'s ``(start, stop)`` of each parameter's flattened elements: its part of each parameter.

    Arguments:
        offsets: where each parameter starts in the whole (see :func:`offsets`).
        numels: each parameter's number of elements, in the same order.
        n: the elements of the whole, all parameters together.
        ranks: the ranks the whole is split across (at least 1).
        rank: the rank, ``0 <= rank < ranks``.

    Returns:
        one pair per parameter, ``param_bounds(offset, numel, n, ranks)[rank]`` for each.
    """
    start, stop = rank_range(n, ranks, rank)
    return [_part(start, stop, off, m) for off, m in zip(offsets, numels, strict=True)]
