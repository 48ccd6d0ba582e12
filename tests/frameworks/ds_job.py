"""One rank of a real DeepSpeed ZeRO training job on CPU (launched by ``ds.py`` under torchrun).

It makes real ``engine.save_checkpoint`` folders for a future DeepSpeed reader
(issue #31): ZeRO stage 1, 2 or 3, fp32 or bf16, over ``gloo`` with
``DS_ACCELERATOR=cpu`` (set in :func:`main` before ``deepspeed`` is imported), torch's own
AdamW (``"torch_adam": true``: no compiled ops) in two parameter groups (decay
on the 2-D weights, none on biases and norms) and DeepSpeed's ``WarmupLR``.

The model is the test's own (:class:`DsLM`), with odd sizes on purpose
(vocab 37, dim 11, hidden 19: every parameter has an odd number of elements)
so that ZeRO's padding shows on 2 ranks: stage 1/2 pad each group's flat
buffer to a multiple of 2 * world size, stage 3 pads each parameter to a
multiple of the world size.  With dim 12 / hidden 20 every count is even and
no padding appears at all on 2 ranks; ``dim``/``hidden`` in the spec change it.
``tied`` shares the embedding with the output head.

Invoked as ``ds_job.py '{"saves": [<spec>, ...]}'``: several saves, one after the other, in one
launch; see :func:`main` for the keys.  Rank 0 writes each save's ground truth (see
:func:`truth`) to its ``spec["dump"]``.

fp16: the spec accepts "fp16" (with a dynamic loss scale), but DeepSpeed's CPU
accelerator reports fp16 as supported only when
``torch.ops.mkldnn._is_mkldnn_fp16_supported()`` is true; where it is false
``deepspeed.initialize`` raises "Type fp16 is not supported on your device."
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

SEED = 1234
VOCAB, DIM, HIDDEN, SEQ, BATCH = 37, 11, 19, 9, 2
LR, BETAS, EPS, DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DsBlock(nn.Module):
    """Pre-norm MLP block: LayerNorm, Linear(dim, hidden) with bias, GELU, Linear(hidden, dim) without."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class DsLM(nn.Module):
    """Embedding, two blocks, a head; ``tied`` makes ``head.weight`` the embedding's weight.

    A persistent buffer (``pos``) shows how DeepSpeed saves buffers next to parameters.
    """

    def __init__(self, tied: bool, vocab: int = VOCAB, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([DsBlock(dim, hidden) for _ in range(2)])
        self.head = nn.Linear(dim, vocab, bias=False)
        nn.init.normal_(self.tok.weight, std=0.2)
        if tied:
            self.head.weight = self.tok.weight
        self.register_buffer(
            "pos", torch.linspace(-0.1, 0.1, SEQ).unsqueeze(1).expand(SEQ, dim).clone(), persistent=True
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]].to(self.tok.weight.dtype)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int, rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic tokens for (step, rank) from a seeded generator."""
    gen = torch.Generator().manual_seed(SEED * 1000 + step * 97 + rank)
    ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def param_groups(model: nn.Module) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """Decay (2-D weights) and no-decay (biases, norms) groups, and the FQNs of each.

    The FQNs are ``model.named_parameters()``'s (a tied head weight appears
    once, under the embedding's name).
    """
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            decay.append(p)
            decay_names.append(name)
        else:
            no_decay.append(p)
            no_decay_names.append(name)
    groups = [{"params": decay, "weight_decay": DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return groups, [decay_names, no_decay_names]


def ds_config(spec: dict[str, Any]) -> dict[str, Any]:
    dtype = spec["dtype"]
    if dtype not in DTYPES:
        raise SystemExit(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": DECAY, "torch_adam": True},
        },
        # WarmupLR sets warmup_min_lr at construction and after the first step (iteration 0),
        # so the first two steps run at warmup_min_lr: with 0 there the weights would not move.
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": LR / 5, "warmup_max_lr": LR, "warmup_num_steps": 5, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": int(spec["stage"])},
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8, "loss_scale_window": 100, "hysteresis": 2,
                 "min_loss_scale": 1},
    }
    if spec.get("grad_accum_dtype"):
        config["data_types"] = {"grad_accum_dtype": spec["grad_accum_dtype"]}
    return config


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().cpu()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _moments_linked(engine: Any, keys: tuple[str, ...]) -> bool:
    """Whether every rank's stage 1/2 hp-fragments hold ``keys`` (collective).

    ``safe_get_full_optimizer_state`` reads ``param._hp_mapping.optim_fragment``,
    which DeepSpeed fills once (``_lazy_init_hp_params_optimizer_state``, then
    ``_hp_optimizer_states_linked = True``) with the optimizer-state tensors
    shaped like the rank's flat fp32 partition.  DeepSpeed 0.19.8 calls it at the
    end of ``_optimizer_step(group_no)`` for group 0, before group 1 has stepped
    and has any state: every parameter of the second and later param groups
    then has an empty ``optim_fragment`` on every rank, for good.  The API then
    raises ValueError on the ranks that hold a fragment of such a parameter
    while a rank holding none waits in its all_reduce, so ask first.
    """
    import torch.distributed as dist

    ok = True
    for p in engine.module.parameters():
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None and not all(k in (mapping.optim_fragment or {}) for k in keys):
            ok = False
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag)
    return int(flag) == 0


def truth(engine: Any, names: list[list[str]], stage: int, rank: int) -> dict[str, Any]:
    """The gathered state at save time (collective: every rank calls it; rank 0 gets it, others {}).

    ``fp32`` from ``deepspeed.utils.safe_get_full_fp32_param``; ``lp`` (the
    full low-precision weights the model computes with) from the parameter
    itself (stage 1/2) or under ``deepspeed.zero.GatheredParameters``
    (stage 3); moments from ``safe_get_full_optimizer_state`` where every rank
    holds linked fragments (see :func:`_moments_linked`), else left out and
    named in ``missing_moments`` for ``ds.fill_moments_from_universal``;
    ``moments_relinked_api`` (a cross-check, stage 1/2 only) from the same API
    after DeepSpeed's linking is redone; ``step`` from the base torch
    optimizer's own state (the API returns only tensors shaped like the flat
    partition); ``module`` is what ``engine.module_state_dict()`` returns,
    which ``save_checkpoint`` stores.
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    keys = ("exp_avg", "exp_avg_sq")
    base = engine.optimizer.optimizer  # the torch AdamW under the ZeRO wrapper
    steps = {float(s["step"]) for s in base.state.values() if "step" in s}
    step_values = [s["step"] for s in base.state.values() if "step" in s]
    if len(steps) != 1:
        raise SystemExit(f"rank {rank}: expected one step value in the base optimizer state, got {sorted(steps)}")
    step = _clone(step_values[0])

    linked = True if stage == 3 else _moments_linked(engine, keys)
    relinked: dict[str, dict[str, torch.Tensor]] = {}
    if not linked:
        # A cross-check only (the dump's moments then come from ds_to_universal):
        # DeepSpeed's own linking, redone now that every group has its state.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
        if _moments_linked(engine, keys):
            for name, p in engine.module.named_parameters():
                got = {k: safe_get_full_optimizer_state(p, k) for k in keys}
                if rank == 0:
                    relinked[name] = {k: _clone(v) for k, v in got.items()}
    out: dict[str, Any] = {"fp32": {}, "lp": {}, "state": {}, "sources": {}}
    for name, p in engine.module.named_parameters():
        fp32 = safe_get_full_fp32_param(p)
        moments = {k: safe_get_full_optimizer_state(p, k) for k in keys} if linked else {}
        if stage == 3:
            with deepspeed.zero.GatheredParameters([p]):
                lp = p.detach().clone()
        else:
            lp = p.detach().clone()
        if rank == 0:
            out["fp32"][name] = _clone(fp32)
            out["lp"][name] = _clone(lp)
            out["state"][name] = {**{k: _clone(v) for k, v in moments.items()}, "step": step}
    out["sources"] = {
        "fp32": "deepspeed.utils.safe_get_full_fp32_param",
        "exp_avg/exp_avg_sq": "deepspeed.utils.safe_get_full_optimizer_state" if linked
        else "not linked on every rank: filled from ds_to_universal by ds.fill_moments_from_universal",
        "step": "engine.optimizer.optimizer.state[<flat fp32 group>]['step'] (one value on every group)",
        "lp": "deepspeed.zero.GatheredParameters" if stage == 3 else "the engine's parameter",
        "module": "engine.module_state_dict()",
    }
    out["missing_moments"] = [] if linked else list(keys)
    # safe_get_full_optimizer_state after re-running DeepSpeed's linking
    # (_hp_optimizer_states_linked = False; _lazy_init_hp_params_optimizer_state()):
    # only where the first linking left fragments empty, to compare with ds_to_universal.
    out["moments_relinked_api"] = relinked
    groups = []
    for g, fqns in zip(engine.optimizer.param_groups, names):
        hyper = {k: _clone(v) for k, v in g.items() if k != "params"}
        hyper["params"] = list(fqns)
        groups.append(hyper)
    out["param_groups"] = groups
    out["module"] = _clone(dict(engine.module_state_dict())) if rank == 0 else {}
    out["lr_scheduler"] = _clone(engine.lr_scheduler.state_dict()) if engine.lr_scheduler is not None else None
    out["global_steps"] = engine.global_steps
    return out if rank == 0 else {}


def train_and_save(spec: dict[str, Any], rank: int, world: int) -> None:
    """One save of :func:`main`'s list: train ``spec["steps"]`` steps, ``engine.save_checkpoint(spec["out"])``, rank 0
    writes the gathered state (:func:`truth`) to ``spec["dump"]``; then the engine is destroyed (collective).

    Everything a save depends on starts afresh here, as in a process of its own: the seed, the model, its param groups,
    the engine, its optimizer and scheduler. What the process keeps from an earlier save is only what DeepSpeed keeps
    per process (``deepspeed.comm``'s process group, the loaded ops), which a save's files do not record.
    """
    import deepspeed
    import torch.distributed as dist

    t0 = time.time()
    torch.manual_seed(SEED)  # the same initial weights on every rank
    model = DsLM(bool(spec["tied"]), spec.get("vocab", VOCAB), spec.get("dim", DIM), spec.get("hidden", HIDDEN))
    groups, names = param_groups(model)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config(spec))

    losses = []
    for step in range(int(spec["steps"])):
        ids, target = batch(step, rank, model.vocab)
        logits = engine(ids)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, model.vocab), target.reshape(-1))
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        losses.append(float(value) / world)

    engine.save_checkpoint(spec["out"])
    dump = truth(engine, names, int(spec["stage"]), rank)
    if rank == 0:
        dump["initial"] = initial  # fp32 weights before deepspeed.initialize, to show that training moved them
        dump["info"] = {
            "world": world,
            "spec": spec,
            "losses": losses,
            "optimizer": type(engine.optimizer).__name__,
            "base_optimizer": type(engine.optimizer.optimizer).__name__,
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "seconds_in_job": time.time() - t0,
        }
        path = Path(spec["dump"])
        tmp = path.with_name(path.name + ".tmp")
        torch.save(dump, tmp)
        os.replace(tmp, path)
    # DeepSpeed's own teardown of an engine, for another in the same process: the optimizer's hooks and buffers
    engine.destroy()
    dist.barrier()


def to_universal(folder: str, into: str) -> None:
    """``python -m deepspeed.checkpoint.ds_to_universal --input_folder <folder>/<tag> --output_folder <into>/<tag>
    --inject_missing_state --num_extract_workers 1 --num_merge_workers 1`` (``tag``: the one ``latest`` names), in this
    process: the module's own argument parser and ``main``, without the seconds a process of its own spends importing
    torch and DeepSpeed. One worker of each kind: the work is done in this process, none forked."""
    from deepspeed.checkpoint import ds_to_universal

    tag = (Path(folder) / "latest").read_text().strip()
    argv = sys.argv
    sys.argv = [
        "ds_to_universal", "--input_folder", str(Path(folder) / tag), "--output_folder", str(Path(into) / tag),
        "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1",
    ]  # fmt: skip
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = argv


def main() -> None:
    """The one argument: ``{"saves": [spec, ...]}`` (JSON), the saves made in turn in this one world
    (:func:`train_and_save`); then, for each save whose spec names ``universal`` (a folder for its output), DeepSpeed's
    ``ds_to_universal`` of it (:func:`to_universal`), the saves shared out over the ranks.

    Why several saves in one launch: each rank of a launch spends about 25 s of a CPU core on imports (DeepSpeed's own,
    then, at the first ``deepspeed.initialize``, ``torch._dynamo``, which torch's optimizers import, and DeepSpeed's
    Muon module), where the save itself takes 1 to 2 s; a later engine in the same process imports nothing more.
    ``ds_to_universal`` runs here for the same reason (a process of its own: about 5 s, nearly all imports).

    Each save's spec keys: out (save folder), stage (1|2|3), dtype ("fp32"|"bf16"|"fp16"), steps, tied (bool), dump
    (path for rank 0's ground truth); optional vocab, dim, hidden (model sizes), grad_accum_dtype (DeepSpeed
    ``data_types.grad_accum_dtype``, e.g. "fp32") and universal."""
    specs = json.loads(sys.argv[1])["saves"]
    # Before deepspeed is imported: it picks its accelerator then.  Set here, not at
    # import time, so that importing this module for DsLM alone changes nothing.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for spec in specs:
        train_and_save(spec, rank, world)
    converts = [spec for spec in specs if spec.get("universal")]
    for spec in converts[rank::world]:
        to_universal(spec["out"], spec["universal"])
    dist.barrier()
    # A background thread of gloo / DeepSpeed's CPU comm can abort the interpreter's
    # teardown after the work is done ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
