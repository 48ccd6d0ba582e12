"""Megatron-Core's GPT <-> Hugging Face models: which family a GPT or a ``config.json`` is, and its maps, both ways.

A Megatron GPT computes the function of one Hugging Face model or another depending on what it is built of: with
RMSNorm, SwiGLU and RoPE a ``LlamaForCausalLM`` (or a ``Qwen2ForCausalLM``, a ``Qwen3ForCausalLM``:
:mod:`osdpipe.layout.megatron_llama`), with LayerNorm and a learned position table, Megatron-LM's defaults, a
``GPT2LMHeadModel`` (:mod:`osdpipe.layout.megatron_gpt2`). Each such family is a module with the same functions
(:class:`HfFamily`), and :data:`FAMILIES` is their one registry: what converts, checks or proves a GPT asks here, and
the family is chosen once, from Megatron-LM's ``args``, from a ``config.json``, or from a GPT's layout. A new family
(another architecture of transformers) is a module and an entry in :data:`FAMILIES`, not a branch in each caller.

The order of :data:`FAMILIES` is the order they are asked in; the last, the Llama's, fits every GPT (its refusals then
say what of it a Llama cannot express). A family's model is the same transformers model in a model folder and in a
PyTorch job's training checkpoint (the HF Trainer's, accelerate's, PyTorch's own: its ``model.factory`` is
:attr:`HfFamily.HF_FACTORY`), so no function here asks which. A torchtitan job's model is a llama3 or a qwen3
(:func:`titan_family`), tied as torchtitan ties and without biases: :func:`titan_refusals` says what it cannot
hold.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from osdpipe.layout import llama_titan, megatron_gpt2, megatron_llama
from osdpipe.layout.maps import Map, compose, invert
from osdpipe.layout.megatron import Gpt, gpt_of
from osdpipe.layout.megatron_llama import titan_args, titan_family, titan_refusals

__all__ = [
    "FAMILIES", "HF_NAMES", "MEGATRON_NAMES", "NAMINGS", "TORCHTITAN", "HfFamily", "architecture", "family_of_args",
    "family_of_config", "family_of_gpt", "from_hf", "hf_config", "hf_factory", "hf_map", "hf_names_of",
    "hf_refusals", "hf_shapes", "megatron_args", "model_map", "refusal", "refusals",
    "titan_args", "titan_family", "titan_refusals", "tied_names", "to_hf", "true_vocab_size",
]  # fmt: skip


class HfFamily(Protocol):
    """A Hugging Face family a Megatron GPT is written as: a module of pure functions, each the one its name says in
    :mod:`osdpipe.layout.megatron_llama` and :mod:`osdpipe.layout.megatron_gpt2`. A family's model is the same
    transformers model in a model folder and in a PyTorch job, so its functions do not ask which."""

    #: The ``model.factory`` (:data:`osdpipe.layout.models.BUILTIN_MODELS`) that builds the family's transformers model
    #: from a ``config.json``'s keys: what a PyTorch job resuming a converted Megatron save builds.
    HF_FACTORY: str
    #: The word embedding's Hugging Face name: the one parameter ``lm_head.weight`` is where the model ties them.
    HF_EMBEDDING: str

    def fits_args(self, args: dict[str, Any]) -> bool: ...

    def fits_config(self, config: dict[str, Any]) -> bool: ...

    def fits_gpt(self, gpt: Gpt) -> bool: ...

    def architecture(self, args: dict[str, Any]) -> str: ...

    def refusals(self, args: dict[str, Any]) -> list[str]: ...

    def hf_config(self, args: dict[str, Any], *, vocab_size: int, dtype: str) -> dict[str, Any]: ...

    def hf_shapes(self, gpt: Gpt, vocab_size: int) -> dict[str, tuple[int, ...]]: ...

    def hf_names_of(self, gpt: Gpt) -> dict[str, list[str]]: ...

    def hf_map(self, gpt: Gpt, vocab_size: int) -> Map: ...

    def to_hf(self, gpt: Gpt, tensors: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]: ...

    def from_hf(
        self, gpt: Gpt, tensors: dict[str, torch.Tensor], padded_vocab: int | None = None
    ) -> dict[str, torch.Tensor]: ...

    def hf_refusals(self, config: dict[str, Any]) -> list[str]: ...

    def megatron_args(
        self, config: dict[str, Any], tp: int, pp: int, world: int, *, iteration: int, sharding: str,
        divisible_by: int, vpp: int,
    ) -> dict[str, Any]: ...  # fmt: skip


#: Every family, in the order they are asked whether they fit; the Llama's, which fits all, last.
FAMILIES: tuple[HfFamily, ...] = (megatron_gpt2, megatron_llama)  # type: ignore[assignment]


#: The models a Megatron GPT is read or written as, by what their parameters are named: Megatron's own GPT (its
#: sharded keys, layers stacked: :func:`osdpipe.layout.models.megatron_gpt`), the transformers model of its family, or
#: its torchtitan model (llama3 and qwen3 name their parameters alike).
MEGATRON_NAMES, HF_NAMES, TORCHTITAN = "megatron", "hf", "torchtitan"
NAMINGS = (MEGATRON_NAMES, HF_NAMES, TORCHTITAN)


def family_of_args(args: dict[str, Any]) -> HfFamily:
    """The family of the GPT Megatron-LM's ``args`` describe."""
    return next(f for f in FAMILIES if f.fits_args(args))


def family_of_config(config: dict[str, Any]) -> HfFamily:
    """The family of a Hugging Face ``config.json``."""
    return next(f for f in FAMILIES if f.fits_config(config))


def family_of_gpt(gpt: Gpt) -> HfFamily:
    """The family a GPT's layout maps to (its tensors say it: LayerNorm's biases, a position table)."""
    return next(f for f in FAMILIES if f.fits_gpt(gpt))


def true_vocab_size(args: dict[str, Any]) -> int:
    """The tokenizer's vocabulary: ``args["vocab_size"]`` when Megatron-LM recorded it (``--vocab-size``, the
    NullTokenizer's); otherwise it is not in the save (Megatron-LM keeps only ``padded_vocab_size`` for other
    tokenizers) and the padded size is taken: the padding rows then stay in the HF model, as tokens no text holds."""
    vocab = args.get("vocab_size")
    return int(vocab) if vocab else int(args["padded_vocab_size"])


def params_dtype(args: dict[str, Any]) -> str:
    """The job's ``params_dtype`` as transformers names it."""
    if args.get("bf16"):
        return "bfloat16"
    if args.get("fp16"):
        return "float16"
    return "float32"


def architecture(args: dict[str, Any]) -> str:
    """The Hugging Face model (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``GPT2LMHeadModel``)
    that computes the GPT Megatron-LM's ``args`` describe."""
    return family_of_args(args).architecture(args)


def refusals(args: dict[str, Any]) -> list[str]:
    """What of the GPT ``args`` describe its family cannot express (empty: nothing); a torchtitan model, whose linears
    have no biases, asks :func:`titan_refusals`."""
    return family_of_args(args).refusals(args)


def refusal(args: dict[str, Any], *, titan: bool = False) -> str | None:
    """Why the GPT ``args`` describe cannot become its Hugging Face model (``titan``: nor its torchtitan model), and
    what to do instead, in one line; ``None``: it can. What the command says when it works out the model, and the
    reader when it opens the save, alike."""
    if why := refusals(args):
        return (f"a Megatron GPT with {', '.join(why)}: not supported yet as a {architecture(args)} "
                "(output.checkpoint=hf|pytorch|accelerate|torchtitan); convert it within Megatron instead")
    if titan and (why := titan_refusals(args)):
        return (f"a Megatron GPT with {', '.join(why)}: not supported yet as torchtitan's {titan_family(args).name}; "
                "convert it for a Hugging Face model's job (output.checkpoint=accelerate|pytorch) or within Megatron "
                "instead")
    return None


def hf_factory(args: dict[str, Any]) -> str:
    """The ``model.factory`` of the transformers model that computes the GPT Megatron-LM's ``args`` describe."""
    return family_of_args(args).HF_FACTORY


def hf_config(args: dict[str, Any], *, vocab_size: int | None = None, dtype: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model that computes the GPT Megatron-LM's ``args`` describe
    (:func:`architecture`).

    ``vocab_size``: the true vocabulary (default :func:`true_vocab_size`); ``dtype``: the weights' (default the
    job's ``params_dtype``: ``bfloat16`` with ``bf16``).

    Raises:
        ValueError: one line: a vocabulary larger than the padded one, what the family cannot express (its
            refusals), "not supported yet", or an arg ``config.json`` needs that ``args`` lack (a save that is not
            Megatron-LM's own).
    """
    vocab = int(vocab_size) if vocab_size is not None else true_vocab_size(args)
    padded = int(args.get("padded_vocab_size") or vocab)
    if not 0 < vocab <= padded:
        raise ValueError(f"vocabulary {vocab} is not in (0, padded_vocab_size {padded}]")
    try:
        return family_of_args(args).hf_config(args, vocab_size=vocab, dtype=dtype or params_dtype(args))
    except KeyError as exc:
        raise ValueError(f"common.pt's args hold no {exc.args[0]}, which config.json needs; is it a Megatron-LM "
                         "save?") from None


def hf_shapes(gpt: Gpt, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face state dict :func:`to_hf` gives for ``gpt``, and its shape."""
    return family_of_gpt(gpt).hf_shapes(gpt, vocab_size)


def hf_names_of(gpt: Gpt) -> dict[str, list[str]]:
    """Each Megatron key of :func:`osdpipe.layout.megatron.global_shapes` -> the Hugging Face names its elements go to
    under :func:`to_hf`, in the state dict's order: what puts a Megatron param group's keys into the Hugging Face
    names of the same group."""
    return family_of_gpt(gpt).hf_names_of(gpt)


def hf_map(gpt: Gpt, vocab_size: int) -> Map:
    """:func:`to_hf` as data: each Hugging Face parameter as the pieces of Megatron's tensors it is made of
    (:mod:`osdpipe.layout.maps`)."""
    return family_of_gpt(gpt).hf_map(gpt, vocab_size)


def model_map(args: dict[str, Any], source: str, target: str) -> Map:
    """Each parameter of the GPT Megatron-LM's ``args`` describe, named as ``target`` names it (one of
    :data:`NAMINGS`), as the pieces of the same GPT named as ``source`` names it: Megatron's to its Hugging Face
    model's (the vocabulary cut to the true one, :func:`true_vocab_size`), on to torchtitan's, and back (the padding
    rows padding). The one map a conversion between them reads through (:mod:`osdpipe.io.formats.mapped`).

    Raises:
        ValueError: one line: a naming that is none of :data:`NAMINGS`, a pair that is the same, or a map between
            a Hugging Face model and torchtitan's (each converts the other itself).
    """
    if source == target or not {source, target} <= set(NAMINGS) or MEGATRON_NAMES not in (source, target):
        raise ValueError(f"no map from a GPT named as {source!r} to one named as {target!r}: osdpipe maps Megatron's "
                         f"GPT to and from {HF_NAMES!r} and {TORCHTITAN!r}")
    gpt, vocab = gpt_of(args), true_vocab_size(args)
    forward = hf_map(gpt, vocab)
    if TORCHTITAN in (source, target):
        heads = llama_titan.heads_of(titan_args(args, vocab_size=vocab))
        forward = compose(forward, llama_titan.titan_map(heads, hf_shapes(gpt, vocab)))
    return forward if source == MEGATRON_NAMES else invert(forward)


def tied_names(gpt: Gpt) -> tuple[str, str] | None:
    """Where ``gpt`` ties its output layer to the word embedding: ``(embedding, "lm_head.weight")``, the two Hugging
    Face names of the one parameter (transformers' ``named_parameters()`` yields the first alone); else ``None``."""
    return (family_of_gpt(gpt).HF_EMBEDDING, "lm_head.weight") if gpt.tied else None


def to_hf(gpt: Gpt, tensors: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Megatron's GPT tensors (every key of :func:`osdpipe.layout.megatron.global_shapes`, layers stacked) -> the
    Hugging Face state dict of its family, the vocabulary cut to its first ``vocab_size`` rows: a pure
    rearrangement, so the same call maps fp32 masters and Adam's moments."""
    return family_of_gpt(gpt).to_hf(gpt, tensors, vocab_size)


def from_hf(gpt: Gpt, tensors: dict[str, torch.Tensor], padded_vocab: int | None = None) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_hf`, the vocabulary padded with zero rows to ``padded_vocab`` (default ``gpt``'s)."""
    return family_of_gpt(gpt).from_hf(gpt, tensors, padded_vocab)


def hf_refusals(config: dict[str, Any]) -> list[str]:
    """What of a Hugging Face ``config.json`` a Megatron GPT (the local layer spec) cannot express (empty: nothing),
    as its family reads it."""
    return family_of_config(config).hf_refusals(config)


def megatron_args(
    config: dict[str, Any],
    tp: int,
    pp: int,
    world: int,
    *,
    iteration: int = 0,
    sharding: str = "fully_reshardable",
    divisible_by: int = 128,
    vpp: int = 1,
) -> dict[str, Any]:
    """The Megatron-LM ``args`` (``common.pt``) of the GPT that computes the Hugging Face model of ``config`` (its
    ``config.json``), for TP ``tp`` x PP ``pp`` on ``world`` ranks, ``vpp`` model chunks per pipeline stage: the
    inverse of :func:`hf_config`.

    Raises:
        ValueError: one line: what Megatron cannot express (:func:`hf_refusals`), "not supported yet"; or a TP that
            does not divide the heads, the query groups or the FFN, a PP (times ``vpp``) that does not divide the
            layers, a world that is no multiple of TP x PP.
    """
    family = family_of_config(config)
    return family.megatron_args(config, tp, pp, world, iteration=iteration, sharding=sharding,
                                divisible_by=divisible_by, vpp=vpp)  # fmt: skip
