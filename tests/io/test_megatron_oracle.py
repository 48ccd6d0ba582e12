"""The test oracle (tests/support/megatron_oracle*.py) the Megatron tests hold the product's output against is right.

Its writer makes the buckets and padded vocabulary of the small saves the tests convert as it writes them: the bytes
are those of the tensors made whole. Its read-back check, held against a source as it is read, fails on one wrong
element anywhere in a save: a check that passes says something of the product's output.
"""

from __future__ import annotations

from pathlib import Path

import megatron_oracle_deferred as deferred
import pytest
import torch
from megatron_oracle import read_save
from megatron_oracle_check import read_back_problems
from megatron_oracle_deferred import MadeAsWritten
from megatron_oracle_writer import Target, write_save
from synthetic_megatron import one_element_changed, synthetic_save

from osdpipe.layout import megatron as layout


def _joined(windows) -> bytes:
    return b"".join(bytes(w) for w in windows)


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("rows", [5, 8, 12])
def test_a_repadded_tensor_is_its_rows_kept_and_zeros_after(rows: int) -> None:
    tensor = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) + 1
    want = torch.zeros(rows, 3)
    want[: min(rows, 8)] = tensor[: min(rows, 8)]
    assert _joined(deferred.repadded_windows(tensor, rows)) == _as_bytes(want)


def test_zeros_come_in_windows_of_at_most_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(deferred, "ZERO_WINDOW", 10)
    assert [len(w) for w in deferred.zeros(25)] == [10, 10, 5]
    assert list(deferred.zeros(0)) == []


@pytest.mark.parametrize("padded", [1056, 1152, 1248])
@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 2, 2), (2, 1, 3), (4, 2, 1)])
def test_a_buckets_bytes_are_the_bucket_made_whole(tp: int, pp: int, dp: int, padded: int) -> None:
    """Every bucket of a tied GPT (the last stage's copy of the embedding), its vocabulary padded to fewer, as many and
    more rows than the global tensors hold (1152), against the bucket filled in memory: each parameter's pieces copied
    from the target's global tensors (the vocabulary repadded whole first), zeros between parameters."""
    gpt = layout.Gpt(4, 32, 64, 4, 2, 8, 1152, True, tied=True)
    generator = torch.Generator().manual_seed(1)
    optim = {key: torch.randn(shape, generator=generator) for key, shape in layout.global_shapes(gpt).items()}
    target = layout.Gpt(4, 32, 64, 4, 2, 8, padded, True, tied=True)
    repadded = {key: torch.cat([t[:padded], torch.zeros(max(0, padded - t.shape[0]), *t.shape[1:])])
                if key in layout.VOCAB_KEYS else t for key, t in optim.items()}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            params = layout.local_parameters(target, tp, pp, tp_rank, pp_rank)
            by_name = {p.name: p for p in params}
            for bucket in layout.buckets(params, dp):
                whole = torch.zeros(bucket.data_end)
                for name, start, stop in bucket.entries:
                    view = whole[start:stop].view(by_name[name].shape)
                    for piece in by_name[name].pieces:
                        box = tuple(slice(a, b) for a, b in piece.box)
                        rows = view[piece.local_start : piece.local_stop]
                        rows.copy_(repadded[piece.key][box].reshape(rows.shape))
                made = _joined(deferred.bucket_windows(bucket, by_name, optim.__getitem__))
                assert made == _as_bytes(whole), (tp_rank, pp_rank)


def test_a_placeholder_reads_as_zeros_and_its_windows_make_its_bytes_once() -> None:
    made = MadeAsWritten()
    tensor = made.add((1000, 1000), torch.float32, lambda: iter([memoryview(b"x")]))
    assert tensor.shape == (1000, 1000) and not bool(tensor.any())  # untouched anonymous memory reads as zeros
    assert made.fills(tensor.untyped_storage()) and _joined(made.windows(tensor.untyped_storage())) == b"x"
    assert not made.fills(tensor.untyped_storage())  # made once


#: Which output item each case changes: the first exp_avg bucket, or the model's word embedding (padded for the target).
CHOSEN = {"bucket": lambda key: "bucket_idx_" in key and key.endswith(".exp_avg"),
          "vocabulary": lambda key: key == "embedding.word_embeddings.weight"}


@pytest.mark.parametrize(
    ("source_tp", "target", "kind", "index", "said"),
    [
        (2, Target(1, 2, 2, "dp_reshardable"), "bucket", 7, "differs from the source's at"),
        # TP1 pads the vocabulary to 1056 rows, the source (TP2) to 1152: the last row kept is the source's
        (2, Target(1, 1, 1, "fully_reshardable"), "vocabulary", -1, "rows [0, 1056) differ from the source's"),
        # TP2 pads to 1152 rows where the source (TP1) holds 1056: the rows it adds must be zero
        (1, Target(2, 1, 1, "dp_reshardable"), "vocabulary", -1, "the padding rows [1056, 1152) it adds are not zero"),
    ],
)
def test_the_read_back_compared_as_it_is_read_finds_one_wrong_element(
    tmp_path: Path, source_tp: int, target: Target, kind: str, index: int, said: str
) -> None:
    save = read_save(synthetic_save(tmp_path, tp=source_tp))
    write_save(save, tmp_path / "right", target)
    assert read_back_problems(save, tmp_path / "right") == []
    with one_element_changed(CHOSEN[kind], index) as changed:
        write_save(save, tmp_path / "wrong", target)
    assert changed
    problems = read_back_problems(save, tmp_path / "wrong")
    assert len(problems) == 1 and said in problems[0], problems
