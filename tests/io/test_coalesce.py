"""osdpipe.io.coalesce: which byte ranges of one object are fetched as one request."""

from __future__ import annotations

import random

import pytest

from osdpipe.io.coalesce import Span, coalesce


def test_ranges_back_to_back_are_one_request_up_to_max_bytes() -> None:
    ranges = [(i * 100, 100) for i in range(10)]
    assert coalesce(ranges, max_gap=0, max_bytes=400) == [
        Span(0, 400, (0, 1, 2, 3)),
        Span(400, 800, (4, 5, 6, 7)),
        Span(800, 1000, (8, 9)),
    ]


def test_a_small_gap_is_fetched_a_large_one_starts_another_request() -> None:
    ranges = [(0, 100), (150, 100), (600, 100)]
    assert coalesce(ranges, max_gap=50, max_bytes=10_000) == [Span(0, 250, (0, 1)), Span(600, 700, (2,))]
    assert coalesce(ranges, max_gap=49, max_bytes=10_000) == [
        Span(0, 100, (0,)),
        Span(150, 250, (1,)),
        Span(600, 700, (2,)),
    ]
    assert coalesce(ranges, max_gap=500, max_bytes=10_000) == [Span(0, 700, (0, 1, 2))]


def test_order_of_asking_does_not_matter_members_name_the_input_ranges() -> None:
    ranges = [(300, 100), (0, 100), (100, 200)]
    assert coalesce(ranges, max_gap=0, max_bytes=1000) == [Span(0, 400, (1, 2, 0))]


def test_overlaps_and_repeats_join_a_long_range_stands_alone() -> None:
    ranges = [(0, 100), (50, 100), (50, 100), (200, 5000), (5200, 10)]
    assert coalesce(ranges, max_gap=100, max_bytes=1000) == [
        Span(0, 150, (0, 1, 2)),
        Span(200, 5200, (3,)),
        Span(5200, 5210, (4,)),
    ]


def test_empty_ranges_fetch_nothing_and_bad_bounds_are_refused() -> None:
    assert coalesce([(10, 0), (0, 0)], max_gap=0, max_bytes=10) == []
    assert coalesce([], max_gap=0, max_bytes=10) == []
    with pytest.raises(ValueError, match="max_gap"):
        coalesce([(0, 1)], max_gap=-1, max_bytes=10)
    with pytest.raises(ValueError, match="max_bytes"):
        coalesce([(0, 1)], max_gap=0, max_bytes=0)


@pytest.mark.parametrize("seed", range(20))
def test_every_range_is_covered_once_and_the_bounds_hold(seed: int) -> None:
    rng = random.Random(seed)
    ranges = [(rng.randrange(0, 5000), rng.randrange(0, 300)) for _ in range(60)]
    max_gap, max_bytes = rng.randrange(0, 200), rng.randrange(1, 1500)
    spans = coalesce(ranges, max_gap, max_bytes)
    members = [i for s in spans for i in s.members]
    assert sorted(members) == [i for i, (_, n) in enumerate(ranges) if n > 0]
    for span in spans:
        assert span.length <= max_bytes or len(span.members) == 1
        for i in span.members:
            start, length = ranges[i]
            assert span.start <= start and start + length <= span.stop
        assert span.start == min(ranges[i][0] for i in span.members)
        assert span.stop == max(sum(ranges[i]) for i in span.members)
    assert all(a.start <= b.start for a, b in zip(spans, spans[1:]))  # in the order of their starts
    # a request ends where the next range could not join it: too far, or the request would grow too long
    for a, b in zip(spans, spans[1:]):
        first = ranges[b.members[0]]
        assert first[0] - a.stop > max_gap or max(a.stop, sum(first)) - a.start > max_bytes
