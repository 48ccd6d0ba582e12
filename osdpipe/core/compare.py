"""Bitwise comparison of optimizer state dicts, reporting where they differ;
and where a converted range holds NaN or Inf."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from osdpipe.layout.ranges import Segment


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so ``-0.0 != 0.0`` and equal NaNs are equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    x, y = (t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
    word = _widest_word(x, y)
    return torch.equal(x.view(word), y.view(word))


def differing_bits(block: torch.Tensor, held: torch.Tensor) -> int:
    """How many elements of ``block`` differ, bit for bit, from ``held`` (cast to ``block``'s dtype, of its shape)."""
    held = held.to(block.dtype)
    if bits_equal(block, held):
        return 0
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[block.element_size()]
    return int((block.contiguous().view(word) != held.contiguous().view(word)).sum())


def _widest_word(*flats: torch.Tensor) -> torch.dtype:
    """The widest integer type every byte tensor of ``flats`` can be viewed as:
    ``torch.equal`` compares int64 words about 5x faster than bytes."""
    for word in (torch.int64, torch.int32, torch.int16):
        if all(f.numel() % word.itemsize == 0 and f.storage_offset() % word.itemsize == 0 for f in flats):
            return word
    return torch.uint8


def differing_segments(
    label: str, flat: torch.Tensor, segments: Sequence[Segment], pieces: Sequence[torch.Tensor]
) -> list[str]:
    """Each segment of the flat result ``flat`` whose elements differ,
    bitwise, from its ``pieces`` read from the source, naming the first.

    ``label`` names the result (``<layout key>.<state name>``); a line reads
    ``<label>: differs from <fqn>[<flat index>] (flat) : <got> vs <want>``.
    """
    problems = []
    for seg, want in zip(segments, pieces, strict=True):
        got = flat[seg.dest : seg.dest + seg.length]
        if not bits_equal(got, want):
            unequal = (got != want).nonzero()
            bad = int(unequal[0]) if unequal.numel() else 0  # bytes differ where values compare equal: -0.0 against 0.0
            problems.append(
                f"{label}: differs from {seg.fqn}[{seg.start + bad}] (flat) : {got[bad].item()} vs {want[bad].item()}"
            )
    return problems


def nonfinite_segments(name: str, flat: torch.Tensor, segments: Sequence[Segment]) -> list[str]:
    """Each segment of the flat state ``flat`` (state ``name``) that holds NaN or Inf:
    ``"block1.gate exp_avg (2 element(s), first at flat index 5)"``."""
    if not flat.is_floating_point():
        return []
    found = []
    for seg in segments:
        part = flat[seg.dest : seg.dest + seg.length]
        if bool(torch.isfinite(part.sum())):
            # a NaN or an Inf anywhere makes the sum NaN or Inf;
            # a finite sum needs no element-wise pass (one that overflows gets it)
            continue
        hits = (~torch.isfinite(part)).nonzero()
        if hits.numel():
            found.append(
                f"{seg.fqn} {name} ({hits.numel()} element(s), first at flat index {seg.start + int(hits[0])})"
            )
    return found


def describe_tensor(t: torch.Tensor) -> str:
    return f"tensor{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def diff(
    a: Any, b: Any, path: str = "", limit: int = 5, sequence_types: bool = True, tensor_bytes: bool = True
) -> list[str]:
    """Where ``a`` and ``b`` differ, as ``path: what`` lines (at most ``limit``); empty when bitwise equal.

    ``sequence_types=False`` takes a list and a tuple of equal items as equal
    (PyTorch's ``set_optimizer_state_dict`` turns ``betas=(0.9, 0.999)`` into
    a list; the optimizer reads either alike). Tensors are compared bitwise;
    with ``tensor_bytes=False`` by dtype and shape only (the structure of a
    file loaded with ``mmap``, without reading its data).
    """
    out: list[str] = []

    def walk(x: Any, y: Any, where: str) -> None:
        if len(out) >= limit:
            return
        if torch.is_tensor(x) or torch.is_tensor(y):
            if not (torch.is_tensor(x) and torch.is_tensor(y)):
                out.append(f"{where}: {type(x).__name__} vs {type(y).__name__}")
            elif x.dtype != y.dtype or x.shape != y.shape:
                out.append(f"{where}: {describe_tensor(x)} vs {describe_tensor(y)}")
            elif tensor_bytes and not bits_equal(x, y):
                flat_x, flat_y = x.reshape(-1), y.reshape(-1)
                bytes_x = flat_x.view(torch.uint8).reshape(flat_x.numel(), -1)
                bytes_y = flat_y.view(torch.uint8).reshape(flat_y.numel(), -1)
                bad = (bytes_x != bytes_y).any(dim=1)
                i = int(bad.nonzero()[0]) if bad.any() else 0
                out.append(
                    f"{where}: {int(bad.sum())} element(s) differ, first at flat index {i}: "
                    f"{flat_x[i].item()} vs {flat_y[i].item()}"
                )
        elif isinstance(x, dict) and isinstance(y, dict):
            if list(map(str, x)) != list(map(str, y)) and set(map(str, x)) != set(map(str, y)):
                out.append(f"{where}: keys {sorted(map(str, x))} vs {sorted(map(str, y))}")
                return
            for k in x:
                walk(x[k], y[k], f"{where}[{k!r}]")
        elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            if len(x) != len(y) or (sequence_types and type(x) is not type(y)):
                out.append(f"{where}: {x!r} vs {y!r}")
                return
            for i, (xi, yi) in enumerate(zip(x, y)):
                walk(xi, yi, f"{where}[{i}]")
        elif type(x) is not type(y) or x != y:
            out.append(f"{where}: {x!r} vs {y!r}")

    walk(a, b, path or "state_dict")
    return out
