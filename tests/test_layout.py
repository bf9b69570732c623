"""phalanx._layout, the one sharding layout: chunk sizes, padding, each rank's range and per-parameter bounds."""

from __future__ import annotations

import doctest
import itertools

import pytest

import phalanx
from phalanx import _layout
from phalanx._layout import chunk_size, offsets, padded_size, param_bounds, rank_bounds, rank_range

RANKS = (1, 2, 3)
TOTALS = (0, 1, 2, 3, 5, 7, 10, 12)  # n = 0, n < N, n divisible by N and not


def test_module_docstring_example_runs() -> None:
    failed, tried = doctest.testmod(_layout, raise_on_error=False)
    assert tried > 0 and failed == 0


@pytest.mark.parametrize(("n", "ranks", "k"), [
    (10, 3, 4), (9, 3, 3), (7, 2, 4), (2, 3, 1), (1, 3, 1), (5, 1, 5), (0, 1, 0), (0, 3, 0)])
def test_chunk_size_is_ceil_of_n_over_ranks(n: int, ranks: int, k: int) -> None:
    assert chunk_size(n, ranks) == k


@pytest.mark.parametrize("ranks", RANKS)
def test_chunk_size_minimum_one_only_changes_an_empty_total(ranks: int) -> None:
    assert chunk_size(0, ranks, minimum=1) == 1
    assert padded_size(0, ranks, minimum=1) == ranks
    for n in TOTALS[1:]:
        assert chunk_size(n, ranks, minimum=1) == chunk_size(n, ranks)


def test_chunk_size_refuses_zero_ranks() -> None:
    with pytest.raises(phalanx.InvalidArgumentError, match="ranks"):
        chunk_size(4, 0)


@pytest.mark.parametrize(("n", "ranks", "padded"), [
    (10, 3, 12), (9, 3, 9), (7, 2, 8), (2, 3, 3), (5, 1, 5), (0, 2, 0), (0, 1, 0)])
def test_padded_size_is_the_smallest_multiple_of_ranks_at_least_n(n: int, ranks: int, padded: int) -> None:
    assert padded_size(n, ranks) == padded == ranks * chunk_size(n, ranks)


def test_rank_range_clips_the_last_chunks_to_the_total() -> None:
    assert [rank_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert [rank_range(2, 3, r) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]  # n < N: the last is empty
    assert [rank_range(0, 2, r) for r in range(2)] == [(0, 0), (0, 0)]
    assert rank_range(5, 1, 0) == (0, 5)


def test_rank_range_of_a_padded_total_is_the_unclipped_chunk() -> None:
    k = chunk_size(10, 3)
    assert [rank_range(padded_size(10, 3), 3, r) for r in range(3)] == [(r * k, (r + 1) * k) for r in range(3)]
    assert [rank_range(padded_size(0, 2, minimum=1), 2, r) for r in range(2)] == [(0, 1), (1, 2)]


@pytest.mark.parametrize(("n", "ranks"), list(itertools.product(TOTALS, RANKS)))
def test_rank_ranges_cover_the_total_once_in_rank_order(n: int, ranks: int) -> None:
    ranges = [rank_range(n, ranks, r) for r in range(ranks)]
    owners = [r for r, (lo, hi) in enumerate(ranges) for _ in range(lo, hi)]
    assert len(owners) == n  # every element once: no gap, no overlap
    assert owners == sorted(owners)
    assert all(lo <= hi and hi - lo <= chunk_size(n, ranks) for lo, hi in ranges)


def test_offsets_lay_parameters_end_to_end() -> None:
    assert offsets([3, 5, 2]) == [0, 3, 8]
    assert offsets([0, 4, 0, 1]) == [0, 0, 4, 4]
    assert offsets([]) == []


def _concatenated(numels: list[int]) -> list[tuple[int, int]]:
    """The whole as (parameter, element) pairs: parameter i's elements, end to end."""
    return [(i, e) for i, m in enumerate(numels) for e in range(m)]


@pytest.mark.parametrize("numels", [[3, 5, 2], [1], [4, 0, 3], [0], [2, 2, 2, 2, 1], [7, 1]])
@pytest.mark.parametrize("ranks", RANKS)
def test_param_bounds_agree_with_slicing_the_concatenated_parameters(numels: list[int], ranks: int) -> None:
    whole, n = _concatenated(numels), sum(numels)
    for i, (off, m) in enumerate(zip(offsets(numels), numels, strict=True)):
        bounds = param_bounds(off, m, n, ranks)
        assert len(bounds) == ranks
        for r, (a, b) in enumerate(bounds):
            lo, hi = rank_range(n, ranks, r)
            assert [(i, e) for e in range(a, b)] == [x for x in whole[lo:hi] if x[0] == i]
        assert [e for a, b in bounds for e in range(a, b)] == list(range(m))  # the parameter, once, in order


@pytest.mark.parametrize("numels", [[3, 5, 2], [4, 0, 3], [0], [2, 2, 2, 2, 1]])
@pytest.mark.parametrize("ranks", RANKS)
def test_rank_bounds_are_each_parameters_bounds_on_that_rank(numels: list[int], ranks: int) -> None:
    n, offs = sum(numels), offsets(numels)
    for r in range(ranks):
        assert rank_bounds(offs, numels, n, ranks, r) == [param_bounds(o, m, n, ranks)[r]
                                                          for o, m in zip(offs, numels, strict=True)]


def test_param_bounds_example_with_a_parameter_across_two_ranks() -> None:
    # 10 elements on 3 ranks (chunks [0,4) [4,8) [8,10)); the parameter at 3 with 5 elements spans ranks 0 and 1
    assert param_bounds(3, 5, 10, 3) == ((0, 1), (1, 5), (5, 5))
    assert rank_bounds([0, 3, 8], [3, 5, 2], 10, 3, 0) == [(0, 3), (0, 1), (0, 0)]


def test_bounds_on_one_rank_hold_the_whole_parameter() -> None:
    assert param_bounds(4, 6, 12, 1) == ((0, 6),)
    assert rank_bounds([0, 4], [4, 6], 10, 1, 0) == [(0, 4), (0, 6)]


def test_bounds_of_an_empty_total_are_empty_on_every_rank() -> None:
    assert param_bounds(0, 0, 0, 3) == ((0, 0), (0, 0), (0, 0))
    assert rank_bounds([0, 0], [0, 0], 0, 2, 1) == [(0, 0), (0, 0)]
