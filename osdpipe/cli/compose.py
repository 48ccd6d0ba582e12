"""The ``osdpipe`` command: compose the config with Hydra, validate it, launch. Nothing else.

Hydra lives only here, in the launcher process; ranks receive the validated
:class:`~osdpipe.spec.config.RunSpec`.

This module imports no torch, so that Hydra's answers (``--cfg``, a help
with overrides, an unknown key) and a config whose schema is wrong print
without it. Torch comes in with the job (:func:`_run_job`), once the schema
is checked (:func:`osdpipe.spec.config.check_schema`).

Exit codes: 0 every job succeeded; 1 a conversion or check failed; 2 the
command line or a config is bad (an unknown key or recipe, a bad value, an
output path that cannot be written, an input whose files the config does not
describe: :func:`osdpipe.pipeline.execute.check_source`, before anything is
written), in a sweep too: a bad config is the first thing to mend. Every error
is one line on stderr, a traceback only with ``runtime.debug=true``.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from osdpipe.cli import new_dirs
from osdpipe.cli.sweep import JobRecord, summarize_sweep
from osdpipe.core import rankserver
from osdpipe.io import remote_input, store
from osdpipe.io.output import OutputError
from osdpipe.spec.config import (
    ConfigError,
    check_schema,
    name_torchtitans_model,
    output_takes_input,
    unknown_key,
    validate,
)

if TYPE_CHECKING:
    from osdpipe.io import remote_output
    from osdpipe.run.report import Report
    from osdpipe.spec.config import RunSpec

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2

#: Config nodes that hold whatever keys the user names (a factory's or an optimizer's keyword arguments):
#: overriding a key they do not have yet adds it, with no ``+`` needed.
#: Config keys whose value is a dict of the user's own keys: an override may add keys (``model.kwargs.depth=12``) or
#: give it whole (``target.tp_plan={up:colwise}``).
OPEN_DICTS = ("model.kwargs", "optim.kwargs", "source.tp_plan", "target.tp_plan", "runtime.storage_options")

#: The exit code of every job of this invocation (one, or one per sweep job).
_exit_codes: list[int] = []
#: Every sweep job as it ended, for the sweep's summary: Hydra's basic launcher runs them in this process.
_sweep_jobs: list[JobRecord] = []
#: In a sweep, each ``output.path`` given (resolved) and the first job given it (:func:`_given_to_another_job`).
_sweep_outputs: dict[str, int] = {}
#: The errors the current job printed (the first is its outcome in a sweep's summary).
_job_errors: list[str] = []

# hydra.run.dir: output.path when given (nothing lands in the current directory), else outputs/<date>/<time>;
# a sweep job's: <sweep dir>/<N>. Each name is noted before Hydra makes the directory, so that a job that never
# ran removes what it made and nothing else (new_dirs.discard).
# An object store's output.path (s3://, gs://) is not a directory here: the job's is the default one, where the
# conversion is made before it is uploaded (osdpipe.io.remote_output); nor is any other URL (refused by the schema).
OmegaConf.register_new_resolver(
    "osdpipe_run_dir",
    lambda path, default: new_dirs.note(default if path is None or store.is_url(path) else path),
    replace=True,
)
OmegaConf.register_new_resolver(
    "osdpipe_sweep_job", lambda sweep_dir, num: Path(new_dirs.note(os.path.join(sweep_dir, str(num)))).name,
    replace=True,
)


def _error(message: str) -> None:
    _job_errors.append(message)
    print(f"osdpipe: error: {message}", file=sys.stderr, flush=True)


def _internal_error(exc: BaseException) -> None:
    _error(
        f"internal error: {type(exc).__name__}: {exc} "
        "(rerun with runtime.debug=true for the traceback, and please report it)"
    )


def summarize(report: Report, output: str) -> str:
    """A short human summary of a successful run for the terminal."""
    lines = [f"osdpipe: OK  ->  {output}"]
    for s in report.stages:
        sent = f"  {s.sent:>12,d} B sent to other ranks" if s.sent else ""
        lines.append(f"  {s.name:<10} {s.seconds:8.3f} s  {s.bytes:>12,d} B{sent}")
    for c in report.checks:
        lines.append(f"  check {c.name:<10} {'pass' if c.ok else 'FAIL'}  {c.detail}")
    if report.entries:
        counts = Counter(e["part"] for e in report.entries)
        per_rank = sum(1 for e in report.entries if "source_rank" in e)
        ranks = f" ({per_rank} describe one rank of the world that saved it)" if per_rank else ""
        left = sum(1 for e in report.entries if e["part"] == "other" and e["fate"].startswith("left out"))
        carried = f"{counts['other'] - left} other(s) carried over unchanged" + (f", {left} left out" if left else "")
        converted = Counter(e["part"] for e in report.entries if e["fate"].startswith("converted"))
        lines.append(
            f"  entries    {converted['model']} of the model and {converted['optimizer']} of the optimizer converted, "
            f"{carried}{ranks}; report.json lists each"
        )
    if report.memory:
        top = max(report.memory, key=lambda m: m.peak_rss)
        held = (
            ""
            if top.peak_anonymous is None
            else f", {(top.peak_anonymous - (top.baseline_anonymous or 0)) / 1e6:,.1f} MB anonymous beyond its baseline"
        )
        lines.append(f"  memory     peak RSS {top.peak_rss / 1e6:,.0f} MB ({top.process}){held}")
    return "\n".join(lines)


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


@hydra.main(version_base="1.3", config_path="pkg://osdpipe.conf", config_name="config")
def run(cfg: DictConfig) -> bool:
    """One Hydra job: one conversion. Returns whether it succeeded (a sweep goes on after a failure)."""
    _job_errors.clear()
    start = time.perf_counter()
    try:
        with remote_input.one_snapshot():  # its steps open an input in object storage as one listing, small reads once
            code = _run_job(cfg)
    except Exception as exc:  # noqa: BLE001 - a bug in osdpipe: one line, the traceback on request
        if cfg.runtime.debug:
            traceback.print_exc()
        _internal_error(exc)
        code = EXIT_FAILED
    _exit_codes.append(code)
    _record_sweep_job(cfg, code, time.perf_counter() - start)
    return code == EXIT_OK


def _record_sweep_job(cfg: DictConfig, code: int, seconds: float) -> None:
    """In a sweep, keep what the summary needs of this job, above all what no report.json says (a bad config writes
    none)."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return
    # Where the job's report.json is: its output, unless that is the job's directory or a URL (the run directory the
    # osdpipe_run_dir resolver chose: a conversion into object storage is made and its record kept there)
    written = cfg.output.path
    output_dir = written if written is not None and not store.is_url(written) else hydra_cfg.runtime.output_dir
    error = _job_errors[0] if _job_errors else None
    record = JobRecord(
        hydra_cfg.job.num,
        tuple(hydra_cfg.overrides.task),
        code,
        error,
        seconds,
        str(output_dir),
        str(hydra_cfg.sweep.dir),
    )
    _sweep_jobs.append(record)


def _given_to_another_job(given: str | None) -> str | None:
    """In a sweep, why ``output.path`` (as the user gave it, resolved; ``None``: each job's own directory) cannot be
    this job's: an earlier job of the sweep was given the same. Its conversion would be refused there, or with
    ``output.overwrite=true`` replace the earlier job's, and the sweep would end with one conversion of many. The
    first job given a path is noted here, in :data:`_sweep_outputs`."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN or given is None:
        return None
    key = given if store.is_url(given) else os.path.abspath(given)
    first = _sweep_outputs.setdefault(key, hydra_cfg.job.num)
    if first == hydra_cfg.job.num:
        return None
    return (f"output.path={given!r} was job {first}'s too: each job of a sweep writes a conversion of its own; leave "
            "output.path out (each job writes into <sweep dir>/<job number>) or make it differ per job "
            "('output.path=/ckpt/sweep/${hydra:job.num}')")


def job_config(cfg: DictConfig, job_dir: str, overrides: Sequence[str] = ()) -> dict:
    """The plain dict a job validates: ``cfg`` resolved, ``output.path`` defaulting to the job's directory, and the
    model named by torchtitan's names where ``overrides`` (the user's) name no model otherwise
    (:func:`osdpipe.spec.config.name_torchtitans_model`)."""
    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    if raw.get("output", {}).get("path") is None:
        raw["output"]["path"] = job_dir
    named = {o.lstrip("+~").split("=", 1)[0].strip() for o in overrides if "=" in o}
    return name_torchtitans_model(raw, model_given=bool(named & {"model", "model.factory"}))


def _config_error(exc: Exception) -> int:
    """Say a bad config, one line per problem, and remove the directories Hydra made for the job."""
    return _refused([f"config: {line}" for line in str(exc).splitlines()])


def _refused(lines: Sequence[str]) -> int:
    """Say why the job cannot run (exit code 2), one line per problem, and remove the directories Hydra made for it:
    a job refused before it ran leaves nothing behind."""
    for line in lines:
        _error(line)
    new_dirs.discard(HydraConfig.get().runtime.output_dir)
    return EXIT_CONFIG


def _run_job(cfg: DictConfig) -> int:
    raw = job_config(cfg, HydraConfig.get().runtime.output_dir, HydraConfig.get().overrides.task)
    try:
        checked = check_schema(raw)
    except ConfigError as exc:
        return _config_error(exc)
    if (why := output_takes_input(checked.output.path, checked.input.path)) is not None:
        return _config_error(ConfigError([why]))
    if (why := _given_to_another_job(cfg.output.path)) is not None:
        return _config_error(ConfigError([why]))
    remote = raw["output"]["path"] if store.is_remote(raw["output"]["path"]) else None
    if remote is not None:  # made in local directories, then uploaded (osdpipe.io.remote_output)
        raw["output"]["path"] = made_in(HydraConfig.get().runtime.output_dir)
        local = checked.output.model_copy(update={"path": raw["output"]["path"]})
        checked = checked.model_copy(update={"output": local})
    runtime = checked.runtime
    if rankserver.starts_ranks(runtime.mode, runtime.workers, checked.input.path is not None, runtime.launcher):
        rankserver.start()  # where the command line did not say (a recipe's runtime.mode, say); started once
    # Imported here, past the schema check, to keep torch out of --help and config errors.
    from osdpipe.pipeline.execute import check_source, execute
    from osdpipe.run.collective import one_line
    from osdpipe.spec.plan import plan_run
    from osdpipe.spec.reconcile import Contradiction, Given, reconcile

    try:
        # What the input's files show settles what the user did not say, and refuses what they said wrongly.
        raw, notes = reconcile(raw, Given.from_overrides(HydraConfig.get().overrides.task))
        spec = validate(raw)
        plan = plan_run(spec)  # the model's answers: its tree, and whether both wrappings fit it
    except (ConfigError, Contradiction) as exc:
        return _config_error(exc)
    if spec.input.path is not None:
        try:  # the input's metadata against the model and the source layout, before anything is written
            check_source(plan)
        except ValueError as exc:  # the files are not what the config describes (InputError, among them)
            return _refused([one_line(exc)])
    return _made_and_published(
        spec,
        remote,
        lambda said, upload: execute(
            replace(plan, upload=upload), warnings=[*notes, *said], source_checked=spec.input.path is not None
        ),
    )


def made_in(job_dir: str) -> str:
    """Where this process makes its part of a conversion bound for object storage: the job's directory, where the
    run's record stays; under torchrun, a process other than rank 0 makes its ranks' files in a directory of its own
    inside its job's (nodes share no filesystem, and the processes of one node may share a job's directory), sends
    them as they are written, and removes the directory at the end (:func:`_made_and_published`)."""
    rank = int(os.environ.get("RANK", "0"))
    return job_dir if rank == 0 else os.path.join(job_dir, f".rank-{rank}")


def _made_and_published(
    spec: RunSpec, remote: str | None, run: Callable[[list[str], remote_output.Upload | None], Report]
) -> int:
    """``run`` the conversion ``spec`` says (given what the destination found to say, and where to send files as they
    are written, if it can), said as every run is; where the user's ``output.path`` is ``remote`` (a URL), the
    conversion is made in the job's directory (``spec``'s) and then committed there whole
    (:mod:`osdpipe.io.remote_output`: the prefix proven writable first, an earlier run's leftovers recovered; what a
    failed run sent removed).

    Under torchrun rank 0 alone prepares the prefix, commits and publishes; the other processes learn from it, when
    the world meets, how the prefix is written (:func:`osdpipe.pipeline.execute.execute`), and send their ranks' files
    as they are written."""
    from osdpipe.io import remote_output  # fsspec: only for an output in object storage, imported lazily within

    destination = upload = None
    try:
        if remote is not None:
            destination, upload = _destination(spec, remote)
        report = run(destination.notes if destination else [], upload)
    except OutputError as exc:
        return _refused([exc.said()])
    if remote is not None and not _is_rank0():  # its files are in the prefix, or removed by rank 0
        shutil.rmtree(spec.output.path, ignore_errors=True)
        new_dirs.discard(HydraConfig.get().runtime.output_dir)  # its job's, unless rank 0's record is there
        return _said(report, spec, remote)
    if destination is not None and not report.ok:
        remote_output.discard(destination)  # the files its ranks sent before it failed
    if destination is not None and report.ok:
        from osdpipe.run import progress  # tqdm: past the schema check

        display = progress.Display(progress.wanted(spec.runtime.progress))
        display.phase(f"uploading to {remote}", unit="B")
        try:
            remote_output.publish(destination, Path(spec.output.path), lambda done, total: display(
                ("items", done, total)))
        except OutputError as exc:
            _error(f"{exc} (the conversion, whole, is in {spec.output.path})")
            return EXIT_FAILED
        finally:
            display.close()
    return _said(report, spec, remote or spec.output.path)


def _destination(
    spec: RunSpec, remote: str
) -> tuple[remote_output.Destination | None, remote_output.Upload]:
    """The prefix ``remote`` prepared (:func:`osdpipe.io.remote_output.prepare`), and how the ranks send files into
    it. Under torchrun rank 0 alone prepares it; the others, and rank 0 where the prefix is refused, go on to meet it
    in the world, where it says the refusal to every rank (the others would wait for it there until torchrun stopped
    them).

    Raises:
        OutputError: the prefix refused, outside torchrun.
    """
    from osdpipe.io import remote_output

    options, budget = spec.runtime.storage_options, spec.runtime.memory_budget
    torchrun = rankserver.joins_torchrun(spec.runtime.launcher)
    if torchrun and not _is_rank0():
        return None, remote_output.Upload.from_rank0(remote, options, budget)
    try:
        destination = remote_output.prepare(remote, spec.output.overwrite, options, budget)
    except OutputError as exc:
        if not torchrun:
            raise
        return None, remote_output.Upload.from_rank0(remote, options, budget, refused=str(exc))
    return destination, destination.upload


def _said(report: Report, spec: RunSpec, where: str) -> int:
    """Say how a run ended (``where``: the output, as the user named it), on rank 0 (every rank under torchrun agreed
    on it); its exit code."""
    if rankserver.in_torchrun():
        # the run is over: torchrun stopping the ranks must not cut this rank's last words and exit code
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not _is_rank0() and (report.ok or report.agreed):
        return EXIT_OK if report.ok else EXIT_FAILED  # rank 0 speaks for every rank: it raised the same error
    if report.ok:
        print(summarize(report, where), flush=True)
        for warning in report.warnings:
            print(f"osdpipe: warning: {warning}", file=sys.stderr)
        return EXIT_OK
    if spec.runtime.debug and report.traceback:
        print(report.traceback, file=sys.stderr)
    written = f" (report: {Path(spec.output.path) / 'report.json'})" if _is_rank0() else ""  # rank 0 writes it
    _error(f"{report.failure}{written}")
    return EXIT_FAILED


def hydra_message(exc: BaseException) -> str:
    """Hydra's or OmegaConf's complaint about the command line, in one line that says what to do."""
    text = str(exc)
    if isinstance(exc, MissingConfigException):
        missing = text.split("Could not find '", 1)[-1].split("'", 1)[0]
        group, _, name = missing.rpartition("/")
        options = [
            line.strip()
            for line in text.split("Available options", 1)[-1].splitlines()[1:]
            if line.startswith("\t") and line.strip()
        ]
        if group:
            options = [o for o in options if "=" not in o and "path" not in o]
            return (
                f"{group}={name}: no such {group}; choose one of {', '.join(options)}"
                if options
                else f"{group}={name}: no such {group}"
            )
    if "Could not override '" in text or "Key '" in text and "is not in struct" in text:
        return unknown_key(text.split("'", 2)[1])
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    if isinstance(exc, OverrideParseException):
        return (
            f"{exc.override} cannot be parsed ({first}); "
            "write overrides as key=value, quoting lists: 'target.wrap=[Block]'"
        )
    return first


def open_dict_overrides(args: list[str]) -> list[str]:
    """Let ``model.kwargs.depth=12`` add a key the composed config does not have (as ``++`` would); a dict given whole
    is merged into the recipe's."""
    return [f"++{a}" if "=" in a and _in_open_dict(a.split("=", 1)[0]) else a for a in args]


def _in_open_dict(key: str) -> bool:
    return any(key == d or key.startswith(f"{d}.") for d in OPEN_DICTS)


def main() -> None:
    """Console entry point (see the module docstring for the exit codes)."""
    args = sys.argv[1:]  # check, inspect and --version are answered before this module is imported (osdpipe.cli.entry)
    debug = any(a.lstrip("+") == "runtime.debug=true" for a in args)
    sys.argv = [sys.argv[0], *open_dict_overrides(args)]
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra's errors reach the handler below, which says them in one line
    _exit_codes.clear()
    _sweep_jobs.clear()
    _sweep_outputs.clear()
    try:
        run()
    except (HydraException, OmegaConfBaseException) as exc:
        if debug:
            traceback.print_exc()
        _error(hydra_message(exc))
        sys.exit(EXIT_CONFIG)
    except OSError as exc:  # Hydra creates the run directory (output.path, when given) before the job starts
        _error(f"output.path: cannot create {exc.filename} ({exc.strerror}); choose a directory you can write to")
        sys.exit(EXIT_CONFIG)
    except Exception as exc:  # noqa: BLE001 - a bug in osdpipe: one line, the traceback on request
        if debug:
            traceback.print_exc()
        _internal_error(exc)
        sys.exit(EXIT_FAILED)
    code = max(_exit_codes, default=EXIT_OK)  # a bad config (2) outranks a failed conversion (1)
    if _sweep_jobs and _is_rank0():
        code = _summarize_sweep(code)
    sys.exit(code)


def _summarize_sweep(code: int) -> int:
    """The sweep's table, sweep.json and sweep.png; a summary that cannot be written is an error (exit code
    at least 1)."""
    try:
        problem = summarize_sweep(_sweep_jobs, code)
    except Exception as exc:  # noqa: BLE001 - a bug in the summary: one line; the jobs' reports are in place
        _internal_error(exc)
        return max(code, EXIT_FAILED)
    if problem is None:
        return code
    _error(problem)
    return max(code, EXIT_FAILED)


if __name__ == "__main__":
    main()
