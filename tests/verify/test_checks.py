"""The element checks the stages run on every output tensor: coverage gaps and non-finite values."""

from __future__ import annotations

import torch

from osdpipe.layout.ranges import LocalTensor, Segment, uncovered
from osdpipe.run.stages.shard import nonfinite


def test_uncovered_is_what_no_range_covers() -> None:
    assert uncovered(0, 5, []) == [(0, 5)]
    assert uncovered(0, 5, [(0, 5)]) == []
    assert uncovered(0, 5, [(3, 5), (0, 2)]) == [(2, 3)]
    assert uncovered(0, 6, [(0, 3), (1, 2), (0, 3), (3, 4)]) == [(4, 6)]  # overlapping, repeated, adjacent
    assert uncovered(0, 4, [(2, 4)]) == [(0, 2)]
    assert uncovered(2, 8, [(0, 3), (7, 12)]) == [(3, 7)]  # ranges reaching outside


def _tensor(numel: int) -> LocalTensor:
    return LocalTensor(
        key="w", fqns=("a", "b"), shape=(numel,), segments=(Segment("a", 10, 4, 0), Segment("b", 0, 4, 4)), flat=True
    )


def test_nonfinite_names_each_parameter_and_the_first_element() -> None:
    value = torch.zeros(8)
    value[5], value[6] = float("inf"), float("-inf")  # their sum is NaN: still found
    assert nonfinite(_tensor(8), {"exp_avg": value}) == ["b exp_avg (2 element(s), first at flat index 1)"]
    value[1] = float("nan")
    assert nonfinite(_tensor(8), {"exp_avg": value})[0] == "a exp_avg (1 element(s), first at flat index 11)"


def test_a_sum_that_overflows_is_not_taken_for_a_nonfinite_element() -> None:
    value = torch.full((8,), 60000.0, dtype=torch.float16)  # finite; the sum overflows float16
    assert not bool(torch.isfinite(value.sum()))
    assert nonfinite(_tensor(8), {"exp_avg": value}) == []


def test_a_memory_sample_is_the_kernels_rssanon_and_leaves_a_mapped_file_out(tmp_path) -> None:
    """A sample reads ``/proc/self/statm`` (cheaper than ``status``): resident less file-backed pages, which is what
    ``status`` calls ``RssAnon``; the pages of a file read through ``mmap`` are not the conversion's memory."""
    import mmap

    from osdpipe.core import memory

    assert abs(memory._anonymous_bytes() - memory._status_bytes("RssAnon")) < 4 << 20
    mapped = tmp_path / "mapped"
    mapped.write_bytes(b"\1" * (64 << 20))
    with mapped.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        before = memory._anonymous_bytes()
        touched = sum(view[offset] for offset in range(0, len(view), mmap.PAGESIZE))
        after = memory._anonymous_bytes()
        resident = memory._status_bytes("RssFile")
    assert touched == (64 << 20) // mmap.PAGESIZE and resident > 60 << 20
    assert after - before < 8 << 20, (before, after)


def test_memory_watch_sees_a_peak_that_is_gone_and_stops_its_thread() -> None:
    import mmap
    import threading
    import time

    from osdpipe.core.memory import MemoryWatch

    watch = MemoryWatch("this process").start()
    # 100 MB of fresh anonymous pages, each touched: a tensor could reuse memory
    # the allocator already holds (it did, late in a full run) and never raise RssAnon.
    held = mmap.mmap(-1, 100_000_000, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, len(held), mmap.PAGESIZE):
        held[offset] = 1
    deadline = time.monotonic() + 10  # held until the watch has sampled it (a loaded machine may be slow to)
    while (watch.peak or 0) - (watch.baseline or 0) < 90e6 and time.monotonic() < deadline:
        time.sleep(0.05)
    held.close()
    peak = watch.stop()
    assert peak.peak_anonymous - peak.baseline_anonymous > 90e6, peak
    assert peak.peak_rss >= peak.peak_anonymous
    assert not any(t.name == "osdpipe-memory" and t.is_alive() for t in threading.enumerate())


def test_a_flat_tensor_of_two_param_groups_is_stepped_as_a_part_in_each() -> None:
    """A distributed optimizer's bucket holds parameters of both of Megatron's groups (norms without weight decay
    beside matrices with it): the resume check's bare optimizers step each group's elements in that group, each part
    with a step counter of its own; a tensor of one group is itself."""
    from osdpipe.verify.resume_training import by_group

    decay, none = {"weight_decay": 0.1}, {"weight_decay": 0.0}
    bucket = LocalTensor("bucket", ("w", "norm", "v"), (12,),
                         (Segment("w", 0, 4, 0), Segment("norm", 2, 3, 6), Segment("v", 1, 2, 10)), flat=True)
    state = {"exp_avg": torch.arange(12.0), "step": torch.tensor(3.0)}
    parts = by_group(bucket, state, {"w": decay, "v": decay, "norm": none}.get)
    assert [(p.fqns, p.shape, g) for p, _, g in parts] == [(("w", "v"), (6,), decay), (("norm",), (3,), none)]
    (first, held, _), (second, other, _) = parts
    assert first.segments == (Segment("w", 0, 4, 0), Segment("v", 1, 2, 4))
    assert torch.equal(held["exp_avg"], torch.tensor([0.0, 1, 2, 3, 10, 11]))
    assert torch.equal(other["exp_avg"], torch.tensor([6.0, 7, 8])) and second.segments == (Segment("norm", 2, 3, 0),)
    assert held["step"] is not other["step"] and held["step"] is not state["step"] and float(other["step"]) == 3.0
    alone = LocalTensor("w", ("w",), (4,), (Segment("w", 0, 4, 0),), flat=False)
    assert by_group(alone, state, {"w": decay}.get) == [(alone, state, decay)]
