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

import torch

_PRIME = 2**31 - 1
#: Rounds of multiply-add-xorshift that mix an index with the key's constants.
_ROUNDS = 3


# a rank asks for many ranges of one key; a process playing 1024 ranks, for the same keys
@functools.lru_cache(maxsize=4096)
def _constants(key: str) -> tuple[int, ...]:
    """The key's offset and per-round multipliers and addends, each in ``[1, prime)``:
    a digest, the same in every process."""
    digest = hashlib.sha256(key.encode()).digest()
    return tuple(int.from_bytes(digest[4 * i : 4 * i + 4], "little") % (_PRIME - 1) + 1 for i in range(1 + 2 * _ROUNDS))


def uniform(key: str, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the sequence of ``key``: float64 values in ``[0, 1)``."""
    offset, *mix = _constants(key)
    x = (torch.arange(start, stop, dtype=torch.int64) + offset) % _PRIME
    for a, b in zip(mix[::2], mix[1::2]):
        x = (x * a + b) % _PRIME
        x = (x ^ (x >> 11)) % _PRIME
    return x.to(torch.float64) / _PRIME


def values(key: str, start: int, stop: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[start, stop)`` of ``key``'s sequence as values in ``[-scale, scale)`` of ``dtype`` (1-D).

    Computed in float64 and cast once, so the same element has the same bits
    in every range that holds it.
    """
    return ((uniform(key, start, stop) * 2 - 1) * scale).to(dtype)


def grad_key(seed: int, step: int, fqn: str) -> str:
    """The key of parameter ``fqn``'s gradient at ``step`` (``generate.seed`` is ``seed``)."""
    return f"grad\0{seed}\0{step}\0{fqn}"


def param_key(seed: int, fqn: str) -> str:
    """The key of parameter ``fqn``'s synthetic starting value (the resume check starts every job from it)."""
    return f"param\0{seed}\0{fqn}"
