"""Hugging Face's ``LlamaForCausalLM`` as the accelerate job (``accel_job.py``'s ``job``) trains it: built from the
``config.json`` a conversion wrote, its forward returning the logits tensor the job's loss takes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


class LogitsLlama(LlamaForCausalLM):
    """``LlamaForCausalLM`` under its own parameter names, its forward giving the logits alone."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input_ids=ids).logits


def logits_llama(config: str) -> LogitsLlama:
    """The model ``config`` (a ``config.json``) describes; ``vocab`` is what the job draws its tokens from."""
    conf = LlamaConfig(**json.loads(Path(config).read_text()))
    model = LogitsLlama(conf)
    model.vocab = conf.vocab_size
    return model
