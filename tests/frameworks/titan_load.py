"""Entry point that torchrun launches: torchtitan's own ``CheckpointManager`` loads a step folder into an FSDP2 job of
the test's own model.

torchtitan's trainer builds only torchtitan's models; a step folder written
for another model (a DeepSpeed job's, converted with
``output.checkpoint=torchtitan``) is loaded here by the pieces the trainer
loads with: ``CheckpointManager`` over ``ModelWrapper`` and an
``OptimizersContainer`` of the job's param groups, its ``--checkpoint.folder``
the output folder and its ``exclude_from_loading`` as the test gives it.
Then one training step. Rank 0 writes, to ``spec["dump"]``, the model and
the optimizer gathered whole right after the load (FQN keyed, as
``get_optimizer_state_dict`` gives them), the step's loss, and whether the
manager found a checkpoint.

On CPU torchtitan needs one patch: ``torchtitan.tools.utils`` picks its
device when imported and falls back to "cuda" without an accelerator; it is
imported while ``torch._utils._get_available_device_type`` answers "cpu"
(as :mod:`frameworks.titan_train` does).

spec (JSON, the one argument): folder, model (``module:Class``), kwargs, groups
(``[[regex, optimizer kwargs], ...]``, first match wins), exclude, dump.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import torch
import torch.distributed as dist


def _import_torchtitan_on_cpu() -> None:
    original = torch._utils._get_available_device_type
    torch._utils._get_available_device_type = lambda: "cpu"
    try:
        importlib.import_module("torchtitan.tools.utils")
    finally:
        torch._utils._get_available_device_type = original


class _TrainState:
    """The trainer's ``train_state`` entry: its step and tokens seen (what ``Trainer.state_dict`` holds)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    _import_torchtitan_on_cpu()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.utils._pytree import tree_map
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    module, _, name = spec["model"].partition(":")
    torch.manual_seed(1234)  # other weights than the checkpoint's: the load must replace every one
    model = getattr(importlib.import_module(module), name)(**spec["kwargs"])
    for block in getattr(model, "blocks", []):
        fully_shard(block)
    fully_shard(model)
    groups = [
        ParamGroupConfig(pattern=p, optimizer_name="AdamW", optimizer_kwargs=kwargs) for p, kwargs in spec["groups"]
    ]
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(param_groups=groups, implementation="for-loop"), model_parts=[model]
    )
    train_state = _TrainState()
    config = CheckpointManager.Config(enable=True, folder=spec["folder"], exclude_from_loading=list(spec["exclude"]))
    manager = CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None,
                                states={"train_state": train_state}, sd_adapter=None)
    found = manager.load()

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    loaded = {
        # the module's own state dict, gathered: get_model_state_dict cannot name the keys a state-dict hook makes
        # (torchtitan's fused wqkv saved as wq, wk, wv)
        "model": {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()},
        "optim": get_optimizer_state_dict(model, optimizers.optimizers[0], options=full),
    }
    # the step below moves what is not a gathered copy (step)
    loaded = tree_map(lambda v: v.clone() if torch.is_tensor(v) else v, loaded)

    ids = torch.randint(0, model.vocab, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, model.vocab), ids[:, 1:].reshape(-1))
    loss.backward()
    optimizers.step()
    if dist.get_rank() == 0:
        torch.save({**loaded, "found": found, "step": train_state.step, "loss": float(loss)}, spec["dump"])
    manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    from frameworks.launch import run_then_leave

    run_then_leave(main)
