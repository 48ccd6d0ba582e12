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
keep whole, and the staging and the server-side copies are skipped (:func:`_write_direct`): ``.incoming/writing.json``
names the files the run writes, then every file is uploaded straight to its own key, the markers last in the same
order (so a reader that lists the prefix meanwhile finds no ``.metadata`` before the files it describes, and no
manifest before the whole conversion), and the note is deleted. A run killed before the end leaves the note and some
of the files, no manifest; the next run into the prefix removes the files it names (markers first) and the note, and
aborts the multipart uploads into them; ``osdpipe check`` says the prefix holds no whole conversion and why. With
``output.overwrite=true`` over a conversion in place the steps above are kept: the old conversion stays whole until
the new one is.

``report.json`` and ``osdpipe.log`` are not part of a conversion: they are uploaded after the commit
(:func:`publish_record`), and stay in the local job directory, from which the conversion itself is then removed. A
run that fails uploads nothing: its report is in the local job directory.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from osdpipe.io import store
from osdpipe.io.output import MANIFEST, OutputError, conversion_entries, conversion_names

INCOMING = ".incoming"
#: Under ``.incoming/``, while a run writes a conversion straight into a prefix that held none: the files it writes.
WRITING = "writing.json"
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
    #: What :func:`recover` did to the prefix before the run: said in the run's warnings.
    notes: list[str] = field(default_factory=list)

    def key(self, *names: str) -> str:
        """fsspec's path of ``names`` under the prefix."""
        return self.location.child(*names).path

    def fail(self, exc: BaseException, *names: str) -> OutputError:
        key = self.location.child(*names) if names else None
        error = store.failure(exc, self.location, WHERE, self.storage_options, key=key)
        assert isinstance(error, OutputError)
        return error


def markers_last(names: list[str]) -> list[str]:
    """``names`` (paths relative to the conversion) in upload order: the markers (:data:`MARKERS`) last, ``.metadata``
    files before the manifest."""

    def rank(name: str) -> int:
        base = name.rsplit("/", 1)[-1]
        return MARKERS.index(base) + 1 if base in MARKERS else 0

    return sorted(names, key=lambda n: (rank(n), n))


def prepare(url: str, overwrite: bool, storage_options: Mapping[str, Any] | None = None) -> Destination:
    """The prefix ``url``, proven writable (an object written and deleted), an earlier run's leftovers recovered
    (:func:`recover`), and refused when it holds a conversion and ``overwrite`` is false.

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
    destination = Destination(location, options, store.filesystem(location, options, WHERE))
    destination.notes.extend(recover(destination))
    held = _conversion_in_place(destination)
    if held and not overwrite:
        raise OutputError(
            f"{WHERE}={location.url!r} already holds a conversion ({', '.join(held[:3])}); "
            "choose another path or set output.overwrite=true"
        )
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
    if WRITING in incoming:  # a run writing straight into the prefix was killed: what it wrote is removed
        notes += _undo_direct(destination)
        incoming.remove(WRITING)
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


def publish(destination: Destination, directory: Path) -> list[str]:
    """Upload the conversion committed in the local ``directory`` into the prefix and commit it there whole (see the
    module docstring: staged and copied into place over a conversion, straight to its keys into a prefix that holds
    none), then the run's record (:func:`publish_record`); the local copy of the conversion is removed
    (``report.json`` and ``osdpipe.log`` stay). Returns the uploaded files (relative paths), in upload order.

    The manifest's ``config.output.path`` is the prefix's URL (the conversion's digests do not cover it).

    Raises:
        OutputError: the upload or the commit failed; what the upload had put under ``.incoming/`` (or, into an
            empty prefix, in place) is removed.
    """
    local = [p for entry in conversion_entries(directory) for p in ([entry] if entry.is_file() else entry.rglob("*"))]
    names = markers_last([p.relative_to(directory).as_posix() for p in local if p.is_file()])
    if not _conversion_in_place(destination):  # nothing to keep whole: no staging, no server-side copy
        _write_direct(destination, directory, names)
    else:
        _stage(destination, directory, names)
        _commit(destination, names)
    publish_record(destination, directory)
    for entry in conversion_entries(directory):  # committed in the prefix: the local copy's disk is given back
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    return names


def _upload(destination: Destination, directory: Path, names: list[str], *under: str) -> None:
    """``names`` (in :func:`markers_last` order) from ``directory`` to the prefix (or ``under`` it): the data files
    several in flight, then the markers one by one, in order; the manifest with the prefix's URL in it."""
    data = [n for n in names if n.rsplit("/", 1)[-1] not in MARKERS]
    if data:
        destination.fs.put(
            [str(directory / n) for n in data], [destination.key(*under, n) for n in data]
        )  # several in flight (s3fs: its max_concurrency); a large file in parts as it is read
    for name in names[len(data) :]:
        if name == MANIFEST:
            destination.fs.pipe_file(destination.key(*under, name), _manifest_for(directory, destination))
        else:
            destination.fs.put_file(str(directory / name), destination.key(*under, name))


def _write_direct(destination: Destination, directory: Path, names: list[str]) -> None:
    """Into a prefix that holds no conversion: every file straight to its own key, the markers last, so that a
    reader that lists the prefix meanwhile finds no marker (no ``.metadata``, no manifest) before every file it
    vouches for is there. :data:`WRITING` under ``.incoming/`` names the files first and is deleted last: a run
    killed in between leaves it, and the next run (:func:`recover`) removes what it names, ``osdpipe check`` says
    so. A failed upload removes what it wrote."""
    note = destination.key(INCOMING, WRITING)
    try:
        destination.fs.pipe_file(note, json.dumps({"files": names}, indent=2).encode())
        _upload(destination, directory, names)
        destination.fs.rm_file(note)
    except Exception as exc:  # noqa: BLE001
        error = destination.fail(exc)
        try:
            _remove_written(destination, names)
            destination.fs.rm_file(note)
        except Exception:  # noqa: BLE001 - the next run names what is left (recover)
            pass
        raise error from None


def _remove_written(destination: Destination, names: list[str]) -> list[str]:
    """Of ``names``, those in the prefix, deleted, markers first (the manifest, then ``.metadata``: no reader takes
    what is left for a conversion); returns them."""
    there = set(_objects(destination))
    written = [n for n in names if n in there]
    markers = list(reversed(markers_last([n for n in written if n.rsplit("/", 1)[-1] in MARKERS])))
    for name in markers:
        destination.fs.rm_file(destination.key(name))
    rest = [destination.key(n) for n in written if n not in markers]
    if rest:
        destination.fs.rm(rest)
    return written


def _undo_direct(destination: Destination) -> list[str]:
    """A run that wrote straight into an empty prefix (:func:`_write_direct`) and was killed before the end: the
    files it names, removed, unless its manifest (its last file) made it whole; its unfinished multipart uploads
    aborted. Returns what was done, in words."""
    try:
        named = json.loads(destination.fs.cat_file(destination.key(INCOMING, WRITING)))["files"]
        if not isinstance(named, list) or not all(isinstance(n, str) for n in named):
            raise ValueError(f"{WRITING} does not list files")
        if MANIFEST in named and MANIFEST in _objects(destination):
            destination.fs.rm_file(destination.key(INCOMING, WRITING))  # whole: only its note was left
            return []
        removed = _remove_written(destination, named)
        destination.fs.rm_file(destination.key(INCOMING, WRITING))
    except Exception as exc:  # noqa: BLE001
        raise destination.fail(exc, INCOMING, WRITING) from None
    notes = []
    if removed:
        shown = ", ".join(removed[:5]) + (f" and {len(removed) - 5} more" if len(removed) > 5 else "")
        notes.append(
            f"removed {len(removed)} object(s) of an unfinished conversion that a run killed while writing it into "
            f"{destination.location.url} left (no manifest; no reader took them for a conversion): {shown}"
        )
    return notes + _abort_unfinished_uploads(destination, named)


def _stage(destination: Destination, directory: Path, names: list[str]) -> None:
    """Step 1 of the module docstring: every file under ``.incoming/``, the markers last; a failure removes it."""
    try:
        _upload(destination, directory, names, INCOMING)
    except Exception as exc:  # noqa: BLE001
        error = destination.fail(exc)
        try:
            destination.fs.rm(destination.key(INCOMING), recursive=True)
        except Exception:  # noqa: BLE001 - the next run names what is left (recover)
            pass
        raise error from None


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
        old_markers = list(reversed(markers_last([o for o in old if o.rsplit("/", 1)[-1] in MARKERS])))
        for name in old_markers:  # the manifest first: from here no reader takes the prefix for a whole conversion
            fs.rm_file(key(name))
        new = set(incoming)
        gone = [key(o) for o in old if o not in new and o not in old_markers]
        if gone:
            fs.rm(gone)
        ordered = markers_last(incoming)
        data = [n for n in ordered if n.rsplit("/", 1)[-1] not in MARKERS]
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
