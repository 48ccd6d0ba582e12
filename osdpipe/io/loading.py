"""Loading a converted file into a job, checked before anything is loaded.

A param-ID keyed file names nothing: state 2 is whatever the optimizer's
third parameter is. A file converted for one wrapping loads without a word
into a job wrapped another way with as many parameters, and fails at the
first step (``size 16384 vs 8224``), or never fails when the shapes happen to
agree. So osdpipe's ``rank_local`` and ``plain`` files record, per param ID,
what its local tensor holds (:data:`PARAM_LAYOUT`), and :func:`check_fits`
holds every state tensor against the optimizer's parameter first: its local
shape, and the parameters it is made of, by FSDP1's own ``FlatParameter``
metadata where the parameter carries it, or by the model's parameter names
where a model is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from osdpipe.io.formats.base import local_part
from osdpipe.io.whole_rank_file import MODEL_PART, OPTIMIZER_PART, is_whole
from osdpipe.layout.kinds.fsdp2 import from_rank_local
from osdpipe.layout.optim import local_shape
from osdpipe.layout.ranges import DTENSOR_TABLE, LocalTensor
from osdpipe.layout.tree import WRAPPER_PARTS, WRAPPER_PREFIX, ModuleTree

#: The top-level key of a param-ID keyed file osdpipe writes that records, per
#: param ID, what the local tensor holds: ``{"key": its name (a parameter FQN,
#: or "<unit>._flat_param"), "fqns": [the parameters it is made of, in flat
#: order], "shapes": [their shapes], "local_shape": [the local tensor's shape]}``.
PARAM_LAYOUT = "param_layout"


class LayoutMismatch(ValueError):
    """A file's state does not fit the optimizer it is being loaded into: it was converted for another layout."""


def describe_layout(tensor: LocalTensor, tree: ModuleTree) -> dict[str, Any]:
    """The :data:`PARAM_LAYOUT` entry of a local tensor."""
    return {
        "key": tensor.key,
        "fqns": list(tensor.fqns),
        "shapes": [list(tree.param(f).shape) for f in tensor.fqns],
        "local_shape": list(tensor.shape),
    }


def without_records(osd: dict[str, Any]) -> dict[str, Any]:
    """``osd`` without the tables osdpipe adds to a param-ID keyed file: what ``optim.state_dict()`` itself holds."""
    return {k: v for k, v in osd.items() if k not in (PARAM_LAYOUT, DTENSOR_TABLE)}


def unwrapped_name(name: str) -> str:
    """A wrapped model's parameter name without the module names wrappers insert
    (FSDP1's, DDP's ``module.``, torch.compile's)."""
    parts = [p for p in name.split(".") if p not in WRAPPER_PARTS]
    while parts[:1] == [WRAPPER_PREFIX] and len(parts) > 1:
        parts = parts[1:]
    return ".".join(parts)


def check_fits(
    optim: torch.optim.Optimizer, osd: dict[str, Any], *, model: nn.Module | None = None, where: str = "the file"
) -> None:
    """Raise :class:`LayoutMismatch` unless every state of ``osd`` fits the parameter of ``optim`` its param ID names.

    Checked for every param ID with state: the parameter exists; every state
    tensor has the parameter's local shape; and where ``osd`` records what
    the ID holds (:data:`PARAM_LAYOUT`): that the local shape is the recorded
    one, that an FSDP1 ``FlatParameter`` is made of the recorded parameters
    (its ``_fqns`` and ``_shapes``), and, with ``model``, that the parameter's
    name is the recorded one.
    """
    params = [p for g in optim.param_groups for p in g["params"]]
    names = {id(p): unwrapped_name(n) for n, p in model.named_parameters()} if model is not None else {}
    records = osd.get(PARAM_LAYOUT) or {}
    fix = (
        "it was converted for another layout: "
        "convert the checkpoint to this job's layout (target.* as this job wraps its model)"
    )
    for pid, state in osd.get("state", {}).items():
        if not isinstance(pid, int):
            continue
        if pid >= len(params):
            raise LayoutMismatch(
                f"{where}: param ID {pid} has state, but the optimizer holds {len(params)} parameter(s); {fix}"
            )
        param, record = params[pid], records.get(pid)
        holds = f" ({record['key']}: {_show_fqns(record['fqns'])})" if record else ""
        here = local_shape(param)
        for name, value in state.items():
            local = local_part(value)
            if torch.is_tensor(local) and local.dim() > 0 and tuple(local.shape) != here:
                raise LayoutMismatch(
                    f"{where}: param ID {pid}{holds}: state {name!r} has shape {tuple(local.shape)}, "
                    f"but the optimizer's parameter {pid} {_named(names, param)}has local shape {here}; {fix}"
                )
        if record:
            _check_record(pid, record, param, here, names, where, fix)


def _check_record(
    pid: int,
    record: dict[str, Any],
    param: torch.Tensor,
    here: tuple[int, ...],
    names: dict[int, str],
    where: str,
    fix: str,
) -> None:
    """The parameter against what the file says param ID ``pid`` holds."""
    said = f"{where}: param ID {pid} holds {record['key']} ({_show_fqns(record['fqns'])})"
    if tuple(record["local_shape"]) != here:
        raise LayoutMismatch(
            f"{said} as a local tensor of shape {tuple(record['local_shape'])}, "
            f"but the optimizer's parameter {pid} has {here}; {fix}"
        )
    # FSDP1's FlatParameter: the parameters it flattens, named within its unit
    flat_fqns = getattr(param, "_fqns", None)
    if flat_fqns is not None:
        shapes = [tuple(s) for s in getattr(param, "_shapes", [])]
        recorded = list(zip(record["fqns"], (tuple(s) for s in record["shapes"])))
        theirs = list(zip(flat_fqns, shapes))
        fits = len(recorded) == len(theirs) and all(
            (fqn == rel or fqn.endswith(f".{rel}")) and shape == their_shape
            for (fqn, shape), (rel, their_shape) in zip(recorded, theirs)
        )
        if not fits:
            raise LayoutMismatch(
                f"{said}, but the optimizer's parameter {pid} is an FSDP unit's flat parameter "
                f"of {_show_fqns(list(flat_fqns))} with shapes {shapes[:4]}{' ...' if len(shapes) > 4 else ''}; {fix}"
            )
    name = names.get(id(param))
    if name is not None and name != record["key"]:
        raise LayoutMismatch(f"{said}, but the optimizer's parameter {pid} is the model's {name}; {fix}")


def _named(names: dict[int, str], param: torch.Tensor) -> str:
    name = names.get(id(param))
    return f"({name}) " if name else ""


def _show_fqns(fqns: list[str]) -> str:
    return ", ".join(fqns[:3]) + (f" and {len(fqns) - 3} more" if len(fqns) > 3 else "")


def load_rank_local(optim: torch.optim.Optimizer, path: str | Path, model: nn.Module | None = None) -> None:
    """Load a ``rank_local`` file osdpipe wrote for this rank into ``optim``, whatever the kind:
    the one call a resuming job makes.

    The file is read with ``weights_only=True`` and checked against the
    optimizer before anything is loaded (:func:`check_fits`; pass ``model``
    to have each parameter's name checked too). DTensor state (FSDP2) is
    rebuilt on the optimizer's parameters; other state loads as it is.

    A whole checkpoint's file (``{"model": ..., "optim": ..., ...}``) loads its
    optimizer part so, and, given ``model``, its model part too: each
    parameter's and buffer's local piece, checked by name and shape first
    (:func:`fitting_model`). The other entries are the caller's to take
    from the file (``torch.load(path, weights_only=True)``).

    Raises:
        LayoutMismatch: the file was converted for another layout (one line naming the param ID, both shapes or
            compositions).
    """
    load_rank_state(optim, torch.load(path, map_location="cpu", weights_only=True), str(path), model)


def load_rank_state(
    optim: torch.optim.Optimizer, loaded: dict[str, Any], where: str, model: nn.Module | None = None
) -> None:
    """Load one rank's state as a ``rank_local`` file holds it (``loaded``, read from ``where``) into ``optim`` (and
    ``model``), as :func:`load_rank_local` does: for a framework's own files put in that form (veRL's)."""
    osd, pieces = (loaded[OPTIMIZER_PART], loaded[MODEL_PART]) if is_whole(loaded) else (loaded, None)
    check_fits(optim, osd, model=model, where=where)
    # both parts checked before either loads
    targets = fitting_model(model, pieces, where) if pieces is not None and model is not None else None
    optim.load_state_dict(from_rank_local(optim, {k: v for k, v in osd.items() if k != PARAM_LAYOUT}))
    if targets is not None:
        _copy_into(targets, pieces)


def _local_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The live model's state by its unwrapped names, each as this rank's local tensor (a DTensor's local piece)."""
    return {unwrapped_name(name): local_part(value) for name, value in model.state_dict(keep_vars=True).items()}


def fitting_model(model: nn.Module, pieces: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """This rank's live tensor for each of a whole checkpoint's model pieces, by name, once the pieces are found to fit.

    Raises:
        LayoutMismatch: the part's names or local shapes are not this rank's model's (converted for another model or
            layout), naming the first that differs and what to do.
    """
    own = _local_model(model)
    missing, unexpected = sorted(set(own) - set(pieces)), sorted(set(pieces) - set(own))
    if missing or unexpected:
        raise LayoutMismatch(
            f"{where}: the model part holds {_show_fqns(unexpected) or 'nothing else'} "
            f"where the model has {_show_fqns(missing) or 'nothing else'}; "
            "it was converted for another model"
        )
    for name, piece in pieces.items():
        if tuple(piece.shape) != tuple(own[name].shape) or piece.dtype != own[name].dtype:
            raise LayoutMismatch(
                f"{where}: the model part's {name} is {piece.dtype} {list(piece.shape)} but this rank's parameter is "
                f"{own[name].dtype} {list(own[name].shape)}; "
                "the file was converted for another layout: convert again with this job's target.*"
            )
    return own


def load_model_local(model: nn.Module, pieces: dict[str, torch.Tensor], where: str) -> None:
    """Copy each local piece of a whole checkpoint's model part into this rank's live model,
    in place (no collective: each rank its own).

    Raises:
        LayoutMismatch: as :func:`fitting_model`.
    """
    _copy_into(fitting_model(model, pieces, where), pieces)


def _copy_into(targets: dict[str, torch.Tensor], pieces: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, piece in pieces.items():
            targets[name].copy_(piece.to(targets[name].device))
