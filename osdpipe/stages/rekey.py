"""rekey: key the converted state the way the target loads it.

For ``rank_local`` and ``plain`` output, state is keyed by parameter ID: the position in the
target optimizer's param groups (see :func:`osdpipe.optim.group_members`),
never ``named_parameters()`` order. Param groups keep the source's
hyperparameters, as PyTorch's ``optim_state_dict_to_load`` does, and each must
hold exactly the parameters of the target's group, else the target optimizer
would silently pair state with the wrong parameters. Every tensor is checked
against the shape of the parameter it is keyed to.

For ``fsdp_full`` and ``dcp`` output, state stays keyed by canonical FQN.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from osdpipe.context import Context
from osdpipe.layout import LocalTensor
from osdpipe.stages import stage


def _check_shapes(tensor: LocalTensor, state: dict[str, Any], key: Any) -> None:
    for name, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != tensor.shape:
            raise ValueError(f"state {name!r} for {tensor.key} (key {key}) has shape {tuple(value.shape)}, but the target parameter has {tensor.shape}")


def id_keyed(ctx: Context) -> dict[str, Any]:
    """This rank's state keyed by the target optimizer's parameter IDs."""
    assert ctx.meta is not None
    layout = ctx.target_layout()
    groups = ctx.target_groups(layout)
    ids = {layout[i].key: pid for pid, i in enumerate(i for g in groups for i in g)}
    fqn_to_id = {f: ids[t.key] for t in layout if t.key in ids for f in t.fqns}
    state = {}
    for tensor in layout:
        if tensor.key in ctx.local_state and tensor.key in ids:
            _check_shapes(tensor, ctx.local_state[tensor.key], ids[tensor.key])
            state[ids[tensor.key]] = ctx.local_state[tensor.key]
            ctx.result_keys[tensor.key] = ids[tensor.key]
    target_groups = [sorted(ids[layout[i].key] for i in g) for g in groups]
    if ctx.meta.param_groups is None:
        return {"state": dict(sorted(state.items()))}
    if len(ctx.meta.param_groups) != len(target_groups):
        raise ValueError(
            f"the source has {len(ctx.meta.param_groups)} param group(s) but the target optimizer has {len(target_groups)}; "
            "set optim.param_groups to the source's grouping"
        )
    param_groups = []
    for g, (source_group, target_ids) in enumerate(zip(ctx.meta.param_groups, target_groups)):
        group = copy.deepcopy(source_group)
        group["params"] = sorted({fqn_to_id[f] for f in source_group["params"] if f in fqn_to_id})
        if group["params"] != target_ids:
            raise ValueError(
                f"param group {g}: the source's parameters map to IDs {group['params']} but the target optimizer's group {g} "
                f"holds {target_ids}; set optim.param_groups so the groups hold the same parameters"
            )
        param_groups.append(group)
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def fqn_keyed(ctx: Context) -> dict[str, Any]:
    """This rank's state keyed by canonical FQN, with the source's param groups."""
    assert ctx.meta is not None
    state = {}
    for tensor in ctx.target_layout():
        if tensor.key in ctx.local_state:
            _check_shapes(tensor, ctx.local_state[tensor.key], tensor.key)
            state[tensor.key] = ctx.local_state[tensor.key]
            ctx.result_keys[tensor.key] = tensor.key
    out: dict[str, Any] = {"state": {**state, **ctx.meta.extra}}
    if ctx.meta.param_groups is not None:
        out["param_groups"] = copy.deepcopy(ctx.meta.param_groups)
    return out


@stage("rekey")
def rekey(ctx: Context) -> None:
    ctx.result = id_keyed(ctx) if ctx.id_keyed else fqn_keyed(ctx)
