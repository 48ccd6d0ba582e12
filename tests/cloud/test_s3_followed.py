"""A rank file bound for object storage goes up in parts while it is written (osdpipe.io.followed_upload), and is whole
at its key only once its rank hands it over (its checks passed); otherwise nothing of it stays, not even parts.

Against the real S3 server of tests/cloud/conftest.py; the files are written as the save stage writes them, through
osdpipe.io.torchfile.written, inside the upload queue's ``following``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from cloudenv import S3

from osdpipe.io import followed_upload, remote_output, store, torchfile
from osdpipe.io.part_source import PartSource
from osdpipe.io.upload_queue import UploadQueue

#: A budget whose parts are S3's smallest, 5 MiB (an eighth of it, osdpipe.io.store.upload_part_bytes).
BUDGET = 40 << 20
SIZE = 40 << 20  # two of torchfile's 16 MiB buffers reach the file before it ends: parts go up meanwhile


def _bytes(n: int) -> bytes:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy().tobytes()


def _unfinished(s3: S3, prefix: str) -> list[dict]:
    """The multipart uploads begun under ``prefix`` and neither completed nor aborted."""
    return s3.fs().call_s3("list_multipart_uploads", Bucket=s3.bucket, Prefix=f"{prefix}/").get("Uploads", [])


def _parts_sent(s3: S3, prefix: str, within_s: float = 60) -> int:
    """The parts the one unfinished upload under ``prefix`` holds, once it holds any (waits ``within_s``)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for upload in _unfinished(s3, prefix):
            listed = s3.fs().call_s3("list_parts", Bucket=s3.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            if listed.get("Parts"):
                return len(listed["Parts"])
        time.sleep(0.05)
    return 0


def _queue(s3: S3, tmp_path: Path, over_a_conversion: bool) -> tuple[UploadQueue, Path]:
    if over_a_conversion:
        first = tmp_path / "first"
        first.mkdir()
        (first / "rank_0.pt").write_bytes(b"the previous conversion")
        (first / "manifest.json").write_text("{}")
        remote_output.publish(remote_output.prepare(s3.url("out"), overwrite=False), first)
    destination = remote_output.prepare(s3.url("out"), overwrite=True, memory_budget=BUDGET)
    assert destination.staged is over_a_conversion
    staging = tmp_path / "staging"
    staging.mkdir()
    return UploadQueue(destination.upload), staging


@pytest.mark.parametrize("writer", ["S3Parts", "BufferedParts"])
@pytest.mark.parametrize("over_a_conversion", [False, True], ids=["empty prefix", "over a conversion"])
def test_a_rank_file_goes_up_as_it_is_written_and_is_whole_only_once_handed_over(
    s3: S3, tmp_path: Path, over_a_conversion: bool, writer: str, monkeypatch
) -> None:
    """S3's own multipart calls (osdpipe's writer for s3://), and fsspec's buffered file (the writer of every other
    store), each on the real server."""
    monkeypatch.setattr(followed_upload, "PARTS", {"s3": getattr(followed_upload, writer)})
    queue, staging = _queue(s3, tmp_path, over_a_conversion)
    data = _bytes(SIZE + 12345)  # not a whole number of parts, nor of O_DIRECT blocks
    key = f"out/{remote_output.INCOMING}/rank_0.pt" if over_a_conversion else "out/rank_0.pt"
    with queue.following(staging), torchfile.written(staging / "rank_0.pt", sync=False) as out:
        out.write(data[:SIZE])
        assert _parts_sent(s3, "out") >= 1, "no part went up while the file was written"
        assert key not in s3.keys("out"), "part of a file is never an object"
        if not over_a_conversion:  # straight to its key: a note names it before its first byte
            assert [k for k in s3.keys("out") if k.startswith("out/.incoming/writing/")]
        out.write(data[SIZE:])
    upload = queue.followed("rank_0.pt")
    assert upload is not None and upload.settled(60) == "held"
    assert key not in s3.keys("out"), "a file is whole at its key only once its rank hands it over"
    queue.send(staging, ["rank_0.pt"])
    assert queue.finish() is None
    assert upload.state == "whole"
    assert s3.fs().cat_file(f"{s3.bucket}/{key}") == data == (staging / "rank_0.pt").read_bytes()
    assert _unfinished(s3, "out") == []


def test_a_file_smaller_than_a_part_goes_in_one_request_when_handed_over(s3: S3, tmp_path: Path) -> None:
    """Without a budget a part is 50 MiB: a 40 MiB file never holds one, so nothing is held in memory for it while it
    is written, and it goes up as a file sent whole does, in one PUT (an S3 ETag without a part count)."""
    destination = remote_output.prepare(s3.url("out"), overwrite=False)
    staging = tmp_path / "staging"
    staging.mkdir()
    queue = UploadQueue(destination.upload)
    data = _bytes(SIZE)
    with queue.following(staging), torchfile.written(staging / "rank_0.pt", sync=False) as out:
        out.write(data)
    upload = queue.followed("rank_0.pt")
    assert upload is not None and upload.settled(60) == "held"
    assert _unfinished(s3, "out") == []
    queue.send(staging, ["rank_0.pt"])
    assert queue.finish() is None
    assert s3.fs().cat_file(f"{s3.bucket}/out/rank_0.pt") == data
    assert "-" not in s3.fs().info(f"{s3.bucket}/out/rank_0.pt")["ETag"], "sent in parts"


def test_a_file_no_rank_hands_over_leaves_nothing_not_even_its_parts(s3: S3, tmp_path: Path) -> None:
    """As after a rank's failed check: the save stage never hands the file over, and the queue abandons it."""
    queue, staging = _queue(s3, tmp_path, over_a_conversion=False)
    with queue.following(staging), torchfile.written(staging / "rank_0.pt", sync=False) as out:
        out.write(_bytes(SIZE))
        assert _parts_sent(s3, "out") >= 1
    upload = queue.followed("rank_0.pt")
    assert upload is not None and upload.settled(60) == "held"
    queue.withdraw()
    assert upload.state == "abandoned"
    assert _unfinished(s3, "out") == []
    assert [k for k in s3.keys("out") if not k.startswith("out/.incoming/")] == []


def test_a_file_whose_writer_fails_leaves_nothing_not_even_its_parts(s3: S3, tmp_path: Path) -> None:
    queue, staging = _queue(s3, tmp_path, over_a_conversion=True)
    with pytest.raises(RuntimeError, match="the writer failed"), queue.following(staging):
        with torchfile.written(staging / "rank_0.pt", sync=False) as out:
            out.write(_bytes(SIZE))
            assert _parts_sent(s3, "out") >= 1
            raise RuntimeError("the writer failed")
    assert not (staging / "rank_0.pt").exists()
    upload = queue.followed("rank_0.pt")
    assert upload is not None and upload.settled(60) == "abandoned"  # by its own thread, told by the writer
    assert _unfinished(s3, "out") == []
    assert queue.finish() is None
    assert s3.keys("out/.incoming") == []


def test_markers_are_not_followed_they_go_last_with_publish(s3: S3, tmp_path: Path) -> None:
    queue, staging = _queue(s3, tmp_path, over_a_conversion=False)
    with queue.following(staging), torchfile.written(staging / ".metadata", sync=False) as out:
        out.write(b"a marker")
    assert queue.followed(".metadata") is None
    queue.send(staging, [".metadata"])
    assert queue.finish() is None
    assert s3.keys("out") == [] and _unfinished(s3, "out") == []


def test_what_is_left_when_a_file_is_handed_over_goes_up_a_part_at_a_time(s3: S3, tmp_path: Path, monkeypatch) -> None:
    """A writer faster than the store: while the first part goes up, the rest of the file is written and handed over.
    What is left is sent a part at a time, never as one request of the rest of the file (which could outgrow memory,
    and S3's 5 GiB part)."""
    sent: list[int] = []
    first_part_sending, first_part_held = threading.Event(), threading.Event()

    class Recorded(followed_upload.S3Parts):
        def send(self, source: PartSource, start: int, length: int) -> None:
            sent.append(length)
            if len(sent) == 1:
                first_part_sending.set()
                first_part_held.wait(30)  # until the file is written and handed over
            super().send(source, start, length)

    monkeypatch.setattr(followed_upload, "PARTS", {"s3": Recorded})
    destination = remote_output.prepare(s3.url("out"), overwrite=True, memory_budget=BUDGET)
    part = store.upload_part_bytes(BUDGET)
    data = _bytes(SIZE + 12345)
    (tmp_path / "rank_0.pt").write_bytes(data)
    upload = followed_upload.FollowedUpload(destination, tmp_path, "rank_0.pt")
    upload.grown(part)  # the first part is written: it goes up
    assert first_part_sending.wait(30)
    upload.ended(len(data))
    handed_over = threading.Thread(target=upload.commit)
    handed_over.start()
    time.sleep(0.5)  # the hand-over is asked for while the first part is still going up
    first_part_held.set()
    handed_over.join(60)
    assert upload.state == "whole" and sent == [part] * (SIZE // part) + [len(data) - SIZE // part * part], sent
    assert s3.fs().cat_file(f"{s3.bucket}/out/rank_0.pt") == data


def test_the_parts_grow_with_the_file_so_s3s_part_count_holds_its_largest_object() -> None:
    """The file's size is not known while it is written: the part grows with what went up, so a 5 TiB file (S3's
    largest object) goes up in fewer than S3's 10,000 parts, starting from the default part."""
    sent, parts = 0, 0
    while sent < 5 << 40:
        part = followed_upload.part_size(followed_upload.DEFAULT_PART, sent)
        assert part % store.PART_QUANTUM == 0 and part >= store.MIN_PART
        sent, parts = sent + part, parts + 1
    assert parts < store.MAX_PARTS, parts
    assert followed_upload.part_size(followed_upload.DEFAULT_PART, 10 << 30) == followed_upload.DEFAULT_PART


def _parts_held_until_the_next_is_answered(fs, monkeypatch, fail_part: int | None = None) -> dict[str, int]:
    """Wrap ``fs``'s requests: part 1's answer waits until part 2 is answered (at most 10 s), so parts sent one at
    a time never overlap, and several at once are answered out of order; ``fail_part`` fails with the store's
    error. What it saw: the most parts under way at once."""
    seen = {"running": 0, "most": 0}
    answered: set[int] = set()
    asked = fs._call_s3

    async def call(method: str, **kwargs):
        if method != "upload_part":
            return await asked(method, **kwargs)
        number = kwargs["PartNumber"]
        seen["running"] += 1
        seen["most"] = max(seen["most"], seen["running"])
        try:
            if number == fail_part:
                raise PermissionError(f"the store refused part {number}")
            if number == 1:
                for _ in range(1000):
                    if 2 in answered:
                        break
                    await asyncio.sleep(0.01)
            answer = await asked(method, **kwargs)
            answered.add(number)
            return answer
        finally:
            seen["running"] -= 1

    monkeypatch.setattr(fs, "_call_s3", call)
    return seen


def test_s3_parts_go_up_several_at_once_and_make_the_object_in_order(s3: S3, tmp_path: Path, monkeypatch) -> None:
    """Two parts in flight: the second goes up while the first is still unanswered (one at a time, the first would
    wait for the second in vain), never a third beside them, and the object is the parts in the order sent though
    answered out of order."""
    fs = s3.fs()
    seen = _parts_held_until_the_next_is_answered(fs, monkeypatch)
    data = _bytes(3 * store.MIN_PART + 1234)
    (tmp_path / "rank_0.pt").write_bytes(data)
    parts = followed_upload.S3Parts(fs, f"{s3.bucket}/out/rank_0.pt", store.MIN_PART, in_flight=2)
    source = PartSource(tmp_path / "rank_0.pt")
    for start in range(0, len(data), store.MIN_PART):
        parts.send(source, start, min(store.MIN_PART, len(data) - start))
    parts.complete()
    source.close()
    assert seen["most"] == 2, seen
    assert s3.fs().cat_file(f"{s3.bucket}/out/rank_0.pt") == data
    assert _unfinished(s3, "out") == []


def test_a_part_the_store_refuses_fails_the_upload_and_leaves_no_parts(s3: S3, tmp_path: Path, monkeypatch) -> None:
    fs = s3.fs()
    _parts_held_until_the_next_is_answered(fs, monkeypatch, fail_part=2)
    (tmp_path / "rank_0.pt").write_bytes(_bytes(3 * store.MIN_PART))
    parts = followed_upload.S3Parts(fs, f"{s3.bucket}/out/rank_0.pt", store.MIN_PART, in_flight=2)
    source = PartSource(tmp_path / "rank_0.pt")
    with pytest.raises(PermissionError, match="refused part 2"):
        for start in range(0, 3 * store.MIN_PART, store.MIN_PART):
            parts.send(source, start, store.MIN_PART)
        parts.complete()
    parts.abandon()
    assert _unfinished(s3, "out") == [] and s3.keys("out") == []


def test_the_queue_tells_the_bytes_it_sent_while_it_waits_up_to_every_file_handed_over(s3: S3, tmp_path: Path) -> None:
    """What the live line shows of the upload's tail, after the last rank converted (osdpipe.pipeline.loop): a rank
    file that went up in parts as it was written and a file sent whole, counted together, all of it at the end."""
    queue, staging = _queue(s3, tmp_path, over_a_conversion=False)
    data = _bytes(SIZE + 12345)
    with queue.following(staging), torchfile.written(staging / "rank_0.pt", sync=False) as out:
        out.write(data)
    (staging / "extra.bin").write_bytes(b"x" * 1000)  # not written by torchfile: sent whole
    queue.send(staging, ["rank_0.pt", "extra.bin"])
    shown: list[tuple[int, int]] = []
    assert queue.finish(lambda sent, total: shown.append((sent, total))) is None
    total = len(data) + 1000
    assert shown[-1] == (total, total), shown
    assert all(t == total for _, t in shown) and [s for s, _ in shown] == sorted(s for s, _ in shown), shown
    assert s3.fs().cat_file(f"{s3.bucket}/out/rank_0.pt") == data
