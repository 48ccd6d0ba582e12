"""An input in object storage (``input.path=s3://bucket/prefix``, ``gs://...``), read in byte ranges.

:func:`as_path` is where a reader turns ``input.path`` into something it opens: a local path stays a
:class:`pathlib.Path` (the local code and its speed are unchanged: nothing local goes through fsspec), a URL becomes a
:class:`RemotePath`, which answers the few questions the readers ask of a path (``/``, ``is_file``, ``is_dir``,
``stat().st_size``, ``read_bytes``) from one listing of the prefix, and reads bytes only as ranges:

* :meth:`RemotePath.read_range`: one ranged request (``Range: bytes=a-b``) for one DCP item, or a file's structure;
* :class:`Prefetch`: the items one DCP read plan needs (or the items a rank's shard or roundtrip reads will ask for,
  :meth:`osdpipe.io.formats.dcp_reader.DcpCheckpoint.expect`), each object's neighbouring items as one request
  (:func:`osdpipe.io.coalesce.coalesce`), several requests in flight, the bytes fetched and not yet used bounded by
  :func:`in_flight_limit` (``runtime.memory_budget``);
* :meth:`RemotePath.open_blocks`: a seekable file that fetches the blocks it is asked for (a file's structure: a
  ``torch.save`` archive's index, headers and pickle, :mod:`osdpipe.io.remote_torchfile`).

A file of which only some pieces are needed is never downloaded whole. :data:`METER` counts what was fetched (the
tests prove a rank's read fetches less than the files it touches).

A run reads its input as **one snapshot** (:func:`one_snapshot`, around a whole command): the prefix is listed once,
and every small read (:data:`SMALL_READ`: a ``.metadata``, a step, a param group: what working out the config,
checking the source and each stage's reader ask for again) is fetched once, however many readers open the input.

The store's options (``runtime.storage_options``) and the in-flight bound reach the readers through :func:`configure`,
called where a run or a command knows them (the load stage, the config check, ``osdpipe inspect``). Every failure of
the store is said in one line naming the URL, credentials redacted (:func:`osdpipe.io.store.failure`); a missing
object is a :class:`FileNotFoundError` naming its URL, as a missing local file is.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from osdpipe.core.seekable import Seekable
from osdpipe.io import store
from osdpipe.io.coalesce import Span, coalesce

WHERE = "input.path"
#: Requests in flight at once, reading one plan's items or a checkpoint's structure.
CONCURRENCY = 8
#: The most unwanted bytes a request fetches between two wanted ranges of one object (else: a request each).
MAX_GAP = 4 << 20
#: Bytes fetched and not yet used, without ``runtime.memory_budget`` (with it: half of it, the pieces' size).
DEFAULT_IN_FLIGHT = 256 << 20
#: A read this small is kept for the rest of a snapshot (:func:`one_snapshot`), up to :data:`SMALL_KEPT` in all.
SMALL_READ = 64 << 10
SMALL_KEPT = 64 << 20


@dataclass
class _Settings:
    storage_options: Mapping[str, Any]
    memory_budget: int | None


_settings = _Settings({}, None)


def configure(storage_options: Mapping[str, Any] | None, memory_budget: int | None = None) -> None:
    """The store's options and the memory budget the readers of a URL use from now on (this process's)."""
    global _settings
    _settings = _Settings(dict(storage_options or {}), memory_budget)


def in_flight_limit() -> int:
    """The most bytes fetched and not yet used at once: half of ``runtime.memory_budget`` (the size of the pieces the
    run copies), else :data:`DEFAULT_IN_FLIGHT`."""
    budget = _settings.memory_budget
    return DEFAULT_IN_FLIGHT if budget is None else max(1, budget // 2)


@dataclass(frozen=True)
class Seen:
    """What a run has seen of its input so far, as the processes it starts take it over (:func:`seen`,
    :func:`one_snapshot`): each listed prefix's listing, keyed by its URL and store options, and the small ranges."""

    listings: dict[tuple[str, str], dict[str, int]]
    small: dict[tuple[str, int, int], bytes]


@dataclass
class _Snapshot:
    """What one run has seen of its input: the prefixes it listed and the small ranges it was given."""

    prefixes: dict[tuple[str, str], _Prefix] = field(default_factory=dict)
    small: dict[tuple[str, int, int], bytes] = field(default_factory=dict)
    small_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Listings the process that started this one made (:class:`Seen`), taken as each prefix is opened here.
    handed_listings: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)

    @classmethod
    def taking_over(cls, seen: Seen | None) -> _Snapshot:
        if seen is None:
            return cls()
        return cls(small=dict(seen.small), small_bytes=sum(map(len, seen.small.values())),
                   handed_listings=dict(seen.listings))  # fmt: skip

    def prefix(self, location: store.Location) -> _Prefix:
        key = (location.url, json.dumps(_settings.storage_options, sort_keys=True, default=str))
        with self.lock:
            if key not in self.prefixes:
                self.prefixes[key] = _Prefix(location, listed=self.handed_listings.get(key))
            return self.prefixes[key]

    def seen(self) -> Seen:
        with self.lock:
            listings = {key: dict(p.listed) for key, p in self.prefixes.items() if p.listed is not None}
            return Seen({**self.handed_listings, **listings}, dict(self.small))


def _kept(path: RemotePath, start: int, length: int) -> bytes | None:
    """Range ``[start, start + length)`` of ``path`` as this run's snapshot kept it, else ``None``."""
    snapshot = _snapshot
    if snapshot is None or length > SMALL_READ:
        return None
    with snapshot.lock:
        return snapshot.small.get((str(path), start, length))


def _keep(path: RemotePath, start: int, data: bytes | memoryview) -> None:
    """Keep a small range a reader was given for the rest of this run's snapshot (within :data:`SMALL_KEPT`);
    a copy of a slice, which would otherwise hold its whole request."""
    snapshot = _snapshot
    if snapshot is None or len(data) > SMALL_READ:
        return
    with snapshot.lock:
        if snapshot.small_bytes + len(data) <= SMALL_KEPT:
            snapshot.small[(str(path), start, len(data))] = bytes(data)
            snapshot.small_bytes += len(data)


_snapshot: _Snapshot | None = None


def seen() -> Seen | None:
    """What this process's snapshot holds (``None`` outside one), for the processes it starts to go on from."""
    snapshot = _snapshot
    return None if snapshot is None else snapshot.seen()


@contextmanager
def one_snapshot(taken_over: Seen | None = None) -> Iterator[None]:
    """Within it, this process reads every input in object storage as one snapshot: each prefix listed once, each
    small range (:data:`SMALL_READ`) fetched once.

    A command's steps open its input several times: working out what the user did not say (its facts), checking the
    source, then each stage's reader. Each reads the same ``.metadata`` and the same small items (a step, the param
    groups), one request each, and lists the prefix again; on a store a request costs a round trip (and, on one that
    reads the whole object to serve a range, the whole object). Read once, they also agree: every step of the run sees
    the same listing. Large ranges are not kept (they are the conversion's bytes, fetched as a plan needs them and let
    go). Nested: the outer snapshot holds.

    ``taken_over``: what the process that started this one had seen (:func:`seen`): a run's ranks and workers go on
    from the command's snapshot, so they neither fetch again what working out the config fetched nor list the prefix
    again, and they see the listing the command saw.
    """
    global _snapshot
    outer = _snapshot
    _snapshot = outer or _Snapshot.taking_over(taken_over)
    try:
        yield
    finally:
        _snapshot = outer


class Meter:
    """Bytes and requests fetched from object storage by this process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0
        self.requests = 0
        #: (URL, start, end) of every ranged request, in the order they were made.
        self.ranges: list[tuple[str, int, int]] = []

    def add(self, url: str, start: int, end: int) -> None:
        with self._lock:
            self.bytes += end - start
            self.requests += 1
            self.ranges.append((url, start, end))

    def reset(self) -> None:
        with self._lock:
            self.bytes, self.requests, self.ranges = 0, 0, []


METER = Meter()


def is_remote(path: object) -> bool:
    return store.is_remote(str(path)) if isinstance(path, (str, RemotePath)) else False


def as_path(path: str | Path | RemotePath) -> Path | RemotePath:
    """``path`` as the readers open it: a :class:`RemotePath` for an ``s3://`` or ``gs://`` URL, else a local
    :class:`~pathlib.Path`.

    Raises:
        InputError: a URL osdpipe does not read (another scheme, no bucket).
    """
    if isinstance(path, (Path, RemotePath)):
        return path
    if (why := store.slash_short(path)) is not None:  # inspect takes no config that says it first
        raise store.error_type(WHERE)(why)
    if store.is_url(path):
        try:
            location = store.parse(path, WHERE)
        except ValueError as exc:
            raise store.error_type(WHERE)(str(exc)) from None
        return RemotePath(_Prefix(location) if _snapshot is None else _snapshot.prefix(location), location.key)
    return Path(path)


def probe(url: str, where: str = WHERE) -> dict:
    """fsspec's ``info`` of ``url`` (``type``: ``file`` or ``directory``), a first look that fails in one line naming
    ``where`` (the key or argument that gave it): no such bucket, no such key, access denied, no credentials, an
    endpoint that does not answer."""
    try:
        location = store.parse(url, where)
    except ValueError as exc:
        raise store.error_type(where)(str(exc)) from None
    return store.info(location, _settings.storage_options, where)


class _Prefix:
    """The prefix the user named, with one filesystem and one listing of it, shared by every path under it."""

    def __init__(self, location: store.Location, listed: dict[str, int] | None = None) -> None:
        self.location = location
        self.options = _settings.storage_options
        self.fs = store.filesystem(location, self.options, WHERE)
        self._sizes: dict[str, int] | None = listed
        self._lock = threading.Lock()

    @property
    def listed(self) -> dict[str, int] | None:
        """The listing (:meth:`sizes`), where it was made."""
        with self._lock:
            return self._sizes

    def fail(self, exc: BaseException, key: str) -> Exception:
        return store.failure(exc, self.location, WHERE, self.options, key=self.at(key))

    def at(self, key: str) -> store.Location:
        return store.Location(self.location.scheme, self.location.bucket, key)

    def sizes(self) -> dict[str, int]:
        """Every object at or under the prefix, by key, with its size: listed once."""
        with self._lock:
            if self._sizes is None:
                root = self.location.path
                try:
                    found = self.fs.find(root, detail=True)
                except FileNotFoundError:
                    found = {}
                except Exception as exc:  # noqa: BLE001 - said in one line
                    raise self.fail(exc, self.location.key) from None
                bucket = self.location.bucket + "/"
                self._sizes = {
                    name.removeprefix(bucket): int(info.get("size") or 0)
                    for name, info in found.items()
                    if info.get("type", "file") != "directory"
                }
            return self._sizes

    def covers(self, key: str) -> bool:
        top = self.location.key
        return not top or key == top or key.startswith(top + "/")


@dataclass(frozen=True)
class _Stat:
    st_size: int


class RemotePath:
    """An object (or a "directory": a key that others are under) in object storage, as the readers ask about paths.

    ``str()`` is its URL. It has no ``__fspath__``: nothing takes it for a local file.
    """

    def __init__(self, prefix: _Prefix, key: str) -> None:
        self._prefix, self.key = prefix, key.strip("/")

    # ---------------------------------------------------------------- naming

    @property
    def location(self) -> store.Location:
        return self._prefix.at(self.key)

    def __str__(self) -> str:
        return self.location.url

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: RemotePath) -> bool:  # sorted(), as paths sort
        return str(self) < str(other)

    def __truediv__(self, name: str | Path) -> RemotePath:
        parts = [p for p in str(name).split("/") if p and p != "."]
        return RemotePath(self._prefix, "/".join([self.key, *parts]) if self.key else "/".join(parts))

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self._prefix, self.key.rpartition("/")[0])

    @property
    def fs_path(self) -> str:
        return self.location.path

    # ---------------------------------------------------------------- what is there

    def _size(self) -> int | None:
        if self._prefix.covers(self.key):
            return self._prefix.sizes().get(self.key)
        try:  # outside the listed prefix (a manifest above it): asked on its own
            info = self._prefix.fs.info(self.fs_path)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - said in one line
            raise self._prefix.fail(exc, self.key) from None
        return int(info.get("size") or 0) if info.get("type") == "file" else None

    def is_file(self) -> bool:
        return self._size() is not None

    def is_dir(self) -> bool:
        inside = self.key + "/" if self.key else ""
        if self._prefix.covers(self.key) or (self._prefix.location.key + "/").startswith(inside):
            return any(k.startswith(inside) for k in self._prefix.sizes())
        try:
            return bool(self._prefix.fs.isdir(self.fs_path))
        except Exception as exc:  # noqa: BLE001 - said in one line
            raise self._prefix.fail(exc, self.key) from None

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def stat(self) -> _Stat:
        size = self._size()
        if size is None:
            raise FileNotFoundError(f"{self} does not exist")
        return _Stat(size)

    def rglob(self, pattern: str = "*") -> list[RemotePath]:
        """Every object under this key, at any depth (``pattern`` must be ``*``: the layouts ask for everything)."""
        if pattern != "*":
            raise ValueError(f"{self}: only rglob('*') is served in object storage")
        inside = self.key + "/" if self.key else ""
        return [RemotePath(self._prefix, k) for k in sorted(self._prefix.sizes()) if k.startswith(inside)]

    def relative_to(self, other: RemotePath) -> PurePosixPath:
        inside = other.key + "/" if other.key else ""
        if not self.key.startswith(inside):
            raise ValueError(f"{self} is not under {other}")
        return PurePosixPath(self.key[len(inside) :])

    def iterdir(self) -> list[RemotePath]:
        inside = self.key + "/" if self.key else ""
        names = {k[len(inside) :].split("/", 1)[0] for k in self._prefix.sizes() if k.startswith(inside)}
        return [self / n for n in sorted(names)]

    # ---------------------------------------------------------------- bytes

    def read_range(self, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)``: one ranged request.

        Raises:
            FileNotFoundError: the object is missing; InputError: the store failed (one line).
        """
        if length <= 0:
            return b""
        if (kept := _kept(self, start, length)) is not None:
            return kept
        try:
            data = self._prefix.fs.cat_file(self.fs_path, start=start, end=start + length)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self} does not exist") from None
        except Exception as exc:  # noqa: BLE001 - said in one line
            raise self._prefix.fail(exc, self.key) from None
        METER.add(str(self), start, start + len(data))
        if len(data) == length:
            _keep(self, start, data)
        return data

    def read_bytes(self) -> bytes:
        """The whole object (for small ones: ``.metadata``, a manifest)."""
        return self.read_range(0, self.stat().st_size)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def open(self, mode: str = "rb") -> Any:
        """The object read front to back (:meth:`stream`), as ``open(path, "rb")`` reads a local file."""
        if mode != "rb":
            raise ValueError(f"{self}: object storage is read here, not written ({mode!r})")
        return self.stream()

    def open_blocks(self, block: int) -> BlockFile:
        """The object as a seekable file that fetches ``block`` bytes at a time, as it is read, keeping the last few."""
        return BlockFile(self, block)

    def stream(self, block: int = 16 << 20) -> Any:
        """The object read front to back (hashing it): fsspec's file, reading ahead ``block`` bytes at a time."""
        try:
            return self._prefix.fs.open(self.fs_path, "rb", block_size=block, cache_type="readahead")
        except FileNotFoundError:
            raise FileNotFoundError(f"{self} does not exist") from None
        except Exception as exc:  # noqa: BLE001 - said in one line
            raise self._prefix.fail(exc, self.key) from None


class BlockFile(Seekable):
    """A remote object read where it is asked for: aligned blocks fetched by range (:meth:`RemotePath.read_range`),
    the last :data:`KEPT_BLOCKS` kept (a zip's index, then its headers, are read in small pieces, near each other)."""

    KEPT_BLOCKS = 8

    def __init__(self, path: RemotePath, block: int) -> None:
        super().__init__(path.stat().st_size)
        self.path, self.block = path, block
        self._kept: dict[int, bytes] = {}

    def _block(self, index: int) -> bytes:
        if index not in self._kept:
            if len(self._kept) >= self.KEPT_BLOCKS:
                del self._kept[next(iter(self._kept))]
            start = index * self.block
            self._kept[index] = self.path.read_range(start, min(self.block, self.size - start))
        return self._kept[index]

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self.pos < self.size:
            index, at = divmod(self.pos, self.block)
            piece = self._block(index)[at : at + len(view) - done]
            view[done : done + len(piece)] = piece
            done += len(piece)
            self.pos += len(piece)
        return done


class Prefetch:
    """The byte ranges one read plan needs, fetched ahead of their use, several at once, as few requests.

    ``wanted`` lists ``(path, start, length)`` in the order they will be asked for (:meth:`take`). Each object's
    ranges are fetched as the requests :func:`~osdpipe.io.coalesce.coalesce` makes of them (ranges that touch, or lie
    at most ``gap`` bytes apart, up to ``span`` bytes a request: a quarter of ``limit``) and cut apart here: a request
    costs a round trip and, on S3, a GET's price, and a store that reads the whole object to serve a range (moto's
    server) the whole object. Requests start in the order their first range is wanted, while the bytes fetched and
    not yet taken stay within ``limit`` (one request is always allowed, however large: it is needed); a request whose
    ranges are all taken is dropped here, which lets the next ones start. A range asked for that was not planned (or
    a second time) is fetched then, alone; so is a planned one whose request has not started (a plan that reads
    from more objects at once than ``limit`` holds requests of); its request still starts for the ranges left in it.
    Within a run's snapshot (:func:`one_snapshot`), a small range it was given before is not fetched again.
    """

    def __init__(
        self,
        wanted: Sequence[tuple[RemotePath, int, int]],
        limit: int | None = None,
        span: int | None = None,
        gap: int | None = None,
    ) -> None:
        self.limit = in_flight_limit() if limit is None else limit
        self.span = max(1, self.limit // 4) if span is None else span
        self.gap = min(MAX_GAP, self.span // 8) if gap is None else gap
        self._requests: list[tuple[RemotePath, int, int]] = []  # (path, start, length): what is fetched
        self._request_of: dict[tuple[RemotePath, int, int], int] = {}  # a wanted range -> the request holding it
        self._untaken: list[int] = []  # per request, its ranges not yet taken
        unique = [w for w in dict.fromkeys(wanted) if _kept(*w) is None]  # a run's small ranges: fetched once
        per_path: dict[RemotePath, list[int]] = {}
        for i, (path, _, _) in enumerate(unique):
            per_path.setdefault(path, []).append(i)
        made: list[tuple[int, Span, list[int]]] = []  # (first use, request, the wanted ranges it holds)
        for indices in per_path.values():
            for request in coalesce([unique[i][1:] for i in indices], self.gap, self.span):
                held = [indices[m] for m in request.members]
                made.append((min(held), request, held))
        for first_use, request, held in sorted(made, key=lambda m: m[0]):
            for i in held:
                self._request_of[unique[i]] = len(self._requests)
            self._requests.append((unique[first_use][0], request.start, request.length))
            self._untaken.append(len(held))
        self._next = 0
        self._held = 0
        self._started: dict[int, Future[bytes]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=CONCURRENCY)
        self._top_up()

    def _top_up(self) -> None:
        with self._lock:
            while self._next < len(self._requests) and len(self._started) < 2 * CONCURRENCY:
                if not self._untaken[self._next]:  # every range of it was taken (fetched alone) before it started
                    self._next += 1
                    continue
                path, start, length = self._requests[self._next]
                if self._started and self._held + length > self.limit:
                    break
                self._held += length
                self._started[self._next] = self._pool.submit(path.read_range, start, length)
                self._next += 1

    def take(self, path: RemotePath, start: int, length: int) -> bytes | memoryview:
        """Range ``[start, start + length)`` of ``path``: a slice of the request that fetched it with its neighbours
        (a view, not a copy: :class:`~osdpipe.core.seekable.ViewFile` reads it as a file), or the bytes alone."""
        if (kept := _kept(path, start, length)) is not None:
            return kept
        with self._lock:
            index = self._request_of.pop((path, start, length), None)
            future = self._started.get(index) if index is not None else None
            if index is not None and future is None:  # planned, not started yet: fetched alone, not again later
                self._untaken[index] -= 1
        if future is None:
            return path.read_range(start, length)
        try:
            data = future.result()
            first = self._requests[index][1]
            whole = (first, len(data)) == (start, length)
            piece = data if whole else memoryview(data)[start - first : start - first + length]
            if len(piece) == length:
                _keep(path, start, piece)
            return piece
        finally:
            with self._lock:
                self._untaken[index] -= 1
                if not self._untaken[index]:
                    del self._started[index]
                    self._held -= self._requests[index][2]
            self._top_up()

    def close(self) -> None:
        with self._lock:
            for future in self._started.values():
                future.cancel()
            self._started.clear()
            self._next = len(self._requests)
        self._pool.shutdown(wait=True)
