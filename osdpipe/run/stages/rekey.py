"""rekey: key the converted state the way the target loads it.

For ``rank_local`` and ``plain`` output, state is keyed by parameter ID (and
DTensor parameters' placements are listed, see
:data:`osdpipe.layout.ranges.DTENSOR_TABLE`): the position in the
target optimizer's param groups (see :func:`osdpipe.layout.optim.group_members`),
never ``named_parameters()`` order. Param groups keep the source's
hyperparameters, as PyTorch's ``optim_state_dict_to_load`` does, and each must
hold exactly the parameters of the target's group, else the target optimizer
would silently pair state with the wrong parameters. Every tensor is checked
against the shape of the parameter it is keyed to.

For ``fsdp_full`` and ``dcp`` output, state stays keyed by canonical FQN and
each param group lists FQNs in the target optimizer's order, as
``FSDP.optim_state_dict`` on the target reports them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from osdpipe.io.formats import SourceMeta
from osdpipe.io.formats.base import WEIGHTS
from osdpipe.io.loading import PARAM_LAYOUT, describe_layout
from osdpipe.io.weights import split_weights
from osdpipe.layout.ranges import DTENSOR_TABLE, LocalTensor
from osdpipe.run.context import Context
from osdpipe.run.products import Keyed, Sharded, Tally


def _check_shapes(tensor: LocalTensor, state: dict[str, Any], key: Any) -> None:
    for name, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != tensor.shape:
            raise ValueError(
                f"state {name!r} for {tensor.key} (key {key}) has shape {tuple(value.shape)}, "
                f"but the target parameter has {tensor.shape}"
            )


def _param_groups(
    meta: SourceMeta,
    layout: tuple[LocalTensor, ...],
    groups: list[list[int]],
    params_of: Callable[[list[int]], list[Any]],
) -> list[dict[str, Any]] | None:
    """The source's param groups, each holding its target group's parameters as ``params_of`` names them.

    Hyperparameters come from the source, as PyTorch keeps them. Group ``g``
    of the source must hold the same parameters as group ``g`` of the target
    optimizer (as far as the target optimizer holds them), else loading would
    pair hyperparameters with the wrong parameters.
    """
    if meta.param_groups is None:
        return None
    if len(meta.param_groups) != len(groups):
        raise ValueError(
            f"the source has {len(meta.param_groups)} param group(s) but the target optimizer has {len(groups)}; "
            "set optim.param_groups to the source's grouping"
        )
    held = {f for g in groups for i in g for f in layout[i].fqns}
    out = []
    for g, (source_group, members) in enumerate(zip(meta.param_groups, groups)):
        target_fqns = {f for i in members for f in layout[i].fqns}
        source_fqns = set(source_group["params"]) & held
        if source_fqns != target_fqns:
            raise ValueError(
                f"param group {g}: the source's group holds {sorted(source_fqns - target_fqns)[:4]} "
                "that the target's does not, "
                f"and the target's holds {sorted(target_fqns - source_fqns)[:4]} that the source's does not; "
                "set optim.param_groups so the groups hold the same parameters"
            )
        group = copy.deepcopy(source_group)
        group["params"] = params_of(members)
        out.append(group)
    return out


def param_ids(ctx: Context) -> dict[str, int]:
    """Layout key -> the target optimizer's param ID, for every tensor of this rank's layout the optimizer holds."""
    layout = ctx.target_layout()
    return {layout[i].key: pid for pid, i in enumerate(i for g in ctx.plan.target_groups(layout) for i in g)}


def id_keyed(ctx: Context, sharded: Sharded, converted: dict[str, dict[str, Any]]) -> Keyed:
    """This rank's optimizer state (``converted``: by layout key) keyed by the target optimizer's parameter IDs."""
    layout = ctx.target_layout()
    groups = ctx.plan.target_groups(layout)
    ids = param_ids(ctx)
    state, keys = {}, {}
    for tensor in layout:
        if tensor.key in converted and tensor.key in ids:
            _check_shapes(tensor, converted[tensor.key], ids[tensor.key])
            state[ids[tensor.key]] = converted[tensor.key]
            keys[tensor.key] = ids[tensor.key]
    out: dict[str, Any] = {"state": dict(sorted(state.items()))}
    param_groups = _param_groups(
        sharded.source.meta, layout, groups, lambda members: sorted(ids[layout[i].key] for i in members)
    )
    if param_groups is not None:
        out["param_groups"] = param_groups
    table = dtensor_table(ctx, layout, ids, out["state"])
    if table:
        out[DTENSOR_TABLE] = table
    # What each ID holds, so that loading can check the file against
    # the optimizer before anything is loaded (osdpipe.io.loading).
    out[PARAM_LAYOUT] = {ids[t.key]: describe_layout(t, ctx.tree) for t in layout if ids.get(t.key) in out["state"]}
    return Keyed(sharded, out, keys)


def dtensor_table(
    ctx: Context, layout: tuple[LocalTensor, ...], ids: dict[str, int], state: dict[int, dict[str, Any]]
) -> dict[int, Any]:
    """Per param ID with tensor state,
    how the target's DTensor parameter lies on its mesh (FSDP2; see :data:`DTENSOR_TABLE`)."""
    table = {}
    for tensor in layout:
        pid = ids.get(tensor.key)
        if tensor.placement is not None and any(
            torch.is_tensor(v) and v.dim() > 0 for v in state.get(pid, {}).values()
        ):
            table[pid] = tensor.placement.describe(ctx.tree.param(tensor.key).shape)
    return dict(sorted(table.items()))


def fqn_keyed(ctx: Context, sharded: Sharded, converted: dict[str, dict[str, Any]]) -> Keyed:
    """This rank's optimizer state (``converted``: by layout key) keyed by canonical FQN;
    param groups list FQNs in the target optimizer's order."""
    meta = sharded.source.meta
    state, keys = {}, {}
    for tensor in ctx.target_layout():
        if tensor.key in converted:
            _check_shapes(tensor, converted[tensor.key], tensor.key)
            state[tensor.key] = converted[tensor.key]
            keys[tensor.key] = tensor.key
    out: dict[str, Any] = {"state": {**state, **meta.extra}}
    optimizer_layout = ctx.optimizer_layout()
    groups = ctx.plan.target_groups(optimizer_layout)
    param_groups = _param_groups(
        meta, optimizer_layout, groups, lambda members: [f for i in members for f in optimizer_layout[i].fqns]
    )
    if param_groups is not None:
        out["param_groups"] = param_groups
    return Keyed(sharded, out, keys)


def rekey(ctx: Context, sharded: Sharded, tally: Tally) -> Keyed:
    """Key the optimizer's state as the target loads it;
    a whole checkpoint's model weights come out of it, by layout key (:mod:`osdpipe.io.weights`)."""
    if sharded.source.meta.carried is None:
        return id_keyed(ctx, sharded, sharded.state) if ctx.id_keyed else fqn_keyed(ctx, sharded, sharded.state)
    optimizer, weights = split_weights(sharded.state)
    for tensor in ctx.target_layout():
        if tensor.key in weights:
            _check_shapes(tensor, {WEIGHTS: weights[tensor.key]}, tensor.key)
    keyed = id_keyed(ctx, sharded, optimizer) if ctx.id_keyed else fqn_keyed(ctx, sharded, optimizer)
    return dataclasses.replace(keyed, weights=weights)
