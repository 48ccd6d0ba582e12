"""A process's finished files sent into object storage in the background, while its next ranks convert.

A conversion into ``s3://`` or ``gs://`` is made in the job's directory and committed into the prefix by
:func:`osdpipe.io.remote_output.publish`. Were every byte to wait for the whole conversion, the upload would follow
the last rank and add its whole time to the run. Instead the save stage hands each rank's data files to its
process's queue as soon as they are written and checked (the roundtrip check and the structure check have passed on
that rank); the queue uploads them (:func:`osdpipe.io.remote_output.send`: under ``.incoming/``, or straight to their
keys after a note naming them) while the process plays its next ranks, or waits for the others. The files that mark a
conversion complete (``.metadata``, the manifest) are never sent here: only ``publish`` sends them, after the local
commit, once every rank's files are in the prefix.

A rank file written by :mod:`osdpipe.io.torchfile` (a DCP rank file, a ``torch.save`` rank file) does not wait for
its last byte either: inside :meth:`UploadQueue.following`, each goes up in parts as it is written
(:class:`~osdpipe.io.followed_upload.FollowedUpload`), and the queue only makes it whole at its key when its rank is
checked; a file no rank hands over is abandoned. Any other file (a safetensors export, a carried file) is sent whole.

The pipeline waits for the queue (:meth:`UploadQueue.finish`) before the local commit moves the staged files, and
says a failed upload as the save stage's failure; a run that fails after some files were sent has them removed by
:func:`osdpipe.io.remote_output.discard`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

from osdpipe.io import remote_output
from osdpipe.io.followed_upload import FollowedUpload
from osdpipe.io.torchfile import followed_as_written

#: Uploads at once from one process, each a file (a large one in parts): enough to keep a store busy while the
#: process converts, few enough that the conversion keeps its CPU.
IN_FLIGHT = 2
#: How often :meth:`UploadQueue.finish` tells its caller the bytes sent while it waits.
SHOWN_EVERY_S = 0.2


class UploadQueue:
    """One process's uploads into the destination ``upload`` names."""

    def __init__(self, upload: remote_output.Upload) -> None:
        self._destination = upload.open()
        self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="osdpipe-upload")
        self._sent: list[tuple[list[str], Future[None]]] = []
        self._following: dict[str, FollowedUpload] = {}  # rank files that went up as they were written, by name
        self._handed: list[str] = []  # the followed files handed over, to be made whole
        self._whole_sent = self._whole_total = 0  # of the files sent whole: bytes that went up, bytes handed over
        self._lock = threading.Lock()

    @contextmanager
    def following(self, directory: Path) -> Iterator[None]:
        """Every rank file written inside (into ``directory``, the staged conversion) goes up as it is written: the
        markers excepted, which only :func:`osdpipe.io.remote_output.publish` sends."""

        def follow(path: Path) -> FollowedUpload | None:
            name = path.relative_to(directory).as_posix()
            if remote_output.is_marker(name) or name in self._following:
                return None
            self._following[name] = FollowedUpload(self._destination, directory, name)
            return self._following[name]

        with followed_as_written(follow):
            yield

    def followed(self, name: str) -> FollowedUpload | None:
        """The upload of rank file ``name`` that went up as it was written, if it did."""
        return self._following.get(name)

    def send(self, directory: Path, names: list[str]) -> None:
        """Upload ``names`` (paths relative to ``directory``, the staged conversion) in the background, or make whole
        those that went up as they were written; the markers among them are left to
        :func:`osdpipe.io.remote_output.publish`."""
        data = [n for n in sorted(names) if not remote_output.is_marker(n)]
        followed = [n for n in data if n in self._following and self._following[n].written]
        for name in followed:
            self._handed.append(name)
            self._sent.append(([name], self._pool.submit(self._following[name].commit)))
        whole = [n for n in data if n not in followed]
        if whole:
            with self._lock:  # a file not there fails its upload, said by finish()
                self._whole_total += sum((directory / n).stat().st_size for n in whole if (directory / n).is_file())
            batch = self._pool.submit(remote_output.send, self._destination, directory, whole, self._whole_went_up)
            self._sent.append((whole, batch))

    def _whole_went_up(self, n: int) -> None:
        with self._lock:
            self._whole_sent += n

    def progress(self) -> tuple[int, int]:
        """``(sent, total)``: the bytes that went up of every file handed over so far, and those files' bytes."""
        with self._lock:
            sent, total = self._whole_sent, self._whole_total
        for name in self._handed:
            went_up, written = self._following[name].progress()
            sent, total = sent + went_up, total + written
        return sent, total

    def finish(self, shown: Callable[[int, int], None] | None = None) -> str | None:
        """Wait for every upload; the first failure in one line (naming the first file of its batch, a rank's files),
        or ``None``. ``shown(sent, total)`` is told the bytes sent (:meth:`progress`) every :data:`SHOWN_EVERY_S`
        meanwhile, and once all are done: the tail of a large output's upload, after its last rank converted."""
        try:
            pending = {future for _, future in self._sent}
            while shown is not None and pending:
                shown(*self.progress())
                done, pending = wait(pending, timeout=SHOWN_EVERY_S, return_when=FIRST_EXCEPTION)
                if any(f.exception() is not None for f in done):
                    break  # said below, as the first failure
            if shown is not None:
                shown(*self.progress())
            for names, sent in self._sent:
                try:
                    sent.result()
                except Exception as exc:  # noqa: BLE001 - said as the save stage's failure
                    return str(self._destination.fail(exc, names[0]))
            return None
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Send nothing more; wait for the uploads under way (their files are read from the staged conversion,
        which a failed run then removes); abandon the files followed as written that no rank handed over."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for upload in self._following.values():
            upload.cancel()  # nothing to do for one made whole

    def withdraw(self) -> None:
        """For a run that failed: send nothing more, and once nothing is in flight, remove from the destination what
        this queue sent (:func:`osdpipe.io.remote_output.withdraw`). The launcher removes the whole run's files too
        (:func:`osdpipe.io.remote_output.discard`), but under torchrun it is another process: an upload of this one
        still in flight then would land after it, named by no note."""
        self.cancel()
        sent = [n for names, future in self._sent if future.done() and not future.cancelled() for n in names]
        remote_output.withdraw(self._destination, sent)
