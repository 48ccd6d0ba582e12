"""verify: prove the converted state right, or say exactly where it is wrong.

The catalog (:mod:`osdpipe.spec.checks`) says what each check proves; its
module in :mod:`osdpipe.verify.checks` runs it. This stage runs those
``pipeline.checks`` names, on this rank, and says in the report which did not
run and why.
"""

from __future__ import annotations

from osdpipe.run.context import Context
from osdpipe.run.products import CheckResult, Keyed, SkippedCheck, Tally, Verified
from osdpipe.spec import checks
from osdpipe.verify.checks import runner
from osdpipe.verify.checks.common import Subject


def verify(ctx: Context, keyed: Keyed, tally: Tally) -> Verified:
    """Run the configured checks on this rank
    (each rank's own results: :mod:`osdpipe.pipeline.loop` combines them after the last rank)."""
    # A live optimizer's groups (Python API) are known on its own rank only:
    # each rank publishes the keys its optimizer holds.
    held = ctx.world.published("held keys", ctx.rank, ctx.plan.held_keys(ctx.rank))
    subject = Subject(ctx, keyed, keyed.source, tally, dict(held))
    results: list[CheckResult] = []
    skipped: list[SkippedCheck] = []
    for name in ctx.spec.pipeline.checks:
        check, run = checks.get(name), runner(name)
        why = run.skip_reason(subject)
        if why is not None:
            skipped.append(SkippedCheck(name, why))
            if check.warn_when_skipped:  # a check that cannot apply is no news; one left out for size or mode is
                tally.warnings.append(f"verify did not run {name}: it {why}")
            continue
        try:
            result = run.run(subject)
        except Exception as exc:  # a check that cannot run has failed, and says why
            result = CheckResult(name, False, f"{type(exc).__name__}: {exc}")
        results.append(result)
    return Verified(keyed, tuple(results), tuple(skipped))
