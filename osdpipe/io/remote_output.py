"""A conversion committed whole into object storage (``output.path=s3://bucket/prefix`` or ``gs://...``).

The conversion is made and committed on the local disk as any other (:mod:`osdpipe.io.output`, in the job's directory
``outputs/<date>/<time>/``), then :func:`publish` puts it into the prefix. An object store has no rename and no
directory to swap, so a reader that lists the prefix while objects arrive must not take part of them for a whole
conversion, and a run that dies must leave the previous conversion or the new one whole. The order:

1. every file of the conversion is uploaded under ``<prefix>/.incoming/``, the files that mark a conversion complete
   last (:func:`markers_last`: DCP's ``.metadata``, Megatron-LM's ``latest_checkpointed_iteration.txt``, then
   ``manifest.json``). Until ``.incoming/manifest.json`` exists
   the previous conversion in the prefix is untouched; a failed upload removes what it uploaded;
2. committing (``.incoming/manifest.json`` there: the new conversion is whole and from here on only goes forward):
   the previous conversion's markers are deleted first (``manifest.json``, then ``.metadata``: from this moment no
   reader takes the prefix for a complete conversion), then its other objects that the new one does not have;
3. every object of ``.incoming/`` is copied into place, server side, the markers last (``.metadata``, then
   ``manifest.json``: the prefix is a complete conversion again, the new one);
4. ``.incoming/`` is deleted.

This is "write beside, delete the old only once the new is complete", not "a fresh prefix and a pointer": readers
(``dcp.load`` through PyTorch's ``FsspecReader``, torchtitan, ``osdpipe check``) read the prefix they are given and
follow no pointer. A run killed during step 1 leaves the previous conversion whole and stray objects under
``.incoming/``; killed during steps 2 to 4, the new conversion whole under ``.incoming/``. The next run into the
prefix (:func:`prepare`, through :func:`recover`) finishes the commit in the second case, removes the strays in the
first, aborts in both the S3 multipart uploads the killed run left unfinished (a large file's upload, or its
server-side copy into place: no listing shows them, but S3 keeps and bills their parts), and names what it did in the
run's warnings. The copy into place costs a server-side copy of every object
(no bytes through this machine).

Into a prefix that holds no conversion (a first conversion, or a prefix whose last run was undone) there is nothing to
keep whole, and the staging and the server-side copies are skipped (:attr:`Destination.staged` is false): every file
is uploaded straight to its own key, each named first in a note under ``.incoming/writing/`` (:func:`send`), the
markers last in the same order (so a reader that lists the prefix meanwhile finds no ``.metadata`` before the files it
describes, and no manifest before the whole conversion); the notes are deleted last. A run killed before the end
leaves notes and some of the files, no manifest; the next run into the prefix removes the files they name (markers
first) and the notes, and aborts the multipart uploads into them; ``osdpipe check`` says the prefix holds no whole
conversion and why. With ``output.overwrite=true`` over a conversion in place the steps above are kept: the old
conversion stays whole until the new one is.

The data files need not wait for the whole conversion: the ranks send theirs as soon as their save stage has written
and checked them (:class:`osdpipe.io.upload_queue.UploadQueue`, given an :class:`Upload`), while the next ranks
convert; :func:`publish` then uploads only what is not there yet, and the markers. A run that fails after some were
sent removes them (:func:`discard`).

Under torchrun the nodes share no directory: each process makes its ranks' files in a local directory of its own and
sends them as above; rank 0 alone prepares the prefix (the others take from it how files go in: :class:`Upload`),
writes the files that finish the conversion and the manifest, which lists every file, and publishes: the files it
does not hold are the others', already in the prefix (:func:`conversion_files`, :func:`sent_ahead`).

``report.json`` and ``osdpipe.log`` are not part of a conversion: they are uploaded after the commit
(:func:`publish_record`), and stay in the local job directory, from which the conversion itself is then removed. A
run that fails leaves nothing in the prefix: its report is in the local job directory.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from osdpipe.io import store
from osdpipe.io.output import MANIFEST, OutputError, OutputHeld, already_holds, conversion_entries, conversion_names

INCOMING = ".incoming"
#: Under ``.incoming/``, while a run writes a conversion straight into a prefix that held none: notes (JSON, each
#: ``{"files": [...]}``) naming the files it writes, one per batch, each written before the batch's first byte.
WRITING = "writing"
#: What a run writes and deletes in the prefix to prove it may write there.
PROBE = ".osdpipe-write-test"
#: Files that mark a conversion complete, in the order they are written (last: the manifest); deleted in reverse:
#: DCP's ``.metadata`` (its loaders key on it), Megatron-LM's ``latest_checkpointed_iteration.txt`` (its load reads it
#: first, then the iteration folder it names), osdpipe's manifest.
MARKERS = (".metadata", "latest_checkpointed_iteration.txt", MANIFEST)
#: What of a run is not part of its conversion, uploaded after it.
RECORDS = ("report.json", "osdpipe.log")
WHERE = "output.path"


@dataclass
class Destination:
    """A prefix in object storage, proven writable: where :func:`publish` commits a conversion."""

    location: store.Location
    storage_options: Mapping[str, Any]
    fs: Any
    #: A conversion is in place, kept whole until the new one is: files go under ``.incoming/`` and are copied into
    #: place at the commit. Otherwise straight to their keys, each named in a note first.
    staged: bool = False
    #: What :func:`recover` did to the prefix before the run: said in the run's warnings.
    notes: list[str] = field(default_factory=list)
    #: The parts files go up in (:func:`osdpipe.io.store.upload_part_bytes`; ``None``: the store client's own).
    part_bytes: int | None = None

    @property
    def upload(self) -> Upload:
        """What a rank's process needs to send files here."""
        return Upload(self.location.url, dict(self.storage_options), self.staged, self.part_bytes)

    @property
    def sent_under(self) -> tuple[str, ...]:
        """Where a conversion's files go before the commit, under the prefix: ``.incoming/`` where it is staged, else
        the prefix itself (straight to their keys)."""
        return (INCOMING,) if self.staged else ()

    def key(self, *names: str) -> str:
        """fsspec's path of ``names`` under the prefix."""
        return self.location.child(*names).path

    def fail(self, exc: BaseException, *names: str) -> OutputError:
        key = self.location.child(*names) if names else None
        error = store.failure(exc, self.location, WHERE, self.storage_options, key=key)
        assert isinstance(error, OutputError)
        return error


@dataclass(frozen=True)
class Upload:
    """A :class:`Destination` as it travels to the processes that play the ranks (in the plan): its URL, options and
    mode, from which each process opens its own."""

    url: str
    storage_options: dict[str, Any]
    staged: bool
    part_bytes: int | None = None
    #: Why rank 0 could not prepare the prefix (under torchrun: said by every rank when the world meets).
    refused: str | None = None

    @classmethod
    def from_rank0(
        cls, url: str, storage_options: Mapping[str, Any] | None, memory_budget: int | None, refused: str | None = None
    ) -> Upload:
        """What a process knows of the destination before the world meets under torchrun, where rank 0 alone
        prepares the prefix: where it is and in what parts files go up (and, on rank 0, why the prefix was
        ``refused``). Whether files are staged (:attr:`Destination.staged`) is what rank 0 found: its :class:`Upload`
        replaces this one when the world meets (:mod:`osdpipe.pipeline.execute`)."""
        options = dict(storage_options or {})
        return cls(url, options, staged=False, part_bytes=store.upload_part_bytes(memory_budget), refused=refused)

    def accepted(self) -> Upload:
        """This upload, where rank 0 prepared the prefix.

        Raises:
            OutputError: why it could not (no such bucket, a conversion already there, ...).
        """
        if self.refused is not None:
            raise OutputError(self.refused)
        return self

    def open(self) -> Destination:
        location = store.parse(self.url, WHERE)
        fs = store.filesystem(location, self.storage_options, WHERE)
        return Destination(location, self.storage_options, fs, self.staged, part_bytes=self.part_bytes)


def is_marker(name: str) -> bool:
    """Whether ``name`` (a path relative to the conversion) is a file that marks a conversion complete."""
    return name.rsplit("/", 1)[-1] in MARKERS


def markers_last(names: list[str]) -> list[str]:
    """``names`` (paths relative to the conversion) in upload order: the markers (:data:`MARKERS`) last, ``.metadata``
    files before the manifest."""

    def rank(name: str) -> int:
        base = name.rsplit("/", 1)[-1]
        return MARKERS.index(base) + 1 if base in MARKERS else 0

    return sorted(names, key=lambda n: (rank(n), n))


def prepare(
    url: str, overwrite: bool, storage_options: Mapping[str, Any] | None = None, memory_budget: int | None = None
) -> Destination:
    """The prefix ``url``, proven writable (an object written and deleted), an earlier run's leftovers recovered
    (:func:`recover`), and refused when it holds a conversion and ``overwrite`` is false. Under ``memory_budget``
    (``runtime.memory_budget``) files go up in parts of a size it bounds (:func:`osdpipe.io.store.upload_part_bytes`).

    Raises:
        OutputError: in one line naming the URL (no such bucket, access denied, no credentials, an endpoint that does
            not answer, a conversion already there).
    """
    try:
        location = store.parse(url, WHERE)
    except ValueError as exc:
        raise OutputError(str(exc)) from None
    options = dict(storage_options or {})
    probe = Destination(location, options, store.filesystem(location, options, WHERE, probe=True))
    bound = store.first_look_s(location.scheme, options)  # a PUT waits for "100 Continue" with no timeout of its own
    try:
        probe.fs.pipe_file(probe.key(PROBE), b"", timeout=bound)
        probe.fs.rm_file(probe.key(PROBE), timeout=bound)
    except Exception as exc:  # noqa: BLE001 - said in one line, whatever the backend raised
        raise probe.fail(exc) from None
    destination = Destination(
        location, options, store.filesystem(location, options, WHERE), part_bytes=store.upload_part_bytes(memory_budget)
    )
    destination.notes.extend(recover(destination))
    held = _conversion_in_place(destination)
    if held and not overwrite:
        raise OutputHeld(already_holds(location.url, held))
    destination.staged = bool(held)  # nothing to keep whole: no staging, no server-side copy
    return destination


def _objects(destination: Destination, *under: str) -> list[str]:
    """Every object under the prefix (or ``under`` it), as paths relative to that."""
    root = destination.key(*under)
    try:
        found = destination.fs.find(root)
    except FileNotFoundError:
        return []
    except Exception as exc:  # noqa: BLE001
        raise destination.fail(exc, *under) from None
    return sorted(p[len(root) + 1 :] for p in found if p.startswith(root + "/"))


def _conversion_in_place(destination: Destination) -> list[str]:
    """The top-level names of the conversion in the prefix (what an overwrite replaces)."""
    tops = sorted({o.split("/", 1)[0] for o in _objects(destination) if not o.startswith(INCOMING + "/")})
    manifest = None
    if MANIFEST in tops:
        try:
            manifest = destination.fs.cat_file(destination.key(MANIFEST)).decode()
        except Exception as exc:  # noqa: BLE001
            raise destination.fail(exc, MANIFEST) from None
    return conversion_names(tops, manifest)


def recover(destination: Destination) -> list[str]:
    """Bring a prefix that an earlier run left mid-way back to one whole conversion; returns what was done, in words.

    ``.incoming/`` with its manifest: the commit was under way, it is finished. Without: the upload was cut; the
    objects it left are removed, and named. Either way the multipart uploads it left unfinished are aborted
    (:func:`_abort_unfinished_uploads`).
    """
    incoming = _objects(destination, INCOMING)
    if MANIFEST in incoming:
        _commit(destination, incoming)
        return [
            f"finished committing into {destination.location.url} the conversion that a run killed while "
            "committing left",
            *_abort_unfinished_uploads(destination, incoming),  # its server-side copies of large objects, in parts
        ]
    notes = []
    written = [o for o in incoming if o.startswith(WRITING + "/")]
    if written:  # a run writing straight into the prefix was killed: what it wrote is removed
        notes += _undo_direct(destination, written)
        incoming = [o for o in incoming if o not in written]
    if incoming:
        shown = ", ".join(incoming[:5]) + (f" and {len(incoming) - 5} more" if len(incoming) > 5 else "")
        try:
            destination.fs.rm([destination.key(INCOMING, o) for o in incoming])
        except Exception as exc:  # noqa: BLE001
            raise destination.fail(exc, INCOMING) from None
        notes.append(
            f"removed {len(incoming)} stray object(s) an unfinished run left under "
            f"{destination.location.child(INCOMING).url}/: {shown}"
        )
    return notes + _abort_unfinished_uploads(destination)


def _abort_unfinished_uploads(destination: Destination, committed: list[str] = ()) -> list[str]:
    """Abort the multipart uploads a killed run began under ``.incoming/`` (its upload) or into the objects of the
    conversion it was committing (``committed``: its server-side copies of large objects go in parts too), S3 only: no
    object shows them, but S3 keeps their parts, and bills them, until they are aborted. Returns what was done, in
    words; a store that does not let the credentials list or abort them is said in a note, not as a failure (the
    conversion is not touched)."""
    if destination.location.scheme != "s3":
        return []
    top = destination.location.key + "/" if destination.location.key else ""
    prefix = destination.location.child(INCOMING).key + "/"
    fs, bucket = destination.fs, destination.location.bucket
    try:
        uploads, asked = [], {"Bucket": bucket, "Prefix": top if committed else prefix}
        while True:
            answer = fs.call_s3("list_multipart_uploads", **asked)
            uploads += answer.get("Uploads", [])
            if not answer.get("IsTruncated"):
                break
            asked.update(KeyMarker=answer["NextKeyMarker"], UploadIdMarker=answer["NextUploadIdMarker"])
        uploads = [u for u in uploads if u["Key"].startswith(prefix) or u["Key"].removeprefix(top) in committed]
        for upload in uploads:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    except Exception as exc:  # noqa: BLE001 - a note: the parts cost storage, they do not touch a conversion
        return [
            f"could not abort the multipart uploads an unfinished run may have left under "
            f"{destination.location.child(INCOMING).url}/ ({store.failure(exc, destination.location, WHERE)}); "
            "a lifecycle rule (AbortIncompleteMultipartUpload) removes them"
        ]
    if not uploads:
        return []
    names = sorted({u["Key"].removeprefix(top) for u in uploads})
    return [
        f"aborted {len(uploads)} unfinished multipart upload(s) an unfinished run left under "
        f"{destination.location.url}/: {', '.join(names[:5])}"
        + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    ]


def publish(destination: Destination, directory: Path, shown: Callable[[int, int], None] | None = None) -> list[str]:
    """Upload the conversion committed in the local ``directory`` into the prefix and commit it there whole (see the
    module docstring: staged and copied into place over a conversion, straight to its keys into a prefix that holds
    none), then the run's record (:func:`publish_record`); the local copy of the conversion is removed
    (``report.json`` and ``osdpipe.log`` stay). Files the ranks sent as they were written (:func:`sent_ahead`) are not
    sent again; ``shown(done, total)`` is told the bytes sent so far of those it sends. Returns every file of the
    conversion (relative paths), in upload order.

    The manifest's ``config.output.path`` is the prefix's URL (the conversion's digests do not cover it).

    Raises:
        OutputError: the upload failed: what this run put into the prefix (under ``.incoming/``, or, into a prefix
            that held no conversion, in place) is removed (:func:`discard`); or the commit did: the next run into the
            prefix finishes it (:func:`recover`).
    """
    names = conversion_files(directory)
    try:
        ahead = sent_ahead(destination, directory, names)
        unsent = [n for n in names if n not in ahead and not (directory / n).is_file()]
        rest = [] if unsent else [n for n in names if n not in ahead]
        send(destination, directory, rest, None if shown is None else _counted(directory, rest, shown))
    except Exception as exc:  # noqa: BLE001 - before the manifest: nothing of this run is taken for a conversion
        error = destination.fail(exc)
        discard(destination)
        raise error from None
    if unsent:  # another process's files (torchrun): said sent, not there
        discard(destination)
        raise OutputError(
            f"{WHERE}={destination.location.url!r}: {len(unsent)} file(s) of the conversion are neither in "
            f"{directory} nor in the prefix ({', '.join(unsent[:3])}); the processes that wrote them did not send "
            "them: run the conversion again"
        )
    if destination.staged:
        _commit(destination, names)  # cut short, the next run into the prefix finishes it (recover)
    else:
        try:  # every file in place, the manifest last: the notes that named them go
            destination.fs.rm(destination.key(INCOMING), recursive=True)
        except Exception as exc:  # noqa: BLE001 - the conversion is whole; the next run removes the notes
            raise destination.fail(exc, INCOMING) from None
    publish_record(destination, directory)
    for entry in conversion_entries(directory):  # committed in the prefix: the local copy's disk is given back
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    return names


def conversion_files(directory: Path) -> list[str]:
    """Every file of the conversion committed in ``directory`` (paths relative to it), in upload order: those there,
    and those its manifest lists that another process made and sent (under torchrun every process stages its own
    ranks' files in a directory of its own: :mod:`osdpipe.cli.compose`)."""
    local = [p for entry in conversion_entries(directory) for p in ([entry] if entry.is_file() else entry.rglob("*"))]
    names = {p.relative_to(directory).as_posix() for p in local if p.is_file()}
    if (directory / MANIFEST).is_file():
        names |= set(json.loads((directory / MANIFEST).read_text()).get("files", {}))
    return markers_last(sorted(names))


def send(
    destination: Destination, directory: Path, names: list[str], sent: Callable[[int], None] | None = None
) -> None:
    """``names`` (paths relative to ``directory``, in :func:`markers_last` order) into the destination: under
    ``.incoming/`` where it is staged, else straight to their keys after a note naming them (:data:`WRITING`); the
    data files several in flight, then the markers one by one, in order; the manifest with the prefix's URL in it.
    ``sent(n)``: ``n`` more bytes went up. Called by :func:`publish` and, for data files as they are written, by the
    ranks' upload queues."""
    if not names:
        return
    files, each = _callbacks(sent)
    under = destination.sent_under
    if not destination.staged:  # one note per batch: the ranks' processes send theirs at the same time
        write_note(destination, names)
    data = [n for n in names if not is_marker(n)]
    parts = store.upload_options(
        destination.location.scheme, destination.part_bytes, max((directory / n).stat().st_size for n in names)
    )
    if data:
        destination.fs.put(
            [str(directory / n) for n in data], [destination.key(*under, n) for n in data], callback=files, **parts
        )  # several in flight; a large file in parts as it is read
    for name in names[len(data) :]:
        if name == MANIFEST:
            destination.fs.pipe_file(destination.key(*under, name), _manifest_for(directory, destination))
            each.relative_update((directory / name).stat().st_size)  # as counted: the local file's size
        else:
            destination.fs.put_file(str(directory / name), destination.key(*under, name), callback=each, **parts)


def write_note(destination: Destination, names: list[str]) -> None:
    """Name ``names`` in a note of their own under ``.incoming/writing/``, before their first byte goes straight to
    their keys (a prefix that held no conversion): what a run killed meanwhile leaves, the next removes
    (:func:`recover`)."""
    note = destination.key(INCOMING, WRITING, f"{uuid.uuid4().hex}.json")
    destination.fs.pipe_file(note, json.dumps({"files": names}).encode())


def _callbacks(sent: Callable[[int], None] | None) -> tuple[Any, Any]:
    """fsspec's callbacks that pass on to ``sent`` the bytes an upload sends: one for ``put`` of several files (which
    counts files itself and hands each file's transfer a child), one for a file's transfer. s3fs says each part's
    bytes (``relative_update``), gcsfs how far the file is (``absolute_update``): both count."""
    from fsspec.callbacks import Callback  # fsspec: only for an output in object storage

    class Bytes(Callback):
        def relative_update(self, inc: int = 1) -> None:
            self.absolute_update(self.value + inc)

        def absolute_update(self, value: int) -> None:
            if sent is not None and value > self.value:
                sent(value - self.value)
            self.value = value

    class Files(Callback):
        def branched(self, path_1: str, path_2: str, **kwargs: Any) -> Callback:
            return Bytes()

    return Files(), Bytes()


def _counted(directory: Path, names: list[str], shown: Callable[[int, int], None]) -> Callable[[int], None]:
    """A ``sent`` for :func:`send` that tells ``shown`` the bytes sent so far of ``names``' total."""
    total, done = sum((directory / n).stat().st_size for n in names), 0

    def sent(n: int) -> None:
        nonlocal done
        done += n
        shown(done, total)

    return sent


def sent_ahead(destination: Destination, directory: Path, names: list[str]) -> set[str]:
    """Of ``names``, the data files already in the destination as the local files in ``directory`` are (their size),
    or, of those not in ``directory`` (another process's), there at all: sent by the ranks as they were written. What
    is there was sent by this run: :func:`prepare` left nothing of an earlier one under ``.incoming/``, nor, into a
    prefix that held no conversion, at a conversion's keys."""
    under = destination.sent_under
    root = destination.key(*under)
    destination.fs.invalidate_cache()  # listed before the run: what the ranks sent since is not in the cache
    try:
        found = destination.fs.find(root, detail=True)
    except FileNotFoundError:
        return set()
    sizes = {path[len(root) + 1 :]: info.get("size") for path, info in found.items()}
    return {
        n
        for n in names
        if not is_marker(n)
        and n in sizes
        and (not (directory / n).is_file() or sizes[n] == (directory / n).stat().st_size)
    }


def discard(destination: Destination) -> None:
    """Remove what this run put into the prefix: ``.incoming/`` where it is staged (the conversion in place is
    untouched); else the files its notes name, then the notes. For a run that failed, or whose upload did: nothing of
    it stays. What cannot be removed is left to the next run (:func:`recover`), which names it."""
    try:
        if destination.staged:
            destination.fs.rm(destination.key(INCOMING), recursive=True)
        else:
            notes = [o for o in _objects(destination, INCOMING) if o.startswith(WRITING + "/")]
            if notes:
                _undo_direct(destination, notes)
    except Exception:  # noqa: BLE001 - the next run names what is left (recover)
        pass


def withdraw(destination: Destination, names: list[str]) -> None:
    """Remove ``names`` (data files this process sent, paths relative to the conversion) from the destination, where
    they are: under ``.incoming/`` where it is staged, else at their keys. What cannot be removed is left to the
    launcher's :func:`discard` and to the next run (:func:`recover`)."""
    if not names:
        return
    under = destination.sent_under
    try:
        destination.fs.invalidate_cache()
        there = set(_objects(destination, *under))
        gone = [destination.key(*under, n) for n in names if n in there]
        if gone:
            destination.fs.rm(gone)
    except Exception:  # noqa: BLE001 - the run has failed already; the launcher and the next run clean up
        pass


def _remove_written(destination: Destination, names: list[str]) -> list[str]:
    """Of ``names``, those in the prefix, deleted, markers first (the manifest, then ``.metadata``: no reader takes
    what is left for a conversion); returns them."""
    there = set(_objects(destination))
    written = [n for n in names if n in there]
    markers = list(reversed(markers_last([n for n in written if is_marker(n)])))
    for name in markers:
        destination.fs.rm_file(destination.key(name))
    rest = [destination.key(n) for n in written if n not in markers]
    if rest:
        destination.fs.rm(rest)
    return written


def named_in_notes(read: Any, notes: list[str]) -> list[str]:
    """The files that the notes (paths under ``.incoming/``) of a run writing straight into a prefix name, in order,
    each once; ``read(note)`` gives a note's bytes.

    Raises:
        ValueError: a note that is not one osdpipe wrote.
    """
    named: list[str] = []
    for note in sorted(notes):
        files = json.loads(read(note))["files"]
        if not isinstance(files, list) or not all(isinstance(n, str) for n in files):
            raise ValueError(f"{INCOMING}/{note} does not list files")
        named += [n for n in files if n not in named]
    return named


def _undo_direct(destination: Destination, notes: list[str]) -> list[str]:
    """A run that wrote straight into a prefix that held no conversion and was killed before the end (``notes``: its
    notes, paths under ``.incoming/``): the files they name, removed, unless its manifest (its last file) made it
    whole; the notes removed; its unfinished multipart uploads aborted. Returns what was done, in words."""
    try:
        named = named_in_notes(lambda note: destination.fs.cat_file(destination.key(INCOMING, note)), notes)
        whole = MANIFEST in named and MANIFEST in _objects(destination)
        removed = [] if whole else _remove_written(destination, named)  # whole: only its notes were left
        destination.fs.rm([destination.key(INCOMING, note) for note in notes])
    except Exception as exc:  # noqa: BLE001
        raise destination.fail(exc, INCOMING, WRITING) from None
    if whole:
        return []
    notes_said = []
    if removed:
        shown = ", ".join(removed[:5]) + (f" and {len(removed) - 5} more" if len(removed) > 5 else "")
        notes_said.append(
            f"removed {len(removed)} object(s) of an unfinished conversion that a run killed while writing it into "
            f"{destination.location.url} left (no manifest; no reader took them for a conversion): {shown}"
        )
    return notes_said + _abort_unfinished_uploads(destination, named)


def _manifest_for(directory: Path, destination: Destination) -> bytes:
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest.setdefault("config", {}).setdefault("output", {})["path"] = destination.location.url
    return json.dumps(manifest, indent=2, sort_keys=True).encode()


def _commit(destination: Destination, incoming: list[str]) -> None:
    """Steps 2 to 4 of the module docstring; each can be repeated after an interruption."""
    fs, key = destination.fs, destination.key
    try:
        old = [o for o in _objects(destination) if not o.startswith(INCOMING + "/") and o not in RECORDS]
        tops = set(_conversion_in_place(destination))
        old = [o for o in old if o.split("/", 1)[0] in tops]
        old_markers = list(reversed(markers_last([o for o in old if is_marker(o)])))
        for name in old_markers:  # the manifest first: from here no reader takes the prefix for a whole conversion
            fs.rm_file(key(name))
        new = set(incoming)
        gone = [key(o) for o in old if o not in new and o not in old_markers]
        if gone:
            fs.rm(gone)
        ordered = markers_last(incoming)
        data = [n for n in ordered if not is_marker(n)]
        if data:
            fs.copy([key(INCOMING, n) for n in data], [key(n) for n in data])
        for name in ordered[len(data) :]:  # .metadata, then the manifest: the prefix is whole again
            fs.copy(key(INCOMING, name), key(name))
        fs.rm(key(INCOMING), recursive=True)
    except Exception as exc:  # noqa: BLE001
        raise destination.fail(exc) from None


def publish_record(destination: Destination, directory: Path) -> None:
    """Upload the run's ``report.json`` and ``osdpipe.log`` from ``directory`` into the prefix, each whole (one PUT)."""
    for name in RECORDS:
        if (directory / name).is_file():
            try:
                destination.fs.pipe_file(destination.key(name), (directory / name).read_bytes())
            except Exception as exc:  # noqa: BLE001
                raise destination.fail(exc, name) from None
