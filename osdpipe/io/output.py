"""The output directory's life: check it can be written, stage a conversion, commit it whole and durably.

A conversion is the set of entries osdpipe writes under ``output.path``
(:func:`conversion_entries`: the rank files or ``optim.pt`` or ``dcp/``, the
generated ``source/``, ``manifest.json``, a whole checkpoint's export).
Everything of a run is written into ``.staging/`` first, the generated source
included. Only a run that passed goes in, by :func:`commit`:

1. every staged file, then every staged directory, is synced to disk
   (``fsync``): after this the staged conversion survives a power loss;
2. ``.staging`` is renamed to ``.incoming`` (one atomic rename: "committing"),
   and the output directory is synced, so the rename is on disk too;
3. every entry of the previous conversion moves into ``.previous/``, then
   ``.previous/.complete`` is written; both directories synced;
4. every entry of ``.incoming`` moves into place, ``manifest.json`` last
   (it names a complete conversion); the output directory is synced;
5. ``.previous`` and ``.incoming`` are removed.

So an overwrite never mixes two conversions: a file of the old one is either
in place with the whole old conversion, or in ``.previous``. If a run is
killed, or the machine loses power, in the middle, :func:`recover` (called
before every run into the directory) finishes the commit when ``.incoming``
holds a conversion with its manifest, and otherwise puts the previous
conversion back and drops the rest: the directory then holds the old or the
new conversion, whole. ``report.json`` and ``osdpipe.log`` are not part of a
conversion: they describe the last run, failed or not, and are written after
it, each synced and renamed into place (:func:`write_durably`).

``output.fsync=false`` leaves the syncs out, for scratch output: faster, and
as safe against a killed process (the renames are atomic), but after a power
loss or a kernel crash the committed names may hold empty or short files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

#: The manifest: written last into a staged conversion and moved last into place; a conversion without it is not
#: committed.
MANIFEST = "manifest.json"
#: The manifest's key for the input's absolute path when the conversion ran: its config keeps ``input.path`` as the user
#: typed it, which `osdpipe check` run from another directory could not find.
INPUT_ABSOLUTE = "input_path_absolute"
STAGING = ".staging"
#: Where a conversion keeps the source it generated (no ``input.path``): ``<output.path>/source/``.
GENERATED_SOURCE = "source"
INCOMING = ".incoming"
PREVIOUS = ".previous"
_COMPLETE = ".complete"
_RANK_FILE = re.compile(r"rank_\d+\.pt")
_NAMED = ("optim.pt", "dcp", GENERATED_SOURCE, MANIFEST, "model.safetensors", "model.safetensors.index.json")
_EXPORT_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
#: A Megatron-LM save folder's entries (checkpoint=megatron writes them): another save there is a conversion too.
_MEGATRON_SAVE = re.compile(r"iter_\d{7}|latest_checkpointed_iteration\.txt")


class OutputError(OSError):
    """``output.path`` cannot be used; the message says why in one line."""

    #: What the command's error line calls it, before the message (``config``: the config's choice to make, said as
    #: a config error is); ``None``: the message alone.
    kind: str | None = None

    def said(self) -> str:
        """The command's error line, without its ``osdpipe: error:``."""
        return f"{self.kind}: {self}" if self.kind else str(self)


class OutputHeld(OutputError):
    """``output.path`` holds a conversion and ``output.overwrite`` is false (the same words wherever it is found:
    :func:`already_holds`)."""

    kind = "config"


def already_holds(path: str, held: list[str]) -> str:
    """Why ``path`` (a directory or a URL) takes no conversion without ``output.overwrite``: the entries ``held`` there
    (the first three named)."""
    return (
        f"output.path={path!r} already holds a conversion ({', '.join(held[:3])}); "
        "choose another path or set output.overwrite=true"
    )


def conversion_entries(directory: Path) -> list[Path]:
    """The entries of a conversion directly under ``directory`` (what an overwrite replaces).

    Those osdpipe always names so, and every top-level entry the conversion's
    manifest lists (a whole checkpoint's carried files beside its rank files).
    """
    if not directory.is_dir():
        return []
    try:
        manifest = (directory / MANIFEST).read_text()
    except OSError:
        manifest = None
    names = set(conversion_names([p.name for p in directory.iterdir()], manifest))
    return sorted(p for p in directory.iterdir() if p.name in names)


def conversion_names(names: list[str], manifest: str | None) -> list[str]:
    """Which of a directory's top-level ``names`` (a local directory's entries, or an object store prefix's) are a
    conversion's entries, given the text of its ``manifest.json`` (``None``: none there)."""
    listed = set()
    try:
        listed = {Path(name).parts[0] for name in json.loads(manifest or "").get("files", {})}
    except (ValueError, AttributeError, IndexError):
        pass  # no manifest, or not one osdpipe wrote: the names osdpipe always uses
    return sorted(
        n
        for n in names
        if n in _NAMED
        or n in listed
        or any(pattern.fullmatch(n) for pattern in (_RANK_FILE, _EXPORT_SHARD, _MEGATRON_SAVE))
    )


def check_writable(directory: Path) -> None:
    """Create ``directory`` if needed and prove a file can be written in it.

    Raises:
        OutputError: naming the path and the reason (a regular file in the way,
            no permission, a read-only filesystem).
    """
    blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise OutputError(
            f"output.path={str(directory)!r}: {blocker} is a file, not a directory; choose another output.path"
        )
    probe = directory / ".osdpipe-write-test"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutputError(
            f"output.path={str(directory)!r} cannot be written ({exc.strerror or exc}); "
            "choose a directory you can write to"
        ) from None


def _move_all(entries: list[Path], into: Path) -> None:
    for entry in entries:
        os.replace(entry, into / entry.name)


def sync_path(path: Path) -> None:
    """``fsync`` a file or a directory: its bytes (a directory: its entries, so renames into it) are on disk when it
    returns."""
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path) -> None:
    """Sync every file under ``root``, then every directory, deepest first, ``root`` last: its whole content is on
    disk."""
    directories = []
    for here, dirs, files in os.walk(root):
        for name in files:
            sync_path(Path(here) / name)
        directories.append(Path(here))
    for directory in reversed(directories):
        sync_path(directory)


def _finish_commit(directory: Path, durable: bool) -> None:
    """Steps 3 to 5 of the commit; each can be repeated after an interruption."""
    incoming, previous = directory / INCOMING, directory / PREVIOUS
    if not (previous / _COMPLETE).exists():
        previous.mkdir(exist_ok=True)
        _move_all(conversion_entries(directory), previous)  # step 4 has not begun: every entry here is old
        if durable:
            sync_path(previous)
            sync_path(directory)
        (previous / _COMPLETE).touch()
        if durable:
            sync_path(previous)
    names = sorted(p.name for p in incoming.iterdir())
    names.sort(key=lambda n: n == MANIFEST)  # the manifest last: it names a complete conversion
    _move_all([incoming / n for n in names], directory)
    if durable:
        sync_path(directory)
    shutil.rmtree(previous)
    incoming.rmdir()


def _committed(incoming: Path) -> bool:
    """Whether ``.incoming`` holds a committed conversion: its manifest is there, or every entry, the manifest last,
    has moved out."""
    return (incoming / MANIFEST).is_file() or not any(incoming.iterdir())


def _roll_back(directory: Path) -> None:
    """Put the previous conversion back in place from ``.previous`` (what of the new one moved in goes first) and drop
    ``.incoming``."""
    previous = directory / PREVIOUS
    if previous.is_dir():
        for entry in conversion_entries(directory):
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        _move_all([p for p in previous.iterdir() if p.name != _COMPLETE], directory)
    shutil.rmtree(directory / INCOMING, ignore_errors=True)


def recover(directory: Path, durable: bool = True) -> None:
    """Bring an interrupted run's directory back to one whole conversion (see the module docstring).

    ``.incoming`` without a manifest (its files never all reached the disk:
    ``output.fsync=false`` and a power loss) is not a committed conversion:
    the previous one is put back.
    """
    incoming = directory / INCOMING
    if incoming.is_dir():
        if _committed(incoming):
            _finish_commit(directory, durable)
        else:
            _roll_back(directory)
    shutil.rmtree(directory / PREVIOUS, ignore_errors=True)
    shutil.rmtree(directory / STAGING, ignore_errors=True)
    if durable and directory.is_dir():
        sync_path(directory)


def begin(directory: Path, durable: bool = True) -> Path:
    """Prepare ``directory`` for a run: writable, recovered, with an empty ``.staging``; returns the staging path."""
    check_writable(directory)
    recover(directory, durable)
    staging = directory / STAGING
    staging.mkdir()
    return staging


def commit(directory: Path, durable: bool = True) -> None:
    """Replace the conversion in ``directory`` by the one staged in ``.staging``, as a whole; with ``durable``, synced
    at every step."""
    staging = directory / STAGING
    if durable:
        sync_tree(staging)
    os.replace(staging, directory / INCOMING)
    if durable:
        sync_path(directory)
    _finish_commit(directory, durable)


def abort(directory: Path) -> None:
    """Drop what a failed run staged; the previous conversion stays as it was."""
    shutil.rmtree(directory / STAGING, ignore_errors=True)


def write_durably(path: Path, text: str, durable: bool = True) -> None:
    """Write ``text`` to ``path`` whole: into a temporary file, synced, renamed over ``path``, the directory synced.

    A reader (or a run after a crash) finds the old file or the new one, never a part of it.
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        sync_path(path.parent)
