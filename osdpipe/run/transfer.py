"""How a rank gets its ranges of the source: it reads them, or the rank that reads for it sends them.

``runtime.transfer=shared``: every rank reads the input itself (a filesystem
every rank sees). ``scatter``: on each host, the first rank that sees the
input reads it, and every other rank gets exactly its ranges from a reading
rank through the process group (gloo on CPU, NCCL with CUDA tensors), for an
input on one node's local disk. Each byte a receiver needs crosses the process
group once, so the bytes sent are the receivers' own bytes, never the state
times the world size.

Both sides walk the same :func:`plan`: per local tensor, per state name, the
segments that carry source state, in :func:`~osdpipe.layout.ranges.batches` of at
most ``runtime.memory_budget / 2`` bytes. A batch of one segment is sent from
the source's memory and lands in the output tensor itself; a batch of several
travels as one message and is copied into place. Elements no batch carries
(padding, parameters without state) are zero.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from osdpipe.io.digest import pieces_fingerprint
from osdpipe.io.formats import SourceMeta, SourceReader, TensorRef, own_copy
from osdpipe.io.formats.base import expect, read_parts
from osdpipe.layout.ranges import LocalTensor, Segment, batches, uncovered


def reading_ranks(hosts: list[str], visible: list[bool], transfer: str, path: str) -> list[int]:
    """For each rank, the rank that reads its ranges of the input (itself, for a rank that reads).

    ``shared``: every rank reads. ``scatter``: the first rank on each host that
    sees the input reads; a rank on a host with a reader gets its ranges from
    it, and the ranks of hosts without one are spread over the readers.

    Raises:
        ValueError: a rank that must read cannot see ``path``, or no rank can.
    """
    if transfer == "shared":
        blind = [r for r, seen in enumerate(visible) if not seen]
        if blind:
            raise ValueError(
                f"rank(s) {blind} cannot see {path}; with runtime.transfer=shared every rank reads the input itself: "
                "put it on a filesystem every rank shares, or set runtime.transfer=scatter"
            )
        return list(range(len(visible)))
    if not any(visible):
        raise ValueError(f"no rank can see {path}; put it where at least one rank can read it")
    reader_of_host: dict[str, int] = {}
    for rank, (host, seen) in enumerate(zip(hosts, visible, strict=True)):
        if seen:
            reader_of_host.setdefault(host, rank)
    readers = sorted(reader_of_host.values())
    out, orphans = [], 0
    for host in hosts:
        if host in reader_of_host:
            out.append(reader_of_host[host])
        else:
            out.append(readers[orphans % len(readers)])
            orphans += 1
    return out


@dataclass(frozen=True)
class Batch:
    """One read, message or comparison: ``segments`` of state ``name`` of a local tensor, at most one piece of bytes."""

    name: str
    dtype: torch.dtype
    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        return sum(s.length for s in self.segments)


def stateful(tensor: LocalTensor, name: str, meta: SourceMeta) -> list[Segment]:
    """The segments of ``tensor`` whose parameter has tensor state ``name`` in the source (the rest stays zero)."""
    return [s for s in tensor.segments if isinstance(meta.state.get(s.fqn, {}).get(name), TensorRef)]


def plan(tensor: LocalTensor, entry: dict[str, Any], meta: SourceMeta, piece_bytes: int | None) -> list[Batch]:
    """Every batch that fills ``tensor``'s state ``entry``, in the order both sides of a transfer walk them."""
    out = []
    for name, value in entry.items():
        if isinstance(value, TensorRef):
            dtype = value.torch_dtype
            limit = None if piece_bytes is None else max(1, piece_bytes // dtype.itemsize)
            out += [Batch(name, dtype, b) for b in batches(stateful(tensor, name, meta), limit)]
    return out


def allocate(tensor: LocalTensor, entry: dict[str, Any], meta: SourceMeta) -> dict[str, Any]:
    """The state of ``tensor`` before its batches arrive:
    its own copy of each scalar value, tensors zero where no batch writes.

    A source may hold one scalar for many parameters (FSDP1's FULL state
    shares one ``step`` tensor across a unit's parameters). Every output
    tensor gets a copy of its own: a shared ``step`` loaded into a
    per-parameter optimizer is advanced once per parameter that shares it.
    """
    out: dict[str, Any] = {}
    for name, value in entry.items():
        if not isinstance(value, TensorRef):
            out[name] = own_copy(value)
            continue
        # every element is written once: by a batch, or zeroed here
        flat = torch.empty(tensor.numel, dtype=value.torch_dtype)
        for lo, hi in uncovered(0, tensor.numel, [(s.dest, s.dest + s.length) for s in stateful(tensor, name, meta)]):
            flat[lo:hi].zero_()
        out[name] = flat.view(tensor.shape)
    return out


def _device() -> torch.device:
    """Where messages travel from: NCCL moves CUDA tensors only."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Source:
    """This rank's view of the input: its reader, and how much it may hold at once."""

    def __init__(self, reader: SourceReader, piece_bytes: int | None) -> None:
        self.reader, self.piece_bytes = reader, piece_bytes

    def expect(self, batches_: list[Batch]) -> None:
        """The batches about to be read, in order: a reader of object storage fetches them ahead as few requests
        (:func:`osdpipe.io.formats.base.expect`); none: it lets go of what it fetched for the last ones."""
        expect(self.reader, [(s.fqn, b.name, s.start, s.start + s.length) for b in batches_ for s in b.segments])

    def parts(self, batch: Batch) -> tuple[Batch, list[torch.Tensor]]:
        """The batch as the source stores it: its segments cut where a stored piece ends
        (:func:`osdpipe.io.formats.base.read_parts`), and the elements of each cut, in order.

        What is copied into the state goes there from where it was read, without a tensor of its own per segment
        first: a 4 -> 2 conversion of a DCP checkpoint joins two chunks for every segment, 1.6 GB written into new
        tensors (0.8 s of one core, most of it their first touch) only to be copied on.
        """
        segments: list[Segment] = []
        pieces: list[torch.Tensor] = []
        for seg in batch.segments:
            done = 0
            for part in read_parts(self.reader, seg.fqn, batch.name, seg.start, seg.start + seg.length):
                segments.append(replace(seg, start=seg.start + done, length=part.numel(), dest=seg.dest + done))
                pieces.append(part)
                done += part.numel()
            assert done == seg.length, f"{seg.fqn} {batch.name}: {done} of [{seg.start}, {seg.start + seg.length}) read"
        return replace(batch, segments=tuple(segments)), pieces

    def done(self, batch: Batch) -> None:
        """Under a memory budget, memory-mapped pages are let go once copied;
        without one the kernel keeps them cached."""
        if self.piece_bytes is not None:
            for s in batch.segments:
                self.reader.release(s.fqn, batch.name, s.start, s.start + s.length)


def fill(state: dict[str, Any], batches_: list[Batch], source: Source, digests: list[str] | None = None) -> int:
    """Copy every batch from this rank's reader into ``state``; the bytes copied.

    With ``digests``, each batch's fingerprint as read (:func:`osdpipe.io.digest.pieces_fingerprint`) is appended
    to it (for the roundtrip check, which then need not read the source again:
    :func:`osdpipe.run.stages.shard.digests_reads`).
    """
    copied = 0
    for batch in batches_:
        stored, pieces = source.parts(batch)
        if digests is not None:
            digests.append(pieces_fingerprint(pieces))
        place(state[batch.name].view(-1), stored, pieces)
        source.done(batch)
        copied += batch.numel * batch.dtype.itemsize
    return copied


def place(flat: torch.Tensor, batch: Batch, pieces: list[torch.Tensor]) -> None:
    """Copy ``batch``'s pieces, as read from the source, to where its segments go in the flat state ``flat``."""
    for seg, piece in zip(batch.segments, pieces, strict=True):
        flat[seg.dest : seg.dest + seg.length] = piece


class Server:
    """Sends the ranks this rank reads for their batches (``runtime.transfer=scatter``).

    A read that fails does not leave a receiver waiting: from then on every
    batch, to every receiver, goes as zeros, and :meth:`finish` raises the
    error once all of them have what they wait for.
    """

    def __init__(self, source: Source, *, digest: bool) -> None:
        self.source, self.digest = source, digest
        self.failure: Exception | None = None

    def send(self, batches_: list[Batch], dst: int) -> tuple[int, list[str]]:
        """Send rank ``dst`` every batch, read here;
        the bytes sent and, with ``digest``, each batch's fingerprint (for verify)."""
        device, sent, digests = _device(), 0, []
        for batch in batches_:
            message: torch.Tensor | None = None
            if self.failure is None:
                try:
                    _, pieces = self.source.parts(batch)
                    if self.digest:
                        digests.append(pieces_fingerprint(pieces))
                    message = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                except Exception as exc:  # noqa: BLE001 - raised by finish(), after every receiver has its messages
                    self.failure = exc
            dist.send((torch.zeros(batch.numel, dtype=batch.dtype) if message is None else message).to(device), dst)
            if message is not None:
                self.source.done(batch)
            sent += batch.numel * batch.dtype.itemsize
        return sent, digests

    def finish(self) -> None:
        if self.failure is not None:
            raise self.failure


class Receiver:
    """Receives this rank's batches from the rank that reads for it (``runtime.transfer=scatter``).

    The sender's :class:`Server` sends every batch of the plan, and a send
    waits for its receive. So a receiving rank that fails part way (no memory
    for the next tensor, say) must still take what is owed to it: :meth:`drain`
    receives the rest and drops it, and the sender reaches the stage's
    collective, where the failure is agreed on.
    """

    def __init__(self, src: int) -> None:
        self.src = src
        self.received = 0  # batches taken so far, in plan order

    def receive(self, state: dict[str, Any], batches_: list[Batch]) -> int:
        """Receive every batch of ``batches_`` into ``state``; the bytes received."""
        device, got = _device(), 0
        for batch in batches_:
            flat = state[batch.name].view(-1)
            first = batch.segments[0]
            if len(batch.segments) == 1 and device.type == "cpu":
                dist.recv(flat[first.dest : first.dest + first.length], self.src)  # straight into the output
            else:
                message = torch.empty(batch.numel, dtype=batch.dtype, device=device)
                dist.recv(message, self.src)
                message, at = message.cpu(), 0
                for seg in batch.segments:
                    flat[seg.dest : seg.dest + seg.length] = message[at : at + seg.length]
                    at += seg.length
            self.received += 1
            got += batch.numel * batch.dtype.itemsize
        return got

    def drain(self, owed: list[Batch]) -> None:
        """Receive and drop every batch of ``owed`` (the whole plan, in order) not yet received.

        Stops at the first receive that fails: the connection is gone, and
        with it the sender's wait.
        """
        device = _device()
        for batch in owed[self.received :]:
            try:
                dist.recv(torch.empty(batch.numel, dtype=batch.dtype, device=device), self.src)
            except Exception:  # noqa: BLE001 - the failure that made us drain is the one to report
                return
            self.received += 1


def batch_fingerprint(state: dict[str, Any], batch: Batch) -> str:
    """The fingerprint of what ``state`` holds where ``batch`` wrote:
    equal to the sender's digest exactly when every byte arrived and stayed."""
    flat = state[batch.name].reshape(-1)
    return pieces_fingerprint([flat[s.dest : s.dest + s.length] for s in batch.segments])
