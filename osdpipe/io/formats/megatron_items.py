"""What one target rank writes of a Megatron-LM ``torch_dist`` save, and what completes the save.

A rank writes, into the save's one DCP checkpoint (through osdpipe's DCP writer, :mod:`osdpipe.io.formats.dcp_writer`,
a file of its own), each tensor of its written layout (:func:`osdpipe.layout.megatron_grid.written_tensors`) as one
chunk of its item (:func:`~osdpipe.layout.megatron_grid.item_chunks`), and, as the first DP rank of its (PP, TP)
rank, the byte items Megatron keeps per model-parallel rank: its RNG states and, ``dp_reshardable``, the param groups
and each gradient buffer's bucket sizes. Rank 0 carries the linears' ``_extra_state`` items (keyed by global layer).
Every rank's items are known from the grid alone, so each plans the whole checkpoint without a collective
(:func:`plan`), as the DCP writer does for PyTorch's layouts.

What Megatron-LM decides from the parallelism is written for the target (:func:`target_common`): ``common.pt``'s
``args`` (the grid, the padded vocabulary, the sharding type, ``--no-save-optim`` for a save of the weights alone),
its ``content_metadata`` and the optimizer's common part; the rest of ``common.pt`` as the source had it. The RNG
states are one per target (PP, TP) rank: the source's where the grid is the same, else source rank (PP mod the
source's PP, TP mod the source's TP)'s (:func:`rng_source`), so each tensor-parallel rank keeps a distinct
model-parallel stream; the report says so.
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Mapping
from typing import Any

import torch

from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.dcp_writer import BoxShard, Stored
from osdpipe.io.formats.inert_load import Record
from osdpipe.layout import megatron as gpt_layout
from osdpipe.layout.megatron_grid import Grid, chunk_extents, chunk_states, item_chunks, state_item
from osdpipe.layout.ranges import WEIGHTS


def rng_source(grid: Grid, source_tp: int, source_pp: int, pp_rank: int, tp_rank: int) -> tuple[int, int]:
    """The source (PP, TP) rank whose RNG states target (``pp_rank``, ``tp_rank``) carries."""
    return pp_rank % source_pp, tp_rank % source_tp


def rank_items(
    grid: Grid,
    rank: int,
    weights_dtype: torch.dtype,
    state: Mapping[str, Mapping[str, Any]] | None,
    *,
    groups: list[dict[str, Any]] | None,
    rng: Mapping[tuple[int, int], bytes],
    source_grid: tuple[int, int],
    extra: Mapping[str, bytes],
) -> dict[str, Any]:
    """Target rank ``rank``'s items of the save, as the DCP writer saves them.

    Args:
        grid: the target's grid.
        rank: the target rank.
        weights_dtype: the model's weights' dtype (the optimizer's states are fp32).
        state: the rank's written tensors' states by layout key (:func:`~osdpipe.layout.megatron_grid.
            written_tensors`: the weights among them), ``None`` where only the plan is needed.
        groups: the optimizer's param groups as the save keeps them (no ``params``); ``None``: the weights alone.
        rng: the source's RNG states by its (PP, TP) rank, as stored.
        source_grid: the source's (TP, PP).
        extra: the linears' ``_extra_state`` items, as stored (rank 0 writes them).
    """
    pp_rank, dp_rank, tp_rank = grid.coordinates(rank)
    boxes: dict[str, list[tuple[Any, torch.Tensor | None]]] = {}  # each item's boxes this rank writes (a layer each)
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, chunk in item_chunks(grid, rank).items():
        for name in chunk_states(grid, chunk, weights_only=groups is None):
            item = state_item(chunk, name)
            local = None if state is None else state[key][name].reshape(chunk_extents(chunk))
            boxes.setdefault(item, []).append((chunk.box, local))
            shapes[item] = (chunk.shape, weights_dtype if name == WEIGHTS else torch.float32)
    items: dict[str, Any] = {
        item: BoxShard(shapes[item][0], tuple(b for b, _ in held), shapes[item][1],
                       None if state is None else tuple(v for _, v in held))
        for item, held in boxes.items()
    }
    if dp_rank == 0:
        source = rng_source(grid, *source_grid, pp_rank, tp_rank)
        if source in rng:
            items[f"rng_state/shard_{pp_rank}.{tp_rank}_{grid.pp}.{grid.tp}"] = Stored(
                None if state is None else rng[source])
    if groups is not None and grid.sharding == "dp_reshardable":
        dense, experts = optimizer_groups(grid, groups)
        if dp_rank == 0:
            items.update(_bucket_items(grid, pp_rank, tp_rank, 0, False, dense, planned=state is None))
        if grid.expert_parallel and grid.bucket_dp(dp_rank, True)[1] == 0:  # the first of its expert DP ranks
            items.update(_bucket_items(grid, pp_rank, tp_rank, grid.ep_rank(dp_rank), True, experts,
                                       planned=state is None))
    if rank == 0:
        items.update({flat: Stored(None if state is None else raw) for flat, raw in extra.items()})
    return items


def optimizer_groups(grid: Grid, groups: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The param groups of the target's dense optimizer and (expert parallelism) of its experts' optimizer, from the
    converted groups (``is_expert_parallel``: megatron-core's mark of the experts' group): at EP 1 the experts are
    dense parameters, so an experts' group is left out, its parameters in the dense group with weight decay
    (megatron-core makes one group of both there); over EP the experts' group is the source's, or, where the source
    had none (EP 1), the dense group with weight decay marked as the experts', as megatron-core makes it.

    Raises:
        InputError: an experts' group whose hyperparameters differ from the dense group they would join at EP 1
            (one line: the learning rate or weight decay a target of one group cannot keep).
    """
    dense = [g for g in groups if not g.get("is_expert_parallel")]
    experts = [g for g in groups if g.get("is_expert_parallel")]
    decayed = next((g for g in dense if float(g.get("wd_mult", 1.0)) != 0.0), None)
    if not grid.expert_parallel:
        for group in experts:
            if decayed is not None and _hyper(group) != _hyper(decayed):
                raise InputError(
                    f"target.ep_size=1 makes the experts dense parameters of the dense param group, but the save's "
                    f"experts' group ({_hyper(group)}) differs from it ({_hyper(decayed)}); "
                    "keep target.ep_size above 1")
        return dense, []
    if not experts and decayed is not None:
        experts = [{**decayed, "is_expert_parallel": True}]
    return dense, experts


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters and step: all but megatron-core's mark of the experts' group."""
    return {k: v for k, v in group.items() if k not in ("is_expert_parallel", "params")}


def _bucket_items(grid: Grid, pp_rank: int, tp_rank: int, ep_rank: int, expert: bool, groups: list[dict[str, Any]],
                  planned: bool) -> dict:
    """A ``dp_reshardable`` model-parallel rank's byte items of its dense optimizer (or, ``expert``, of the experts'
    optimizer of expert-parallel rank ``ep_rank``): the param groups (with ``step``), and each gradient buffer's
    bucket sizes, padded and unpadded, by its ``(param dtype, grad dtype)``, as megatron-core's load reads them."""
    prefix = grid.optimizer_prefix(pp_rank, tp_rank, ep_rank, expert)
    pair = tuple(getattr(torch, d.strip().removeprefix("torch.")) for d in grid.dtypes.split(","))
    laid = [grid.buckets(pp_rank, tp_rank, chunk, ep_rank, expert) for chunk in range(grid.vpp)]
    values = {
        f"{prefix}.optimizer/shard_0_1": [{"param_groups": groups}],
        f"{prefix}.per_bucket_numel/shard_0_1": [[{pair: [b.numel for b in buckets]} for buckets in laid]],
        f"{prefix}.per_bucket_numel_unpadded/shard_0_1": [[{pair: [b.data_end for b in buckets]} for buckets in laid]],
    }
    return {flat: Stored(None if planned else pickled(value)) for flat, value in values.items()}


def pickled(value: Any) -> bytes:
    """A byte item's value as ``torch.save`` writes it, by us: DCP's own path turns a dict's tuple keys (the buckets'
    ``(param dtype, grad dtype)``) into strings, which Megatron's load then refuses."""
    data = io.BytesIO()
    torch.save(value, data)
    return data.getvalue()


def target_args(args: Mapping[str, Any], grid: Grid, weights_only: bool) -> dict[str, Any]:
    """The source's ``args`` with the parallelism, and what Megatron-LM derives from it, set for ``grid``.

    Raises:
        InputError: the args hold an object of Megatron's own, which cannot be written back without it.
    """
    records = sorted(k for k, v in args.items() if isinstance(v, Record))
    if records:
        raise InputError(f"common.pt's args {', '.join(records)} hold Megatron objects, which osdpipe cannot write "
                         "back without Megatron: not supported yet")
    out = dict(args)
    out.update(
        tensor_model_parallel_size=grid.tp,
        pipeline_model_parallel_size=grid.pp,
        data_parallel_size=grid.dp,
        world_size=grid.world_size,
        padded_vocab_size=grid.gpt.padded_vocab_size,
        dist_ckpt_optim_fully_reshardable=grid.sharding == "fully_reshardable" and not weights_only,
        **gpt_layout.virtual_stage_args(grid.gpt.num_layers, grid.pp, grid.vpp),
    )
    if weights_only:  # what Megatron-LM's --no-save-optim --no-save-rng record, and its load reads
        out.update(no_save_optim=True, no_save_rng=True)
    if "expert_tensor_parallel_size" in out:
        out["expert_tensor_parallel_size"] = grid.tp
    if grid.gpt.num_experts or "expert_model_parallel_size" in out:
        out["expert_model_parallel_size"] = grid.ep
    return out


def target_common(
    common: Mapping[str, Any], grid: Grid, groups: list[dict[str, Any]] | None, iteration: int
) -> dict[str, Any]:
    """``common.pt`` for ``grid``: the source's, with the target's ``args``, the optimizer's param groups (``None``:
    the weights alone, without optimizer and scheduler entries) and sharding type."""
    weights_only = groups is None
    replaced = ("args", "optimizer", "content_metadata") + (("opt_param_scheduler",) if weights_only else ())
    out = {k: v for k, v in common.items() if k not in replaced}
    content = {**(common.get("content_metadata") or {})}
    if weights_only:
        content = {k: v for k, v in content.items() if not k.startswith("distrib_optim")}
    else:
        chained = optimizer_groups(grid, groups)
        parts = [{"optimizer": {"param_groups": g}} if grid.sharding == "fully_reshardable" else {} for g in chained]
        parts = [{**part, "param_state_sharding_type": grid.sharding} for part in parts]
        # a ChainedOptimizer of two (expert parallelism) saves each optimizer's part by its index
        out["optimizer"] = dict(enumerate(parts)) if grid.expert_parallel else parts[0]
        content["distrib_optim_sharding_type"] = grid.sharding
        if grid.sharding == "fully_reshardable":
            content.setdefault("distrib_optim_fully_reshardable_mem_efficient", False)
        else:
            content.pop("distrib_optim_fully_reshardable_mem_efficient", None)
    args = target_args(common["args"], grid, weights_only)
    out.update(args=argparse.Namespace(**args), iteration=iteration, content_metadata=content)
    return out
