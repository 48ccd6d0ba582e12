"""Megatron-Core's GPT <-> Hugging Face models: which family a GPT or a ``config.json`` is, and its maps, both ways.

A Megatron GPT computes the function of one Hugging Face model or another depending on what it is built of: with
RMSNorm, SwiGLU and RoPE a ``LlamaForCausalLM`` (or a ``Qwen2ForCausalLM``: :mod:`osdpipe.layout.megatron_llama`),
with LayerNorm and a learned position table, Megatron-LM's defaults, a ``GPT2LMHeadModel``
(:mod:`osdpipe.layout.megatron_gpt2`). Each such family is a module with the same functions (:class:`HfFamily`), and
:data:`FAMILIES` is their one registry: what converts, checks or proves a GPT asks here, and the family is chosen once,
from Megatron-LM's ``args``, from a ``config.json``, or from a GPT's layout. A new family (another architecture of
transformers) is a module and an entry in :data:`FAMILIES`, not a branch in each caller.

The order of :data:`FAMILIES` is the order they are asked in; the last, the Llama's, fits every GPT (its refusals then
say what of it a Llama cannot express: a GPT-2's norms in a training checkpoint, say). Training checkpoints (a PyTorch
job's, torchtitan's) are written and read for the Llama family alone (a Llama or a Qwen2, biases and tying as
transformers holds them; torchtitan's llama3 without either: :func:`titan_refusals`); model folders for every family
(:attr:`HfFamily.IN_TRAINING_CHECKPOINTS`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from osdpipe.layout import megatron_gpt2, megatron_llama
from osdpipe.layout.megatron import Gpt
from osdpipe.layout.megatron_llama import hf_names_of, titan_args, titan_refusals

__all__ = [
    "FAMILIES", "HfFamily", "architecture", "family_of_args", "family_of_config", "family_of_gpt", "from_hf",
    "hf_config", "hf_names_of", "hf_refusals", "hf_shapes", "megatron_args", "refusals", "titan_args",
    "titan_refusals", "to_hf", "true_vocab_size",
]  # fmt: skip


class HfFamily(Protocol):
    """A Hugging Face family a Megatron GPT is written as: a module of pure functions, each the one its name says in
    :mod:`osdpipe.layout.megatron_llama` and :mod:`osdpipe.layout.megatron_gpt2`. A family's model is the same
    transformers model in a model folder and in a PyTorch job, so its functions do not ask which; the registry does,
    choosing among the families a training checkpoint holds (:func:`family_of_args`)."""

    #: Whether training checkpoints (a PyTorch job's, torchtitan's) hold this family; model folders hold every one.
    IN_TRAINING_CHECKPOINTS: bool

    def fits_args(self, args: dict[str, Any]) -> bool: ...

    def fits_config(self, config: dict[str, Any]) -> bool: ...

    def fits_gpt(self, gpt: Gpt) -> bool: ...

    def architecture(self, args: dict[str, Any]) -> str: ...

    def refusals(self, args: dict[str, Any]) -> list[str]: ...

    def hf_config(self, args: dict[str, Any], *, vocab_size: int, dtype: str) -> dict[str, Any]: ...

    def hf_shapes(self, gpt: Gpt, vocab_size: int) -> dict[str, tuple[int, ...]]: ...

    def to_hf(self, gpt: Gpt, tensors: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]: ...

    def from_hf(
        self, gpt: Gpt, tensors: dict[str, torch.Tensor], padded_vocab: int | None = None
    ) -> dict[str, torch.Tensor]: ...

    def hf_refusals(self, config: dict[str, Any]) -> list[str]: ...

    def megatron_args(
        self, config: dict[str, Any], tp: int, pp: int, world: int, *, iteration: int, sharding: str,
        divisible_by: int,
    ) -> dict[str, Any]: ...  # fmt: skip


#: Every family, in the order they are asked whether they fit; the Llama's, which fits all, last.
FAMILIES: tuple[HfFamily, ...] = (megatron_gpt2, megatron_llama)  # type: ignore[assignment]


def _held(model_folder: bool) -> list[HfFamily]:
    return [f for f in FAMILIES if model_folder or f.IN_TRAINING_CHECKPOINTS]


def family_of_args(args: dict[str, Any], *, model_folder: bool = True) -> HfFamily:
    """The family of the GPT Megatron-LM's ``args`` describe, among those a model folder (``model_folder``) or a
    training checkpoint holds."""
    return next(f for f in _held(model_folder) if f.fits_args(args))


def family_of_config(config: dict[str, Any], *, model_folder: bool = True) -> HfFamily:
    """The family of a Hugging Face ``config.json``, among those a model folder or a training checkpoint holds."""
    return next(f for f in _held(model_folder) if f.fits_config(config))


def family_of_gpt(gpt: Gpt) -> HfFamily:
    """The family a GPT's layout maps to (its tensors say it: LayerNorm's biases, a position table)."""
    return next(f for f in FAMILIES if f.fits_gpt(gpt))


def true_vocab_size(args: dict[str, Any]) -> int:
    """The tokenizer's vocabulary: ``args["vocab_size"]`` when Megatron-LM recorded it (``--vocab-size``, the
    NullTokenizer's); otherwise it is not in the save (Megatron-LM keeps only ``padded_vocab_size`` for other
    tokenizers) and the padded size is taken: the padding rows then stay in the HF model, as tokens no text holds."""
    vocab = args.get("vocab_size")
    return int(vocab) if vocab else int(args["padded_vocab_size"])


def _dtype_name(args: dict[str, Any]) -> str:
    """The job's ``params_dtype`` as transformers names it."""
    if args.get("bf16"):
        return "bfloat16"
    if args.get("fp16"):
        return "float16"
    return "float32"


def architecture(args: dict[str, Any]) -> str:
    """The Hugging Face model (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``GPT2LMHeadModel``) that computes the GPT
    Megatron-LM's ``args`` describe."""
    return family_of_args(args).architecture(args)


def refusals(args: dict[str, Any], *, model_folder: bool = False) -> list[str]:
    """What of the GPT ``args`` describe its family cannot express (empty: nothing): a model folder's family
    (``model_folder``), else a training checkpoint's, the Llama family's (a PyTorch job's Llama or Qwen2; torchtitan's
    llama3, which can neither bias its linears nor tie its embeddings, asks :func:`titan_refusals`)."""
    return family_of_args(args, model_folder=model_folder).refusals(args)


def hf_config(args: dict[str, Any], *, vocab_size: int | None = None, dtype: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model that computes the GPT Megatron-LM's ``args`` describe
    (:func:`architecture`).

    ``vocab_size``: the true vocabulary (default :func:`true_vocab_size`); ``dtype``: the weights' (default the
    job's ``params_dtype``: ``bfloat16`` with ``bf16``).

    Raises:
        ValueError: one line: a vocabulary larger than the padded one, or what the family cannot express (its
            refusals), "not supported yet".
    """
    vocab = int(vocab_size) if vocab_size is not None else true_vocab_size(args)
    padded = int(args.get("padded_vocab_size") or vocab)
    if not 0 < vocab <= padded:
        raise ValueError(f"vocabulary {vocab} is not in (0, padded_vocab_size {padded}]")
    return family_of_args(args).hf_config(args, vocab_size=vocab, dtype=dtype or _dtype_name(args))


def hf_shapes(gpt: Gpt, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face state dict :func:`to_hf` gives for ``gpt``, and its shape."""
    return family_of_gpt(gpt).hf_shapes(gpt, vocab_size)


def to_hf(gpt: Gpt, tensors: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Megatron's GPT tensors (every key of :func:`osdpipe.layout.megatron.global_shapes`, layers stacked) -> the
    Hugging Face state dict of its family, the vocabulary cut to its first ``vocab_size`` rows: a pure
    rearrangement, so the same call maps fp32 masters and Adam's moments."""
    return family_of_gpt(gpt).to_hf(gpt, tensors, vocab_size)


def from_hf(gpt: Gpt, tensors: dict[str, torch.Tensor], padded_vocab: int | None = None) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_hf`, the vocabulary padded with zero rows to ``padded_vocab`` (default ``gpt``'s)."""
    return family_of_gpt(gpt).from_hf(gpt, tensors, padded_vocab)


def hf_refusals(config: dict[str, Any], *, model_folder: bool = False) -> list[str]:
    """What of a Hugging Face ``config.json`` a Megatron GPT (the local layer spec) cannot express (empty: nothing),
    as its family reads it: a model folder's (``model_folder``: every family), else a training checkpoint's (the HF
    Trainer's, accelerate's, torchtitan's: the Llama family's)."""
    return family_of_config(config, model_folder=model_folder).hf_refusals(config)


def megatron_args(
    config: dict[str, Any],
    tp: int,
    pp: int,
    world: int,
    *,
    iteration: int = 0,
    sharding: str = "fully_reshardable",
    divisible_by: int = 128,
    model_folder: bool = False,
) -> dict[str, Any]:
    """The Megatron-LM ``args`` (``common.pt``) of the GPT that computes the Hugging Face model of ``config`` (its
    ``config.json``), for TP ``tp`` x PP ``pp`` on ``world`` ranks: the inverse of :func:`hf_config`, a model folder's
    (``model_folder``: every family) or a training checkpoint's (the Llama family's).

    Raises:
        ValueError: one line: what Megatron cannot express (:func:`hf_refusals`), "not supported yet"; or a TP that
            does not divide the heads, the query groups or the FFN, a PP that does not divide the layers, a world
            that is no multiple of TP x PP.
    """
    family = family_of_config(config, model_folder=model_folder)
    return family.megatron_args(config, tp, pp, world, iteration=iteration, sharding=sharding,
                                divisible_by=divisible_by)  # fmt: skip
