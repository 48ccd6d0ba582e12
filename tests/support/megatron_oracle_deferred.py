"""The tensors the test oracle's writer (:mod:`megatron_oracle_writer`) makes from the source's, made as written.

A Megatron-LM save written for another grid holds the source's global tensors as they are, and tensors made from
them: every ``dp_reshardable`` bucket (each parameter's piece of a state, in the target's bucket order, zeros between
parameters) and every vocabulary tensor padded for the target's TP (:func:`osdpipe.layout.megatron.padded_vocab_size`).
Each is a placeholder (:func:`osdpipe.io.torchfile.placeholder`: its size, no memory held), and
:class:`MadeAsWritten`, a :class:`osdpipe.io.torchfile.Filler`, hands the file its bytes as the writer reaches its
record, a parameter at a time; a test changes one element of them as they are written
(:func:`synthetic_megatron.one_element_changed`). The bytes are those of the tensor made whole
(tests/io/test_megatron_oracle.py compares them). Not the product's path: the product writes a save rank by rank
through the stage loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import torch

from osdpipe.io.digest import tensor_bytes
from osdpipe.io.torchfile import placeholder
from osdpipe.layout import megatron as layout
from osdpipe.layout.flat_buffer import FlatBuffer

#: The most zeros (bytes) handed to the file in one window: padding rows of a large vocabulary are not made at once.
ZERO_WINDOW = 16 << 20


class MadeAsWritten:
    """Placeholders (:meth:`add`) and how each one's bytes are made: the writer's :class:`~osdpipe.io.torchfile.Filler`
    (:func:`osdpipe.io.torchfile.filled_as_written`). Each placeholder is filled once; a forked writer fills its own
    share from its copy of this object."""

    def __init__(self) -> None:
        self._makers: dict[int, Callable[[], Iterator[memoryview]]] = {}

    def add(
        self, shape: tuple[int, ...], dtype: torch.dtype, windows: Callable[[], Iterator[memoryview]]
    ) -> torch.Tensor:
        """A placeholder of ``shape`` and ``dtype`` whose bytes, front to back, ``windows()`` makes as it is written."""
        flat, _ = placeholder(math.prod(shape), dtype)
        tensor = flat.view(shape)
        self._makers[tensor.untyped_storage()._cdata] = windows
        return tensor

    def fills(self, storage: torch.UntypedStorage) -> bool:
        return storage._cdata in self._makers

    def windows(self, storage: torch.UntypedStorage) -> Iterator[memoryview]:
        return self._makers.pop(storage._cdata)()


def zeros(nbytes: int) -> Iterator[memoryview]:
    """``nbytes`` zero bytes, at most :data:`ZERO_WINDOW` at a time."""
    window = memoryview(bytes(min(nbytes, ZERO_WINDOW)))
    while nbytes > 0:
        yield window[: min(nbytes, ZERO_WINDOW)]
        nbytes -= ZERO_WINDOW


def repadded_windows(tensor: torch.Tensor, rows: int) -> Iterator[memoryview]:
    """The bytes of ``tensor`` given ``rows`` rows: its first ones kept, the rest zero (a vocabulary padded for the
    target's TP: more rows than the source's, or fewer)."""
    keep = min(rows, tensor.shape[0])
    yield memoryview(tensor_bytes(tensor[:keep]))
    yield from zeros((rows - keep) * math.prod(tensor.shape[1:]) * tensor.element_size())


def box_of(tensor: torch.Tensor, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``box`` (a ``(start, stop)`` per axis) of ``tensor``, its rows past ``tensor``'s own zero: a box of a
    vocabulary tensor as the target pads it, without the padded tensor made."""
    (first, stop), rest = box[0], tuple(slice(a, b) for a, b in box[1:])
    held = min(stop, tensor.shape[0])
    if held >= stop:
        return tensor[(slice(first, stop), *rest)]
    out = torch.zeros((stop - first, *(b - a for a, b in box[1:])), dtype=tensor.dtype)
    if held > first:
        out[: held - first] = tensor[(slice(first, held), *rest)]
    return out


def local_state(param: layout.LocalParameter, state_of: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """One rank's local parameter ``param`` of a state, from the global tensors (``state_of(key)``), piece by piece."""
    local = torch.zeros(param.shape, dtype=torch.float32)
    for piece in param.pieces:
        rows = local[piece.local_start : piece.local_stop]
        rows.copy_(box_of(state_of(piece.key), piece.box).reshape(rows.shape))
    return local


def bucket_windows(
    bucket: FlatBuffer, by_name: Mapping[str, layout.LocalParameter], state_of: Callable[[str], torch.Tensor]
) -> Iterator[memoryview]:
    """The bytes of one ``dp_reshardable`` bucket of a state, cut at its unpadded size: each parameter's local state
    (:func:`local_state`) at its place, zeros between parameters."""
    at = 0
    for name, start, stop in sorted(bucket.entries, key=lambda entry: entry[1]):
        yield from zeros((start - at) * 4)
        yield memoryview(tensor_bytes(local_state(by_name[name], state_of)))
        at = stop
    yield from zeros((bucket.data_end - at) * 4)
