"""``osdpipe check OUTPUT_DIR [key=value ...]``: prove a converted checkpoint right later, without converting it again
to disk.

Two checks, and a third when asked, each said in one line:

* ``files``: every file ``manifest.json`` lists is there with its sha256;
  where a file differs, its tensors' digests name the tensor that does.
* ``roundtrip`` (when the source can be read): every target rank's state is
  derived again from the source, in memory and offline (the stages ``load``
  to ``rekey``; nothing is written), and compared with what the files hold,
  bitwise: the first differing key, tensor and element are named. The
  source is the manifest's ``input.path``, the ``source/`` a generated
  conversion keeps, or ``input.path=...`` given on the command line (a
  checkpoint that moved).
* ``load`` (with ``--load``): on a local world of ``target.world_size``
  ranks, each rank's target optimizer, on a live model wrapped as the target
  says, loads what the files hold, as a resuming job would (a param-ID keyed
  file as it is; an FQN-keyed one through its kind's PyTorch loading API),
  and takes one step on synthetic gradients: every state element that was
  finite must stay finite (the ``load_step`` check of ``verify``).

The conversion's config comes from the manifest; ``key=value`` arguments
override it (``input.path``, ``model.factory`` where a module moved).

``OUTPUT_DIR`` may be a URL, ``s3://bucket/prefix`` (or ``gs://``), where ``output.path=s3://...`` committed a
conversion: ``manifest.json`` is read from the prefix and every file it lists is hashed as it streams in (never
written to disk); ``strays`` names the objects an unfinished run left under ``<prefix>/.incoming/`` (they do not touch
the committed conversion; the next run into the prefix removes them); ``roundtrip`` reads the source and the files
by range, as a conversion from a URL reads its input; ``--load`` loads a copy of the files in a temporary directory
(the target job's loaders read local files), removed after. The store's own endpoint and credentials are used
(:mod:`osdpipe.io.remote_input`).

Exit codes: 0 every check passed; 1 a check failed; 2 the command line or the
directory cannot be checked (no manifest, an unknown key).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# the stages' products (CheckResult: what verify's checks give); it imports no torch
from osdpipe.run.products import CheckResult, Keyed, Tally

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: The conversion's stages the ``roundtrip`` check plays again: those that derive a rank's state from the source.
DERIVING_STAGES = ("load", "broadcast", "flatten", "shard", "rekey")
USAGE = (
    "usage: osdpipe check OUTPUT_DIR [--load] [key=value ...]  "
    "(--load: load it on a target world and step; input.path=... names a source that moved)"
)


class CheckUsageError(ValueError):
    """The directory or the command line cannot be checked (exit code 2)."""


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / "manifest.json"
    if not path.is_file():
        raise CheckUsageError(f"{path} does not exist; point osdpipe check at the output.path of a finished conversion")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckUsageError(f"{path} cannot be read as JSON ({exc}); it is not a manifest osdpipe wrote") from None
    if not isinstance(manifest, dict) or not all(
        isinstance(manifest.get(k), dict) for k in ("config", "files", "tensors")
    ):
        raise CheckUsageError(f"{path} has no config, files and tensors tables; it is not a manifest osdpipe wrote")
    return manifest


def check_files(directory: Path, manifest: dict[str, Any]) -> CheckResult:
    """Every file the manifest lists, with its digest; for a torch file that differs, the tensor that does.

    A file the manifest lists under ``pieces`` has the digest of its pieces
    (:func:`osdpipe.io.torchfile.pieces_digest`); any other, and every file of a
    manifest written before pieces, its sha256.
    """
    from osdpipe.io.digest import file_sha256  # imports torch: not on check --help's path (tests/cli/test_startup.py)
    from osdpipe.io.torchfile import pieces_digest

    problems = []
    pieces = manifest.get("pieces", {})
    for name, digest in sorted(manifest["files"].items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        try:
            if not isinstance(path, Path):  # in object storage: hashed as it streams in
                got = _streamed_digest(path, pieces.get(name))
            else:
                got = pieces_digest(path, pieces[name]) if name in pieces else file_sha256(path)
        except ValueError as exc:  # longer or shorter than its pieces
            got = str(exc)
        if got != digest:
            problems.append(
                f"{path} differs from its digest in the manifest" + _tensor_named(path, name, manifest["tensors"])
            )
    count = len(manifest["files"])
    return CheckResult(
        "files", not problems, "; ".join(problems[:5]) or f"{count} file(s) match the manifest's digests"
    )


def _streamed_digest(path: Any, pieces: list[int] | None) -> str:
    """An object's digest as the manifest records it, hashed as it streams in
    (:class:`osdpipe.io.remote_input.RemotePath`): the sha256 of its bytes, or with ``pieces`` (lengths) the digest
    of its pieces' (:func:`osdpipe.io.torchfile.digest_of_pieces`)."""
    import hashlib

    from osdpipe.io.torchfile import digest_of_pieces

    cuts = list(pieces) if pieces is not None else None
    digests, h, left = [], hashlib.sha256(), cuts.pop(0) if cuts else None
    with path.stream() as f:
        while chunk := f.read(1 << 24):
            view = memoryview(chunk)
            while view:
                if left is None:  # one sha256 of the whole, or past the last piece
                    if cuts is not None:
                        raise ValueError(f"{path} is longer than its pieces say")
                    h.update(view)
                    break
                take = min(left, len(view))
                h.update(view[:take])
                view, left = view[take:], left - take
                if left == 0:
                    digests.append(h.hexdigest())
                    h, left = hashlib.sha256(), (cuts.pop(0) if cuts else None)
    if cuts is None:
        return h.hexdigest()
    if left is not None or cuts:
        raise ValueError(f"{path} is shorter than its pieces say")
    return digest_of_pieces(digests)


def _tensor_named(path: Path, name: str, tensors: dict[str, str]) -> str:
    """``": tensor 3.exp_avg differs"``, from the file's tensor digests against the manifest's (empty when it cannot
    tell)."""
    if not isinstance(path, Path) or path.suffix != ".pt":  # in object storage: not loaded here
        return ""
    # torch: not on check --help's path (tests/cli/test_startup.py)
    import torch

    from osdpipe.io.digest import tensor_digests

    try:
        got = tensor_digests(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    except Exception as exc:  # noqa: BLE001 - a file too damaged to load says so
        return f" and does not load ({type(exc).__name__})"
    prefix = f"{name}:"
    expected = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    differ = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
    return (
        f": tensor(s) {', '.join(differ[:3])} differ"
        if differ
        else ": every tensor matches, so the rest of the file differs"
    )


def conversion_config(directory: Path, manifest: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """The manifest's config with the command line's overrides, its source found, and its output being this directory
    (never written)."""
    # omegaconf: not on check --help's path, nor in the ranks --load starts (they import this module)
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise CheckUsageError(f"{bad[0]} is not key=value; {USAGE}")
    base = OmegaConf.create(manifest["config"])
    OmegaConf.set_struct(base, True)
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as exc:
        key = next((o.split("=", 1)[0] for o in overrides if o.split("=", 1)[0] in str(exc)), "an override")
        raise CheckUsageError(
            f"{key}: not a key of the conversion's config; "
            "check its spelling against the config reference in docs/config.md"
        ) from None
    raw = OmegaConf.to_container(merged, resolve=True)
    assert isinstance(raw, dict)
    raw["output"] = {**raw["output"], "path": str(directory), "overwrite": True}
    if not any(o.split("=", 1)[0] == "input.path" for o in overrides):
        raw["input"] = {**raw["input"], "path": _input_where_it_was(directory, manifest, raw["input"].get("path"))}
    # a generated source is kept in the conversion's source/, in the format its world saved
    if raw["input"].get("path") is None:
        # the registries import torch: not on check --help's path
        from osdpipe.io import checkpoints, formats
        from osdpipe.layout import kinds

        layout = checkpoints.get((raw.get("checkpoint") or {}).get("layout", "optimizer"))
        if layout.whole:  # the framework's own folder, named as the framework names it
            fmt, name = layout.input_formats[0], layout.generated_name(raw["generate"]["steps"])
        else:
            fmt = kinds.get(raw["source"]["kind"]).saved_format(raw["source"]["state_dict_type"])
            name = formats.get(fmt).generated_name
        generated = directory / "source" / name
        if generated.exists():
            raw["input"] = {**raw["input"], "path": str(generated), "format": fmt}
    raw["runtime"] = {**raw["runtime"], "mode": "offline", "transfer": "shared", "progress": False}
    # The check derives each rank's state again and holds it against the files: what the stages before save make. Its
    # plan says so, or the shard stage would do what it does for a conversion that saves and verifies (under
    # runtime.memory_budget, leave the state to be made as save writes it: zeros to compare with).
    raw["pipeline"] = {**(raw.get("pipeline") or {}), "stages": list(DERIVING_STAGES)}  # the Python API's have none
    return raw


def _input_where_it_was(directory: Path, manifest: dict[str, Any], typed: str | None) -> str | None:
    """The conversion's input as it was found when it ran: the absolute path the manifest recorded beside what the user
    typed, so that a relative ``input.path`` is found from any working directory; refused in one line where it moved."""
    from osdpipe.io.output import INPUT_ABSOLUTE  # the output directory's names; torch: not on check --help's path
    from osdpipe.io.store import is_url  # no torch

    absolute = manifest.get(INPUT_ABSOLUTE)
    if typed is None or absolute is None:  # a generated source, or a manifest written before the path was recorded
        return typed
    if is_url(absolute):  # object storage: the same from anywhere; the check's first read says if it is gone
        return absolute
    if not Path(absolute).exists():
        raise CheckUsageError(
            f"the conversion's input {typed!r} (at {absolute} when it ran) is not there any more; "
            f"pass input.path=WHERE_IT_IS_NOW to check {directory} against it"
        )
    return absolute


def conversion_plan(raw: dict[str, Any]) -> Any:
    """The plan of the conversion's config (a config that does not validate, or a model it does not fit, cannot be
    checked: exit 2)."""
    # pydantic (config) and torch (plan): not on check --help's path
    from osdpipe.spec.config import ConfigError, validate
    from osdpipe.spec.plan import plan_run

    try:
        return plan_run(validate(raw))
    except ConfigError as exc:
        raise CheckUsageError(f"the conversion's config does not validate: {str(exc).splitlines()[0]}") from None


def check_roundtrip(directory: Path, plan: Any) -> CheckResult:
    """Derive every target rank's state from the source again (offline, in memory) and compare it with the files."""
    spec = plan.spec
    if spec.input.path is None:
        return CheckResult("roundtrip", True, "skipped: no source to compare with (give input.path=...)")
    fmt = plan.output_format
    problems: list[str] = []
    opened: dict[str, Any] = {}
    for played in expected_results(plan):
        keyed = played.find(Keyed)
        if keyed.weights is not None:  # a whole checkpoint, laid out by its layout
            # torch.distributed.checkpoint: only for a whole checkpoint
            from osdpipe.io.checkpoints.output import rank_parts

            parts = rank_parts(keyed, plan.output_checkpoint)
            problems += plan.output_checkpoint.differences(
                directory, parts, played.ctx.rank, world_size=plan.world_size, tree=plan.tree, fmt=fmt, opened=opened,
                target=plan.target_spec,
            )
        else:
            problems += fmt.differences(
                directory,
                spec.output.key,
                played.ctx.rank,
                keyed.state_dict,
                tree=plan.tree,
                world_size=plan.world_size,
                opened=opened,
            )
        # one file, rank 0's: the other ranks write none (never a whole checkpoint's format)
        if len(problems) >= 5 or fmt.one_writer:
            break
    return CheckResult(
        "roundtrip",
        not problems,
        "; ".join(problems[:5])
        or f"every {fmt.name} tensor equals the source's, element by element ({spec.input.path})",
    )


def expected_results(plan: Any) -> Any:
    """Each target rank once the conversion's own stages derived its state from the source, offline
    (:class:`~osdpipe.pipeline.loop.Played`)."""
    # torch: not on check --help's path
    from osdpipe.pipeline.loop import play
    from osdpipe.run.world import SoloWorld

    yield from play(plan, SoloWorld(plan.world_size), DERIVING_STAGES)


def check_load(directory: Path, plan: Any) -> list[CheckResult]:
    """Load the files on a local world of the target's ranks, as the target job would: ``load`` (one step) and
    ``resume`` (see the module docstring)."""
    # multiprocessing (rankserver) and torch (launch): only --load starts ranks
    from osdpipe.core import rankserver
    from osdpipe.run.launch import WorldError, run_local_world

    spec = plan.spec
    rankserver.start()
    try:
        results = run_local_world(
            load_rank, spec.target.world_size, (plan, str(directory)), timeout_s=spec.runtime.timeout_s
        )
    except WorldError as exc:
        return [CheckResult("load", False, str(exc))]
    where = f"on {spec.target.world_size} {spec.target.kind} rank(s)"
    findings = []
    for i, name in enumerate(LOAD_CHECKS):
        failed = [f"rank {r}: {checks[i].detail}" for r, checks in enumerate(results) if not checks[i].ok]
        findings.append(CheckResult(name, not failed, "; ".join(failed[:3]) or f"{where}: {results[0][i].detail}"))
    return findings


#: What ``--load`` checks on every rank of the target world.
LOAD_CHECKS = ("load", "resume")


def load_rank(plan: Any, directory: str) -> list[Any]:
    """On one rank of the target world: its optimizer loads what the files hold for it and steps (``load``), and
    resumes (``resume``).

    Returns one ``CheckResult`` per name of :data:`LOAD_CHECKS`.
    """
    # torch: a rank's work, not on check --help's path
    from osdpipe.layout import kinds
    from osdpipe.pipeline.loop import SOURCE_STAGES, play
    from osdpipe.run.context import Context
    from osdpipe.run.world import GroupWorld
    from osdpipe.verify.checks.common import Subject
    from osdpipe.verify.checks.load_step import load_and_step
    from osdpipe.verify.checks.resume import resume_result

    spec, world = plan.spec, GroupWorld()
    kind = kinds.get(spec.target.kind)
    fmt = plan.output_format
    subject = Subject(Context(plan, world, world.rank), None, None, Tally())
    if spec.input.path is not None:  # the source, which resume steps a reference from; every rank takes part
        try:
            subject.source = next(play(plan, world, SOURCE_STAGES)).product
        except Exception:  # noqa: BLE001 - a source that cannot be read leaves resume its storage part, and it says why
            subject.source = None
    model, optim = subject.live
    if plan.checkpoint.whole:  # model and optimizer, loaded as the framework loads them
        from osdpipe.verify.checks.load_step import step_loaded

        def load_as_a_user_does(model: Any, optim: Any) -> None:
            plan.output_checkpoint.load_output(model, optim, Path(directory), world.rank, fmt)

        load_as_a_user_does(model, optim)
        # what the loaded job holds: where two states would share memory, they do here
        written = optim.state_dict()["state"]
        return [step_loaded(subject, model, optim), resume_result(subject, written, load_as_a_user_does)]
    path = fmt.output_path(Path(directory), world.rank)
    written = fmt.read_written(path, spec.output.key)

    def load_as_a_user_does(model: Any, optim: Any) -> None:
        fmt.load_as_a_user_does(model, optim, path, written, kind)

    loaded = load_and_step(subject, written if plan.id_keyed else kind.to_load(model, optim, written))
    return [loaded, resume_result(subject, written["state"], load_as_a_user_does)]


def run_check(args: list[str]) -> int:
    """The command: check, print one line per check, return the exit code.

    Its steps open the source again (planning, the roundtrip's own stages) and, for a conversion in object storage,
    the output: one snapshot of what is in a bucket (:func:`osdpipe.io.remote_input.one_snapshot`), as a run reads
    its input."""
    from osdpipe.io import remote_input  # no torch: fsspec only once a URL is opened

    with remote_input.one_snapshot():
        return _run_check(args)


def _run_check(args: list[str]) -> int:
    if not args or args[0].startswith("-"):
        print(USAGE, file=sys.stderr if args[:1] != ["--help"] else sys.stdout)
        return EXIT_OK if args[:1] == ["--help"] else EXIT_USAGE
    directory, load = Path(args[0]), "--load" in args[1:]
    overrides = [a for a in args[1:] if a != "--load"]
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:
        print(f"osdpipe check: error: {unknown[0]} is not an option; {USAGE}", file=sys.stderr)
        return EXIT_USAGE
    from osdpipe.io.store import is_url, slash_short  # no torch

    if is_url(args[0]):  # object storage; another scheme is refused there in one line, not looked for on the disk
        return _check_remote(args[0], load, overrides)
    if (why := slash_short(args[0])) is not None:
        print(f"osdpipe check: error: {why}", file=sys.stderr)
        return EXIT_USAGE
    try:
        manifest = read_manifest(directory)
        raw = conversion_config(directory, manifest, overrides)
        if load:
            _loadable(raw)
        plan = conversion_plan(raw)
    except CheckUsageError as exc:
        print(f"osdpipe check: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # the manifest's config cannot be composed (an interpolation, an unknown kind)
    except Exception as exc:  # noqa: BLE001
        from osdpipe.run.collective import one_line  # imports torch: only on an error, not on check --help's path

        print(
            f"osdpipe check: error: {directory / 'manifest.json'}: its config cannot be used: {one_line(exc)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    checks = [
        ("files", lambda: check_files(directory, manifest)),
        ("roundtrip", lambda: check_roundtrip(directory, plan)),
    ]
    findings = [_run_one(name, run) for name, run in checks]
    if load:
        findings += _run_many("load", lambda: check_load(directory, plan))
    return _said(findings, directory)


def _loadable(raw: dict[str, Any]) -> None:
    """Refuse ``--load`` of an output whose target job osdpipe does not build (a Megatron-LM save's: megatron-core's
    own), in one line.

    Raises:
        CheckUsageError: naming why.
    """
    from osdpipe.layout import kinds

    kind = kinds.find((raw.get("target") or {}).get("kind"))
    if kind is not None and kind.no_live_job is not None:
        raise CheckUsageError(f"--load: {kind.no_live_job}, which osdpipe does not start (tests/frameworks/"
                              "test_megatron.py loads every conversion so); check it without --load")


def _check_remote(url: str, load: bool, overrides: list[str]) -> int:
    """A conversion committed into object storage: ``files`` (streamed and hashed), ``strays``, and ``roundtrip``
    (the source read again, each rank's state derived again and held against the files, read from the bucket)."""
    # fsspec and torch: not on check --help's path
    from osdpipe.io.remote_input import as_path, probe
    from osdpipe.io.remote_output import INCOMING, WRITING
    from osdpipe.run.collective import one_line

    try:
        probe(url, "OUTPUT_DIR")
        directory = as_path(url)
        incoming = directory / INCOMING
        if not (directory / "manifest.json").is_file() and (incoming / "manifest.json").is_file():
            return _check_cut_commit(url, directory, incoming)
        if not (directory / "manifest.json").is_file() and (incoming / WRITING).is_dir():
            return _check_cut_write(url, directory, incoming)
        manifest = read_manifest(directory)  # a RemotePath answers as a Path does here
        raw = conversion_config(directory, manifest, overrides)
        if load:
            _loadable(raw)
        plan = conversion_plan(raw)
    except CheckUsageError as exc:
        print(f"osdpipe check: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - the store's failure, said in one line
        print(f"osdpipe check: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    findings = [
        _run_one("files", lambda: check_files(directory, manifest)),
        _run_one("strays", lambda: check_strays(directory)),
        _run_one("roundtrip", lambda: check_roundtrip(directory, plan)),
    ]
    if load:
        findings += _run_many("load", lambda: _load_a_copy(directory, manifest, plan))
    return _said(findings, directory)


def _load_a_copy(directory: Any, manifest: dict[str, Any], plan: Any) -> list[CheckResult]:
    """``--load`` of a conversion in object storage: its files copied into a temporary directory (``TMPDIR``: it
    needs room for them), loaded there on the target world as a local conversion is (:func:`check_load`), the copy
    removed. The target job's loaders read local files; the ``files`` check has hashed the objects already."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="osdpipe-check-load-") as copy:
        for name in sorted(manifest["files"]):
            local = Path(copy) / name
            local.parent.mkdir(parents=True, exist_ok=True)
            with (directory / name).open() as remote, local.open("wb") as out:
                shutil.copyfileobj(remote, out, 16 << 20)
        return check_load(Path(copy), plan)


def _check_cut_commit(url: str, directory: Any, incoming: Any) -> int:
    """A prefix whose commit a killed run cut (:mod:`osdpipe.io.remote_output`, steps 2 to 4): the old conversion's
    manifest is gone, the new conversion is whole under ``.incoming/``. The prefix is no conversion a reader can take
    until the next run into it finishes the commit: said as a failure, with the new conversion's files checked."""
    manifest = read_manifest(incoming)
    findings = [
        _run_one("files", lambda: check_files(incoming, manifest)),
        CheckResult(
            "commit",
            False,
            f"a run was killed while committing into {url}: the prefix holds no whole conversion until the next run "
            f"into it (output.path={url}) finishes the commit of the one under {incoming}/ (checked above)",
        ),
    ]
    return _said(findings, directory)


def _check_cut_write(url: str, directory: Any, incoming: Any) -> int:
    """A prefix into which a killed run was writing a conversion straight (it held none before,
    :mod:`osdpipe.io.remote_output`): some of its files, no manifest. No conversion is there: said as a failure, with
    the files the next run removes."""
    from osdpipe.io.remote_output import WRITING, named_in_notes

    notes = [f"{WRITING}/{p.name}" for p in (incoming / WRITING).iterdir()]
    try:
        named = named_in_notes(lambda note: (incoming / note).read_bytes(), notes)
    except (ValueError, KeyError, TypeError):
        named = []
    written = [n for n in named if (directory / n).is_file()]
    shown = ", ".join(written[:5]) + (f" and {len(written) - 5} more" if len(written) > 5 else "")
    finding = CheckResult(
        "commit",
        False,
        f"a run was killed while writing a conversion into {url}, which held none: {len(written)} of its "
        f"{len(named)} file(s) are there ({shown or 'none'}), no manifest, so no reader takes them for a conversion; "
        f"the next run into it (output.path={url}) removes them",
    )
    return _said([finding], directory)


def check_strays(directory: Any) -> CheckResult:
    """The objects an unfinished run left under a prefix's ``.incoming/`` (:mod:`osdpipe.io.remote_output`)."""
    from osdpipe.io.remote_output import INCOMING

    incoming = directory / INCOMING
    names = sorted(p.key.removeprefix(incoming.key + "/") for p in _objects_under(incoming))
    if not names:
        return CheckResult("strays", True, f"nothing under {incoming}/")
    if "manifest.json" in names:
        return CheckResult(
            "strays",
            True,
            f"a run was killed while committing into {directory}: the whole conversion it uploaded is under "
            f"{incoming}/ ({len(names)} object(s)); the next run into the prefix finishes its commit, replacing this "
            "one",
        )
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return CheckResult(
        "strays",
        True,
        f"{len(names)} stray object(s) an unfinished run left under {incoming}/: {shown}; they do not touch this "
        "conversion, and the next run into the prefix removes them",
    )


def _objects_under(directory: Any) -> list[Any]:
    todo, found = [directory], []
    while todo:
        for child in todo.pop().iterdir():
            (found if child.is_file() else todo).append(child)
    return found


def _said(findings: list[CheckResult], directory: Path) -> int:
    """Print one line per check and the verdict; the exit code."""
    for f in findings:
        print(f"  check {f.name:<10} {'pass' if f.ok else 'FAIL'}  {f.detail}")
    ok = all(f.ok for f in findings)
    print(f"osdpipe check: {'OK' if ok else 'FAILED'}  {directory}", file=sys.stdout if ok else sys.stderr)
    return EXIT_OK if ok else EXIT_FAILED


def _run_many(name: str, run: Any) -> list[CheckResult]:
    """The findings of ``run``; if it cannot run at all, one failed finding called ``name``."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - said as the check's failure, not as a traceback
        from osdpipe.run.collective import one_line  # imports torch: only on an error, not on check --help's path

        return [CheckResult(name, False, one_line(exc))]


def _run_one(name: str, run: Any) -> CheckResult:
    """One check's finding; a file or source that cannot be read, or does not fit, fails that check in one line."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - said as the check's failure, not as a traceback
        from osdpipe.run.collective import one_line  # imports torch: only on an error, not on check --help's path

        return CheckResult(name, False, one_line(exc))
