"""One rank of a veRL FSDP2 actor on CPU/gloo (launched by :mod:`frameworks.launch`): ``save``, ``load`` or
``load_pytorch``.

``save``: a tiny Llama of the test's own (transformers' ``LlamaForCausalLM``), ``fully_shard`` on each decoder layer and
the root over a ``cpu`` mesh named as veRL names it (``create_device_mesh``: ``mesh_dim_names=["fsdp"]``), or with
``"fsdp": 1`` FSDP1 wrapped by veRL's own policy (``get_fsdp_wrap_policy``: the decoder layers, flat parameters, veRL's
``actor.strategy=fsdp``), AdamW with a scheduler, ``steps`` steps on batches of its own, then veRL's own
``FSDPCheckpointManager.save_checkpoint``: the folder veRL writes. Rank 0 dumps the state the job held, gathered whole
(PyTorch's ``get_model_state_dict``/``get_optimizer_state_dict`` with ``full_state_dict``), beside it, and the state
after two more steps.

``load``: a fresh job of another world size builds the model from the output's ``huggingface/config.json``, wraps it
the same way, and loads the output with veRL's own manager (``load_checkpoint``), as veRL resumes; it dumps the state
it holds and the state after the same two steps. ``load_pytorch`` loads the output as a PyTorch job loads PyTorch's
layout (``dcp.load`` of ``{"model", "optim"}``, then ``set_model_state_dict``/``set_optimizer_state_dict``) instead.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

#: The test's own Llama: odd sizes, so that dim-0 shards are uneven on 2, 3 and 4 ranks.
CONFIG = dict(vocab_size=67, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip


def wrapped(config: Any, fsdp: int = 2) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if fsdp == 1:  # veRL's actor.strategy=fsdp: its own wrap policy (the decoder layers), flat parameters
        from torch.distributed.fsdp import FullyShardedDataParallel
        from verl.utils.fsdp_utils import get_fsdp_wrap_policy

        return FullyShardedDataParallel(model, auto_wrap_policy=get_fsdp_wrap_policy(model), use_orig_params=False,
                                        device_id=torch.device("cpu"))  # fmt: skip
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model: torch.nn.Module, optimizer: Any, scheduler: Any, index: int) -> float:
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(100 * index + 7))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return float(loss)


def gathered(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The whole state the job holds, on every rank (FQN keyed), copied: a plain ``step`` tensor comes back as the
    optimizer's own, which the next step would advance."""
    import copy

    # on CPU: nothing to offload (and FSDP1 fails to gather a flat parameter so in torch 2.13)
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return copy.deepcopy({"model": get_model_state_dict(model, options=options),
                          "optim": get_optimizer_state_dict(model, optimizer, options=options)})  # fmt: skip


def _manager(model: torch.nn.Module, optimizer: Any, scheduler: Any) -> Any:
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    contents = ["model", "optimizer", "extra"]
    return FSDPCheckpointManager(model, optimizer, scheduler, checkpoint_config=OmegaConf.create(
        {"save_contents": contents, "load_contents": contents}))  # fmt: skip


def _job(config: Any, fsdp: int = 2) -> tuple[torch.nn.Module, Any, Any]:
    model = wrapped(config, fsdp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _two_more_steps(model: torch.nn.Module, optimizer: Any, scheduler: Any, first: int) -> dict[str, Any]:
    losses = [step(model, optimizer, scheduler, first + i) for i in range(2)]
    return {**gathered(model, optimizer), "losses": losses, "lr": scheduler.get_last_lr()}


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from transformers import LlamaConfig

    if spec["mode"] == "save":
        model, optimizer, scheduler = _job(LlamaConfig(**CONFIG), spec.get("fsdp", 2))
        for index in range(spec["steps"]):
            step(model, optimizer, scheduler, index)
        _manager(model, optimizer, scheduler).save_checkpoint(spec["path"], global_step=spec["steps"])
        state = gathered(model, optimizer)
        state["after"] = _two_more_steps(model, optimizer, scheduler, spec["steps"])
    else:
        out = Path(spec["path"])
        model, optimizer, scheduler = _job(LlamaConfig.from_pretrained(out / "huggingface"))
        if spec["mode"] == "load":
            _manager(model, optimizer, scheduler).load_checkpoint(str(out))
        else:
            import torch.distributed.checkpoint as dcp

            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
            dcp.load(state, checkpoint_id=str(out / "dcp"))
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, optimizer, state["optim"])
        state = gathered(model, optimizer)
        state["after"] = _two_more_steps(model, optimizer, scheduler, spec["steps"])
    if rank == 0:
        torch.save(state, spec["dump"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from frameworks.launch import run_then_leave

    run_then_leave(main)
