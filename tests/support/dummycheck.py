"""A check of a test's own, registered only by its line in the catalog (``osdpipe.spec.checks.CHECKS``) and in
``osdpipe.verify.checks.RUNS`` (see ``test_registries.py``)."""

from __future__ import annotations

import torch

from osdpipe.run.products import CheckResult
from osdpipe.verify.checks.common import Subject


def run(ctx: Subject) -> CheckResult:
    tensors = sum(1 for state in ctx.local_state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return CheckResult("counted", tensors > 0, f"rank {ctx.rank} holds {tensors} state tensor(s)")


def skip_reason(ctx: Subject) -> str | None:
    return None
