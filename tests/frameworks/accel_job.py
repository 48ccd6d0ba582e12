"""One rank of a real accelerate FSDP job on CPU (launched by ``accel.py`` under torchrun).

Why a worker of its own: ``Accelerator.save_state``/``load_state`` only take
their FSDP paths when accelerate believes it runs FSDP, and neither accelerate
nor the HF Trainer turns FSDP on for CPU: with ``cpu=True`` under torchrun the
state is ``MULTI_CPU`` and ``prepare()`` silently wraps the model in DDP.  So
this worker sets on the shared ``AcceleratorState`` what accelerate sets on a
GPU (``distributed_type = FSDP``, ``fsdp_plugin``) and a plain
``torch.device("cpu")`` (FSDP1 refuses ``device_id=cpu:0`` when it computes on
cpu).  Everything after that is accelerate's own code: ``prepare`` (FSDP1
wrapping or FSDP2 ``fully_shard`` with its embedding/tail carving),
``backward``, the prepared scheduler, ``save_state`` and ``load_state``.

The model is the test's own small LM with odd sizes (dim 12, hidden 20, vocab
37) so that FSDP's flat-parameter padding and dim-0 shards cut through
parameters, an optionally tied embedding/head, LayerNorms and a persistent
buffer.  AdamW has two parameter groups (decay / no decay) and a LambdaLR.

Invoked as ``accel_job.py '<json spec>'``; see :func:`main` for the keys.  Rank 0
writes the gathered state (full model state dict and FQN-keyed optimizer
state, see :func:`gathered`) to ``spec["dump"]`` with ``torch.save``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB, DIM, HIDDEN, SEQ, BATCH = 37, 12, 20, 9, 2
SEED = 1234
LR, DECAY = 3e-3, 0.1


def schedule(step: int) -> float:
    """LR factor that changes at every scheduler step, so a lost scheduler state shows."""
    return 1.0 / (1.0 + 0.1 * step)


class AccelBlock(nn.Module):
    """Pre-norm block: causal running-mean token mixing plus an MLP (odd widths)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        count = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device).view(1, -1, 1)
        x = x + self.mix(torch.cumsum(h, dim=1) / count)
        return x + self.down(torch.nn.functional.gelu(self.up(h)))


class AccelLM(nn.Module):
    """A tiny causal LM; ``tied`` shares the embedding with the output head.

    ``get_input_embeddings``/``get_output_embeddings`` and the final ``norm``
    make accelerate's FSDP2 preparation carve the embedding and the tail into
    their own units, as it does for a transformers model.
    """

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([AccelBlock(DIM, HIDDEN) for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        nn.init.normal_(self.tok.weight, std=0.2)  # keeps the tied logits (and the loss) moderate
        if tied:
            self.head.weight = self.tok.weight
        position = torch.arange(SEQ, dtype=torch.float32).unsqueeze(1)
        freq = torch.exp(torch.arange(DIM, dtype=torch.float32) * (-math.log(100.0) / DIM))
        self.register_buffer("pos", torch.sin(position * freq) * 0.1, persistent=True)

    def get_input_embeddings(self) -> nn.Module:
        return self.tok

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step: int, rank: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic tokens for (step, rank): the same on every run and world."""
    gen = torch.Generator().manual_seed(SEED * 1000 + step * 97 + rank)
    ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def param_groups(model: nn.Module, use_orig_params: bool, fsdp_version: int) -> list[dict[str, Any]]:
    """Decay (matrices) and no-decay (biases, norms) groups, as users write them.

    FSDP1 without ``use_orig_params`` has only flat parameters after wrapping,
    so there the groups are by FSDP unit: the root's flat parameter (embedding,
    final norm, head) gets no decay, the blocks' flat parameters get decay.
    """
    if fsdp_version == 1 and not use_orig_params:
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            (decay if ".blocks." in f".{name}" else no_decay).append(p)
    else:
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            (decay if p.ndim >= 2 and not name.startswith("tok.") else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def patch_fsdp1_to_cpu() -> None:
    """Make FSDP1's ``FlatParamHandle.to_cpu`` a no-op when the flat parameter is already on CPU.

    Why: FULL_STATE_DICT with ``offload_to_cpu=True`` (what accelerate's
    ``save_state`` sets on more than one process, and what
    ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` sets)
    enters ``handle.to_cpu()``, which copies the unsharded flat parameter to
    CPU and then frees the unsharded storage.  On a CPU compute device the
    "copy" is the same storage, so the parameters' views point at freed memory
    and rank 0 dies with SIGSEGV while cloning them.  On a GPU the copy is
    real; on CPU the data already is where ``to_cpu`` would put it.
    """
    import contextlib

    from torch.distributed.fsdp._flat_param import FlatParamHandle

    original = FlatParamHandle.to_cpu
    if getattr(original, "_accel_cpu_patch", False):
        return

    @contextlib.contextmanager
    def to_cpu(self: Any):  # type: ignore[no-untyped-def]
        if self.flat_param.device.type == "cpu":
            yield
            return
        with original(self):
            yield

    to_cpu._accel_cpu_patch = True  # type: ignore[attr-defined]
    FlatParamHandle.to_cpu = to_cpu  # type: ignore[method-assign]


def build(spec: dict[str, Any]) -> tuple[Any, nn.Module, Any, Any]:
    """Accelerator with FSDP forced on CPU, prepared model, optimizer, scheduler."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    job = spec.get("job") or {}  # another job's model than this module's own: see main()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=spec["fsdp_version"],
        state_dict_type=spec["state_dict_type"],
        auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        transformer_cls_names_to_wrap=[job.get("wrap", "AccelBlock")],
        use_orig_params=spec["use_orig_params"] if spec["fsdp_version"] == 1 else None,
        sync_module_states=False if spec["fsdp_version"] == 1 else None,
        cpu_ram_efficient_loading=False,
    )
    accelerator = Accelerator(cpu=True)
    state = AcceleratorState()
    assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
    if spec.get("tweak", True):  # False only to show what accelerate does by itself (DDP)
        # What accelerate does for FSDP on a GPU, done by hand for CPU.
        device = torch.device(spec.get("device", "cpu"))  # "cpu:0" only to show FSDP1 refusing it
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
        state.device = device
        PartialState._shared_state["device"] = device
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        assert accelerator.distributed_type == DistributedType.FSDP and accelerator.device == device

    torch.manual_seed(SEED)
    if job:  # its own model and param groups (by parameter name), and no scheduler
        import importlib

        module, _, name = job["model"].partition(":")
        model = getattr(importlib.import_module(module), name)(**job["kwargs"])
        named = dict(model.named_parameters())
        optimizer = torch.optim.AdamW(
            [{"params": [named[n] for n in names], **kwargs} for names, kwargs in job["groups"]]
        )
        model, optimizer = accelerator.prepare(model, optimizer)
        return accelerator, model, optimizer, None
    model = AccelLM(spec["tied"])
    if spec["fsdp_version"] == 1 and not spec["use_orig_params"]:
        model = accelerator.prepare(model)  # flat parameters exist only after wrapping
        optimizer = torch.optim.AdamW(param_groups(model, False, 1), lr=LR, betas=(0.9, 0.95), eps=1e-8)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    else:
        optimizer = torch.optim.AdamW(
            param_groups(model, spec["use_orig_params"], spec["fsdp_version"]), lr=LR, betas=(0.9, 0.95), eps=1e-8
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def train_step(accelerator: Any, model: nn.Module, optimizer: Any, scheduler: Any, step: int) -> float:
    """One real forward/backward/step; returns the loss averaged over ranks."""
    vocab = getattr(accelerator.unwrap_model(model), "vocab", VOCAB)
    ids, target = batch(step, accelerator.process_index, vocab)
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), target.reshape(-1))
    accelerator.backward(loss)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    value = loss.detach().clone()
    dist.all_reduce(value)
    return float(value) / accelerator.num_processes


def detached(value: Any) -> Any:
    """A deep copy in which every tensor is cloned.

    Why: ``get_optimizer_state_dict`` hands back some tensors by reference
    (FSDP2's scalar ``step``), which the next ``optimizer.step()`` increments
    in place; a dump taken before a step must not move with it.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(detached(v) for v in value)
    return value


def gathered(model: nn.Module, optimizer: Any, scheduler: Any, step: int) -> dict[str, Any]:
    """The full state every rank holds, gathered (collective: all ranks call it).

    ``model``: FQN-keyed full state dict of the unwrapped model.  ``optim``:
    ``get_optimizer_state_dict(..., full_state_dict=True, cpu_offload=True)``,
    keyed by FQN.  Only rank 0 receives the tensors; the others get {}.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    inner = getattr(optimizer, "optimizer", optimizer)
    model_sd = get_model_state_dict(model, options=opts)
    optim_sd = get_optimizer_state_dict(model, inner, options=opts)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return {
        "model": detached(model_sd),
        "optim": detached(optim_sd),
        "param_groups": detached(groups),
        "scheduler": detached(scheduler.state_dict()) if scheduler is not None else None,
        "step": step,
    }


def main() -> None:
    """Spec keys: mode ("save"|"load"), folder, dump, steps, fsdp_version,
    state_dict_type, tied, use_orig_params, cpu_patch (default True: see
    :func:`patch_fsdp1_to_cpu`), prime (load only: initialize the optimizer
    state before ``load_state``); tweak (default True) and device (default
    "cpu") exist only to demonstrate why the FSDP state is set by hand.
    job (optional): another job's model, ``{"model": "module:Class", "kwargs",
    "wrap": its block class's name, "groups": [[parameter names], AdamW kwargs]}``,
    loaded with no scheduler (what another framework's checkpoint, converted
    for accelerate, is resumed with)."""
    spec = json.loads(sys.argv[1])
    t0 = time.time()
    if spec.get("cpu_patch", True):
        patch_fsdp1_to_cpu()
    accelerator, model, optimizer, scheduler = build(spec)
    rank = accelerator.process_index
    world = accelerator.num_processes
    info: dict[str, Any] = {"world": world, "distributed_type": str(accelerator.distributed_type)}
    info["model_type"] = type(model).__name__
    losses: list[float] = []
    if spec["mode"] == "save":
        for step in range(spec["steps"]):
            losses.append(train_step(accelerator, model, optimizer, scheduler, step))
        info["losses"] = losses
        accelerator.save_state(spec["folder"])
        accelerator.wait_for_everyone()
        dump = gathered(model, optimizer, scheduler, spec["steps"])
    else:
        inner = getattr(optimizer, "optimizer", optimizer)
        if spec.get("prime"):
            # Give the fresh optimizer a state before load_state, as torch's
            # get_optimizer_state_dict does (a zero-gradient step at lr 0):
            # FSDP1 SHARDED_STATE_DICT loads only into state that exists.
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(inner)
        info["optim_state_len_before_load"] = len(inner.state)
        accelerator.load_state(spec["folder"])
        # Evidence of what load_state put into the fresh optimizer, per rank,
        # before gathered() (whose get_optimizer_state_dict would initialize an
        # empty optimizer state with a zero-gradient step).
        local = {
            "optim_state_len": len(inner.state),
            "steps": sorted({float(s["step"]) for s in inner.state.values() if "step" in s}),
            "lr": [g["lr"] for g in inner.param_groups],
            "initial_lr": [g.get("initial_lr") for g in inner.param_groups],
        }
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, local)
        info["after_load_per_rank"] = per_rank
        dump = gathered(model, optimizer, scheduler, spec["steps"])
        loss_after = train_step(accelerator, model, optimizer, scheduler, spec["steps"])
        dump["loss_after"] = loss_after
        info["loss_after"] = loss_after
        # The step's own loss is computed before its update, so it cannot show
        # a lost optimizer state; the loss on the next batch after it can.
        with torch.no_grad():
            vocab = getattr(accelerator.unwrap_model(model), "vocab", VOCAB)
            ids, target = batch(spec["steps"] + 1, rank, vocab)
            nxt = torch.nn.functional.cross_entropy(model(ids).float().reshape(-1, vocab), target.reshape(-1)).detach()
        dist.all_reduce(nxt)
        dump["loss_next"] = float(nxt) / world
        if not math.isfinite(loss_after):
            raise SystemExit(f"loss after load is not finite: {loss_after}")
    info["seconds_in_job"] = time.time() - t0
    if rank == 0:
        dump["info"] = info
        path = Path(spec["dump"])
        tmp = path.with_name(path.name + ".tmp")
        torch.save(dump, tmp)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    from frameworks.launch import run_then_leave

    run_then_leave(main)
