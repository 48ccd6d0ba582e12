"""One rank of the HF Trainer with FSDP on CPU (a probe: does it save and resume?).

Why: the Trainer builds its ``Accelerator`` from ``TrainingArguments.fsdp``,
but with ``use_cpu=True`` accelerate's state is ``MULTI_CPU`` and carries no
``fsdp_plugin``, so the Trainer sees ``is_fsdp_enabled = False`` and trains
with DDP.  :class:`CpuFsdpTrainer` sets on the state what accelerate sets on a
GPU (``distributed_type = FSDP``, the plugin the Trainer built, a plain
``torch.device("cpu")``), then lets the Trainer run as it is.

Run: ``torchrun --standalone --nproc-per-node N accel_trainer_job.py '<json>'`` with keys out, version (1|2),
state_dict_type, max_steps, resume (a checkpoint folder or null), tied, family (``qwen2``: a ``Qwen2ForCausalLM`` of
the same dimensions instead, biases on q, k and v; ``qwen3``: a ``Qwen3ForCausalLM``, a norm on each head's query and
key), llama (the config's dimensions other than :data:`LLAMA`'s), gpt2 (a
``GPT2LMHeadModel`` of these GPT2Config dimensions instead of the Llama), dump (where rank
0 saves the gathered state: at the end of a fresh run, right after the load in a resumed one). Rank 0 prints one
``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accel_job import gathered, patch_fsdp1_to_cpu  # noqa: E402

#: The tiny Llama's dimensions; a test may give others (the spec's ``llama``).
LLAMA = {"vocab_size": 37, "hidden_size": 16, "intermediate_size": 20, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}


#: Each family the Trainer's model may be: its config class and its model.
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def build_llama(tied: bool = False, family: str = "llama", **dims: Any) -> Any:
    """A tiny ``LlamaForCausalLM`` from a ``LlamaConfig`` (no download), or a Qwen2 or Qwen3 of the same dimensions
    (``family``): the Trainer's model, and osdpipe's ``model.factory``; ``dims``: :data:`LLAMA`'s keys to change."""
    import transformers

    config, model = FAMILIES[family]
    return getattr(transformers, model)(getattr(transformers, config)(**{**LLAMA, **dims}, tie_word_embeddings=tied))


def build_gpt2(**dims: Any) -> Any:
    """A tiny ``GPT2LMHeadModel`` of ``dims`` (``GPT2Config``'s keys; no download), tied as transformers ties it by
    default: the Trainer's model where the spec names ``gpt2``."""
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**dims))


def _dump(trainer: Any, path: str | None) -> None:
    """Rank 0 saves the gathered model, optimizer and scheduler state to ``path`` (collective: every rank calls it)."""
    if path is None:
        return
    state = gathered(trainer.model, trainer.optimizer, trainer.lr_scheduler, trainer.state.global_step)
    if trainer.accelerator.is_main_process:
        torch.save(state, path)


def make_trainer(spec: dict[str, Any]) -> Any:
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import Trainer, TrainingArguments

    class CpuFsdpTrainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            state = AcceleratorState()
            if self.args.fsdp_plugin_args is not None and state.distributed_type == DistributedType.MULTI_CPU:
                state.distributed_type = DistributedType.FSDP
                state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                state.device = torch.device("cpu")
                PartialState._shared_state["device"] = torch.device("cpu")
                PartialState._shared_state["distributed_type"] = DistributedType.FSDP
                self.is_fsdp_enabled = True

        def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
            super()._load_optimizer_and_scheduler(checkpoint)
            if checkpoint is not None:  # what resume_from_checkpoint put into the fresh optimizer and the model
                inner = getattr(self.optimizer, "optimizer", self.optimizer)
                self.optim_state_after_resume = len(inner.state)
                _dump(self, spec.get("dump"))

    torch.manual_seed(0)
    if spec.get("gpt2"):
        model = build_gpt2(**spec["gpt2"])
    else:
        model = build_llama(spec.get("tied", False), spec.get("family", "llama"), **(spec.get("llama") or {}))
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, vocab, (64, 9), generator=gen)]
    fsdp_config: dict[str, Any] = {"version": spec["version"]}
    if spec.get("state_dict_type"):
        fsdp_config["state_dict_type"] = spec["state_dict_type"]
    if spec["version"] == 1:
        # The Trainer's FSDP1 default sync_module_states=true makes accelerate's
        # plugin ask for a GPU ("no available devices found") on CPU.
        fsdp_config["sync_module_states"] = "false"
    args = TrainingArguments(
        output_dir=spec["out"],
        use_cpu=True,
        max_steps=spec["max_steps"],
        save_strategy="steps",
        save_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        weight_decay=0.1,
        warmup_steps=1,
        logging_steps=1,
        report_to=[],
        fsdp="full_shard",
        fsdp_config=fsdp_config,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    return CpuFsdpTrainer(model=model, args=args, train_dataset=data)


def main() -> None:
    spec = json.loads(sys.argv[1])
    patch_fsdp1_to_cpu()
    trainer = make_trainer(spec)
    out = trainer.train(resume_from_checkpoint=spec.get("resume"))
    if spec.get("resume") is None:  # the state checkpoint-<max_steps> holds: the Trainer saves at its last step
        _dump(trainer, spec.get("dump"))
    opt = trainer.optimizer
    inner = getattr(opt, "optimizer", opt)
    result = {
        "is_fsdp_enabled": trainer.is_fsdp_enabled,
        "model_type": type(trainer.model_wrapped).__name__,
        "plugin_version": trainer.accelerator.state.fsdp_plugin.fsdp_version if trainer.is_fsdp_enabled else None,
        "state_dict_type": (
            str(trainer.accelerator.state.fsdp_plugin.state_dict_type) if trainer.is_fsdp_enabled else None
        ),
        "groups": [{k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])} for g in inner.param_groups],
        "optim_state_len": len(inner.state),
        "optim_state_after_resume": getattr(trainer, "optim_state_after_resume", None),
        "global_step": trainer.state.global_step,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "train_loss": out.training_loss,
    }
    assert all(math.isfinite(x) for x in result["losses"])
    if trainer.accelerator.is_main_process:
        print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    from frameworks.launch import run_then_leave

    run_then_leave(main)
