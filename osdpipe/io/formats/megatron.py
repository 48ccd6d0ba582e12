"""A Megatron-LM ``torch_dist`` checkpoint's files without Megatron: their names, ``common.pt``, the structure checked.

The product reads a save by ranges through the stage loop (:mod:`osdpipe.io.formats.megatron_reader`,
:mod:`osdpipe.io.formats.megatron_source`) and writes one rank by rank (:mod:`osdpipe.io.checkpoints.megatron`);
what they share of the format is here: the save's folder and item names, ``common.pt`` read inertly, and the checks
that refuse a save osdpipe cannot read, in one line.

A Megatron-LM save folder holds ``latest_checkpointed_iteration.txt`` and ``iter_<7 digits>/``; the iteration
folder is one DCP checkpoint (``.metadata``, ``__<rank>_<k>.distcp``) beside ``common.pt`` (a ``torch.save`` of
``args``, an ``argparse.Namespace``, the iteration, the scheduler's state and, for a ``fully_reshardable``
optimizer, its param groups) and ``metadata.json`` (``sharded_backend: torch_dist``). What is in the DCP items:

* the model, one tensor per sharded key, global over TP and PP (:mod:`osdpipe.layout.megatron`);
* the distributed optimizer in the sharding type ``common.pt``'s ``content_metadata`` names:

  - ``dp_reshardable`` (Megatron-LM's default): per model-parallel domain ``i``, gradient buffer, dtype and bucket,
    one 1-D tensor per state, ``optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_(<param>, <grad>)
    .bucket_idx_<b>.<param|exp_avg|exp_avg_sq>``: each bucket as :func:`osdpipe.layout.megatron.buckets` lays it
    out (one; two on a stage that holds a tied embedding over PP), ``g`` the model chunk (0 but with virtual
    pipeline stages), cut at its unpadded size; the param groups (with
    ``step``) in the byte item ``optimizer.distributed.dp_group_idx_<i>.optimizer``;
  - ``fully_reshardable``: ``optimizer.state.<param|exp_avg|exp_avg_sq>.<sharded key>``, global like the model;
    the param groups (with ``step``) in ``common.pt``;
  - ``fully_sharded_model_space`` (megatron-core's default until 0.14, which dropped it): per sharded key
    ``optimizer.state.<fp32_param|exp_avg|exp_avg_sq>.<sharded key>``, each DP rank's part of each TP/PP-local
    chunk stored flattened: for a key of global shape ``(s_0, .., s_n)`` cut into ``f_i`` chunks along axis ``i``
    (the decoder's layer axis into single layers), the item's shape is ``(f_0, .., f_n, prod(s_i / f_i))``, the last
    axis the chunk in row-major order (megatron-core 0.13 ``dist_checkpointing/strategies/torch.py``, its
    N-D flattened tensors); the param groups (with ``step``) in ``common.pt`` as for ``fully_reshardable``;

* byte items (``rng_state``, a linear's ``_extra_state``, the bucket sizes): each a ``torch.save`` of a one-element
  list.

A save of the weights alone (Megatron-LM's ``--no-save-optim``, recorded in ``args.no_save_optim``; what a converted
model is, as Megatron-LM's ``release`` folder) holds the model's items and no optimizer: Megatron-LM's
``load_checkpoint`` then starts its optimizer fresh (it loads one only where ``args.no_save_optim`` is unset and the
folder is no ``release``), and so does osdpipe (:func:`optimizer_sharding` answers ``None``).

Every pickle (``common.pt``, the byte items) is read by :func:`osdpipe.io.formats.inert_load.load_inert`: names of
``argparse`` and ``megatron`` become inert records, nothing runs, and Megatron need not be installed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.dcp_reader import DcpCheckpoint
from osdpipe.io.formats.inert_load import load_inert, load_inert_bytes
from osdpipe.io.remote_input import RemotePath, as_path
from osdpipe.layout import megatron as layout
from osdpipe.layout.megatron import gpt_of as gpt_of  # the GPT a save's args describe, asked for here

LATEST = "latest_checkpointed_iteration.txt"
#: What ``latest_checkpointed_iteration.txt`` says of a ``release`` save (Megatron-LM's converted weights): its folder
#: is ``release/``, and Megatron-LM loads it at iteration 0 with a fresh optimizer, scheduler and RNG.
RELEASE = "release"
COMMON = "common.pt"
#: The packages whose objects a Megatron pickle may name: kept as inert records, never imported.
DESCRIBED = ("argparse", "megatron")
WHAT = "a Megatron-LM checkpoint's common.pt"
#: The optimizer's per-parameter states, as Megatron's sharded keys name them (``param``: the fp32 master weight).
STATES = ("param", "exp_avg", "exp_avg_sq")
#: The distributed optimizer's sharding types osdpipe reads.
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space")
#: The type a save of each type is written in where ``output.megatron_optim_format`` is unset: its own, or for
#: ``fully_sharded_model_space`` the other model-space type, ``fully_reshardable``, which megatron-core, like the
#: source, loads at any TP and PP (a ``dp_reshardable`` save only at its own).
DEFAULT_OUTPUT = {"dp_reshardable": "dp_reshardable", "fully_reshardable": "fully_reshardable",
                  "fully_sharded_model_space": "fully_reshardable"}
#: How a ``fully_sharded_model_space`` save names each of :data:`STATES` in its keys.
FS_STATES = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
_BUCKET = re.compile(
    r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\((.+)\)"
    r"\.bucket_idx_(\d+)\.(\w+)"
)
#: A model-space optimizer state's key (``fully_reshardable``, ``fully_sharded_model_space``): the state's name as
#: stored, then the weight's key.
_MODEL_SPACE_STATE = re.compile(rf"optimizer\.state\.({'|'.join(sorted({*STATES, *FS_STATES.values()}))})\.(.+)")
_ITERATION = re.compile(r"iter_(\d{7})")
RNG = re.compile(r"rng_state/shard_(\d+)\.(\d+)_\d+\.\d+")

#: The states a PyTorch Adam keeps per parameter, in the order its ``state_dict()`` lists them.
MOMENTS = ("exp_avg", "exp_avg_sq")
#: What megatron-core adds to each param group for its ``OptimizerParamScheduler`` (megatron-core 0.16.1
#: ``optimizer/__init__.py`` ``_get_param_groups``, l. 208-225), which no torch optimizer reads.
SCHEDULERS_KEYS = ("is_expert_parallel", "default_config", "wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr")


def iteration_folder(path: str | Path | RemotePath) -> Path | RemotePath:
    """The ``iter_<N>`` (or ``release``) folder of a save: ``path`` itself, or the one its
    ``latest_checkpointed_iteration.txt`` names (in object storage: a :class:`RemotePath`, read by range).

    Raises:
        InputError: neither, or a ``latest`` file that names a missing folder.
    """
    p = as_path(path)
    if (_ITERATION.fullmatch(p.name) or p.name == RELEASE) and p.is_dir() and not (p / LATEST).is_file():
        return p
    latest = p / LATEST
    if not latest.is_file():
        raise InputError(
            f"{p} holds no {LATEST} and is no iter_<7 digits> folder; point input.path at a Megatron-LM save"
        )
    said = latest.read_text().strip()
    if said == RELEASE:
        folder = p / RELEASE
    elif said.isdigit():
        folder = p / f"iter_{int(said):07d}"
    else:
        raise InputError(f"{latest} says {said!r}, not an iteration; re-copy the save folder")
    if not folder.is_dir():
        raise InputError(f"{latest} names iteration {said}, but {folder} is not there; re-copy the save folder")
    return folder


def megatron_folder(path: Path) -> Path | None:
    """The iteration folder of the Megatron-LM save at ``path`` (a save folder or an ``iter_`` folder of a torch_dist
    save); ``None`` where ``path`` is none. veRL's run folder holds a file of the same name, naming its
    ``global_step_<N>`` folders: a folder of those is veRL's."""
    if (path / LATEST).is_file() and not any(p.name.startswith("global_step_") for p in path.iterdir()):
        return path
    if (path / COMMON).is_file() and (path / "metadata.json").is_file() and (path / ".metadata").is_file():
        return path
    return None


def what_to_do_with(path: Path) -> str:
    """One line for a Megatron-LM save given where an optimizer checkpoint is asked for: what it is (from
    ``common.pt``, read inertly) and the keys that convert it."""
    try:
        save_args = read_common(iteration_folder(path))["args"]
        shape = (f"TP{save_args.get('tensor_model_parallel_size')} PP{save_args.get('pipeline_model_parallel_size')} "
                 f"DP{save_args.get('data_parallel_size')}, iteration {save_args.get('iteration')}")
    except InputError as exc:
        return str(exc)
    return (
        f"{path} is a Megatron-LM torch_dist save ({shape}); set checkpoint=megatron and the target's grid: "
        "target.tp_size=T target.pp_size=P target.world_size=W (docs/frameworks.md, From and to Megatron-Core)"
    )


def read_common(folder: Path) -> dict[str, Any]:
    """``common.pt``, read inertly, with ``args`` as a plain dict."""
    if not (folder / COMMON).is_file():
        raise InputError(f"{folder} holds no {COMMON}; a Megatron-LM torch_dist save has one beside .metadata")
    common = load_inert(folder / COMMON, DESCRIBED, what=WHAT)
    if not isinstance(common, dict) or "args" not in common:
        raise InputError(f"{folder / COMMON} holds no args; it is not a Megatron-LM checkpoint's common.pt")
    args = common["args"]
    common["args"] = dict(args.state) if hasattr(args, "state") and isinstance(args.state, dict) else vars(args)
    return common


def refused_model(args: dict[str, Any], where: Path) -> str | None:
    """Why osdpipe cannot lay out the model ``args`` describe yet (``None``: it can), naming the feature. Absent args
    take Megatron-LM's defaults (LayerNorm, a learned position table, tied embeddings: all laid out)."""
    norm, positions = args.get("normalization", "LayerNorm"), layout.position_embedding_type(args)
    checks = [
        (norm not in ("RMSNorm", "LayerNorm"), f"{norm} normalization"),
        (positions not in ("rope", "learned_absolute"), f"{positions} position embeddings"),
        *moe_refusals(args),
        ((args.get("context_parallel_size") or 1) > 1, "context parallelism"),
        ((args.get("num_distributed_optimizer_instances") or 1) > 1,
         "several distributed optimizer instances (num_distributed_optimizer_instances)"),
        (args.get("transformer_impl", "local") != "local", f"the {args.get('transformer_impl')} layer spec"),
        (bool(args.get("use_megatron_fsdp")) or args.get("ckpt_format") == "fsdp_dtensor", "Megatron-FSDP"),
    ]
    refused = [what for bad, what in checks if bad]
    if refused:
        return f"{where}: a Megatron GPT with {', '.join(refused)}: not supported yet"
    return None


def moe_refusals(args: dict[str, Any]) -> list[tuple[bool, str]]:
    """What of a mixture of experts osdpipe does not lay out yet, as :func:`refused_model`'s checks: it lays out
    SequentialMLP experts (the local spec) in every layer, their tensor parallelism the TP's."""
    if not (args.get("num_experts") or 0):
        return [((args.get("expert_model_parallel_size") or 1) > 1, "expert parallelism without experts")]
    freq = args.get("moe_layer_freq", 1)
    etp = args.get("expert_tensor_parallel_size")
    return [
        (freq not in (1, None) and not (isinstance(freq, list) and all(freq)),
         f"dense layers among the MoE layers (moe_layer_freq={freq})"),
        (bool(args.get("moe_shared_expert_intermediate_size")), "shared experts (moe_shared_expert_intermediate_size)"),
        (bool(args.get("moe_grouped_gemm")), "grouped-GEMM experts (moe_grouped_gemm)"),
        (bool(args.get("moe_router_enable_expert_bias")), "a router expert bias (moe_router_enable_expert_bias)"),
        (bool(args.get("add_bias_linear")), "linear biases in the experts (add_bias_linear)"),
        (etp is not None and int(etp) != int(args.get("tensor_model_parallel_size") or 1),
         f"an expert tensor parallelism other than the TP (expert_tensor_parallel_size={etp})"),
    ]


def chained_parts(optimizer: Any) -> list[dict[str, Any]]:
    """The parts of common.pt's optimizer entry, one per optimizer of the chain: megatron-core's ``ChainedOptimizer``
    of two (the dense one and, with expert parallelism, the experts') keys each by its index; one optimizer is the
    entry itself."""
    if isinstance(optimizer, dict) and optimizer and all(isinstance(k, int) for k in optimizer):
        return [optimizer[k] or {} for k in sorted(optimizer)]
    return [optimizer or {}]


def _saved_groups(checkpoint: DcpCheckpoint, common: dict[str, Any], sharding: str | None) -> list[dict] | None:
    """The optimizer's param groups as saved (their hyperparameters and ``step``; no parameters listed), the dense
    optimizer's then the experts' (expert parallelism): in common.pt for a model-space save, else in the first
    model-parallel domain's optimizer item that holds them, for each optimizer of the chain."""
    parts = chained_parts(common.get("optimizer"))
    if sharding != "dp_reshardable":
        found = [part.get("optimizer", {}).get("param_groups") for part in parts]
        return None if any(g is None for g in found) else [g for groups in found for g in groups]
    args = common["args"]
    tp, pp = int(args["tensor_model_parallel_size"]), int(args["pipeline_model_parallel_size"])
    ep = int(args.get("expert_model_parallel_size") or 1)
    out = []
    for chained in range(len(parts)):
        prefix = f"chained_{chained}." if len(parts) > 1 else ""
        width = tp * ep if chained else tp  # the experts' model-parallel group: TP x EP x PP
        for index in range(width * pp):
            groups = (_byte_item(checkpoint, f"{prefix}optimizer.distributed.dp_group_idx_{index}.optimizer") or {})
            if groups.get("param_groups") is not None:
                out += groups["param_groups"]
                break
        else:
            return None
    return out


def _refuse_unknown_tensors(checkpoint: DcpCheckpoint, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse a save holding a weight (or a model-space optimizer state of one) that the layout of its ``args`` does
    not have, naming it: read without it, the output would lack a weight its job needs while every check, comparing
    what was read, passed. :func:`refused_model` names the features it knows; this catches the rest."""
    unknown = []
    for flat, item in checkpoint.metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata) or _BUCKET.fullmatch(flat):
            continue
        state = _MODEL_SPACE_STATE.fullmatch(flat)
        if (state[2] if state else flat) not in shapes:
            unknown.append(flat)
    if unknown:
        shown = ", ".join(sorted(unknown)[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        raise InputError(
            f"{checkpoint.path}: holds {shown}, which the GPT its common.pt's args describe has no place for: "
            "not supported yet"
        )


def _check_backend(folder: Path) -> None:
    meta = folder / "metadata.json"
    if not meta.is_file():
        raise InputError(f"{folder} holds no metadata.json; it is not a Megatron dist_checkpointing save")
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except ValueError:
        raise InputError(f"{meta} is damaged (not JSON); re-copy the save folder") from None
    if backend != "torch_dist":
        raise InputError(f"{meta}: sharded_backend {backend!r}; osdpipe reads torch_dist saves, not yet this one")


def sharding_type(common: dict[str, Any], folder: Path) -> str:
    """How the save's distributed optimizer is sharded, as ``common.pt`` says it.

    Raises:
        InputError: a sharding type (or a non-distributed optimizer) osdpipe does not read yet.
    """
    said = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    said = said or (common.get("optimizer") or {}).get("param_state_sharding_type")
    if said is None:
        raise InputError(f"{folder}: no distributed optimizer state (a non-distributed optimizer): not supported yet")
    if said not in SHARDING_TYPES:
        raise InputError(f"{folder}: the optimizer is saved {said!r}: not supported yet (osdpipe reads "
                         f"{' and '.join(SHARDING_TYPES)})")
    return said


def optimizer_sharding(common: dict[str, Any], folder: Path) -> str | None:
    """How the save's distributed optimizer is sharded (:func:`sharding_type`); ``None``: the save holds the weights
    alone (``args.no_save_optim``: Megatron-LM's ``--no-save-optim``, and every ``release`` save osdpipe writes), and
    a job that loads it starts its optimizer fresh.

    Raises:
        InputError: a sharding type (or a non-distributed optimizer) osdpipe does not read yet.
    """
    return None if common["args"].get("no_save_optim") else sharding_type(common, folder)


def _byte_item(checkpoint: DcpCheckpoint, name: str, flat: str | None = None) -> Any:
    """The object Megatron saved as ShardedObject ``name`` (stored as ``<name>/shard_<offset>_<shape>``; ``flat``:
    that stored key, where a name has several shards), or ``None``."""
    if flat is None:
        flat = next((f for f in checkpoint.metadata.state_dict_metadata if f.startswith(f"{name}/shard_")), None)
    if flat is None:
        return None
    raw = checkpoint.stored(flat)
    if raw is None:
        raise InputError(f"{checkpoint.path}: {flat} is stored transformed (compressed): not supported yet")
    value = load_inert_bytes(raw, DESCRIBED, what=f"{checkpoint.path}'s item {flat}")
    return value[0] if isinstance(value, list) and len(value) == 1 else value  # a ShardedObject's one-element list


def _groups_with_keys(
    groups: list[dict[str, Any]] | None, shapes: dict[str, tuple[int, ...]], folder: Path
) -> list[dict[str, Any]]:
    """The param groups with the sharded keys each holds: Megatron's default rule puts 1-D parameters (norms,
    biases) in the group without weight decay (``wd_mult`` 0) and the rest in the other; the saved groups do not list
    their parameters."""
    if not groups:
        raise InputError(f"{folder}: the optimizer's param groups are missing; re-copy the save folder")
    dense = [g for g in groups if not g.get("is_expert_parallel")]
    decays = [g for g in dense if float(g.get("wd_mult", 1.0)) != 0.0]
    no_decay = [g for g in dense if float(g.get("wd_mult", 1.0)) == 0.0]
    experts = [g for g in groups if g.get("is_expert_parallel")]
    if len(decays) != 1 or len(no_decay) > 1 or len(experts) > 1 or any(
            float(g.get("wd_mult", 1.0)) == 0.0 for g in experts):
        raise InputError(f"{folder}: {len(groups)} param groups beyond Megatron's default (weight decay and none, "
                         "and with expert parallelism the experts'): not supported yet")
    out = []
    for group in groups:
        one_dim = float(group.get("wd_mult", 1.0)) == 0.0
        expert = bool(group.get("is_expert_parallel"))
        keys = sorted(k for k, shape in shapes.items() if layout.without_weight_decay(k, tuple(shape)) == one_dim
                      and (k in layout.EXPERT_KEYS and bool(experts)) == expert)  # fmt: skip
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": keys})
    return out

