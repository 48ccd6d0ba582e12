"""``load_step``: the target optimizer loads the result and takes a step on synthetic gradients;
what was finite stays finite."""

from __future__ import annotations

import copy
from typing import Any

import torch

from osdpipe.layout import kinds
from osdpipe.layout.ranges import LocalTensor
from osdpipe.run.live_jobs import train_step
from osdpipe.run.products import CheckResult
from osdpipe.verify.checks.common import Subject, live_target_of, loadable, needs_target_world, with_groups


def _nonfinite(value: Any) -> torch.Tensor | None:
    """Where this rank's piece of a floating state tensor is NaN or infinite
    (``None``: nowhere, or not a floating tensor)."""
    if hasattr(value, "to_local"):  # a DTensor (FSDP2): this rank's elements, without a collective
        value = value.to_local()
    if not (torch.is_tensor(value) and (value.is_floating_point() or value.is_complex())):
        return None
    mask = ~torch.isfinite(value.detach())
    return mask.cpu() if bool(mask.any()) else None


def _named(tensor: LocalTensor, name: str, mask: torch.Tensor) -> list[str]:
    """``"<fqn> <name> (<n> elements)"`` for each parameter of ``tensor`` with elements in ``mask``.

    A per-element state maps to parameters through the layout's segments (the
    rest is padding); a scalar state is shared by every parameter of the tensor.
    """
    if mask.numel() != tensor.numel or mask.dim() == 0:
        shown = ", ".join(tensor.fqns[:3]) + (f" and {len(tensor.fqns) - 3} more" if len(tensor.fqns) > 3 else "")
        return [f"{shown} {name}"]
    flat = mask.reshape(-1)
    out, named = [], 0
    for seg in tensor.segments:
        n = int(flat[seg.dest : seg.dest + seg.length].sum())
        named += n
        if n:
            out.append(f"{seg.fqn} {name} ({n} element{'s' if n != 1 else ''})")
    rest = int(flat.sum()) - named
    if rest:
        out.append(f"padding of {tensor.key} {name} ({rest} element{'s' if rest != 1 else ''})")
    return out


def run(ctx: Subject) -> CheckResult:
    """The target optimizer loads the result and takes one step on synthetic gradients (:func:`load_and_step`)."""
    return load_and_step(ctx, loadable(ctx))


def load_and_step(ctx: Subject, loadable: dict[str, Any]) -> CheckResult:
    """This rank's target optimizer loads ``loadable`` and takes one step on synthetic gradients;
    its state must stay finite.

    ``loadable`` is what the optimizer's kind loads on this rank: the
    param-ID keyed state, or what the kind's ``to_load`` made of a full one.

    The rule, element by element: a state element fails when it is NaN or
    infinite after the step but was finite in the loaded state (an element the
    step creates counts as finite before it). Elements already non-finite in
    the loaded state come from the source: with ``input.allow_nonfinite`` they
    are carried and reported, not failed; without it they fail too. Failures
    name parameters by FQN (through this rank's layout), never by param ID.
    """
    model, optim = live_target_of(ctx)
    # load_state_dict keeps tensors that need no cast: a copy stops the step from changing the result.
    loadable = kinds.get(ctx.spec.target.kind).loadable(optim, copy.deepcopy(loadable))
    optim.load_state_dict(with_groups(loadable, optim))
    return step_loaded(ctx, model, optim)


def step_loaded(ctx: Subject, model: Any, optim: Any) -> CheckResult:
    """The rule of :func:`load_and_step` on a target job that has loaded the output already
    (a whole checkpoint, loaded as its framework does)."""
    layout = ctx.optimizer_layout()
    tensor_of = {id(p): t for p, t in zip(model.parameters(), layout)}  # the live model is built on this layout
    loaded = {id(p): {n: _nonfinite(v) for n, v in state.items()} for p, state in optim.state.items()}
    carried = [
        w
        for p, state in optim.state.items()
        for n, mask in loaded[id(p)].items()
        if mask is not None
        for w in _named(tensor_of[id(p)], n, mask)
    ]
    train_step(ctx.spec, model, optim, step=10_000, layout=layout, tree=ctx.tree)
    new_bad = []
    for param, state in optim.state.items():
        for name, value in state.items():
            after = _nonfinite(value)
            before = loaded.get(id(param), {}).get(name)
            if after is not None and before is not None and before.shape == after.shape:
                after = after & ~before
            if after is not None and bool(after.any()):
                new_bad += _named(tensor_of[id(param)], name, after)
    allowed = ctx.spec.input.allow_nonfinite
    problems = []
    if new_bad:
        problems.append(
            f"non-finite after a step where the loaded state was finite: {', '.join(new_bad[:5])}"
            + (" ..." if len(new_bad) > 5 else "")
        )
    if carried and not allowed:
        problems.append(
            f"non-finite in the loaded state (set input.allow_nonfinite=true to carry it): {', '.join(carried[:5])}"
            + (" ..." if len(carried) > 5 else "")
        )
    if problems:
        return CheckResult("load_step", False, "; ".join(problems))
    detail = "loaded; one step left all state finite"
    if carried:
        detail = (
            "loaded; one step left finite every element that was finite "
            f"(non-finite in the source, carried: {', '.join(carried[:3])})"
        )
    return CheckResult("load_step", True, detail)


def skip_reason(ctx: Subject) -> str | None:
    return needs_target_world(ctx)

