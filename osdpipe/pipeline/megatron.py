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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from traceback import format_exc
from typing import Any

import torch

from osdpipe.core.memory import MemoryWatch
from osdpipe.io import output
from osdpipe.io.checkpoints import get as get_layout
from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.megatron import DEFAULT_OUTPUT, MASTERS, MegatronSave, gpt_of, read_save
from osdpipe.io.formats.megatron_writer import Target, Written, write_save
from osdpipe.layout.megatron import VOCAB_KEYS, tp_problem, tp_sizes, virtual_stages, virtual_stages_problem
from osdpipe.run import progress
from osdpipe.run.collective import one_line
from osdpipe.run.products import CheckResult, SkippedCheck
from osdpipe.run.report import Report, StageReport
from osdpipe.run.stages.save import write_manifest
from osdpipe.spec.config import RunSpec
from osdpipe.spec.megatron import HF, MEGATRON, MEGATRON_CHECKS, MegatronJob
from osdpipe.spec.reconcile import Contradiction, Given, another_layouts
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
        # a Hugging Face folder holds the fp32 masters alone: the module's weights and the moments are not read
        read = {"weights": False, "states": MASTERS} if job.hf else {}
        source = source or Source(lambda: read_save(job.source, within_memory=True, on_read=_amount(display), **read))
        save = _stage(stages, "load", display, source.read, _tensor_bytes, unit="B")
        if job.hf:
            done = _as_hf(job, save, staging, stages, display)
        else:
            done = _as_megatron(job, save, staging, stages, display, source.problems)

        def commit() -> dict[str, Any]:
            files = {**done.files, **_small_files(staging, done.files)}
            write_manifest(staging, config, HF if job.hf else MEGATRON, files, {})
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


def _as_hf(
    job: MegatronJob, save: MegatronSave, staging: Path, stages: list[StageReport], display: progress.Display | None
) -> Converted:
    """The ``shard`` and ``verify`` stages of a Hugging Face folder (``output.checkpoint=hf``): the fp32 master weights
    (a save of the weights alone: its weights) mapped to Llama's, Qwen2's, Qwen3's or GPT-2's names and layout
    (:mod:`osdpipe.layout.megatron_hf`), written as ``save_pretrained`` writes them, read back and mapped again: every
    element of every master, the vocabulary's padding rows left out.

    In the source's dtype unless ``output.dtype`` says another (:func:`hf_dtype`). Where osdpipe made the save of a
    Hugging Face folder, the folder's ``config.json`` fields and ``generation_config.json`` it kept
    (:func:`osdpipe.io.hf_folder.record_of`) are the output's again; else the report names what the save could not
    say (:func:`unknown_of_hf`)."""
    from osdpipe.io import hf_folder
    from osdpipe.io.formats.megatron import gpt_of
    from osdpipe.layout import megatron_hf

    gpt, vocab = gpt_of(save.args), megatron_hf.true_vocab_size(save.args)
    record = save.common.get(hf_folder.RECORD)
    dtype = job.dtype or hf_dtype(save)
    held = masters_of(save)
    masters = {key: t.to(getattr(torch, dtype)) for key, t in held.items()}

    try:
        config = hf_config_of(save, dtype)
    except ValueError as exc:  # what its Hugging Face family cannot express, or an arg it needs, named
        raise InputError(f"{save.folder}: {exc}") from None

    def write() -> dict[str, str]:
        try:
            state = megatron_hf.to_hf(gpt, masters, vocab)
        except ValueError as exc:
            raise InputError(f"{save.folder}: {exc}") from None
        written = hf_folder.write_folder(staging, config, state, job.max_shard_size)
        if record and record.get("generation_config") is not None:
            (staging / hf_folder.GENERATION_CONFIG).write_text(record["generation_config"])
        return written

    files = _stage(stages, "shard", display, write, lambda _: _tree_bytes(staging))

    problems = _stage(stages, "verify", display, lambda: hf_folder_problems(save, staging, dtype),
                      lambda _: _tree_bytes(staging))
    if problems:
        raise ReadBackDiffers(f"{job.output}: the written folder read back differs: {'; '.join(problems[:3])}")
    cast = "" if {str(t.dtype) for t in held.values()} == {f"torch.{dtype}"} else (
        f", cast to {dtype} (round to nearest even, as torch casts)")
    which = "weight" if save.weights_only else "fp32 master weight"
    kept = (f"; config.json's fields and {'generation_config.json ' if record.get('generation_config') else ''}"
            "as the Hugging Face folder the save was made of had them") if record else ""
    proved = (f"every {which}{cast}, mapped to Hugging Face's {megatron_hf.architecture(save.args)} and "
              f"back, bitwise (vocabulary {vocab} of {gpt.padded_vocab_size} padded rows){kept}")
    return Converted(save, None, None, roundtrip=proved, files=files, notes=unknown_of_hf(save))


def hf_config_of(save: MegatronSave, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face folder made of ``save`` in ``dtype``: what its ``args`` give
    (:func:`osdpipe.layout.megatron_hf.hf_config`) over the folder the save was made of, where osdpipe kept one
    (:func:`osdpipe.io.hf_folder.config_back`).

    Raises:
        ValueError: one line: what its Hugging Face family cannot express, or an arg ``config.json`` needs.
    """
    from osdpipe.io import hf_folder
    from osdpipe.layout import megatron_hf

    made = megatron_hf.hf_config(save.args, vocab_size=megatron_hf.true_vocab_size(save.args), dtype=dtype)
    return hf_folder.config_back(save.common.get(hf_folder.RECORD), made)


def hf_folder_problems(save: MegatronSave, folder: Path, dtype: str) -> list[str]:
    """What the Hugging Face folder ``folder`` made of ``save`` in ``dtype`` does not hold: every master, cast, bitwise
    (:func:`hf_problems`), ``config.json`` as :func:`hf_config_of` makes it, and the ``generation_config.json`` of
    the folder the save was made of (:func:`osdpipe.io.hf_folder.record_problems`). The verify stage's and
    ``osdpipe check``'s."""
    from osdpipe.io import hf_folder

    record = save.common.get(hf_folder.RECORD)
    return [*hf_problems(save, folder, dtype), *hf_folder.record_problems(record, hf_config_of(save, dtype), folder)]


def hf_dtype(save: MegatronSave) -> str:
    """The dtype of a Hugging Face folder made of ``save`` where ``output.dtype`` says none: the source's own. That of
    the folder the save was made of, as it recorded it (:func:`osdpipe.io.hf_folder.recorded_dtype`); else the job's
    ``params_dtype`` (``args.bf16``: bfloat16, ``args.fp16``: float16, else float32), the dtype its model computes
    in and ``from_pretrained`` loads, where fp32 masters made a bf16 folder an fp32 one."""
    from osdpipe.io import hf_folder
    from osdpipe.layout import megatron_hf

    return hf_folder.recorded_dtype(save.common.get(hf_folder.RECORD)) or megatron_hf.params_dtype(save.args)


def unknown_of_hf(save: MegatronSave) -> list[str]:
    """What a Hugging Face folder made of ``save`` cannot hold as its model had it, in a warning (none where osdpipe
    made the save of a Hugging Face folder and kept it: :func:`osdpipe.io.hf_folder.record_of`): Megatron's ``args``
    hold no token ids, and a Megatron save no ``generation_config.json``."""
    from osdpipe.io import hf_folder

    if hf_folder.RECORD in save.common:
        return []
    return [
        f"{save.folder}: the save holds no Hugging Face folder's config.json (osdpipe keeps one in common.pt's "
        f"{hf_folder.RECORD!r} only where it made the save of a folder): config.json's bos_token_id and eos_token_id "
        "are null and no generation_config.json is written; set the token ids from the model's tokenizer, and copy "
        "its generation_config.json beside the weights"
    ]


def masters_of(save: MegatronSave) -> dict[str, torch.Tensor]:
    """The weights a Hugging Face folder of ``save`` holds, by sharded key: its fp32 masters, or where it holds the
    weights alone (:attr:`MegatronSave.weights_only`), the model's weights."""
    if save.weights_only:
        return save.model
    return {key: states["param"] for key, states in save.optim.items()}


def hf_problems(save: MegatronSave, folder: Path, dtype: str = "float32") -> list[str]:
    """Every fp32 master of ``save`` (cast to ``dtype``, the folder's) that the Hugging Face folder ``folder``, read
    back and mapped to Megatron's layout again, does not hold bitwise (the vocabulary's padding rows, which the folder
    leaves out, aside)."""
    from osdpipe.core.compare import bits_equal
    from osdpipe.io import hf_folder
    from osdpipe.io.formats.megatron import gpt_of
    from osdpipe.layout import megatron_hf

    gpt, vocab = gpt_of(save.args), megatron_hf.true_vocab_size(save.args)
    back = megatron_hf.from_hf(gpt, hf_folder.read_weights(folder), gpt.padded_vocab_size)
    masters = masters_of(save)
    rows = {key: vocab if key in VOCAB_KEYS else None for key in masters}
    cast = getattr(torch, dtype)
    return [f"{key}: differs from the source's fp32 master" + (f" cast to {dtype}" if dtype != "float32" else "")
            for key, master in masters.items()
            if not bits_equal(back[key][: rows[key]], master[: rows[key]].to(cast))]


def run_command(spec: RunSpec, given: Given, warnings: Sequence[str] = ()) -> Report:
    """The ``osdpipe`` command's Megatron conversion of ``spec`` (checked by the schema and
    :func:`osdpipe.spec.megatron.megatron_problem`); ``given``: the keys the user set; ``warnings``: what the run says
    besides (an object-storage destination's). Writes ``report.json`` and ``osdpipe.log`` into ``output.path``, whatever
    happens.

    Raises:
        Contradiction: a ``source.*`` key the user gave is not what the save's ``args`` say, or ``output.path``
            holds a conversion and ``output.overwrite`` is false (exit 2, nothing written).
        OutputError: ``output.path`` cannot be written.
    """
    from osdpipe.pipeline.execute import record  # the report and log of every run, written the same way

    spec, notes = _settled(spec, given)
    notes = [*notes, *warnings]
    out = Path(spec.output.path)
    if not spec.output.overwrite and (why := _held(out)) is not None:
        raise Contradiction(why)
    output.check_writable(out)
    record(out, Report.unfinished(), spec)
    job = MegatronJob.of(spec)
    display = progress.Display(progress.wanted(spec.runtime.progress))
    try:
        report = execute(job, spec.model_dump(mode="json"), notes, display)
    finally:
        display.close()
    record(out, report, spec)
    return report


def _held(directory: Path) -> str | None:
    """Why ``directory`` cannot take a conversion without ``output.overwrite`` (``None``: it can)."""
    held = [p.name for p in output.conversion_entries(directory)]
    return output.already_holds(str(directory), held) if held else None


def _settled(spec: RunSpec, given: Given) -> tuple[RunSpec, list[str]]:
    """``spec`` with its ``source.*`` as the save's ``args`` say (the report and the log name them), refusing a key the
    user gave that says otherwise, a target grid whose pipeline stages cannot split the save's layers or whose TP
    cannot split its heads or FFN, and another framework's checkpoint (before anything is written); and what settling
    found to say."""
    from osdpipe.io.formats.base import InputError
    from osdpipe.io.formats.megatron import iteration_folder, read_common

    try:
        folder = iteration_folder(spec.input.path)
        args = read_common(folder)["args"]
    except InputError:
        if (why := another_layouts(get_layout(MEGATRON), spec.input.path)) is not None:
            raise Contradiction(why) from None  # another framework's checkpoint: a config that names the wrong one
        return spec, []  # the load stage says what is wrong with it
    said = {
        "tp_size": int(args.get("tensor_model_parallel_size") or 1),
        "pp_size": int(args.get("pipeline_model_parallel_size") or 1),
        "vpp_size": virtual_stages(args),
        "world_size": int(args.get("world_size") or 1),
    }
    for key, value in said.items():
        if f"source.{key}" in given and getattr(spec.source, key) != value:
            raise Contradiction(
                f"source.{key}={getattr(spec.source, key)}, but {folder / 'common.pt'}'s args say {value}; "
                f"leave source.{key} out: the save's own args say how it was saved"
            )
    layers, target = args.get("num_layers"), spec.target
    if spec.output.checkpoint != HF and isinstance(layers, int) and \
            (why := virtual_stages_problem(layers, target.pp_size, target.vpp_size)) is not None:
        raise Contradiction(f"{why} ({folder / 'common.pt'}'s args)")
    sizes = _tp_sizes(args) if spec.output.checkpoint != HF else None
    if sizes and (why := tp_problem(sizes, target.tp_size, replicated=True)) is not None:
        raise Contradiction(f"{why} ({folder / 'common.pt'}'s args)")
    settled = spec.model_copy(update={"source": spec.source.model_copy(update={"kind": MEGATRON, **said})})
    notes = [] if str(folder) == spec.input.path else [f"input.path={spec.input.path}: converting {folder}"]
    return settled, notes


def _tp_sizes(args: dict[str, Any]) -> tuple[tuple[int, str], ...] | None:
    """What a target's TP must divide of the GPT a save's ``args`` describe (:func:`tp_sizes`); ``None`` where the
    args lack a dimension (the load stage says what is wrong with them)."""
    try:
        return tp_sizes(gpt_of(args))
    except (KeyError, TypeError, ValueError):
        return None


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


#: What a Hugging Face folder does with each part: it holds the model alone.
_HF_FATES = {
    "model": "left out: the fp32 master weights are the folder's weights (output.checkpoint=hf)",
    "optimizer": "converted: the fp32 master weights, mapped to the Hugging Face model; the moments and steps are left "
                 "out (a Hugging Face folder holds the model alone)",
    "other": "left out: a Hugging Face folder holds the model alone (config.json from args)",
}


#: What a Hugging Face folder does with the one of a save made of a folder (:data:`RECORDED`).
_HF_RECORDED = ("converted: config.json's fields the args do not hold (token ids, dtype, the rest) and "
                "generation_config.json, as the Hugging Face folder the save was made of had them")


def _fates(done: Converted) -> list[dict[str, Any]]:
    """Every entry of the source save and what became of it, as ``report.json`` lists a whole checkpoint's."""
    from osdpipe.io.checkpoints import get
    from osdpipe.io.checkpoints.megatron import RECORDED

    fates = _FATES if done.target is not None else {**_HF_FATES, RECORDED: _HF_RECORDED}
    if done.target is None and done.source.weights_only:  # no masters: the weights are the folder's
        fates["model"] = "converted: the weights (the save holds no optimizer), mapped to the Hugging Face model"
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
