"""verify: prove the converted state right, or say exactly where it is wrong.

Each check is a module of :mod:`osdpipe.checks`, the one list of them
(``roundtrip``, ``reference``, ``load_step``, ``resume``, ``replicas``):
this stage runs those ``pipeline.checks`` names, on this rank, and says in
the report which did not run and why.
"""

from __future__ import annotations

from osdpipe import checks
from osdpipe.context import CheckResult, Context, SkippedCheck


def verify(ctx: Context) -> None:
    """Run the configured checks on this rank (each rank's own results: :mod:`osdpipe.loop` combines them after the last rank)."""
    # A live optimizer's groups (Python API) are known on its own rank only: shared (a rank not yet published computes its own, ctx.held_keys).
    ctx.optimizer_keys.update(ctx.world.published("held keys", ctx.rank, ctx.held_keys(ctx.rank)))
    ctx.checks, ctx.skipped_checks = [], []
    for name in ctx.spec.pipeline.checks:
        check = checks.get(name)
        why = check.skip_reason(ctx)
        if why is not None:
            ctx.skipped_checks.append(SkippedCheck(name, why))
            if check.warn_when_skipped:  # a check that cannot apply is no news; one left out for size or mode is
                ctx.warnings.append(f"verify did not run {name}: it {why}")
            continue
        try:
            result = check.run(ctx)
        except Exception as exc:  # a check that cannot run has failed, and says why
            result = CheckResult(name, False, f"{type(exc).__name__}: {exc}")
        ctx.checks.append(result)
