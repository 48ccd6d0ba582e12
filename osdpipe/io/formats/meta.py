"""A source's metadata keyed by the model's canonical parameter names, and checked against the model.

Every reader names parameters as its checkpoint does (``module.x``,
``_orig_mod.x``, a tied alias); everything after reading speaks canonical
FQNs. Used by the broadcast stage and by :func:`osdpipe.io.formats.inspect_source`
before any process starts.
"""

from __future__ import annotations

import torch

from osdpipe.io.formats.base import InputError, SourceMeta, TensorRef
from osdpipe.layout.tree import ModuleTree


def canonical_meta(meta: SourceMeta, tree: ModuleTree, where: str | None = None) -> SourceMeta:
    """Key the source state by canonical parameter FQNs and check it against the model.

    Checked: every FQN with state, and every FQN the source's param groups
    list, is a parameter of the model; every state tensor has its parameter's
    shape, and a floating state tensor its parameter's dtype.

    Args:
        meta: the source's metadata, as its reader gives it.
        tree: the model's module tree.
        where: the input's path, to open each message with (``None``: messages name no file).

    Raises:
        InputError: for state of a parameter the model does not have, a
            tensor whose shape or dtype differs from its parameter's, or param
            groups that name a parameter the model does not have.
    """
    hint = "is model.factory / model.kwargs the model that saved it?"
    at = f"{where}: " if where else ""
    state: dict[str, dict] = {}
    names: dict[str, str] = {}
    for fqn, entries in meta.state.items():
        param = tree.resolve(fqn) if isinstance(fqn, str) else None
        if param is None:
            raise InputError(f"{at}the source has state for {fqn!r}, which model has no parameter of that name; {hint}")
        if param.fqn in state:
            raise InputError(
                f"{at}the source has state for {param.fqn!r} twice, "
                f"as {names.get(param.fqn, param.fqn)!r} and {fqn!r}; {hint}"
            )
        if fqn != param.fqn:
            names[param.fqn] = fqn
        for name, value in entries.items():
            if not isinstance(value, TensorRef):
                continue
            if value.shape != param.shape:
                raise InputError(
                    f"{at}source state {fqn}.{name} has shape {value.shape} but the parameter has shape {param.shape}; "
                    f"{hint}"
                )
            dtype = getattr(torch, value.dtype, None)
            if (isinstance(dtype, torch.dtype) and dtype.is_floating_point
                    and value.dtype not in (param.dtype, meta.state_dtype)):
                raise InputError(
                    f"{at}source state {fqn}.{name} is {value.dtype} but the parameter is {param.dtype}, "
                    f"and an optimizer keeps floating state in its parameter's dtype; {hint}"
                )
        state[param.fqn] = entries
    groups = None
    if meta.param_groups is not None:
        groups = []
        for i, group in enumerate(meta.param_groups):
            params = group.get("params") if isinstance(group, dict) else None
            if not isinstance(params, list):
                raise InputError(
                    f"{at}the source's param group {i} has no 'params' list; its param_groups are not an optimizer's"
                )
            resolved = [tree.resolve(f) if isinstance(f, str) else None for f in params]
            unknown = next((f for f, p in zip(params, resolved) if p is None), None)
            if unknown is not None:
                raise InputError(
                    f"{at}the source's param_groups name {unknown!r}, which model has no parameter of that name; {hint}"
                )
            groups.append({**group, "params": [p.fqn for p in resolved]})
    return SourceMeta(
        state=state,
        param_groups=groups,
        extra=meta.extra,
        names={**meta.names, **names},
        buffers=meta.buffers,
        carried=meta.carried,
        notes=meta.notes,
        state_dtype=meta.state_dtype,
    )
