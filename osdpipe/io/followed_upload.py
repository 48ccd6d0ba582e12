"""One rank file sent into object storage while it is written: in parts as the writer makes them, made whole at its
key only once its rank has passed its checks.

Sent after its last byte, a rank file's upload would start when the file ends, and the last rank's would add its
whole time to the run. A :class:`~osdpipe.io.torchfile.DirectFile` is written front to back and never goes back over
what it wrote, so what it has written can be read back from the local file and sent while it grows
(:class:`FollowedUpload` is the file's :class:`~osdpipe.io.torchfile.Follower`). The object store's own upload
protocol keeps it invisible until then: an S3 multipart upload (made by S3's own calls, several parts at once:
:class:`S3Parts`), a GCS resumable upload (through fsspec's buffered file, whose chunks go up one by one as its buffer
fills: :class:`BufferedParts`), each an object only once completed. So a reader never sees part of the file;
:meth:`FollowedUpload.commit` completes it once the rank's checks have passed, and
:meth:`FollowedUpload.cancel` abandons it otherwise (the store drops the parts). A process killed meanwhile leaves an
unfinished upload that the next run into the prefix aborts (:func:`osdpipe.io.remote_output.recover`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import mmap
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from osdpipe.io import remote_output, store
from osdpipe.io.part_source import PartBody, PartSource, part_buffer

#: The parts a followed file goes up in without ``runtime.memory_budget``: s3fs's own part size, a multiple of the
#: 256 KiB GCS's resumable uploads need.
DEFAULT_PART = 50 << 20
#: A part grows with the file from this many parts on, so S3's :data:`~osdpipe.io.store.MAX_PARTS` holds any file up to
#: its 5 TiB limit (the file's size is not known while it is written).
PARTS_BEFORE_GROWING = store.MAX_PARTS // 20


class FollowedUpload:
    """The upload of ``name`` (relative to the staged conversion ``directory``, not yet created: the writer creates
    it) into ``destination``, made by a thread of its own as the file grows: a part each time the file holds one
    more, read back from the local file. A file that never holds a whole part goes in one piece when it is handed
    over, as a file sent whole (:func:`osdpipe.io.remote_output.send`): nothing to overlap, and no copy of it held.

    Args:
        destination: where the conversion goes (under ``.incoming/`` where it is staged, else straight to its key,
            after a note naming the file: :func:`osdpipe.io.remote_output.write_note`).
        directory: the staged conversion.
        name: the file's path relative to it.
    """

    def __init__(self, destination: remote_output.Destination, directory: Path, name: str) -> None:
        self.destination, self.directory, self.name = destination, directory, name
        self.part = destination.part_bytes or DEFAULT_PART
        self.in_flight = store.parts_in_flight(destination.part_bytes)
        self._changed = threading.Condition()
        self._end = 0  # the local file's bytes written so far
        self._whole = False  # the writer closed it
        self._dropped = False  # the writer failed: the file is gone
        self._commit = False  # the rank passed its checks: make the object whole
        self._cancel = False
        #: ``sending``; ``held``: the file is written, each whole part of it went up, and the object waits for the
        #: rank's checks (:meth:`commit`); ``whole``: the object is at its key; ``abandoned``.
        self.state = "sending"
        self.error: BaseException | None = None
        self._sent = 0  # the bytes of it that went up (handed to the store's writer)
        self._thread = threading.Thread(target=self._run, name=f"osdpipe-follow-{name}", daemon=True)
        self._thread.start()

    # the writer's side (osdpipe.io.torchfile.Follower)
    def grown(self, end: int) -> None:
        with self._changed:
            self._end = end
            self._changed.notify_all()

    def ended(self, length: int) -> None:
        with self._changed:
            self._end, self._whole = length, True
            self._changed.notify_all()

    def dropped(self) -> None:
        with self._changed:
            self._dropped = True
            self._changed.notify_all()

    # the upload queue's side
    @property
    def written(self) -> bool:
        """The writer finished the file (its upload can be committed)."""
        with self._changed:
            return self._whole

    def progress(self) -> tuple[int, int]:
        """``(sent, written)``: the bytes of the file that went up, and those the writer wrote so far (all of it once
        it is written): what the queue shows while it waits (:meth:`osdpipe.io.upload_queue.UploadQueue.finish`)."""
        with self._changed:
            return self._sent, self._end

    def settled(self, within_s: float) -> str:
        """The state once the upload rests (not ``sending``), or after ``within_s`` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: self.state != "sending", timeout=within_s)
            return self.state

    def commit(self) -> None:
        """Send what is left and make the object whole at its key; waits for it.

        Raises:
            Exception: the store's failure, as the store client raised it (said by the caller, naming the file).
        """
        with self._changed:
            self._commit = True
            self._changed.notify_all()
        self._thread.join()
        if self.error is not None:
            raise self.error
        if self.state != "whole":
            raise RuntimeError(f"{self.name} was not written whole")

    def cancel(self) -> None:
        """Abandon the upload (the store drops its parts) unless it was made whole; waits for the thread."""
        with self._changed:
            self._cancel = True
            self._changed.notify_all()
        self._thread.join()

    def _next(self, sent: int) -> tuple[int, bool] | None:
        """Wait for something to do: ``(upto, finish)``, send the bytes up to ``upto`` (a whole part, while the file
        is written) or, with ``finish``, all of it and make the object whole; ``None``: abandon it. ``held``
        meanwhile, once the file is written and each of its whole parts went up."""
        part = self._part_at(sent)
        with self._changed:
            while True:
                if self._cancel or self._dropped:
                    return None
                if self._whole and self._commit:
                    return self._end, True
                if self._end - sent >= part:
                    return sent + part, False
                if self._whole:
                    self._rest("held")
                self._changed.wait()

    def _rest(self, state: str) -> None:
        with self._changed:
            self.state = state
            self._changed.notify_all()

    def _run(self) -> None:
        remote: Any = None
        local: PartSource | None = None
        sent = 0
        try:
            while (step := self._next(sent)) is not None:
                upto, finish = step
                if finish and remote is None:  # not one whole part: it goes in one piece, as a file sent whole
                    remote_output.send(self.destination, self.directory, [self.name], self._went_up)
                    self._rest("whole")
                    return
                if remote is None:
                    remote = self._open()
                if local is None:
                    local = PartSource(self.directory / self.name)
                while sent < upto:  # one part; at the end, what is left, a part at a time
                    length = min(self._part_at(sent), upto - sent)
                    remote.send(local, sent, length)
                    sent += length
                    self._went_up(length)
                if finish:
                    remote.complete()  # the object is whole
                    self._rest("whole")
                    return
        except BaseException as exc:  # noqa: BLE001 - said when the queue commits it
            self.error = exc
        finally:
            if local is not None:
                local.close()
            if self.state != "whole":
                if remote is not None:
                    remote.abandon()
                self._rest("abandoned")

    def _went_up(self, n: int) -> None:
        with self._changed:
            self._sent += n

    def _open(self) -> Parts:
        """The object's writer (:data:`PARTS`, by the store); where the file goes straight to its key, a note names it
        first."""
        destination = self.destination
        if not destination.staged:
            remote_output.write_note(destination, [self.name])
        writer = PARTS.get(destination.location.scheme, BufferedParts)
        return writer(destination.fs, destination.key(*destination.sent_under, self.name), self.part, self.in_flight)

    def _part_at(self, sent: int) -> int:
        return part_size(self.part, sent)


def part_size(first: int, sent: int) -> int:
    """The part a followed file goes up in once ``sent`` bytes of it went up: ``first``, then a fraction of what went
    up, a multiple of 256 KiB, so the parts stay within S3's count (doubling the file adds
    :data:`PARTS_BEFORE_GROWING` parts at most, about)."""
    grown = sent // PARTS_BEFORE_GROWING
    return max(first, -(-grown // store.PART_QUANTUM) * store.PART_QUANTUM)


class Parts(ABC):
    """An object made of parts sent one by one (each a whole part but the last), visible at its key only once
    :meth:`complete`; :meth:`abandon` drops what was sent. Where even that fails, the next run into the prefix aborts
    it (:func:`~osdpipe.io.remote_output.recover`).

    A writer is made as ``writer(fs, key, part, in_flight)``: the store's fsspec filesystem, the object's key, the
    part size :class:`FollowedUpload` sends (it grows with the file: :func:`part_size`), and how many parts may be
    under way at once (:func:`osdpipe.io.store.parts_in_flight`); each takes what its protocol uses."""

    @abstractmethod
    def send(self, source: PartSource, start: int, length: int) -> None:
        """Send bytes ``[start, start + length)`` of the local file as the next part, read from ``source`` as the
        writer's client sends best."""

    @abstractmethod
    def complete(self) -> None: ...

    @abstractmethod
    def abandon(self) -> None: ...


class BufferedParts(Parts):
    """Through fsspec's buffered file (any store: a GCS resumable upload, say): each part written into its buffer
    and flushed, the file closed to complete it, discarded to drop it; one part at a time (a resumable upload's chunks
    go in order)."""

    def __init__(self, fs: Any, key: str, part: int, in_flight: int = 1) -> None:
        self._file = fs.open(key, "wb", block_size=part)

    def send(self, source: PartSource, start: int, length: int) -> None:
        # a whole part fills the buffer and the client sends it; the last, shorter, stays there until complete
        self._file.blocksize = max(self._file.blocksize, length)
        self._file.write(source.read(start, length))

    def complete(self) -> None:
        self._file.close()

    def abandon(self) -> None:
        try:
            self._file.discard()
        except Exception:  # noqa: BLE001 - the run has failed or is failing; recover cleans up
            pass
        self._file.closed = True  # nothing more to send: s3fs's file would otherwise try its last part when collected


class S3Parts(Parts):
    """An S3 multipart upload made by its own calls, up to ``in_flight`` parts sent at once, each read into a buffer
    of its own (:func:`~osdpipe.io.part_source.part_buffer`) and sent from there as it lies
    (:class:`~osdpipe.io.part_source.PartBody`). Through s3fs's buffered file every part was copied into its buffer
    and out again (2.8 s of the GIL for the bench's 1.6 GB, docs/speed.md), and went up alone: one part at a time
    leaves the store idle while the client reads, hashes and signs the next. The calls are s3fs's own (``call_s3``:
    its retries, its error translation, and the ``s3_additional_kwargs`` of ``runtime.storage_options``, encryption
    say), made on its event loop, which keeps several requests open at once."""

    def __init__(self, fs: Any, key: str, part: int, in_flight: int = 1) -> None:
        self._fs = fs
        self._bucket, self._key, _ = fs.split_path(key)
        self._in_flight = in_flight
        self._id: str | None = None
        self._sent: list[concurrent.futures.Future] = []  # each part's request, in order: part i + 1 is _sent[i]
        self._sending: collections.deque[mmap.mmap] = collections.deque()  # the unanswered parts' buffers, in order
        self._free: list[mmap.mmap] = []  # buffers of answered parts, to read the next into

    def send(self, source: PartSource, start: int, length: int) -> None:
        """Read the part into a free buffer (once fewer than ``in_flight`` parts are under way, which frees one) and
        send it; returns while it goes up.

        Raises:
            Exception: the store's failure of a part sent before, as the store client raised it.
        """
        if self._id is None:
            self._id = self._fs.call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key)["UploadId"]
        self._wait_until(len(self._sent) - self._in_flight + 1)
        buffer = self._free.pop() if self._free else None
        if buffer is None or len(buffer) < length:  # the first parts, or one grown past its buffer
            buffer = part_buffer(length)
        body = PartBody(source.read_into(buffer, start, length))
        request = self._fs._call_s3("upload_part", Bucket=self._bucket, Key=self._key, UploadId=self._id,
                                    PartNumber=len(self._sent) + 1, Body=body)  # fmt: skip
        self._sending.append(buffer)
        self._sent.append(asyncio.run_coroutine_threadsafe(request, self._fs.loop))

    def complete(self) -> None:
        if self._id is None:
            raise RuntimeError(f"s3://{self._bucket}/{self._key}: no part was sent to complete")
        self._wait_until(len(self._sent))
        parts = []
        for number, request in enumerate(self._sent, start=1):
            answer = request.result()
            checksums = {k: v for k, v in answer.items() if k.startswith("Checksum") and k != "ChecksumType"}
            parts.append({"PartNumber": number, "ETag": answer["ETag"], **checksums})
        self._fs.call_s3("complete_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=self._id,
                         MultipartUpload={"Parts": parts})  # fmt: skip

    def abandon(self) -> None:
        if self._id is None:
            return
        concurrent.futures.wait(self._sent)  # a part still going up would outlive the abort
        try:
            self._fs.call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=self._id)
        except Exception:  # noqa: BLE001 - the run has failed or is failing; recover cleans up
            pass

    def _wait_until(self, answered: int) -> None:
        """Wait for the answers of the first ``answered`` parts; the first failure among them is raised."""
        while len(self._sent) - len(self._sending) < answered:
            self._sent[len(self._sent) - len(self._sending)].result()
            self._free.append(self._sending.popleft())


#: The part writer of each store that has one of its own; any other goes through fsspec's buffered file.
PARTS: dict[str, type[Parts]] = {"s3": S3Parts}
