"""What several checks share: the whole source or output on every rank, the live target job, the size limit."""

from __future__ import annotations

import math
from typing import Any

import torch

from osdpipe import kinds
from osdpipe.collective import from_rank0, gather_to_all
from osdpipe.context import Context
from osdpipe.formats import full_state, TensorRef
from osdpipe.reference import live_target
from osdpipe.sizes import show_size


def source_tensor_bytes(ctx: Context) -> int:
    """The bytes of the source's tensor state (what a check holding the whole state holds on every rank)."""
    assert ctx.meta is not None
    return sum(math.prod(v.shape) * v.torch_dtype.itemsize for entries in ctx.meta.state.values() for v in entries.values() if isinstance(v, TensorRef))


def within_full_state_limit(ctx: Context) -> bool:
    limit = ctx.spec.pipeline.full_state_checks_max
    return limit is None or source_tensor_bytes(ctx) <= limit


def full_source(ctx: Context) -> dict[str, Any]:
    """The whole source as a full FQN-keyed state dict (for PyTorch's reference conversion)."""
    assert ctx.meta is not None and ctx.reader is not None
    return full_state(ctx.reader, ctx.meta)


def full_output(ctx: Context) -> dict[str, Any]:
    """The FQN-keyed output gathered to full tensors on every rank (``fsdp_full`` or ``dcp``)."""
    assert ctx.result is not None
    if ctx.output_format.one_writer:  # rank 0 holds it all
        return from_rank0("verify", lambda: ctx.result)
    pieces = gather_to_all(ctx.result["state"])
    state: dict[str, dict[str, Any]] = {}
    for fqn in pieces[0]:
        state[fqn] = {}
        for name, value in pieces[0][fqn].items():
            if torch.is_tensor(value) and value.dim() > 0:
                state[fqn][name] = torch.cat([p[fqn][name] for p in pieces if fqn in p and p[fqn][name].numel()], dim=0)
            else:
                state[fqn][name] = value
    return {**ctx.result, "state": state}


def live_target_of(ctx: Context) -> tuple[Any, Any]:
    """This rank's live target model and optimizer, built once per context."""
    if ctx.live is None:
        ctx.live = live_target(ctx.spec, ctx.spec.target.spec(), ctx.tree, ctx.rank)
    return ctx.live


def loadable(ctx: Context) -> dict[str, Any]:
    """What this rank's target optimizer loads from the output."""
    assert ctx.result is not None
    if ctx.id_keyed:
        return ctx.result
    model, optim = live_target_of(ctx)
    return kinds.get(ctx.spec.target.kind).to_load(model, optim, full_output(ctx))


def with_groups(loadable: dict[str, Any], optim: Any) -> dict[str, Any]:
    """A source without param groups converts to state only (as PyTorch's own conversion does); load_state_dict needs
    groups, so the target's own are what a resuming job pairs it with."""
    if "param_groups" not in loadable:
        loadable["param_groups"] = optim.state_dict()["param_groups"]
    return loadable


def needs_target_world(ctx: Context) -> str | None:
    """Why a check that loads into a live target job with the whole source (``reference``, ``load_step``) cannot run here, or ``None``."""
    if not ctx.world.builds_target:
        return "needs a live target world (runtime.mode=online)"
    if ctx.spec.runtime.transfer == "scatter":
        return "needs the whole source on every rank, which runtime.transfer=scatter does not read everywhere"
    limit, size = ctx.spec.pipeline.full_state_checks_max, source_tensor_bytes(ctx)
    if limit is not None and size > limit:
        return (
            f"needs the whole state on every rank or a live target model, and the source holds {show_size(size)} of tensor state, over "
            f"pipeline.full_state_checks_max={show_size(limit)}: raise it (or set it to null) to run it"
        )
    return None

