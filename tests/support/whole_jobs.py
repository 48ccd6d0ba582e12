"""Whole training checkpoints as torchtitan and accelerate lay them out,
written by plain PyTorch code (issue 19's sources).

Each function is one rank of a 4-rank gloo job over the user's own model
(``userlm``: a tied embedding, parameters that share a shape), trained two
Adam steps with a ``LambdaLR`` scheduler on gradients made from the
parameters, then saved the way the framework saves, with the framework's
names written out here (no torchtitan or accelerate import):

* torchtitan (v0.2 and later): one ``dcp.save`` of the model's state dict
  at the top level (``nested=True``: under ``model``, as v0.1 and earlier
  did), ``optimizer`` as ``get_optimizer_state_dict(...,
  flatten_optimizer_state_dict=True)``, ``lr_scheduler``, ``dataloader``
  (``{"dp_rank_<r>": bytes, "world_size": N}``), ``train_state`` and a user
  entry, into ``<out>/step-2`` (and, beside it, the job's full optimizer
  state as PyTorch reports it: ``<out>/full_optim.pt``);
* accelerate (``save_state`` with FSDP1 SHARDED_STATE_DICT):
  ``pytorch_model_fsdp_0/`` (DCP of ``{"model": model.state_dict()}``),
  ``optimizer_0/`` (DCP of ``{"optimizer": FSDP.optim_state_dict(...)}``),
  ``scheduler.bin``, ``random_states_<r>.pkl`` per rank and
  ``custom_checkpoint_0.pkl``, into ``<out>/checkpoint_0``.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import torch

#: The entries every torchtitan fixture holds besides the model and the optimizer.
TITAN_OTHER = ("lr_scheduler", "dataloader", "train_state", "user_notes")


def user_notes() -> dict:
    """The user's own entry of every torchtitan fixture: plain values and a tensor
    (carried as a tensor item, not as stored bytes)."""
    return {"run": "tiny", "seed": 0, "ema": torch.full((3,), 0.25)}


#: The files an accelerate fixture holds besides its two DCP directories, for 4 ranks.
ACCELERATE_FILES = ("scheduler.bin", "custom_checkpoint_0.pkl", *(f"random_states_{r}.pkl" for r in range(4)))


def _train(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0 / (1 + step))
    for step in range(2):
        for p in model.parameters():  # elementwise on each rank's piece: no forward pass needed
            p.grad = p.detach() * 0.5 + 0.1 * (step + 1)
        optim.step()
        scheduler.step()
    return optim, scheduler


def save_torchtitan(out: str, nested: bool = False) -> None:
    """One rank of an FSDP2 job on 4 ranks saving a torchtitan checkpoint at step 2."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import userlm
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    model = userlm.build()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim, scheduler = _train(model)
    model_sd = get_model_state_dict(model)
    state = {"model": model_sd} if nested else dict(model_sd)
    state["optimizer"] = get_optimizer_state_dict(
        model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    state["lr_scheduler"] = scheduler.state_dict()
    state["dataloader"] = {
        f"dp_rank_{rank}": pickle.dumps({"sample_index": 100 + rank}), "world_size": dist.get_world_size()
    }
    state["train_state"] = {"step": 2, "ntokens_seen": 4096}
    state["user_notes"] = user_notes()
    dcp.save(state, checkpoint_id=str(Path(out) / "step-2"))
    # beside the checkpoint, for the tests to compare with
    full = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    full_model = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save(full, Path(out) / "full_optim.pt")
        torch.save(full_model, Path(out) / "full_model.pt")
    dist.barrier()


def save_accelerate(out: str) -> None:
    """One rank of an FSDP1 job on 4 ranks saving accelerate's ``save_state`` with SHARDED_STATE_DICT."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import userlm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = userlm.build()
    model = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({userlm.MixerBlock}),
        use_orig_params=False,
        device_id=torch.device("cpu"),
    )
    optim, scheduler = _train(model)
    root = Path(out) / "checkpoint_0"
    with FSDP.state_dict_type(
        model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
    ):
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / "pytorch_model_fsdp_0"))
        dcp.save({"optimizer": FSDP.optim_state_dict(model, optim)}, checkpoint_id=str(root / "optimizer_0"))
    random.seed(rank)
    torch.save(
        {"step": 2, "random_state": random.getstate(), "torch_manual_seed": torch.get_rng_state()},
        root / f"random_states_{rank}.pkl",
    )
    if rank == 0:
        torch.save(scheduler.state_dict(), root / "scheduler.bin")
        torch.save({"best_loss": 1.25}, root / "custom_checkpoint_0.pkl")
    dist.barrier()


def save_accelerate_full(out: str) -> None:
    """One rank of an FSDP1 job on 4 ranks saving accelerate's ``save_state`` with FULL_STATE_DICT:
    ``pytorch_model_fsdp.bin``, ``optimizer.bin``."""
    import warnings

    import torch.distributed as dist
    import userlm
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = FSDP(
        userlm.build(),
        auto_wrap_policy=ModuleWrapPolicy({userlm.MixerBlock}),
        use_orig_params=False,
        device_id=torch.device("cpu"),
    )
    optim, scheduler = _train(model)
    root = Path(out) / "checkpoint_0"
    root.mkdir(parents=True, exist_ok=True)
    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=True),
        FullOptimStateDictConfig(rank0_only=True),
    ):
        model_sd, optim_sd = model.state_dict(), FSDP.optim_state_dict(model, optim)
    random.seed(rank)
    torch.save(
        {"step": 2, "random_state": random.getstate(), "torch_manual_seed": torch.get_rng_state()},
        root / f"random_states_{rank}.pkl",
    )
    if rank == 0:
        torch.save(model_sd, root / "pytorch_model_fsdp.bin")
        torch.save(optim_sd, root / "optimizer.bin")
        torch.save(scheduler.state_dict(), root / "scheduler.bin")
    dist.barrier()


# ---------------------------------------------------------------------------- resuming, as the frameworks resume


def _local(sd: dict) -> dict:
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in sd.items()}


def _optimizer_state(optim: torch.optim.Optimizer) -> dict:
    osd = optim.state_dict()
    return {"state": {k: _local(v) for k, v in osd["state"].items()}, "param_groups": osd["param_groups"]}


def _fsdp2_job(seed: int) -> tuple:
    """A fresh job of the user's model on the current world, as torchtitan builds one: FSDP2 on every block and the
    root, Adam, the scheduler."""
    import torch.distributed as dist
    import userlm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    torch.manual_seed(seed)
    model = userlm.build()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optim, torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0 / (1 + step))


def _train_on(model: torch.nn.Module, optim: torch.optim.Optimizer, scheduler) -> None:
    """Two more steps of the job, a real forward and backward on token batches: how a resumed job goes on."""
    import userlm

    for tokens in userlm.batches(500, 2):
        model(tokens).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        scheduler.step()


def resume_torchtitan(paths: list[str]) -> list[dict]:
    """On each rank of the target world: each step folder loaded as torchtitan loads one,
    then two more steps; what the job holds after each.

    torchtitan's load: one ``dcp.load`` of the structure it saves (the
    model's state dict at the top level, or under ``model`` as v0.1 saved
    it, the optimizer flattened, its own entries), then each part set into
    the job. ``dataloader`` is left out, as torchtitan leaves it out when
    the data-parallel degree changes.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    out = []
    for path in paths:
        model, optim, scheduler = _fsdp2_job(seed=7)
        nested = any(
            len(p) > 1 and p[0] == "model" for p in dcp.FileSystemReader(path).read_metadata().planner_data.values()
        )
        model_sd = dict(get_model_state_dict(model))
        state: dict = {"model": model_sd} if nested else dict(model_sd)
        state["optimizer"] = get_optimizer_state_dict(model, optim, options=flat)
        state["lr_scheduler"] = scheduler.state_dict()
        state["train_state"] = {"step": 0, "ntokens_seen": 0}
        state["user_notes"] = {"run": "", "seed": -1, "ema": torch.zeros(3)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"] if nested else {k: v for k, v in state.items() if k in model_sd})
        set_optimizer_state_dict(model, optim, state["optimizer"], options=flat)
        scheduler.load_state_dict(state["lr_scheduler"])
        loaded = {
            "model": _local(get_model_state_dict(model)),
            "optim": _optimizer_state(optim),
            "scheduler": scheduler.state_dict(),
            "train_state": state["train_state"],
            "user_notes": state["user_notes"],
        }
        _train_on(model, optim, scheduler)
        resumed = {"model": _local(get_model_state_dict(model)), "optim": _optimizer_state(optim)}
        out.append({"loaded": loaded, "resumed": resumed})
    return out


def resume_rank_local(path: str, source: str) -> list[dict]:
    """On each rank: the rank file loaded with ``osdpipe.load_rank_local`` (model given), and PyTorch's own reshard of
    the source (torchtitan's load of the step folder on this world); then two more steps each; what each job holds."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import osdpipe

    model, optim, scheduler = _fsdp2_job(seed=9)
    file = Path(path) / f"rank_{dist.get_rank()}.pt"
    osdpipe.load_rank_local(optim, file, model=model)
    whole = torch.load(file, weights_only=True)
    scheduler.load_state_dict(whole["lr_scheduler"])
    mine = {
        "model": _local(get_model_state_dict(model)),
        "optim": _optimizer_state(optim),
        "scheduler": scheduler.state_dict(),
    }
    _train_on(model, optim, scheduler)
    resumed = {"model": _local(get_model_state_dict(model)), "optim": _optimizer_state(optim)}
    theirs = resume_torchtitan([source])[0]
    return [
        {
            "loaded": mine,
            "resumed": resumed,
            "entries": {k: v for k, v in whole.items() if k not in ("model", "optim")},
        },
        theirs,
    ]


def load_rank_files(path: str) -> dict:
    """On each rank of an FSDP2 job: its whole rank file loaded with ``osdpipe.load_rank_local`` (model given) and the
    scheduler from ``scheduler.bin`` beside it; the full model the job then holds, and whether two more steps stay
    finite."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import osdpipe

    model, optim, scheduler = _fsdp2_job(seed=13)
    osdpipe.load_rank_local(optim, Path(path) / f"rank_{dist.get_rank()}.pt", model=model)
    scheduler.load_state_dict(torch.load(Path(path) / "scheduler.bin", weights_only=True))
    full = {
        k: v.detach().clone()
        for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()
    }
    _train_on(model, optim, scheduler)
    finite = all(torch.isfinite(p.full_tensor()).all() for p in model.parameters())
    return {"model": full, "finite": bool(finite), "lr": optim.param_groups[0]["lr"]}


def resume_accelerate(roots: list[str]) -> list[dict]:
    """On each rank: each folder loaded as accelerate's ``load_state`` loads an FSDP1 checkpoint, then two more steps.

    SHARDED_STATE_DICT (``pytorch_model_fsdp_0/``, ``optimizer_0/``) through
    DCP; FULL_STATE_DICT (``pytorch_model_fsdp.bin``, ``optimizer.bin``) as
    full state dicts on every rank.
    """
    import warnings

    import torch.distributed.checkpoint as dcp
    import userlm
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    warnings.simplefilter("ignore")
    out = []
    for root in roots:
        torch.manual_seed(11)
        model = FSDP(
            userlm.build(),
            auto_wrap_policy=ModuleWrapPolicy({userlm.MixerBlock}),
            use_orig_params=False,
            device_id=torch.device("cpu"),
        )
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0 / (1 + step))
        if (Path(root) / "optimizer.bin").is_file():
            from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

            with FSDP.state_dict_type(
                model,
                StateDictType.FULL_STATE_DICT,
                FullStateDictConfig(rank0_only=False),
                FullOptimStateDictConfig(rank0_only=False),
            ):
                model.load_state_dict(torch.load(Path(root) / "pytorch_model_fsdp.bin", weights_only=True))
                full_osd = torch.load(Path(root) / "optimizer.bin", weights_only=True)
                optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, full_osd))
        else:
            with FSDP.state_dict_type(
                model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
            ):
                sd = {"model": model.state_dict()}
                dcp.load(sd, checkpoint_id=str(Path(root) / "pytorch_model_fsdp_0"))
                model.load_state_dict(sd["model"])
                osd = load_sharded_optimizer_state_dict(
                    model_state_dict=model.state_dict(),
                    optimizer_key="optimizer",
                    storage_reader=dcp.FileSystemReader(str(Path(root) / "optimizer_0")),
                )
                optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd["optimizer"]))
        scheduler.load_state_dict(torch.load(Path(root) / "scheduler.bin", weights_only=True))
        loaded = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "optim": optim.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
        _train_on(model, optim, scheduler)
        resumed = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "optim": optim.state_dict()}
        out.append({"loaded": loaded, "resumed": resumed})
    return out
