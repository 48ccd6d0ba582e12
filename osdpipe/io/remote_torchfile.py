"""A ``torch.save`` file in object storage, loaded without its tensor bytes; each tensor's bytes fetched by range
when a reader asks for them.

``torch.load`` of a local file maps it (``mmap=True``): a rank touches only the pages of the ranges it reads. A file
in a bucket cannot be mapped, and ``torch.load`` of a file object reads every storage. :func:`load` instead reads
the archive's structure (checked as a local file's is, :func:`~osdpipe.io.formats.safe_load.check_torch_zip`) and
its pickle, and gives each storage reserved, unreadable memory (:mod:`osdpipe.io.fetched_memory`) whose pages the
readers fetch as they read (:func:`~osdpipe.io.formats.base.mapped_range` and their whole-tensor reads): each run of
pages is one ranged request of the object, several in flight, neighbouring runs joined
(:class:`~osdpipe.io.remote_input.Prefetch`).

Small storages (step counters, scalars: at most :data:`EAGER_BYTES`) are fetched with the structure, so looking at
a file's metadata needs nothing more.
"""

from __future__ import annotations

import io
import zipfile
from typing import Any

import torch

from osdpipe.io import fetched_memory
from osdpipe.io.remote_input import Prefetch, RemotePath

#: A storage this small (a step counter, a scalar) is fetched with the file's structure.
EAGER_BYTES = 16
#: The block size the archive's structure is read in: its index, each record's header (one block each), the pickle.
STRUCTURE_BLOCK = 64 << 10


class ObjectFetcher:
    """A remote object's byte ranges, for the storages reserved for its records: the spans of a plan fetched ahead
    (neighbours joined, several in flight, within the in-flight bound), the others as they are asked for."""

    def __init__(self, path: RemotePath) -> None:
        self.path = path
        self._planned: Prefetch | None = None

    def plan(self, spans: list[tuple[int, int]]) -> None:
        if self._planned is not None:
            self._planned.close()
        self._planned = Prefetch([(self.path, offset, length) for offset, length in spans]) if spans else None

    def fetch(self, spans: list[tuple[int, int]]) -> list[bytes | memoryview]:
        if self._planned is not None:  # a span it did not plan is fetched alone
            return [self._planned.take(self.path, offset, length) for offset, length in spans]
        prefetch = Prefetch([(self.path, offset, length) for offset, length in spans])
        try:
            return [prefetch.take(self.path, offset, length) for offset, length in spans]
        finally:
            prefetch.close()


def load(path: RemotePath, check: Any, unpickler: Any = None) -> Any:
    """``torch.load(path, weights_only=True)`` of a remote ``torch.save`` file, its storages unfetched
    (small ones fetched).

    ``check(file, size)`` checks the archive's structure and returns each record's data span by name
    (:func:`~osdpipe.io.formats.safe_load.check_torch_zip`). ``unpickler(file)``: the unpickler of the pickle
    (default: torch's weights-only one; a framework's files take :mod:`osdpipe.io.formats.inert_load`'s).
    """
    from torch import _weights_only_unpickler

    size = path.stat().st_size
    with path.open_blocks(STRUCTURE_BLOCK) as f:
        spans = check(f, size)
        f.seek(0)
        with zipfile.ZipFile(f) as archive:
            prefix = next(n for n in archive.namelist() if n.endswith("/data.pkl")).rsplit("/", 1)[0]
            pickled = archive.read(f"{prefix}/data.pkl")
            order = f"{prefix}/byteorder"
            byteorder = archive.read(order).decode() if order in archive.namelist() else "little"
    if byteorder != "little":
        raise ValueError(f"{path} was saved on a big-endian machine; load and re-save it there")
    fetcher = ObjectFetcher(path)
    storages: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(saved_id: tuple) -> torch.storage.TypedStorage:
        _, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        if key not in storages:
            start, end = spans[f"{prefix}/data/{key}"]
            nbytes = numel * dtype.itemsize
            if end - start < nbytes:
                raise ValueError(f"{path}: record data/{key} holds {end - start} bytes, its tensor {nbytes}")
            untyped = fetched_memory.reserve(nbytes, start, fetcher)
            storages[key] = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
        return storages[key]

    reading = (_naming_storages(unpickler) if unpickler else _weights_only_unpickler.Unpickler)(
        io.BytesIO(pickled), encoding="utf-8"
    )
    reading.persistent_load = persistent_load
    loaded = reading.load()
    small = [s._untyped_storage for s in storages.values() if 0 < s._untyped_storage.nbytes() <= EAGER_BYTES]
    # the small ones now, as one look at the file needs them
    fetched_memory.fetch_all([torch.empty(0, dtype=torch.uint8).set_(u) for u in small])
    return loaded


def _naming_storages(unpickler: Any) -> Any:
    """``unpickler`` with the storage classes a pickle names (``torch.FloatStorage``) resolved to their dtypes, as
    ``torch.load`` resolves them before its ``pickle_module``'s unpickler is asked (the weights-only one does it
    itself)."""

    class NamingStorages(unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module == "torch" and name.endswith("Storage"):
                try:
                    return torch.serialization.StorageType(name)
                except KeyError:
                    pass
            return super().find_class(module, name)

    return NamingStorages
