"""A Megatron-LM save's conversion: its own stages, offline, as the command and the Python API run them.

Megatron's model and distributed optimizer are laid out by :mod:`osdpipe.layout.megatron` (TP boxes, PP stages,
buckets cut over DP), which the range pipeline's layout kinds do not hold yet. So a Megatron save converts by these
stages, each timed and named in the report as the pipeline's are:

* ``load``: the save read whole and checked (:func:`osdpipe.io.formats.megatron.read_save`);
* ``shard``: every tensor laid out for the target's TP x PP x DP and written into the output's staging directory, by
  ``runtime.workers`` writers (:func:`osdpipe.io.formats.megatron_writer.write_save`);
* ``verify``: the staged save read back by the same reader and held against the source, bit for bit, a tensor at
  a time (:func:`osdpipe.verify.megatron.written_problems`);
* ``save``: ``manifest.json`` written, the conversion committed whole (:mod:`osdpipe.io.output`).

A failure in any stage leaves the output directory as it was, but for ``report.json`` and ``osdpipe.log``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from traceback import format_exc
from typing import Any

from osdpipe.core.memory import MemoryWatch
from osdpipe.io import output
from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.megatron import DEFAULT_OUTPUT, MegatronSave, read_save
from osdpipe.io.formats.megatron_writer import Target, Written, write_save
from osdpipe.run import progress
from osdpipe.run.collective import one_line
from osdpipe.run.products import CheckResult, SkippedCheck
from osdpipe.run.report import Report, StageReport
from osdpipe.run.stages.save import write_manifest
from osdpipe.spec.megatron import MEGATRON, MEGATRON_CHECKS, MegatronJob
from osdpipe.verify.megatron import written_problems


class ReadBackDiffers(RuntimeError):
    """The staged output, read back, does not hold the source's state: nothing was committed."""


@dataclass(frozen=True)
class Source:
    """Where a conversion's :class:`MegatronSave` comes from: ``read`` makes it (the ``load`` stage); ``problems``
    says what else the written save, read back, fails to hold (``None``: nothing beyond the save itself); ``entries``
    lists the source's entries and what became of them for the report (``None``: a Megatron save's own); ``notes``:
    what the report warns of the source, known once it is read."""

    read: Callable[[], MegatronSave]
    problems: Callable[[MegatronSave], list[str]] | None = None
    entries: Callable[[], list[dict[str, Any]]] | None = None
    notes: Callable[[], list[str]] | None = None


@dataclass
class Converted:
    """What a Megatron conversion did: the source it read, what it wrote, and each stage's seconds and bytes."""

    source: MegatronSave
    #: The grid written and what the writer did (``None``: a Hugging Face folder, which has neither).
    target: Target | None
    written: Written | None
    stages: list[StageReport] = field(default_factory=list)
    roundtrip: str = ""
    #: Every committed file and its digest.
    files: dict[str, str] = field(default_factory=dict)
    #: What the report warns of the output (a Hugging Face folder's fields the save could not say).
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The Python API's answer: where the iteration folder is, both parallelisms and sharding types, which source
        (PP, TP) rank's RNG states each target rank got, and what the read-back proved."""
        s, t = self.source, self.target
        assert t is not None and self.written is not None, "a Megatron output's"
        return {
            "folder": str(self.written.folder),
            "iteration": s.iteration,
            "source": {"tp": s.tp, "pp": s.pp, "vpp": s.vpp, "dp": s.dp, "sharding": s.sharding},
            "target": {"tp": t.tp, "pp": t.pp, "vpp": t.vpp, "dp": t.dp, "sharding": t.sharding},
            "rng_from": {f"{p}.{r}": list(src) for (p, r), src in self.written.rng_from.items()},
            "roundtrip": self.roundtrip,
        }


def convert(
    job: MegatronJob,
    config: dict[str, Any],
    display: progress.Display | None = None,
    source: Source | None = None,
) -> Converted:
    """Convert the save ``job`` names into ``job.output``, prove it and commit it; ``config`` is what the manifest
    records. ``source``: where the :class:`MegatronSave` comes from and what else the read-back must hold (default:
    the Megatron-LM save ``job.source``, read by :func:`read_save`; a Hugging Face model's checkpoint:
    :func:`hf_source`).

    Raises:
        osdpipe.io.formats.InputError: the source cannot be read, or holds what osdpipe cannot write yet; one line.
        osdpipe.io.output.OutputError: the output directory cannot be written, or holds a conversion and
            ``job.overwrite`` is false.
        ReadBackDiffers: the output read back differs from the source (nothing is committed).
    """
    directory = Path(job.output)
    if not job.overwrite and (why := _held(directory)) is not None:
        raise output.OutputHeld(f"{why} (the Python API: overwrite=True)")
    stages: list[StageReport] = []
    staging = output.begin(directory, job.fsync)
    try:
        source = source or Source(lambda: read_save(job.source, within_memory=True, on_read=_amount(display)))
        save = _stage(stages, "load", display, source.read, _tensor_bytes, unit="B")
        done = _as_megatron(job, save, staging, stages, display, source.problems)

        def commit() -> dict[str, Any]:
            files = {**done.files, **_small_files(staging, done.files)}
            write_manifest(staging, config, MEGATRON, files, {})
            output.commit(directory, job.fsync)
            return files

        files = _stage(stages, "save", display, commit, lambda _: 0)
    except BaseException:
        output.abort(directory)
        raise
    done.stages, done.files = stages, {name: str(d) for name, d in files.items()}
    return done


def _as_megatron(
    job: MegatronJob, save: MegatronSave, staging: Path, stages: list[StageReport], display: progress.Display | None,
    also: Callable[[MegatronSave], list[str]] | None = None,
) -> Converted:
    """The ``shard`` and ``verify`` stages of a Megatron output: written for the target's grid, read back whole
    (``also``: what else the read-back must hold, such as a Hugging Face source's own tensors)."""
    if save.weights_only and job.optim_format is not None:
        raise InputError(f"{save.folder}: the save holds the model's weights alone, no optimizer state: leave "
                         f"output.megatron_optim_format={job.optim_format} out")
    sharding = None if save.weights_only else job.optim_format or DEFAULT_OUTPUT[save.sharding]
    target = Target(job.tp, job.pp, job.dp, sharding, vpp=job.vpp)
    written = _stage(stages, "shard", display, lambda: write_save(save, staging, target, workers=job.workers),
                     lambda _: _tree_bytes(staging))

    problems = _stage(stages, "verify", display, lambda: written_problems(save, staging, also, _amount(display)),
                      lambda _: _tree_bytes(staging), unit="B")
    if problems:
        raise ReadBackDiffers(f"{job.output}: the written save read back differs: {'; '.join(problems[:3])}")
    if save.weights_only:
        proved = "every weight, bitwise (a save of the weights alone: no optimizer state, iteration 0)"
    else:
        proved = "every weight, fp32 master and moment, the param groups, step, iteration and scheduler, bitwise"
    if also is not None:
        states = "weight" if save.weights_only else "weight, exp_avg and exp_avg_sq"
        from osdpipe.layout.megatron_hf import architecture

        proved += f"; mapped back to Hugging Face's {architecture(save.args)}, every {states} of the source, bitwise"
    return Converted(save, target, written, roundtrip=proved, files=dict(written.digests))


def _held(directory: Path) -> str | None:
    """Why ``directory`` cannot take a conversion without ``output.overwrite`` (``None``: it can)."""
    held = [p.name for p in output.conversion_entries(directory)]
    return output.already_holds(str(directory), held) if held else None


def execute(
    job: MegatronJob, config: dict[str, Any], warnings: list[str], display: progress.Display,
    source: Source | None = None,
) -> Report:
    """The command's run: :func:`convert`, with a report whatever happens (``report.json`` and ``osdpipe.log`` are
    the caller's to write). An unreadable source or a read-back that differs is a failed run; a bug is raised."""
    watch = MemoryWatch("launcher").start()
    skipped = [SkippedCheck(name, "needs the target's own job, which only megatron-core builds")
               for name in config.get("pipeline", {}).get("checks", []) if name not in MEGATRON_CHECKS]
    try:
        done = convert(job, config, display, source)
    except (InputError, ReadBackDiffers) as exc:
        return Report(ok=False, error=one_line(exc), traceback=format_exc(), warnings=list(warnings),
                      memory=[watch.stop()], skipped_checks=skipped)
    warnings = [*warnings, *done.source.notes, *done.notes, *_rng_notes(done),
                *(source.notes() if source is not None and source.notes else [])]
    return Report(
        ok=True,
        stages=done.stages,
        checks=[CheckResult("roundtrip", True, f"{done.roundtrip} ({job.source})")],
        skipped_checks=skipped,
        files=done.files,
        warnings=warnings,
        memory=[watch.stop()],
        entries=source.entries() if source is not None and source.entries is not None else _fates(done),
    )


#: What a Megatron conversion does with each part of the save (:mod:`osdpipe.io.checkpoints.megatron` names them).
_FATES = {
    "model": "converted: the model's weights, laid out for the target's TP and PP",
    "optimizer": "converted: the distributed optimizer's state, laid out for the target's TP, PP and DP",
    "other": "carried over (common.pt's args rewritten for the target's grid, RNG states per target (PP, TP) rank)",
}


def _fates(done: Converted) -> list[dict[str, Any]]:
    """Every entry of the source save and what became of it, as ``report.json`` lists a whole checkpoint's."""
    from osdpipe.io.checkpoints import get

    fates = _FATES
    read = get(MEGATRON).read(done.source.folder)
    return [{"name": e.name, "part": e.part, "where": e.where, "size": e.size, "fate": fates.get(e.name, fates[e.part])}
            for e in read.entries]


def _rng_notes(done: Converted) -> list[str]:
    """What the report says of the RNG states: Megatron-LM loads them once the args match the grid, so a target rank
    that has no source rank of its own (PP, TP) gets another's, which draws the same dropout masks."""
    s, t = done.source, done.target
    if t is None or done.written is None or (s.tp, s.pp) == (t.tp, t.pp) or not done.written.rng_from:
        return []
    return [
        f"RNG states: the target's (PP, TP) grid {t.pp}x{t.tp} differs from the source's {s.pp}x{s.tp}; target rank "
        "(p, t) carries source rank (p mod PP, t mod TP)'s states, so ranks that share a source rank draw the same "
        "random numbers (dropout masks) where the source's drew different ones"
    ]


def _stage(stages: list[StageReport], name: str, display: progress.Display | None, run: Callable[[], Any],
           measured: Callable[[Any], int], unit: str = "item") -> Any:
    if display is not None:
        display.phase(f"megatron: stage {name}", unit)
    start = time.perf_counter()
    result = run()
    stages.append(StageReport(name, round(time.perf_counter() - start, 6), measured(result)))
    return result


def _amount(display: progress.Display | None) -> Callable[[int, int], None] | None:
    """Where a stage that reads a save tells how far it is: the live line, if the run draws one."""
    return display.amount if display is not None else None


def _tensor_bytes(save: MegatronSave) -> int:
    return sum(t.nbytes for t in save.model.values()) + sum(
        t.nbytes for states in save.optim.values() for t in states.values()
    )


def _tree_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _small_files(staging: Path, digests: dict[str, Any]) -> dict[str, str]:
    """The sha256 of every staged file the writer did not hash as it wrote (``common.pt``, ``metadata.json``, the
    ``latest`` file)."""
    from osdpipe.io.digest import file_sha256

    return {
        str(p.relative_to(staging)): file_sha256(p)
        for p in sorted(staging.rglob("*"))
        if p.is_file() and str(p.relative_to(staging)) not in digests
    }
