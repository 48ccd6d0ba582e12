"""Conversions held against PyTorch's own FSDP1 path, on a rank of a live target world
(the conversion and kind tests)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from helpers import planned

from osdpipe.core.compare import diff
from osdpipe.io.loading import without_records
from osdpipe.layout import kinds
from osdpipe.layout.kinds import rank_layout
from osdpipe.pipeline.execute import run_rank
from osdpipe.run.live_jobs import live_target, train_step
from osdpipe.spec.config import RunSpec
from osdpipe.spec.reconcile import settle_and_validate

TIMEOUT_S = 180


def spec_for(tmp: Path, **sections) -> RunSpec:
    """The validated spec of a conversion into ``tmp``, each section's keys over the defaults."""
    raw = {"output": {"path": str(tmp)}, "runtime": {"timeout_s": TIMEOUT_S, "progress": False}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return settle_and_validate(raw)


def pytorch_says(spec: RunSpec, full_path: str) -> list[str]:
    """On this rank of the target world: diff of osdpipe's rank file against FSDP.optim_state_dict_to_load, then load
    and step it."""
    from osdpipe.layout.models import build_model
    from osdpipe.layout.tree import describe

    rank = dist.get_rank()
    tree = describe(build_model(spec.model.factory, spec.model.kwargs, device="meta"))
    model, optim = live_target(spec, spec.target.spec(), tree, rank)
    full = torch.load(full_path, weights_only=True)
    expected = kinds.get("fsdp1").to_load(model, optim, full)
    got = torch.load(Path(spec.output.path) / f"rank_{rank}.pt", weights_only=True)
    problems = diff(without_records(got), expected)
    optim.load_state_dict(got)
    train_step(spec, model, optim, 99, rank_layout(tree, spec.target.spec(), rank), tree)
    return problems


def convert_and_check(specs: list[RunSpec], sources: list[str]) -> list[tuple[bool, list[str], list[str]]]:
    """On this rank: convert each spec's source, and what PyTorch says of each output (:func:`pytorch_says`)."""
    out = []
    for spec, source in zip(specs, sources):
        report = run_rank(planned(spec, source, "fsdp_full"))
        problems = pytorch_says(spec, source)
        out.append((report.ok, [f"{c.name}: {c.detail}" for c in report.checks if not c.ok], problems))
    return out
