"""A Megatron-LM save read as another model's state: the map of its GPT's sharded keys to the model's names.

The format layer reads a save as its own GPT (:mod:`osdpipe.io.formats.megatron_source`); a conversion to a Hugging
Face folder or a PyTorch-native framework reads the same save through a map, and ``inspect`` describes it so. Both
need the map and the model the ``args`` in ``common.pt`` build, from the save's files alone, so they live here, below
the checkpoint layouts that ask for them (:class:`osdpipe.io.checkpoints.megatron.Megatron`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from osdpipe.io import hf_folder
from osdpipe.io.errors import ModelRefused
from osdpipe.io.formats import megatron as files
from osdpipe.io.formats.base import InputError, SourceReader
from osdpipe.io.formats.mapped import MappedReader, ModelMap
from osdpipe.io.formats.megatron import MOMENTS, SCHEDULERS_KEYS
from osdpipe.layout import megatron_hf
from osdpipe.layout.kinds.megatron import FACTORY
from osdpipe.layout.kinds.megatron import Megatron as Kind
from osdpipe.layout.megatron import layout_args, params_dtype
from osdpipe.layout.ranges import WEIGHTS


def gpt_map(path: str, naming: str, *, weights_alone: bool = False, dtype: str | None = None) -> ModelMap:
    """The map of the save's GPT to the model ``naming`` names (:func:`osdpipe.layout.megatron_hf.model_map`),
    its weights being the fp32 masters (a save of the weights alone: the weights), each param group's ``step``
    each parameter's, Megatron's scheduler keys left out; ``weights_alone`` (a Hugging Face folder): the same
    weights alone, in ``dtype`` (default :func:`hf_dtype`).

    Raises:
        InputError: the GPT is one the model cannot express (its refusals), or its args are not Megatron-LM's.
    """
    folder = files.iteration_folder(path)
    common = files.read_common(folder)
    args = common["args"]
    if why := megatron_hf.refusal(args, titan=naming == megatron_hf.TORCHTITAN):
        raise InputError(f"{folder}: {why}")
    saved_alone = files.optimizer_sharding(common, folder) is None
    weights = {WEIGHTS: WEIGHTS if saved_alone else Kind.master_state}
    try:
        pieces = megatron_hf.model_map(args, megatron_hf.MEGATRON_NAMES, naming)
    except ValueError as exc:
        raise InputError(f"{folder}: {exc}") from None
    model = (FACTORY, {"args": layout_args(args)})
    if weights_alone:
        written = dtype or hf_dtype(common)  # kept in that dtype beside the model's fp32 parameters
        return ModelMap(pieces, weights, model, dtypes={WEIGHTS: written}, optimizer=False, state_dtype=written)
    states = weights if saved_alone else {**weights, **{m: m for m in MOMENTS}, "step": "step"}
    return ModelMap(pieces, states, model, group_keys=(*SCHEDULERS_KEYS, "step"))


def model_named(path: str, naming: str) -> tuple[str, dict[str, Any]]:
    """The model of the GPT ``args`` describe, under the names ``naming`` gives it: Megatron's own GPT (its sharded
    keys), torchtitan's llama3 or qwen3 (:func:`~osdpipe.layout.megatron_hf.titan_family`), else the transformers
    model of its family (:func:`~osdpipe.layout.megatron_hf.hf_config`).

    Raises:
        ModelRefused: the GPT is one that model cannot express, or an arg its config needs is missing.
    """
    folder = files.iteration_folder(path)
    args = files.read_common(folder)["args"]
    if naming == megatron_hf.MEGATRON_NAMES:
        return FACTORY, {"args": layout_args(args)}
    titan = naming == megatron_hf.TORCHTITAN
    if why := megatron_hf.refusal(args, titan=titan):
        raise ModelRefused(f"{folder}: {why}")
    vocab = megatron_hf.true_vocab_size(args)
    if titan:
        return megatron_hf.titan_family(args).factory, megatron_hf.titan_args(args, vocab_size=vocab)
    try:
        return megatron_hf.hf_factory(args), megatron_hf.hf_config(args, vocab_size=vocab, dtype="float32")
    except ValueError as exc:  # an arg config.json needs, missing
        raise ModelRefused(f"{folder}: {exc}") from None


def hf_dtype(common: dict[str, Any]) -> str:
    """The dtype of a Hugging Face folder made of a save (its ``common.pt``) where ``output.dtype`` says none: the
    source's own. That of the folder the save was made of, as it recorded it
    (:func:`osdpipe.io.hf_folder.recorded_dtype`); else the job's ``params_dtype`` (``args.bf16``: bfloat16,
    ``args.fp16``: float16, else float32), the dtype its model computes in and ``from_pretrained`` loads."""
    return hf_folder.recorded_dtype(common.get(hf_folder.RECORD)) or params_dtype(common["args"])


def read_as(path: str, naming: str, reader: SourceReader, *, optimizer_only: bool = False) -> MappedReader:
    """``reader`` (the save at ``path`` by its sharded keys) read as the model ``naming`` names (:func:`gpt_map`);
    ``optimizer_only``: its optimizer's states alone, as its facts describe it."""
    from osdpipe.layout.models import meta_model
    from osdpipe.layout.tree import describe

    mapping = gpt_map(path, naming)
    if optimizer_only:
        mapping = replace(mapping, states={t: s for t, s in mapping.states.items() if t != WEIGHTS})
    tree = describe(meta_model(*model_named(path, naming)))
    return MappedReader(reader, mapping, {p.fqn: p.shape for p in tree.params})
