"""A test oracle: a Megatron-LM ``torch_dist`` save written whole from memory for any TP x PP x DP, without Megatron.

The product writes a save rank by rank through the stage loop (:mod:`osdpipe.io.checkpoints.megatron`); this writer is
an independent one, kept for the tests and benchmarks: it makes the small sources they convert
(:mod:`synthetic_megatron`) and writes a save read whole (:mod:`megatron_oracle`) for another grid, for the tests to
hold the product's layout against. It holds the save in memory and writes its DCP files in one process: for small saves
only. What it decides from the target's parallelism, as Megatron-LM does:

* ``common.pt``'s ``args`` are rewritten for the target (``tensor_model_parallel_size``,
  ``pipeline_model_parallel_size``, ``data_parallel_size``, ``world_size``, ``padded_vocab_size``,
  ``expert_tensor_parallel_size``, ``dist_ckpt_optim_fully_reshardable``): Megatron-LM reads from them whether it may
  load the RNG states and a ``dp_reshardable`` optimizer, and refuses a mismatch;
* the vocabulary is padded as Megatron-LM pads it for the target's TP
  (:func:`osdpipe.layout.megatron.padded_vocab_size`): the source's rows are kept up to the target's padded size,
  and rows the target adds are zero, weights, masters and moments alike;
* a ``dp_reshardable`` optimizer is laid out in the target's buckets (:func:`osdpipe.layout.megatron.buckets`),
  the padding between and after parameters zero, each bucket made as it is written (:mod:`megatron_oracle_deferred`);
* the RNG states are one per target (PP, TP) rank: the source's where the grid is the same, otherwise those of source
  rank (PP mod the source's PP, TP mod the source's TP).

A save of the weights alone (:attr:`megatron_oracle.MegatronSave.weights_only`, ``Target.sharding`` ``None``) is
written without optimizer items, param groups or scheduler, ``args.no_save_optim`` and ``args.no_save_rng`` set as
Megatron-LM's ``--no-save-optim --no-save-rng`` set them; a ``release`` source into ``release/``.
"""

from __future__ import annotations

import argparse
import io
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import megatron_oracle_deferred as deferred
import torch
from megatron_oracle import MegatronSave

from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.inert_load import Record
from osdpipe.io.formats.megatron import COMMON, LATEST, RELEASE, STATES, gpt_of
from osdpipe.layout import megatron as layout
from osdpipe.layout.megatron import VOCAB_KEYS

#: The optimizer's sharding types written (megatron-core 0.14 and later no longer save nor load
#: ``fully_sharded_model_space``).
WRITTEN_TYPES = ("dp_reshardable", "fully_reshardable")


@dataclass(frozen=True)
class Target:
    """The parallelism a save is written for, and the optimizer's sharding type."""

    tp: int
    pp: int
    dp: int
    #: The optimizer's sharding type; ``None``: the weights alone (a source without optimizer state).
    sharding: str | None
    #: Model chunks per pipeline rank (virtual pipeline stages, Megatron-LM's interleaved schedule); 1: none.
    vpp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Written:
    """What :func:`write_save` wrote: the iteration folder, where each target rank's RNG states came from, and the
    digest of each DCP file, taken as it was written (by path under the save folder; a ``.distcp`` file's is a
    :class:`osdpipe.io.torchfile.PieceDigest`)."""

    folder: Path
    rng_from: dict[tuple[int, int], tuple[int, int]]
    digests: dict[str, str]


def target_args(args: dict[str, Any], target: Target) -> dict[str, Any]:
    """The source's ``args`` with the parallelism and what Megatron-LM derives from it set for ``target``."""
    out = dict(args)
    out.update(
        tensor_model_parallel_size=target.tp,
        pipeline_model_parallel_size=target.pp,
        data_parallel_size=target.dp,
        world_size=target.world_size,
        padded_vocab_size=layout.padded_vocab_size(
            int(args["vocab_size"]), int(args.get("make_vocab_size_divisible_by") or 128), target.tp
        ),
        dist_ckpt_optim_fully_reshardable=target.sharding == "fully_reshardable",
        **layout.virtual_stage_args(int(args["num_layers"]), target.pp, target.vpp),
    )
    if target.sharding is None:  # what Megatron-LM's --no-save-optim --no-save-rng record, and its load reads
        out.update(no_save_optim=True, no_save_rng=True)
    if "expert_tensor_parallel_size" in out:
        out["expert_tensor_parallel_size"] = target.tp
    return out


def write_save(save: MegatronSave, into: Path, target: Target) -> Written:
    """Write ``save`` for ``target`` into ``into`` as a Megatron-LM save folder (``latest_checkpointed_iteration.txt``
    and ``iter_<N>/``); ``into`` is made, and must hold no save yet.

    The linears' ``_extra_state`` items are carried as they are (they are keyed by global layer).

    Raises:
        InputError: the source's ``args`` hold an object of Megatron's own, which cannot be written without it; or
            ``into`` holds a save already.
    """
    if (target.sharding is None) != save.weights_only:
        held = "the weights alone" if save.weights_only else "an optimizer's state"
        raise InputError(f"{save.folder}: a save of {held} cannot be written with optimizer sharding "
                         f"{target.sharding!r}")
    if target.sharding is not None and target.sharding not in WRITTEN_TYPES:
        raise InputError(f"optim_format={target.sharding!r}: one of {', '.join(WRITTEN_TYPES)}")
    records = sorted(k for k, v in save.args.items() if isinstance(v, Record))
    if records:
        raise InputError(f"{save.folder / COMMON}: args {', '.join(records)} hold Megatron objects, which osdpipe "
                         "cannot write back without Megatron: not supported yet")
    if why := layout.virtual_stages_problem(int(save.args["num_layers"]), target.pp, target.vpp):
        raise InputError(f"{save.folder}: {why}")
    args = target_args(save.args, target)
    gpt = gpt_of(args)
    if why := layout.tp_problem(layout.tp_sizes(gpt), target.tp, replicated=True):
        raise InputError(f"{save.folder}: {why}")
    made = deferred.MadeAsWritten()
    model, optim = _repadded_state(save, gpt.padded_vocab_size, made)
    items: dict[str, Any] = dict(model)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in save.param_groups]
    optimizer_common: dict[str, Any] | None
    if target.sharding is None:
        optimizer_common = None
    elif target.sharding == "fully_reshardable":
        items.update({f"optimizer.state.{s}.{key}": states[s] for key, states in optim.items() for s in STATES})
        optimizer_common = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": target.sharding}
    else:
        items.update(_buckets(gpt, target, args, save.optim, groups, _dtype_key(save), made))
        optimizer_common = {"param_state_sharding_type": target.sharding}
    rng_from = _rng_items(save, target, items)
    items.update(save.extra_state)
    iteration = RELEASE if save.release else f"iter_{save.iteration:07d}"
    if (into / LATEST).exists() or (into / iteration).exists():
        raise InputError(f"{into} holds a Megatron save already; write into an empty directory")
    folder = into / iteration
    folder.mkdir(parents=True)
    digests = _dcp_save(items, folder, made)
    torch.save(_common(save, args, target, optimizer_common), folder / COMMON)
    (folder / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
         "common_backend_version": 1}
    ))
    (into / LATEST).write_text(RELEASE if save.release else str(save.iteration))
    return Written(folder, rng_from, {f"{iteration}/{name}": digest for name, digest in digests.items()})


def _common(
    save: MegatronSave, args: dict[str, Any], target: Target, optimizer: dict[str, Any] | None
) -> dict[str, Any]:
    """``common.pt`` for ``target``: the source's, with the target's ``args``, the optimizer's param groups and
    sharding type (``optimizer`` ``None``: the weights alone, without optimizer and scheduler keys)."""
    replaced = ("args", "optimizer", "content_metadata") + (("opt_param_scheduler",) if optimizer is None else ())
    common = {k: v for k, v in save.common.items() if k not in replaced}
    content = {**(save.common.get("content_metadata") or {})}
    if optimizer is None:
        content = {k: v for k, v in content.items() if not k.startswith("distrib_optim")}
    else:
        common["optimizer"] = optimizer
        content["distrib_optim_sharding_type"] = target.sharding
        if target.sharding == "dp_reshardable":
            content.pop("distrib_optim_fully_reshardable_mem_efficient", None)
        else:
            content.setdefault("distrib_optim_fully_reshardable_mem_efficient", False)
    common.update(args=argparse.Namespace(**args), iteration=save.iteration, content_metadata=content)
    return common


def _repadded_state(
    save: MegatronSave, padded: int, made: deferred.MadeAsWritten
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The source's weights and states as the target holds them: the source's own tensors, but each vocabulary tensor
    padded to ``padded`` rows, made as it is written (``made``)."""

    def held(key: str, tensor: torch.Tensor) -> torch.Tensor:
        if key not in VOCAB_KEYS:
            return tensor
        shape = (padded, *tensor.shape[1:])
        return made.add(shape, tensor.dtype, lambda: deferred.repadded_windows(tensor, padded))

    model = {key: held(key, tensor) for key, tensor in save.model.items()}
    optim = {key: {s: held(key, t) for s, t in states.items()} for key, states in save.optim.items()}
    return model, optim


def _dtype_key(save: MegatronSave) -> str:
    """The gradient buffer's ``(param dtype, grad dtype)`` as Megatron's keys spell it: the source's, or for a
    ``fully_reshardable`` source the weights' dtype with fp32 gradients (Megatron-LM reduces bf16 gradients in fp32)."""
    return save.gbuf_dtypes or f"{save.model['embedding.word_embeddings.weight'].dtype}, torch.float32"


def _buckets(
    gpt: layout.Gpt, target: Target, args: dict[str, Any], optim: dict[str, dict[str, torch.Tensor]],
    groups: list[dict[str, Any]], dtypes: str, made: deferred.MadeAsWritten,
) -> dict[str, Any]:
    """The ``dp_reshardable`` items: per (PP, TP) domain and model chunk (its gradient buffer), each bucket of each
    state (the tied embedding's copy on the last stage filled from the embedding's state), made from the source's
    global tensors ``optim`` as it is written (``made``); per domain its byte items (the param groups, each chunk's
    bucket sizes). The buckets are those the target's job builds with the target's ``args`` (the source's DDP
    options: ``overlap_grad_reduce``, ``ddp_bucket_size`` or ``ddp_num_buckets``;
    :func:`osdpipe.layout.megatron.bucketing`)."""
    items: dict[str, Any] = {}
    pair = tuple(getattr(torch, d.strip().removeprefix("torch.")) for d in dtypes.split(","))
    for pp_rank in range(target.pp):
        for tp_rank in range(target.tp):
            index = layout.dp_group_index(target.tp, tp_rank, pp_rank)
            prefix = f"optimizer.distributed.dp_group_idx_{index}"
            per_chunk = []
            held = layout.rank_numel(gpt, target.tp, target.pp, tp_rank, pp_rank, target.vpp)
            for chunk in range(target.vpp):
                params = layout.local_parameters(gpt, target.tp, target.pp, tp_rank, pp_rank, target.vpp, chunk)
                laid = layout.buckets(params, target.dp, layout.bucketing(args, target.dp, pp_rank, chunk, held))
                per_chunk.append(laid)
                by_name = {p.name: p for p in params}
                for b, bucket in enumerate(laid):
                    for state in STATES:
                        key = f"{prefix}.gbuf_idx_{chunk}.dtype_({dtypes}).bucket_idx_{b}.{state}"
                        items[key] = made.add((bucket.data_end,), torch.float32, partial(
                            deferred.bucket_windows, bucket, by_name, lambda k, s=state: optim[k][s]
                        ))
            items[f"{prefix}.optimizer/shard_0_1"] = [{"param_groups": groups}]
            items[f"{prefix}.per_bucket_numel/shard_0_1"] = [[{pair: [b.numel for b in laid]} for laid in per_chunk]]
            items[f"{prefix}.per_bucket_numel_unpadded/shard_0_1"] = [
                [{pair: [b.data_end for b in laid]} for laid in per_chunk]
            ]
    return items


def _rng_items(save: MegatronSave, target: Target, items: dict[str, Any]) -> dict[tuple[int, int], tuple[int, int]]:
    """One ``rng_state`` item per target (PP, TP) rank; where each came from."""
    source = save.rng
    if not source:
        return {}
    rng_from = {}
    for pp_rank in range(target.pp):
        for tp_rank in range(target.tp):
            taken = (pp_rank % save.pp, tp_rank % save.tp)
            rng_from[(pp_rank, tp_rank)] = taken
            items[f"rng_state/shard_{pp_rank}.{tp_rank}_{target.pp}.{target.tp}"] = source[taken]
    return rng_from


def _pickled(value: Any) -> bytes:
    """A byte item's value as ``torch.save`` writes it, by us: DCP's own path turns a dict's tuple keys (the
    buckets' ``(param dtype, grad dtype)``) into strings, which Megatron's load then refuses."""
    data = io.BytesIO()
    torch.save(value, data)
    return data.getvalue()


def _dcp_save(items: dict[str, Any], folder: Path, made: deferred.MadeAsWritten) -> dict[str, str]:
    """The items as a DCP checkpoint of one file, written by osdpipe's DCP writer (:mod:`osdpipe.io.formats.dcp_writer`:
    hashed as written): tensors whole (``made``'s placeholders filled as they are written), every other item a byte
    item of its own, stored as given (``bytes``: the carried items' stored bytes) or as ``torch.save`` of it. DCP's
    loaders read any number of files. Returns each file's digest, by name."""
    from osdpipe.io.formats import dcp_writer
    from osdpipe.io.torchfile import filled_as_written

    state = {
        key: value if isinstance(value, torch.Tensor) else dcp_writer.Stored(
            value if isinstance(value, bytes) else _pickled(value)
        )
        for key, value in items.items()
    }
    global_plan = dcp_writer.plan(lambda rank: state, 1)
    with filled_as_written(made):
        results, files, _ = dcp_writer.write_rank(folder, state, 0, global_plan)
    return {**files, ".metadata": dcp_writer.finish(folder, global_plan, [results])}
