"""Hugging Face's ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``) as the accelerate job (``accel_job.py``'s ``job``)
trains it: built from the ``config.json`` a conversion wrote, its forward returning the logits tensor the job's loss
takes."""

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


def logits_llama(config: str) -> torch.nn.Module:
    """The model ``config`` (a ``config.json``) describes, a Llama or a Qwen2 (its ``model_type``); ``vocab`` is what
    the job draws its tokens from."""
    held = json.loads(Path(config).read_text())
    qwen2 = held.get("model_type") == "qwen2"
    conf = (transformers.Qwen2Config if qwen2 else transformers.LlamaConfig)(**held)
    model = (LogitsQwen2 if qwen2 else LogitsLlama)(conf)
    model.vocab = conf.vocab_size
    return model
