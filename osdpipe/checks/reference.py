"""``reference``: on the target world, PyTorch's own conversion gives the same bytes, keys and param groups.

``FSDP.optim_state_dict_to_load`` (or the kind's equivalent) from the full
source state for param-ID keyed outputs; for FQN-keyed ones, the full state
a target model reports after loading the source.
"""

from __future__ import annotations

from osdpipe import kinds
from osdpipe.checks.common import Subject, full_output, full_source, live_target_of, needs_target_world
from osdpipe.compare import diff
from osdpipe.products import CheckResult
from osdpipe.loading import PARAM_LAYOUT
from osdpipe.reference import live_target


def run(ctx: Subject) -> CheckResult:
    kind = kinds.get(ctx.spec.target.kind)
    model, optim = live_target_of(ctx)
    full = full_source(ctx)
    if ctx.id_keyed:
        expected, got, what = kind.to_load(model, optim, full), {k: v for k, v in ctx.result.items() if k != PARAM_LAYOUT}, "PyTorch's conversion"
    else:
        fresh_model, fresh_optim = live_target(ctx.spec, ctx.plan.target_spec, ctx.tree, ctx.rank)
        fresh_optim.load_state_dict(kind.loadable(fresh_optim, kind.to_load(fresh_model, fresh_optim, full)))
        expected, got, what = kind.full_state(fresh_model, fresh_optim), full_output(ctx), "the full state PyTorch reports after loading the source"
    problems = diff(got, expected, sequence_types=False)  # a tuple of hyperparameters PyTorch loads back as a list is the same
    return CheckResult("reference", not problems, "; ".join(problems) or f"equals {what} bitwise")


def skip_reason(ctx: Subject) -> str | None:
    return needs_target_world(ctx)

