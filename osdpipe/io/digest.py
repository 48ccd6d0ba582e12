"""Digests of what osdpipe writes: per file, and per tensor (for partial checks), every byte hashed once.

Hashing is the pass over the output bytes that cannot be avoided, so it is
done alongside the write, once: a torch file's bytes are hashed in pieces on
their way to the file (:mod:`osdpipe.io.torchfile`), each storage record a piece,
so a tensor's sha256 is its storage's piece's and the file's digest is made of
the pieces' (:class:`osdpipe.io.torchfile.PieceDigest`). Any other file (a
safetensors export, DCP's ``.metadata``, a carried file) has the sha256 that
``sha256sum`` gives, taken as it is written (:class:`HashingFile`).

Digests that are compared within one run and never written down (a batch as
its reading rank sent it against the same batch as the receiving rank holds
it; a batch as read from object storage against the state it filled) are
fingerprints (:func:`pieces_fingerprint`): XXH3-128, not sha256.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import xxhash

from osdpipe.io.torchfile import save as save_torch_file
from osdpipe.io.whole_rank_file import MODEL_PART, OPTIMIZER_PART, is_whole


class HashingFile:
    """A binary file opened for writing that keeps the sha256 of everything written to it."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()

    def write(self, data: Any) -> int:
        written = self.file.write(data)
        self.sha256.update(data)
        return written

    def __getattr__(self, name: str) -> Any:  # tell, fileno, flush: the file's own
        return getattr(self.file, name)


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, as ``sha256sum`` gives it,
    read in chunks (for checking a file osdpipe wrote earlier)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def tensor_bytes(value: torch.Tensor) -> Any:
    """A tensor's bytes in row-major order, as a buffer ``hashlib`` takes (no copy for a contiguous CPU tensor)."""
    return value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_sha256(value: torch.Tensor, known: dict[int, str] | None = None) -> str:
    """sha256 of a tensor's bytes in row-major order.

    ``known``: sha256 of whole storages, by ``UntypedStorage._cdata``, taken
    as they were written (:func:`osdpipe.io.torchfile.save`); a contiguous CPU
    tensor that covers its storage exactly has its storage's digest. A DTensor's
    is its local tensor's: the bytes a rank's file holds of it.
    """
    if (to_local := getattr(value, "to_local", None)) is not None:
        value = to_local()
    if known and value.device.type == "cpu" and value.is_contiguous() and value.storage_offset() == 0:
        storage = value.untyped_storage()
        if storage.nbytes() == value.numel() * value.element_size() and storage._cdata in known:
            return known[storage._cdata]
    return hashlib.sha256(tensor_bytes(value)).hexdigest()


def pieces_fingerprint(pieces: list[torch.Tensor]) -> str:
    """XXH3-128 of tensors' bytes one after the other: what they hold together, without joining them,
    for two copies of the same bytes in one run to be compared.

    Not sha256, because nobody outside the run ever checks it and nobody can choose the bytes to fool it: what it
    must do is change when one byte does, and a 128-bit XXH3 misses a difference with odds of 2^-128. It takes the
    bytes at memory speed (27 GB/s on one core of the benchmarks' VM, sha256 2 GB/s), where the roundtrip check of
    a source in object storage fingerprints every byte twice (as read, and as the state holds it). What is written
    down (a manifest's files and tensors) stays sha256, which anyone can check by hand.
    """
    h = xxhash.xxh3_128()
    for piece in pieces:
        h.update(tensor_bytes(piece))
    return h.hexdigest()


def tensor_digests(osd: dict[str, Any], known: dict[int, str] | None = None) -> dict[str, str]:
    """sha256 of every state tensor's bytes, keyed ``<param key>.<state name>``:
    for partial checks (``known``: see :func:`tensor_sha256`).

    A whole checkpoint's rank file (its model and optimizer parts, see
    :mod:`osdpipe.io.checkpoints.output`) is keyed ``model.<name>`` and
    ``optim.<param key>.<state name>``.
    """
    if is_whole(osd):
        model = {
            f"{MODEL_PART}.{name}": tensor_sha256(value, known)
            for name, value in osd[MODEL_PART].items()
            if torch.is_tensor(value)
        }
        return {**model, **{f"{OPTIMIZER_PART}.{k}": v for k, v in tensor_digests(osd[OPTIMIZER_PART], known).items()}}
    out = {}
    for key, state in osd.get("state", {}).items():
        for name, value in (state.items() if isinstance(state, dict) else []):
            if torch.is_tensor(value):
                out[f"{key}.{name}"] = tensor_sha256(value, known)
    return out


def save_hashed(osd: dict[str, Any], path: Path) -> tuple[str, dict[str, str]]:
    """Save ``osd`` as a ``torch.save`` file at ``path`` (:func:`osdpipe.io.torchfile.save`), hashing as it writes:
    the file's digest, and each tensor's (:func:`tensor_digests`).

    The tensors' digests are their storages', taken in the file's one pass;
    only a tensor that does not cover its storage is hashed again.
    """
    # the commit syncs the conversion as a whole (osdpipe.io.output)
    digest, storages = save_torch_file(osd, path, sync=False)
    return digest, tensor_digests(osd, storages)
