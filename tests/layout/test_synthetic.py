"""The synthetic values (osdpipe.layout.synthetic), computed a block at a time with a Mersenne remainder, is the
integer hash its docstring defines, bit for bit: held here against that definition written out plainly (``%`` of the
prime after every step, the whole range at once), across blocks, at large indices, for every dtype the checks use.
tests/io/test_facts.py holds what the checks need of it (a range is that range of the whole; every part of the key
counts)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from osdpipe.layout import synthetic

PRIME = 2**31 - 1


def defined(key: str, start: int, stop: int) -> torch.Tensor:
    """The sequence as the module's docstring defines it: an offset and three rounds of multiply-add-xorshift, each
    step's remainder taken with ``%``, over the whole range at once; float64 in ``[0, 1)``."""
    digest = hashlib.sha256(key.encode()).digest()
    offset, *mix = (int.from_bytes(digest[4 * i : 4 * i + 4], "little") % (PRIME - 1) + 1 for i in range(7))
    x = (torch.arange(start, stop, dtype=torch.int64) + offset) % PRIME
    for a, b in zip(mix[::2], mix[1::2], strict=True):
        x = (x * a + b) % PRIME
        x = (x ^ (x >> 11)) % PRIME
    return x.to(torch.float64) / PRIME


BLOCK = synthetic._BLOCK
RANGES = [
    (0, 1),
    (5, 5),
    (0, 3 * BLOCK + 17),  # several whole blocks and a part
    (BLOCK - 3, BLOCK + 3),  # across one block's end
    (2**31 - 40, 2**31 + 2 * BLOCK),  # indices past the prime
    (10**12, 10**12 + 1000),  # a 1024-rank world's last rank of a large parameter
]


@pytest.mark.parametrize(("start", "stop"), RANGES)
@pytest.mark.parametrize("key", [synthetic.grad_key(0, 3, "blocks.0.wq.weight"), synthetic.param_key(7, "w")])
def test_the_sequence_is_its_definition_bit_for_bit(key: str, start: int, stop: int) -> None:
    want = defined(key, start, stop) * 2 - 1
    got = synthetic.values(key, start, stop, 1.0, torch.float64)
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_values_are_the_definition_scaled_and_cast_once(dtype: torch.dtype) -> None:
    key, start, stop = synthetic.grad_key(1, 2, "layer.weight"), BLOCK - 100, 2 * BLOCK + 100
    want = ((defined(key, start, stop) * 2 - 1) * 1e-2).to(dtype)
    got = synthetic.values(key, start, stop, 1e-2, dtype)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_one_changed_round_changes_the_values(monkeypatch) -> None:
    """The comparison above sees a hash that differs from the definition (one constant of one round off by one)."""
    key = synthetic.param_key(0, "w")
    constants = synthetic._constants(key)
    monkeypatch.setattr(synthetic, "_constants", lambda k: (*constants[:-1], constants[-1] + 1))
    assert not torch.equal(synthetic.values(key, 0, 1000, 1.0, torch.float64), defined(key, 0, 1000) * 2 - 1)


def test_the_mersenne_remainder_is_percent_at_its_edges() -> None:
    """The remainder the hash takes in place equals ``%`` of the prime everywhere in ``[0, 2**62)``: at the values
    where a fold or the last subtraction decides (the prime and its multiples, one either side, the largest) and at
    random ones. Random ranges of the sequence meet the prime itself about once in 2**31 elements, so these are
    asked for by name."""
    edges = [0, 1, PRIME - 1, PRIME, PRIME + 1, 2 * PRIME - 1, 2 * PRIME, 2 * PRIME + 1, 2**31, 2**32 - 2, 2**32 - 1,
             2**32, PRIME * PRIME, PRIME * PRIME - 1, PRIME * PRIME + 1, 2**62 - 1, (2**31 - 2) * (2**31 - 1)]
    edges += [PRIME * k + r for k in (3, 2**20, 2**31 - 1, 2**31) for r in (0, 1, PRIME - 1)]
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(edges, dtype=torch.int64),
                   torch.randint(0, 2**62, (100_000,), dtype=torch.int64, generator=generator)])  # fmt: skip
    got = x.clone()
    synthetic._reduce(got, torch.empty_like(got))
    assert torch.equal(got, x % PRIME)
