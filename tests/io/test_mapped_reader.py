"""A source read through a model map (:mod:`osdpipe.io.formats.mapped`) gives what the whole-tensor maps give.

The maps as data (:func:`osdpipe.layout.megatron_hf.model_map`) are checked against the maps as functions
(``to_hf``, ``to_titan``, ``from_hf``), which tests/layout/test_megatron_hf_map.py checks head by head and the
framework tests prove by both frameworks' forward passes: read whole, and read by ranges that cut every parameter at
odd places (a transposed block crossed by many ranges, padding rows within a range). Every element is its own index,
so one misplaced element fails.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from megatron_args import GPT2_ARGS, LLAMA_ARGS

from osdpipe.io.formats.base import InputError, SourceMeta, TensorRef
from osdpipe.io.formats.mapped import MappedReader, ModelMap
from osdpipe.layout import llama_titan, megatron_hf
from osdpipe.layout.megatron import global_shapes, gpt_of

#: A Llama (GQA, untied), a tied Llama with biases (a Llama of attention_bias), a Qwen3 (head norms), and GPT-2.
CASES = {
    "llama": LLAMA_ARGS,
    "llama_tied_biased": {**LLAMA_ARGS, "untie_embeddings_and_output_weights": False, "add_bias_linear": True},
    "qwen3": {**LLAMA_ARGS, "qk_layernorm": True, "kv_channels": 24},
    "gpt2": {**GPT2_ARGS, "add_bias_linear": True},
}


class DictReader:
    """A reader of whole tensors held in memory, by name, one state ``w`` and a ``step``; it counts what it reads."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors, self.read_elements, self.released = tensors, 0, []

    def meta(self) -> SourceMeta:
        state = {k: {"w": TensorRef(tuple(v.shape), "float64"), "step": torch.tensor(3.0)}
                 for k, v in self.tensors.items()}
        return SourceMeta(state=state, param_groups=[{"params": list(self.tensors), "lr": 0.1, "wd_mult": 1.0}])

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        assert name == "w", name
        self.read_elements += stop - start
        return self.tensors[fqn].reshape(-1)[start:stop]

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        self.released.append((fqn, start, stop))


def _indexed(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    out, at = {}, 1
    for key, shape in shapes.items():
        n = math.prod(shape)
        out[key] = torch.arange(at, at + n, dtype=torch.float64).reshape(shape)
        at += n
    return out


def _expected(args: dict, naming: str, megatron: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gpt, vocab = gpt_of(args), megatron_hf.true_vocab_size(args)
    hf = megatron_hf.to_hf(gpt, megatron, vocab)
    if naming == megatron_hf.TORCHTITAN:
        return llama_titan.to_titan(llama_titan.heads_of(megatron_hf.titan_args(args, vocab_size=vocab)), hf)
    return hf


def _reader(args: dict, source: str, target: str, tensors: dict, shapes: dict) -> MappedReader:
    mapping = ModelMap(megatron_hf.model_map(args, source, target), {"w": "w", "step": "step"}, ("x", {}),
                       group_keys=("wd_mult",))
    return MappedReader(DictReader(tensors), mapping, shapes)


def _read_by_ranges(reader: MappedReader, shapes: dict, seed: int) -> dict[str, torch.Tensor]:
    rng, out = random.Random(seed), {}
    for name, shape in shapes.items():
        n, at, parts = math.prod(shape), 0, []
        while at < n:
            stop = min(n, at + rng.randint(1, max(1, n // 3)))
            parts.append(reader.read_range(name, "w", at, stop).clone())
            reader.release(name, "w", at, stop)
            at = stop
        out[name] = torch.cat(parts).reshape(shape)
    return out


#: Each case as its Hugging Face model, and as torchtitan's where torchtitan's models hold it (no biases, no GPT-2).
READ_AS = [*((case, megatron_hf.HF_NAMES) for case in CASES), ("llama", megatron_hf.TORCHTITAN),
           ("qwen3", megatron_hf.TORCHTITAN)]


@pytest.mark.parametrize(("case", "naming"), READ_AS)
def test_megatron_read_as_another_model_is_what_the_maps_give(case: str, naming: str) -> None:
    args = CASES[case]
    megatron = _indexed(global_shapes(gpt_of(args)))
    expected = _expected(args, naming, megatron)
    shapes = {k: tuple(v.shape) for k, v in expected.items()}
    reader = _reader(args, megatron_hf.MEGATRON_NAMES, naming, megatron, shapes)
    whole = reader.read([(k, "w") for k in shapes])
    assert all(torch.equal(whole[(k, "w")], v) for k, v in expected.items())
    by_ranges = _read_by_ranges(reader, shapes, seed=len(case))
    assert all(torch.equal(by_ranges[k], v) for k, v in expected.items())


@pytest.mark.parametrize("case", CASES)
def test_another_model_read_as_megatrons_pads_the_vocabulary_with_zeros(case: str) -> None:
    args = CASES[case]
    gpt = gpt_of(args)
    hf = _expected(args, megatron_hf.HF_NAMES, _indexed(global_shapes(gpt)))
    expected = megatron_hf.from_hf(gpt, hf)
    shapes = {k: tuple(v.shape) for k, v in expected.items()}
    reader = _reader(args, megatron_hf.HF_NAMES, megatron_hf.MEGATRON_NAMES, hf, shapes)
    by_ranges = _read_by_ranges(reader, shapes, seed=7)
    assert all(torch.equal(by_ranges[k], v) for k, v in expected.items())
    assert all(by_ranges[k].dtype == torch.float64 for k in shapes)


def test_a_range_reads_only_what_it_is_made_of() -> None:
    """A row of the embedding reads one row; a range of a GPT-2 Conv1D weight reads its layer's block, once for the
    ranges that cross it one after another."""
    args = CASES["llama"]
    megatron = _indexed(global_shapes(gpt_of(args)))
    shapes = {k: tuple(v.shape) for k, v in _expected(args, megatron_hf.HF_NAMES, megatron).items()}
    reader = _reader(args, megatron_hf.MEGATRON_NAMES, megatron_hf.HF_NAMES, megatron, shapes)
    hidden = LLAMA_ARGS["hidden_size"]
    reader.read_range("model.embed_tokens.weight", "w", 5 * hidden, 6 * hidden)
    assert reader.reader.read_elements == hidden

    args = CASES["gpt2"]
    megatron = _indexed(global_shapes(gpt_of(args)))
    shapes = {k: tuple(v.shape) for k, v in _expected(args, megatron_hf.HF_NAMES, megatron).items()}
    reader = _reader(args, megatron_hf.MEGATRON_NAMES, megatron_hf.HF_NAMES, megatron, shapes)
    name = "transformer.h.1.mlp.c_fc.weight"
    for at in range(0, math.prod(shapes[name]), 7):
        reader.read_range(name, "w", at, min(at + 7, math.prod(shapes[name])))
    assert reader.reader.read_elements == math.prod(shapes[name])


def test_the_metadata_is_the_target_models() -> None:
    args = CASES["llama"]
    megatron = _indexed(global_shapes(gpt_of(args)))
    shapes = {k: tuple(v.shape) for k, v in _expected(args, megatron_hf.HF_NAMES, megatron).items()}
    meta = _reader(args, megatron_hf.MEGATRON_NAMES, megatron_hf.HF_NAMES, megatron, shapes).meta()
    assert list(meta.state) == list(shapes)
    assert all(meta.state[k]["w"] == TensorRef(shapes[k], "float64") for k in shapes)
    assert meta.param_groups == [{"params": list(shapes), "lr": 0.1}]  # the scheduler's key left out


def test_a_run_model_the_map_does_not_hold_is_refused() -> None:
    args = CASES["llama"]
    megatron = _indexed(global_shapes(gpt_of(args)))
    with pytest.raises(InputError, match="holds no model.layers.9.mlp.up_proj.weight"):
        _reader(args, megatron_hf.MEGATRON_NAMES, megatron_hf.HF_NAMES, megatron,
                {"model.layers.9.mlp.up_proj.weight": (4, 4)})
