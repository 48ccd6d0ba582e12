"""Run the stages on every rank, time them, and report.

:func:`execute` is the whole conversion as the CLI runs it: generate a source
when none is given, run the pipeline on the target world, write
``report.json``. :func:`run_rank` is the per-rank part, shared by the local
world, torchrun and the Python API.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.distributed as dist

from osdpipe.collective import StageError, agree, gather_to_all
from osdpipe.config import RunSpec
from osdpipe.context import CheckResult, Context
from osdpipe.models import build_model
from osdpipe.stages import STAGES
from osdpipe.tree import describe


@dataclass
class StageReport:
    name: str
    seconds: float
    bytes: int


@dataclass
class Report:
    """What ``report.json`` holds. ``ok`` is true exactly when every stage ran and every check passed."""

    ok: bool
    stages: list[StageReport] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    error: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / "report.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)
        return path


def run_stages(ctx: Context) -> Report:
    """Run the configured stages in order on this rank; every rank gets the same report."""
    timings: list[tuple[str, float, int]] = []
    for name in ctx.spec.pipeline.stages:
        ctx.bytes_moved = 0
        start = time.perf_counter()
        error = None
        try:
            STAGES[name](ctx)
        except StageError:
            raise  # already agreed on by every rank inside the stage
        except Exception as exc:  # noqa: BLE001 - agreed on below, raised on every rank
            error = f"{type(exc).__name__}: {exc}"
        agree(name, error)
        timings.append((name, time.perf_counter() - start, ctx.bytes_moved))
    per_rank = gather_to_all(timings)
    stages = [
        StageReport(name, round(max(r[i][1] for r in per_rank), 6), sum(r[i][2] for r in per_rank)) for i, (name, _, _) in enumerate(timings)
    ]
    ok = all(c.ok for c in ctx.checks)
    return Report(ok=ok, stages=stages, checks=ctx.checks, files=ctx.files, warnings=ctx.warnings)


def make_context(spec: RunSpec, input_path: str, input_format: str) -> Context:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    tree = describe(build_model(spec.model.factory, spec.model.kwargs, device="meta"))
    return Context(spec=spec, rank=rank, world_size=world, tree=tree, input_path=input_path, input_format=input_format)


def run_rank(spec: RunSpec, input_path: str, input_format: str) -> Report:
    """The pipeline on this rank of an initialized target world (or alone, without one)."""
    return run_stages(make_context(spec, input_path, input_format))


def _convert_worker(spec: RunSpec, input_path: str, input_format: str) -> Report | None:
    report = run_rank(spec, input_path, input_format)
    return report if dist.get_rank() == 0 else None


def execute(spec: RunSpec) -> Report:
    """The whole conversion in a local world (spawned ranks) or in the current torchrun world.

    Never raises for a failed run: the error goes into the report, which is
    also written to ``<output.path>/report.json``.
    """
    from osdpipe.generate import generate_rank
    from osdpipe.launch import WorldError, in_torchrun, run_local_world

    backend = None if spec.runtime.backend == "auto" else spec.runtime.backend
    torchrun = spec.runtime.launcher == "torchrun" or (spec.runtime.launcher == "auto" and in_torchrun())
    report: Report
    try:
        if torchrun:
            report = _execute_torchrun(spec, backend)
        else:
            input_path, input_format = spec.input.path, spec.source_input_format
            if input_path is None:
                input_path = run_local_world(generate_rank, spec.source.world_size, (spec,), backend=backend, timeout_s=spec.runtime.timeout_s)[0]
            results = run_local_world(_convert_worker, spec.target.world_size, (spec, input_path, input_format), backend=backend, timeout_s=spec.runtime.timeout_s)
            report = results[0]
    except (WorldError, StageError) as exc:
        report = Report(ok=False, error=str(exc))
    if not torchrun or int(os.environ.get("RANK", "0")) == 0:
        report.write(spec.output.path)
    return report


def _execute_torchrun(spec: RunSpec, backend: str | None) -> Report:
    """Join the torchrun world; it must be the target world (and, to generate, the source world too)."""
    from osdpipe.generate import generate_rank
    from osdpipe.launch import default_backend, init_world

    world = int(os.environ["WORLD_SIZE"])
    if world != spec.target.world_size:
        raise StageError("launch", {0: f"torchrun started {world} ranks but target.world_size={spec.target.world_size}; start as many ranks as the target has"})
    if not dist.is_initialized():
        init_world(backend or default_backend(), spec.runtime.timeout_s)
    input_path = spec.input.path
    if input_path is None:
        if spec.source.world_size != world:
            raise StageError("generate", {0: f"under torchrun, generating a source needs source.world_size == {world}; give input.path instead"})
        input_path = generate_rank(spec)
    try:
        return run_rank(spec, input_path, spec.source_input_format)
    finally:
        dist.destroy_process_group()
