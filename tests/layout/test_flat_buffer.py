"""The one flat-buffer mechanism (osdpipe.layout.flat_buffer) that FSDP1's flat parameters, ZeRO's partitions and
Megatron's buckets are laid out by: every element of every entry in exactly one rank's slice, where the alignment and
the padding put it, and found again from the other side."""

from __future__ import annotations

import pytest

from osdpipe.layout.flat_buffer import held_by, held_in, pack, rank_slice, segments


def test_entries_start_aligned_and_the_end_is_padded_to_the_multiple() -> None:
    buffer = pack([("a", 5), ("b", 70), ("c", 3)], align=64, multiple=256)
    assert buffer.entries == (("a", 0, 5), ("b", 64, 134), ("c", 192, 195))
    assert (buffer.data_end, buffer.numel) == (195, 256)
    gaps = pack([("a", 5), ("b", 6)], gaps=[3, 1], multiple=4)
    assert gaps.entries == (("a", 0, 5), ("b", 8, 14)) and (gaps.data_end, gaps.numel) == (15, 16)
    closed = pack([("a", 5)], align=64, data_end=64, multiple=128)
    assert (closed.data_end, closed.numel) == (64, 128)


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("align", [1, 8, 64])
def test_every_element_is_in_exactly_one_slice_and_found_again(parts: int, align: int) -> None:
    sizes = [("a", 37), ("b", 1), ("c", 130), ("d", 9)]
    buffer = pack(sizes, align=align, multiple=parts)
    slices = {r: rank_slice(buffer, parts, r) for r in range(parts)}
    held = held_by((r, segments(buffer, lo, hi)) for r, (lo, hi, _) in slices.items())
    for name, numel in sizes:
        covered = [(p.start, p.start + p.length) for p in held[name]]
        assert covered[0][0] == 0 and covered[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), f"{name}: gaps or overlaps {covered}"
        start = dict((n, s) for n, s, _ in buffer.entries)[name]
        for p in held[name]:  # where the slice holds it is where the buffer put it
            lo = slices[p.where][0]
            assert lo + p.offset == start + p.start
    some = held_in(held["c"], 10, 100)
    assert sum(p.length for p in some) == 90 and some[0].start == 10


def test_a_slice_past_the_data_holds_padding_only() -> None:
    buffer = pack([("a", 3)], multiple=8)
    assert rank_slice(buffer, 4, 3) == (6, 8, 2) and segments(buffer, 6, 8) == ()
    assert segments(buffer, 2, 4) == (segments(buffer, 2, 3)[0],) and segments(buffer, 2, 4)[0].length == 1
