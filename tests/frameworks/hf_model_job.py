"""Hugging Face's ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``GPT2LMHeadModel`` as the accelerate job
(``accel_job.py``'s ``job``) trains it: built from the ``config.json`` a conversion wrote, its forward returning the
logits tensor the job's loss takes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers


class _Logits:
    """A causal LM under its own parameter names, its forward giving the logits alone."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids=ids).logits  # type: ignore[misc]


class LogitsLlama(_Logits, transformers.LlamaForCausalLM):
    pass


class LogitsQwen2(_Logits, transformers.Qwen2ForCausalLM):
    pass


class LogitsQwen3(_Logits, transformers.Qwen3ForCausalLM):
    pass


class LogitsGpt2(_Logits, transformers.GPT2LMHeadModel):
    pass


#: ``model_type`` -> the config class and the model of it.
_MODELS = {"llama": (transformers.LlamaConfig, LogitsLlama), "qwen2": (transformers.Qwen2Config, LogitsQwen2),
           "qwen3": (transformers.Qwen3Config, LogitsQwen3), "gpt2": (transformers.GPT2Config, LogitsGpt2)}


def logits_model(config: str) -> torch.nn.Module:
    """The model ``config`` (a ``config.json``) describes, by its ``model_type``; ``vocab`` is what the job draws its
    tokens from."""
    held = json.loads(Path(config).read_text())
    config_class, model_class = _MODELS[held.get("model_type", "llama")]
    conf = config_class(**held)
    model = model_class(conf)
    model.vocab = conf.vocab_size
    return model
