"""Entry point that torchrun launches: an FSDP2 job of torchtitan's llama3 or qwen3 trains a few steps and torchtitan's
own ``CheckpointManager`` saves it, as torchtitan's trainer saves (``step-<N>`` under ``--checkpoint.folder``).

The model is torchtitan's llama3 or qwen3 of the dimensions in ``model_args.json`` (``spec["model"]``, a builder of
:mod:`frameworks.titan_llama_job`: torchtitan's own config classes), not a registry flavor, which torchtitan's
trainer would need (its llama3 flavors scale RoPE as Llama 3.1, which a Megatron GPT converted from them would need
too). Everything else is torchtitan's: ``fully_shard`` per block, an ``OptimizersContainer`` of AdamW with two param
groups (decay for the matrices, none for the norms), ``CheckpointManager.save``. Rank 0 then writes, to
``spec["dump"]``, the model and the optimizer gathered whole (the truth the conversion is held against).

spec (JSON, the one argument): folder, model (a builder's name in :mod:`frameworks.titan_llama_job`), args
(``model_args.json``), steps, lr, dump.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist


class _TrainState:
    """The trainer's ``train_state`` entry: its step and tokens seen."""

    def __init__(self, step: int) -> None:
        self.step, self.ntokens_seen = step, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "ntokens_seen": torch.tensor(self.ntokens_seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = int(state["step"]), int(state["ntokens_seen"])


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    from frameworks.titan_load import _import_torchtitan_on_cpu

    _import_torchtitan_on_cpu()
    from frameworks import titan_llama_job
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.utils._pytree import tree_map
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    torch.manual_seed(4321)
    model = getattr(titan_llama_job, spec["model"])(spec["args"])
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    groups = [
        ParamGroupConfig(pattern=r".*norm\.weight$", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": spec["lr"], "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": spec["lr"], "weight_decay": 0.1}),
    ]
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(param_groups=groups, implementation="for-loop"), model_parts=[model]
    )
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(spec["steps"]):
        ids = torch.randint(0, model.vocab, (2, 9), generator=generator)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, model.vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
    train_state = _TrainState(spec["steps"])
    config = CheckpointManager.Config(enable=True, folder=spec["folder"], interval=spec["steps"])
    manager = CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None,
                                states={"train_state": train_state}, sd_adapter=None)
    assert manager.save(curr_step=spec["steps"])
    manager.close()

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    truth = {
        "model": {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()},
        "optim": get_optimizer_state_dict(model, optimizers.optimizers[0], options=full),
    }
    truth = tree_map(lambda v: v.clone() if torch.is_tensor(v) else v, truth)
    if dist.get_rank() == 0:
        torch.save(truth, spec["dump"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from frameworks.launch import run_then_leave

    run_then_leave(main)
