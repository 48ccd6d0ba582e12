"""One rank file sent into object storage while it is written: in parts as the writer makes them, made whole at its
key only once its rank has passed its checks.

Sent after its last byte, a rank file's upload would start when the file ends, and the last rank's would add its
whole time to the run. A :class:`~osdpipe.io.torchfile.DirectFile` is written front to back and never goes back over
what it wrote, so what it has written can be read back from the local file and sent while it grows
(:class:`FollowedUpload` is the file's :class:`~osdpipe.io.torchfile.Follower`). The object store's own upload
protocol keeps it invisible until then: an S3 multipart upload, a GCS resumable upload, both through fsspec's
buffered file, whose parts go up as its buffer fills and whose object exists only once it is closed. So a reader never
sees part of the file; :meth:`FollowedUpload.commit` closes it once the rank's checks have passed, and
:meth:`FollowedUpload.cancel` abandons it otherwise (the store drops the parts). A process killed meanwhile leaves an
unfinished upload that the next run into the prefix aborts (:func:`osdpipe.io.remote_output.recover`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from osdpipe.io import remote_output, store

#: The parts a followed file goes up in without ``runtime.memory_budget``: s3fs's own part size, a multiple of the
#: 256 KiB GCS's resumable uploads need.
DEFAULT_PART = 50 << 20
#: How much of the local file one read takes: a part is gathered in the store client's buffer.
READ_BYTES = 8 << 20
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
        local = -1
        sent = 0
        try:
            while (step := self._next(sent)) is not None:
                upto, finish = step
                if finish and remote is None:  # not one whole part: it goes in one piece, as a file sent whole
                    remote_output.send(self.destination, self.directory, [self.name])
                    self._rest("whole")
                    return
                if remote is None:
                    remote = self._open()
                if local < 0:
                    local = os.open(self.directory / self.name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                remote.blocksize = self._part_at(sent)  # the client sends a part once its buffer holds this much
                while sent < upto:
                    chunk = os.pread(local, min(READ_BYTES, upto - sent), sent)
                    if not chunk:
                        raise OSError(f"{self.directory / self.name} ends at byte {sent}, before the {upto} written")
                    remote.write(chunk)
                    sent += len(chunk)
                if finish:
                    remote.close()  # the last part, and the object is whole
                    self._rest("whole")
                    return
        except BaseException as exc:  # noqa: BLE001 - said when the queue commits it
            self.error = exc
        finally:
            if local >= 0:
                os.close(local)
            if self.state != "whole":
                if remote is not None:
                    _abandon(remote)
                self._rest("abandoned")

    def _open(self) -> Any:
        """The object's writer: fsspec's buffered file, its parts :attr:`part` bytes; where the file goes straight to
        its key, a note names it first."""
        destination = self.destination
        if not destination.staged:
            remote_output.write_note(destination, [self.name])
        return destination.fs.open(destination.key(*destination.sent_under, self.name), "wb", block_size=self.part)

    def _part_at(self, sent: int) -> int:
        return part_size(self.part, sent)


def part_size(first: int, sent: int) -> int:
    """The part a followed file goes up in once ``sent`` bytes of it went up: ``first``, then a fraction of what went
    up, a multiple of 256 KiB, so the parts stay within S3's count (doubling the file adds
    :data:`PARTS_BEFORE_GROWING` parts at most, about)."""
    grown = sent // PARTS_BEFORE_GROWING
    return max(first, -(-grown // store.PART_QUANTUM) * store.PART_QUANTUM)


def _abandon(remote: Any) -> None:
    """Drop an unfinished upload: the store discards its parts (S3's multipart upload aborted, GCS's resumable one
    cancelled). Where even that fails, the next run into the prefix aborts it
    (:func:`~osdpipe.io.remote_output.recover`)."""
    try:
        remote.discard()
    except Exception:  # noqa: BLE001 - the run has failed or is failing; recover cleans up
        pass
    remote.closed = True  # nothing more to send: s3fs's file would otherwise try its last part when collected
