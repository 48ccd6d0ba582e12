"""Deterministic synthetic values that any layout can compute for its own elements alone.

The value of element ``i`` of a parameter's flattened view is a pure function
of a key (what the values are for: a gradient at a step, a parameter's
starting value), the parameter's canonical FQN and ``i``. There is no
generator state, so a rank computes exactly the ranges its local tensors hold
(an FSDP1 flat shard's segments, an FSDP2 row chunk, a whole parameter) and
every layout sees the same value for the same element: a step on synthetic
gradients is the same step of the unwrapped model, wherever the parameter
was cut. Nothing needs a forward pass or an input, so any model trains.

The function is an integer hash modulo the prime ``2**31 - 1``: every
intermediate stays below ``2**62``, so int64 arithmetic is exact on every
machine and every vectorization, unlike float functions (``sin``) whose
vectorized and scalar paths may round differently.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator

import torch

_PRIME = 2**31 - 1
#: Rounds of multiply-add-xorshift that mix an index with the key's constants.
_ROUNDS = 3
#: Elements hashed at once. The hash is some twenty passes over its int64 values; a block of 2 MiB keeps them in the
#: CPU's cache, where a whole parameter's went out to memory and back for each pass (6x the time on 10M elements).
_BLOCK = 1 << 18


# a rank asks for many ranges of one key; a process playing 1024 ranks, for the same keys
@functools.lru_cache(maxsize=4096)
def _constants(key: str) -> tuple[int, ...]:
    """The key's offset and per-round multipliers and addends, each in ``[1, prime)``:
    a digest, the same in every process."""
    digest = hashlib.sha256(key.encode()).digest()
    return tuple(int.from_bytes(digest[4 * i : 4 * i + 4], "little") % (_PRIME - 1) + 1 for i in range(1 + 2 * _ROUNDS))


def _reduce(x: torch.Tensor, spare: torch.Tensor) -> None:
    """``x %= 2**31 - 1`` in place, for ``0 <= x < 2**62`` (``spare``: a tensor of ``x``'s shape to work in).

    The prime is a Mersenne number: ``2**31`` is ``prime + 1``, so ``hi * 2**31 + lo`` leaves the remainder of
    ``hi + lo``. Two such folds bring ``x`` to at most ``2**31``, and the prime is taken off where ``x + 1`` reaches
    ``2**31``: shifts, masks and adds, where ``%`` is an integer division per element, the slowest of the hash's
    operations by far. The same remainders, so the same values, bit for bit."""
    for _ in range(2):
        torch.bitwise_right_shift(x, 31, out=spare)
        x.bitwise_and_(_PRIME).add_(spare)
    _take_prime_off_at_prime(x, spare)


def _take_prime_off_at_prime(x: torch.Tensor, spare: torch.Tensor) -> None:
    """``x`` in ``[0, prime + 1]`` -> ``x % prime``, in place: ``(x + 1) >> 31`` is 1 where ``x >= prime``."""
    torch.add(x, 1, out=spare)
    x.sub_(spare.bitwise_right_shift_(31), alpha=_PRIME)


def _hashed(key: str, start: int, stop: int) -> Iterator[tuple[int, torch.Tensor]]:
    """The integer hash of elements ``[start, stop)`` of ``key``, each in ``[0, prime)``, a block at a time: each
    block's offset from ``start`` and its int64 values (reused for the next block: use them before asking for it)."""
    offset, *mix = _constants(key)
    rounds = list(zip(mix[::2], mix[1::2], strict=True))
    size = min(_BLOCK, max(stop - start, 0))
    x, spare = torch.empty(size, dtype=torch.int64), torch.empty(size, dtype=torch.int64)
    for first in range(start, stop, _BLOCK):
        n = min(_BLOCK, stop - first)
        block, work = x[:n], spare[:n]
        torch.arange(first + offset, first + offset + n, dtype=torch.int64, out=block)
        _reduce(block, work)
        for a, b in rounds:
            block.mul_(a).add_(b)  # below 2**62: both factors below 2**31
            _reduce(block, work)
            torch.bitwise_right_shift(block, 11, out=work)
            block.bitwise_xor_(work)  # below 2**31: prime itself is the one value to take back to 0
            _take_prime_off_at_prime(block, work)
        yield first - start, block


def values(key: str, start: int, stop: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[start, stop)`` of ``key``'s sequence as values in ``[-scale, scale)`` of ``dtype`` (1-D).

    Computed in float64 and cast once, so the same element has the same bits
    in every range that holds it.
    """
    out = torch.empty(max(stop - start, 0), dtype=dtype)
    for at, block in _hashed(key, start, stop):
        out[at : at + len(block)].copy_(block.to(torch.float64).div_(_PRIME).mul_(2).sub_(1).mul_(scale))
    return out


def grad_key(seed: int, step: int, fqn: str) -> str:
    """The key of parameter ``fqn``'s gradient at ``step`` (``generate.seed`` is ``seed``)."""
    return f"grad\0{seed}\0{step}\0{fqn}"


def param_key(seed: int, fqn: str) -> str:
    """The key of parameter ``fqn``'s synthetic starting value (the resume check starts every job from it)."""
    return f"param\0{seed}\0{fqn}"
