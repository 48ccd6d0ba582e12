"""ZeRO's layout math: every element of every parameter is in exactly one rank's partition,
where DeepSpeed puts it (issue 31).

Real DeepSpeed files hold the same math to account in ``tests/frameworks/test_deepspeed.py``.
"""

from __future__ import annotations

import pytest

from osdpipe.layout.flat_buffer import held_in
from osdpipe.layout.zero import partition_size, pieces_by_parameter, rank_segments, saved_lengths

GROUPS = [[("emb", 37 * 12), ("w1", 20 * 12), ("b1", 20)], [("norm", 12), ("b2", 7)]]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8, 64])
def test_every_element_is_held_once_and_partitions_are_equal_sized(stage: int, world_size: int) -> None:
    pieces = pieces_by_parameter(GROUPS, world_size, stage)
    for group in GROUPS:
        size = partition_size([n for _, n in group], world_size, stage)
        for fqn, numel in group:
            covered = sorted((p.start, p.start + p.length) for p in pieces[fqn])
            assert covered[0][0] == 0 and covered[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), f"{fqn}: gaps or overlaps {covered}"
            assert all(0 <= p.offset and p.offset + p.length <= size for p in pieces[fqn])
        for rank in range(world_size):  # no two parameters share an element of a partition
            spans = sorted((s.dest, s.dest + s.length) for s in rank_segments(group, world_size, stage, rank))
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_stage_1_and_2_cut_one_flat_buffer_padded_to_twice_the_world() -> None:
    group = [("a", 5), ("b", 6)]  # 11 elements; 2 ranks: padded to 12, 6 each
    assert partition_size([5, 6], 2, 2) == 6
    assert [(s.fqn, s.start, s.length, s.dest) for s in rank_segments(group, 2, 2, 0)] == [
        ("a", 0, 5, 0), ("b", 0, 1, 5)
    ]
    assert [(s.fqn, s.start, s.length, s.dest) for s in rank_segments(group, 2, 2, 1)] == [("b", 1, 5, 0)]
    assert partition_size([5, 6], 3, 1) == 4  # padded to 12 = 2 x 3 x 2


def test_stage_3_cuts_each_parameter_on_its_own() -> None:
    group = [("a", 5), ("b", 6)]  # a: pieces of 3 (rank 1 holds 2, then padding); b: pieces of 3
    assert partition_size([5, 6], 2, 3) == 6
    assert [(s.fqn, s.start, s.length, s.dest) for s in rank_segments(group, 2, 3, 0)] == [
        ("a", 0, 3, 0), ("b", 0, 3, 3)
    ]
    assert [(s.fqn, s.start, s.length, s.dest) for s in rank_segments(group, 2, 3, 1)] == [
        ("a", 3, 2, 0), ("b", 3, 3, 3)
    ]
    # ranks past a small parameter hold only padding
    assert [(s.fqn, s.start) for s in rank_segments([("tiny", 1)], 4, 3, 2)] == []


def test_a_range_is_cut_from_the_pieces_that_hold_it() -> None:
    pieces = pieces_by_parameter([[("a", 5), ("b", 6)]], 2, 2)["b"]
    assert [(p.where[0], p.start, p.length, p.offset) for p in held_in(pieces, 0, 6)] == [(0, 0, 1, 5), (1, 1, 5, 0)]
    assert [(p.where[0], p.start, p.length, p.offset) for p in held_in(pieces, 2, 4)] == [(1, 2, 2, 1)]


def test_stage_1_and_2_parameter_alignment_pads_after_each_parameter_but_the_last() -> None:
    group, paddings = [("a", 5), ("b", 6)], [3, 0]  # a at 0, b at 8: 14 elements, padded to 16 on 2 ranks
    assert partition_size([5, 6], 2, 2, paddings) == 8
    assert [(s.fqn, s.start, s.length, s.dest) for s in rank_segments(group, 2, 2, 0, paddings)] == [("a", 0, 5, 0)]
    assert [(s.fqn, s.start, s.length, s.dest) for s in rank_segments(group, 2, 2, 1, paddings)] == [("b", 0, 6, 0)]


def test_a_ranks_file_holds_its_moments_padded_and_its_stage_1_2_masters_without_the_groups_end_padding() -> None:
    # DeepSpeed 0.19.8, 2 ranks, stage 1: a group of 1650 elements is padded to 1652;
    # rank 1's fp32 partition was saved with 824
    numels = [407, 209, 19, 209, 209, 209, 388]
    assert sum(numels) == 1650
    assert saved_lengths(numels, 2, 1, 0) == (826, 826)
    assert saved_lengths(numels, 2, 1, 1) == (826, 824)
    assert saved_lengths([5, 6], 4, 2, 3) == (4, 0)  # 11 padded to 16, 4 a rank: the last holds padding alone
    assert saved_lengths([5, 6], 2, 3, 1) == (6, 6)  # stage 3: each parameter's piece, padding included, on every rank

