"""``universal`` (a DeepSpeed source, asked for): DeepSpeed's own ``ds_to_universal`` of the save holds what osdpipe
read, bitwise.

osdpipe reads a ZeRO save with its own reader and never runs DeepSpeed's
code. This check runs DeepSpeed's: ``python -m
deepspeed.checkpoint.ds_to_universal`` cuts the save into one folder per
parameter (``zero/<fqn>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``, and for
stage 1/2 ``step.pt``), and every one of those tensors must equal, bit for bit,
the fp32 master weight and the optimizer state osdpipe read for that
parameter. With ``roundtrip`` (the output holds what was read), the output
then holds what DeepSpeed itself makes of its save.

It is not among the default checks: DeepSpeed's loading unpickles the save's
files with ``weights_only=False``, which runs whatever code they hold, where
osdpipe's reader runs none. Ask for it (``pipeline.checks=[...,universal]``)
on saves you trust, with DeepSpeed installed. Rank 0 runs it, in a temporary
folder beside nothing of the output, and every rank reports its result.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from osdpipe.io import formats
from osdpipe.io.formats.ds_universal import ds_to_universal, universal_differences
from osdpipe.io.store import is_remote
from osdpipe.run.collective import from_rank0
from osdpipe.run.products import CheckResult
from osdpipe.verify.checks.common import Subject, full_model_source, full_source


def skip_reason(ctx: Subject) -> str | None:
    converter = formats.get(ctx.spec.input.format).universal_converter
    if converter is None:
        return "applies to a source whose framework converts it to a universal checkpoint itself (DeepSpeed's)"
    if is_remote(ctx.spec.input.path):
        return f"needs the save on a local disk ({converter} reads local files)"
    if importlib.util.find_spec(converter.split(".")[0]) is None:
        return f"needs {converter.split('.')[0]} installed (its own {converter} is the reference)"
    return None


def run(ctx: Subject) -> CheckResult:
    problems, notes = from_rank0("verify", lambda: _compare(ctx))
    said = (
        "DeepSpeed's own ds_to_universal of the save holds the fp32 weights, moments and steps osdpipe read, bitwise "
        "(and roundtrip holds the output to them)"
    )
    return CheckResult("universal", not problems, "; ".join(problems[:3]) or "; ".join([said, *notes]))


def _compare(ctx: Subject) -> tuple[list[str], list[str]]:
    source = full_source(ctx)
    weights = full_model_source(ctx)
    with tempfile.TemporaryDirectory(prefix="osdpipe-universal-") as work:
        folder = ds_to_universal(
            Path(ctx.spec.input.path), Path(work) / "universal", timeout_s=ctx.spec.runtime.timeout_s
        )
        return universal_differences(folder, weights, source["state"])
