"""Optimizers as the config describes them, and which parameter gets which ID.

``optim.name`` is any optimizer class of ``torch.optim`` by name, or a user's
own ``package.module:Class``; :func:`resolve_optimizer` turns it into the class
for both the config check and :func:`build_optimizer`. Conversion never looks
at state names: whatever tensor and scalar state the optimizer keeps travels.

An optimizer keys its state by the position of each parameter in its param
groups, concatenated: *not* by ``named_parameters()`` order. Both building a
real optimizer and rekeying a converted state go through
:func:`group_members` (:func:`pattern_members` for the groups of a
param-ID keyed input), so the IDs osdpipe writes are the IDs the target
optimizer assigns.
"""

from __future__ import annotations

import fnmatch
import importlib
import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from osdpipe.layout.ranges import LocalTensor, select_params

if TYPE_CHECKING:  # annotations only: the config's validators import this module
    from osdpipe.spec.config import OptimConfig


#: Optimizers of ``torch.optim`` that osdpipe cannot drive, and why.
REFUSED_OPTIMIZERS = {
    "LBFGS": "it needs a closure that re-evaluates the loss and keeps one history over all its parameters together, "
    "which no per-parameter layout can split or reshard",
    "SparseAdam": "it needs sparse gradients, which FSDP's flat parameters never have",
}


def torch_optimizers() -> list[str]:
    """The optimizer classes of ``torch.optim`` by name (subclasses of ``Optimizer``),
    less :data:`REFUSED_OPTIMIZERS`."""
    names = []
    for name in dir(torch.optim):
        value = getattr(torch.optim, name)
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer:
            names.append(name)
    return sorted(n for n in names if n not in REFUSED_OPTIMIZERS)


def resolve_optimizer(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class ``optim.name`` names: a class of ``torch.optim``, or ``package.module:Class``.

    Raises:
        ValueError: one line naming the value and the fix: an unknown or
            refused name, a module that does not import, or a class that is
            not a ``torch.optim.Optimizer``.
    """
    if name == "auto":
        raise ValueError(
            "optim.name=auto: the input's optimizer could not be read from its files; "
            "set optim.name (Adam, AdamW, SGD, ...)"
        )
    if name in REFUSED_OPTIMIZERS:
        raise ValueError(f"torch.optim.{name} cannot be converted: {REFUSED_OPTIMIZERS[name]}")
    if ":" not in name:
        known = torch_optimizers()
        if name not in known:
            raise ValueError(
                f"{name!r} is not an optimizer of torch.optim ({', '.join(known)}); "
                "name your own as package.module:Class"
            )
        return getattr(torch.optim, name)
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{name!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"{name!r}: module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"{name!r} is {cls!r}, not a subclass of torch.optim.Optimizer")
    return cls


def optimizer_label(name: str) -> str:
    """How messages name the optimizer: ``torch.optim.Adam``, or ``package.module:Class`` as given."""
    return name if ":" in name else f"torch.optim.{name}"


def accepted_hyperparameters(cls: type[torch.optim.Optimizer]) -> set[str] | None:
    """The keyword arguments ``cls.__init__`` takes besides its first (the parameters);
    ``None``: any (it has ``**kwargs``)."""
    parameters = list(inspect.signature(cls).parameters.values())[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def group_members(cfg: OptimConfig, layout: tuple[LocalTensor, ...]) -> list[list[int]]:
    """For each param group of ``cfg``, the indices into ``layout`` (``model.parameters()`` order) of its parameters.

    See :func:`pattern_members`; the groups are ``optim.param_groups``.
    """
    return pattern_members([g.params for g in cfg.param_groups] or None, layout)


def pattern_members(
    groups: list[list[str]] | None, layout: tuple[LocalTensor, ...], where: str = "optim.param_groups"
) -> list[list[int]]:
    """For each group of FQN patterns, the indices into ``layout`` (``model.parameters()`` order) of its parameters.

    Without groups (``None`` or empty) there is one group over all parameters,
    in order. With groups, each takes the parameters its patterns match (a
    flat parameter matches when one of its original parameters does);
    parameters no group matches are left out of the optimizer.

    Args:
        groups: the ``fnmatch`` patterns of each param group.
        layout: the local tensors of one rank.
        where: the config key the groups come from, for error messages.

    Raises:
        ValueError: if a parameter falls into two groups or a group matches nothing.
    """
    if not groups:
        return [list(range(len(layout)))]
    index = {t.key: i for i, t in enumerate(layout)}
    members_of, seen = [], {}
    for g, patterns in enumerate(groups):
        members = [index[t.key] for t in select_params(list(layout), patterns)]
        if not members and layout:  # a rank that holds nothing (a full output's other ranks) has empty groups
            raise ValueError(f"{where}[{g}].params={patterns} matches no parameter of the wrapped model")
        for i in members:
            if i in seen:
                raise ValueError(
                    f"{layout[i].key} (holding {', '.join(layout[i].fqns[:3])}"
                    f"{'...' if len(layout[i].fqns) > 3 else ''}) "
                    f"is in {where}[{seen[i]}] and [{g}]; a parameter can be in one group only"
                    + (
                        "; with use_orig_params=false a flat parameter moves as a whole"
                        if len(layout[i].fqns) > 1
                        else ""
                    )
                )
            seen[i] = g
        members_of.append(members)
    return members_of


def local_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of this rank's piece of ``param``: its local tensor's for a DTensor (FSDP2), else its own."""
    return tuple(param.to_local().shape if hasattr(param, "to_local") else param.shape)


def check_matches_layout(params: list[nn.Parameter], layout: tuple[LocalTensor, ...]) -> None:
    """Raise unless ``params`` (a wrapped model's ``parameters()``) are the local tensors ``layout`` describes."""
    shapes = [local_shape(p) for p in params]
    if len(params) != len(layout) or any(shape != t.shape for shape, t in zip(shapes, layout)):
        raise ValueError(
            "the wrapped model does not have the expected layout: its parameters have shapes "
            f"{shapes[:6]}..., the layout {[t.shape for t in layout][:6]}...; "
            "is the layout (world_size, wrap, use_orig_params, sharding_strategy) how this model was wrapped?"
        )


def build_optimizer(cfg: OptimConfig, model: nn.Module, layout: tuple[LocalTensor, ...]) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` describes over the wrapped ``model`` whose parameters ``layout`` describes."""
    params = list(model.parameters())
    check_matches_layout(params, layout)
    param_groups: list[dict[str, Any]] = []
    for members, group in zip(group_members(cfg, layout), cfg.param_groups or [None]):
        options = group.options if group is not None else {}
        param_groups.append({"params": [params[i] for i in members], **options})
    return resolve_optimizer(cfg.name)(param_groups, lr=cfg.learning_rate, **cfg.kwargs)


def options_for(cfg: OptimConfig, fqn: str) -> dict[str, Any]:
    """The configured options (``optim.param_groups[i]``'s hyperparameters)
    of the group parameter ``fqn`` falls in ({} for none)."""
    for group in cfg.param_groups:
        if any(fnmatch.fnmatchcase(fqn, pattern) for pattern in group.params):
            return group.options
    return {}


def bare_optimizer(cfg: OptimConfig, groups: list[tuple[str, list[torch.Tensor]]]) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` describes over bare tensors:
    one param group per ``(fqn, tensors)``, with the options of ``fqn``'s configured group.

    What stands in for the target's optimizer where no wrapped model exists
    (the ``resume`` check's reference, and its bare targets); loading a
    state dict then sets the hyperparameters it carries.
    """
    param_groups = [{"params": tensors, **options_for(cfg, fqn)} for fqn, tensors in groups]
    return resolve_optimizer(cfg.name)(param_groups, lr=cfg.learning_rate, **cfg.kwargs)
