"""flatten: decide, per local tensor of the target, which state it carries.

Original parameters that share an FSDP1 flat parameter share one state entry.
Their tensor state is concatenated (a parameter without state contributes
zeros, as FSDP1 does), and their scalar and non-tensor state must agree, since
one flat tensor can hold only one ``step``: a mismatch is an error, as in
PyTorch. No tensor bytes are read here; the result describes each local state
tensor (shape, dtype) for the shard stage to fill.
"""

from __future__ import annotations

from typing import Any

import torch

from osdpipe.io.formats import SourceMeta, TensorRef
from osdpipe.layout import kinds
from osdpipe.layout.ranges import LayoutSpec, LocalTensor
from osdpipe.layout.tree import ModuleTree
from osdpipe.run.context import Context
from osdpipe.run.products import Described, Flattened, Tally


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (
            torch.is_tensor(a)
            and torch.is_tensor(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool((a == b).all() | (a.isnan() & b.isnan()).all())
        )
    return type(a) is type(b) and a == b


def flat_entry(tensor: LocalTensor, meta: SourceMeta) -> dict[str, Any] | None:
    """The state of one local tensor: ``{name: TensorRef(local shape) | value}``, or ``None`` for no state.

    Raises:
        ValueError: when parameters sharing a flat parameter disagree in state
            names, tensor dtypes, or scalar state.
    """
    with_state = [f for f in tensor.fqns if any(tensor.holds(n) for n in meta.state.get(f) or ())]
    if not with_state or not tensor.stepped:
        return None
    names = {f: {n for n in meta.state[f] if tensor.holds(n)} for f in with_state}
    first = names[with_state[0]]
    if any(n != first for n in names.values()):
        detail = "; ".join(f"{f}: {sorted(n)}" for f, n in names.items())
        raise ValueError(
            f"parameters sharing flat parameter {tensor.key} have differing optimizer state names ({detail})"
        )
    entry: dict[str, Any] = {}
    for name in sorted(first):
        values = [meta.state[f][name] for f in with_state]
        if all(isinstance(v, TensorRef) for v in values):
            dtypes = {v.dtype for v in values}
            if len(dtypes) > 1:
                raise ValueError(
                    f"state {name!r} of the parameters in flat parameter {tensor.key} mixes dtypes {sorted(dtypes)}"
                )
            entry[name] = TensorRef(tensor.shape, dtypes.pop())
            continue
        if any(isinstance(v, TensorRef) for v in values):
            raise ValueError(f"state {name!r} is a tensor for some parameters of {tensor.key} and a scalar for others")
        if len(tensor.fqns) > 1 and (
            len(with_state) < len(tensor.fqns) or any(not _same(v, values[0]) for v in values)
        ):
            shown = {f: meta.state[f][name] if f in with_state else "<no state>" for f in tensor.fqns}
            raise ValueError(
                f"parameters sharing flat parameter {tensor.key} must have the same scalar state {name!r}, "
                f"but got {shown}; give every parameter of the unit the same state, or wrap them in different units"
            )
        entry[name] = values[0]
    return entry


def unmanaged_warning(tree: ModuleTree, spec: LayoutSpec) -> str | None:
    """A warning naming the parameters no FSDP unit of the target manages (``wrap_root=false``), if any."""
    unmanaged = kinds.get(spec.kind).unmanaged(tree, spec)
    if not unmanaged:
        return None
    shown = ", ".join(unmanaged[:8]) + (f" and {len(unmanaged) - 8} more" if len(unmanaged) > 8 else "")
    return (
        f"{len(unmanaged)} parameter(s) are outside every FSDP unit of the target: {shown}. Their state is converted "
        "whole on every rank; keeping them in step across ranks is left to you, as in the training job"
    )


def flatten(ctx: Context, source: Described, tally: Tally) -> Flattened:
    message = unmanaged_warning(ctx.tree, ctx.plan.target_spec) if ctx.id_keyed else None
    if message is not None:
        tally.warnings.append(message)  # the command prints the report's warnings
    entries = {}
    for tensor in ctx.target_layout():
        entry = flat_entry(tensor, source.meta)
        if entry is not None:
            entries[tensor.key] = entry
    return Flattened(source, entries)
