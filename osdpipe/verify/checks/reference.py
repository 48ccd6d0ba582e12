"""``reference``: on the target world, PyTorch's own conversion gives the same bytes, keys and param groups.

``FSDP.optim_state_dict_to_load`` (or the kind's equivalent) from the full
source state for param-ID keyed outputs; for FQN-keyed ones, the full state
a target model reports after loading the source. A whole checkpoint's model
weights likewise: ``set_model_state_dict`` of the source's full weights.
"""

from __future__ import annotations

from typing import Any

from osdpipe.core.compare import diff
from osdpipe.io.formats import local_part
from osdpipe.io.loading import PARAM_LAYOUT, unwrapped_name
from osdpipe.layout import kinds
from osdpipe.run.live_jobs import live_target
from osdpipe.run.products import CheckResult
from osdpipe.verify.checks.common import (
    Subject,
    full_model_output,
    full_model_source,
    full_output,
    full_source,
    live_target_of,
    local_model_output,
    model_only,
    needs_target_world,
    whole,
)


def run(ctx: Subject) -> CheckResult:
    kind = kinds.get(ctx.spec.target.kind)
    if model_only(ctx):  # no optimizer in the source or the output: the model's weights are all there is to compare
        problems = [f"model: {p}" for p in _model_problems(ctx, kind)]
        return CheckResult(
            "reference",
            not problems,
            "; ".join(problems)
            or (
                f"the model's weights equal the target's after {_how_loaded(ctx)} of the source's "
                "(a model-only checkpoint)"
            ),
        )
    model, optim = live_target_of(ctx)
    full = full_source(ctx)
    if ctx.id_keyed:
        expected, got, what = (
            kind.to_load(model, optim, full),
            {k: v for k, v in ctx.result.items() if k != PARAM_LAYOUT},
            "PyTorch's conversion",
        )
    else:
        fresh_model, fresh_optim = live_target(ctx.spec, ctx.plan.target_spec, ctx.tree, ctx.rank)
        fresh_optim.load_state_dict(kind.loadable(fresh_optim, kind.to_load(fresh_model, fresh_optim, full)))
        expected, got, what = (
            kind.full_state(fresh_model, fresh_optim),
            full_output(ctx),
            "the full state PyTorch reports after loading the source",
        )
    # a tuple of hyperparameters PyTorch loads back as a list is the same
    problems = diff(got, expected, sequence_types=False)
    said = f"equals {what} bitwise"
    if whole(ctx):
        problems += [f"model: {p}" for p in _model_problems(ctx, kind)]
        said += f"; so do the model's weights, against the target's after {_how_loaded(ctx)} of the source's"
    return CheckResult("reference", not problems, "; ".join(problems) or said)


def _how_loaded(ctx: Subject) -> str:
    return (
        "the model's own load_state_dict (its hooks make keys set_model_state_dict cannot place)"
        if ctx.tree.key_maps
        else "set_model_state_dict"
    )


def _model_problems(ctx: Subject, kind: Any) -> list[str]:
    """A whole checkpoint's model part against PyTorch's own load of the source's full weights into a fresh target job.

    Param-ID keyed outputs are each rank's local pieces, compared with the
    live model's own; FQN-keyed ones are gathered whole and compared with
    the full state dict PyTorch reports (``get_model_state_dict``).
    """
    fresh, _ = live_target(ctx.spec, ctx.plan.target_spec, ctx.tree, ctx.rank)
    kind.load_model_full(fresh, full_model_source(ctx), hooked=bool(ctx.tree.key_maps))
    if ctx.id_keyed:
        expected = {
            unwrapped_name(name): local_part(value).detach() for name, value in fresh.state_dict(keep_vars=True).items()
        }
        return diff(local_model_output(ctx), expected, limit=3)
    return diff(full_model_output(ctx), kind.full_model_state(fresh, hooked=bool(ctx.tree.key_maps)), limit=3)


def skip_reason(ctx: Subject) -> str | None:
    return needs_target_world(ctx)

