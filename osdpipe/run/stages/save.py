"""save: write the target format atomically, with a manifest.

Every rank writes into ``<output.path>/.staging`` (made by the launcher, see
:mod:`osdpipe.io.output`), hashing as it writes (:mod:`osdpipe.io.digest`); only
when every rank has written its files and checked their structure does the
process that plays rank 0 write ``manifest.json`` there and commit the staged
conversion (:func:`commit`, called by :mod:`osdpipe.pipeline.loop` after the last
rank), replacing a previous one as a whole. A failure on any rank leaves
the output directory as it was: nothing half-written. A run whose verify
failed writes no data. Where the output is bound for object storage, a
rank's files go up as they are written and are made whole once they are
checked (:mod:`osdpipe.io.upload_queue`).
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from osdpipe.core.version import __version__
from osdpipe.io import output
from osdpipe.io.formats.base import RankFiles
from osdpipe.io.store import is_url
from osdpipe.io.torchfile import PieceDigest, filled_as_written
from osdpipe.io.upload_queue import UploadQueue
from osdpipe.io.weights import WholeSource
from osdpipe.run.collective import agree, barrier, gather_to_all, one_line
from osdpipe.run.context import Context
from osdpipe.run.products import Keyed, Staged, Tally, Verified, find
from osdpipe.run.stages.broadcast import act_on_nonfinite
from osdpipe.run.streamed_output import StreamedOutput

if TYPE_CHECKING:
    from osdpipe.io.checkpoints.base import Carrying

def save(ctx: Context, before: Keyed | Verified, tally: Tally) -> Staged:
    """Stage this rank's files; :func:`commit` commits every rank's once the last has written
    (see :mod:`osdpipe.pipeline.loop`)."""
    passed = not isinstance(before, Verified) or before.ok
    if not all(gather_to_all(passed)):
        # a result that failed verify is not written;
        # report.json says where it differs (every rank returns: the collectives below stay in step)
        return Staged(before, None)
    keyed = find(before, Keyed)
    assert keyed is not None
    staging = Path(ctx.spec.output.path) / output.STAGING
    if ctx.rank == 0:
        staging.mkdir(parents=True, exist_ok=True)  # the launcher made it; the Python API's caller may not have
    barrier()
    fmt = ctx.output_format
    mine = RankFiles()
    error = None
    queue = ctx.world.kept.get(UploadQueue)
    try:
        streamed = keyed.sharded.streamed
        with (
            filled_as_written(streamed) if streamed is not None else nullcontext(),
            queue.following(staging) if queue is not None else nullcontext(),
        ):
            if keyed.weights is not None:
                mine = _write_whole(ctx, keyed, staging)
            elif fmt.writes(ctx.rank):
                mine = fmt.write(
                    keyed.state_dict,
                    staging,
                    ctx.rank,
                    key=ctx.spec.output.key,
                    tree=ctx.tree,
                    world_size=ctx.world_size,
                    shared=ctx.world.kept,
                )
        if streamed is not None:
            _made_as_written(ctx, streamed, tally)
        tally.moved += sum((staging / name).stat().st_size for name in mine.files)
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error = one_line(exc)
    finally:
        if keyed.sharded.streamed is not None:
            keyed.sharded.streamed.close()
    agree("save", error, rank=ctx.rank)  # on failure the launcher drops the staged run (output.abort)
    if queue is not None:  # an output in object storage: this rank's files go now (or, gone up as they were written,
        queue.send(staging, list(mine.files))  # are made whole), while the next ranks convert
    return Staged(before, mine)


def _made_as_written(ctx: Context, streamed: StreamedOutput, tally: Tally) -> None:
    """Act on what filling the output as it was written found:
    what shard and roundtrip act on when it is filled in memory.

    Raises:
        ValueError: a placeholder was never written (its file would hold zeros), an element differs
            from the source, or the source holds NaN or Inf (without ``input.allow_nonfinite``).
    """
    if streamed.unwritten:
        raise ValueError(
            f"{ctx.output_format.name} output of rank {ctx.rank} was not written from its placeholders "
            f"({', '.join(streamed.unwritten[:3])}): a bug in osdpipe, please report it; "
            "without runtime.memory_budget the output is filled in memory"
        )
    if streamed.differences:
        raise ValueError(
            f"roundtrip, comparing rank {ctx.rank}'s output with the source as it was written: "
            f"{'; '.join(streamed.differences[:5])}"
        )
    act_on_nonfinite(ctx, tally, streamed.nonfinite)
    tally.moved += streamed.filled


def _write_whole(ctx: Context, keyed: Keyed, staging: Path) -> RankFiles:
    """This rank's part of a whole checkpoint, laid out by its layout;
    with ``output.model_format=safetensors``, the first rank that reads the source also exports the model from it."""
    # torch.distributed.checkpoint: only where a whole checkpoint is written
    from osdpipe.io.checkpoints.output import export_safetensors, rank_parts

    source = keyed.source
    parts = rank_parts(keyed, ctx.plan.output_checkpoint)
    mine = ctx.plan.output_checkpoint.write(
        parts, staging, ctx.rank, world_size=ctx.world_size, tree=ctx.tree, shared=ctx.world.kept,
        fmt=ctx.output_format, target=ctx.plan.target_spec, output_config=ctx.spec.output,
    )
    if ctx.spec.output.model_format == "safetensors" and ctx.rank == source.first_reader:
        mine.files.update(
            export_safetensors(
                source.reader, source.meta, ctx.tree, staging, ctx.spec.output.max_shard_size, _to_hf(ctx.spec)
            )
        )
    return mine


def _to_hf(spec: Any) -> Any:
    """The model's own conversion to Hugging Face's names for the export,
    as ``output.model_keys`` asks (``None``: its own names)."""
    from osdpipe.layout.models import hf_adapter  # imports the model's framework: only where it exports

    if spec.output.model_keys == "fqn":
        return None
    return hf_adapter(spec.model.factory, spec.model.kwargs)


#: Config sections that say how a conversion ran, not what it produced: left out of the manifest's hashed content.
RUN_SECTIONS = ("runtime", "pipeline")
#: Keys of the input and output sections that name places or how files are written, not content.
PLACE_KEYS = ("path", "overwrite", "fsync")


def conversion_of(config: dict[str, Any]) -> dict[str, Any]:
    """What defines the converted bytes: the config without paths and without how it ran
    (mode, transfer, budget, checks), and without torchtitan's names for the model
    (``checkpoint.model``, ``checkpoint.flavor``), which the ``model`` section holds."""
    out = {k: v for k, v in config.items() if k not in RUN_SECTIONS}
    for side in ("input", "output"):
        out[side] = {k: v for k, v in config[side].items() if k not in PLACE_KEYS}
    out["checkpoint"] = {k: v for k, v in config["checkpoint"].items() if k not in ("model", "flavor")}
    return out


#: What the manifest's digests are, in its own words: how to check a file by hand.
DIGESTS = (
    "files: a file listed under pieces has the sha256 of its pieces' sha256, "
    "one lowercase hex digest and a newline each: "
    "cut the file at the lengths given, in order, sha256sum each piece, and sha256sum the digests' lines. "
    "Any other file has its sha256 (sha256sum). tensors: the sha256 of each tensor's bytes in row-major order, "
    "which for a torch file's tensor is the digest of its piece."
)


def content_sha256(content: dict[str, Any]) -> str:
    """sha256 of the manifest's content (versions, conversion, files, tensor digests):
    equal for two runs that wrote the same bytes."""
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def source_rank_files(carrying: Carrying, files: dict[str, Any]) -> dict[str, int]:
    """The output's carried files that describe one rank of the world that saved the
    checkpoint (accelerate's ``random_states_<r>.pkl``, the Trainer's
    ``rng_state_<r>.pth``), each with that rank: the manifest's ``source_rank_files``."""
    ranks = {entry.where: entry.source_rank for entry in carrying.entries if entry.source_rank is not None}
    carried = {Path(f).name for f in carrying.files}
    return {
        name: ranks[Path(name).name]
        for name in sorted(files)
        if Path(name).name in ranks and Path(name).name in carried
    }


def commit(ctx: Context, per_rank: list[RankFiles], tally: Tally, carried: WholeSource | None = None) -> dict[str, str]:
    """Finish a DCP checkpoint, write the manifest into the staged conversion and commit it;
    returns the files and their digests.

    Called once, by the process that plays rank 0, with what every rank
    staged (``per_rank``, in rank order); ``carried``: what a whole
    checkpoint carries over (its layout finishes the output).
    """
    staging = Path(ctx.spec.output.path) / output.STAGING
    files = {k: v for r in per_rank for k, v in r.files.items()}
    if carried is not None:
        writer = ctx.plan.output_checkpoint
        finished = writer.finish(staging, ctx.world.kept, per_rank, ctx.output_format, writer.adopt(carried.carrying),
                                 target=ctx.plan.target_spec)
    else:
        finished = ctx.output_format.finish(staging, ctx.world.kept, per_rank)
    files.update(finished)
    tally.moved += sum((staging / name).stat().st_size for name in finished)
    tensors = {k: v for r in per_rank for k, v in sorted(r.tensors.items())}
    extra = {}
    if carried is not None and (ranks := source_rank_files(carried.carrying, files)):
        extra["source_rank_files"] = ranks
    write_manifest(staging, ctx.spec.model_dump(mode="json"), ctx.spec.output.format, files, tensors, extra)
    output.commit(staging.parent, ctx.spec.output.fsync)
    return files


def write_manifest(
    staging: Path, config: dict[str, Any], fmt: str, files: dict[str, Any], tensors: dict[str, str],
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``manifest.json`` into the staged conversion: its content (versions, what was converted, each file's
    digest, each tensor's, ``extra``), that content's sha256, the config, and where the input was."""
    content = {
        "osdpipe_version": __version__,
        "torch_version": torch.__version__,
        "conversion": conversion_of(config),
        "format": fmt,
        "digests": DIGESTS,
        "files": {name: str(digest) for name, digest in sorted(files.items())},
        "pieces": {
            name: list(digest.pieces) for name, digest in sorted(files.items()) if isinstance(digest, PieceDigest)
        },
        "tensors": tensors,
        **(extra or {}),
    }
    manifest = {**content, "content_sha256": content_sha256(content), "config": config}
    # what the user typed stays in config; `osdpipe check` from elsewhere needs this
    if config["input"].get("path") is not None:
        typed = config["input"]["path"]  # a URL is where it is from anywhere
        manifest[output.INPUT_ABSOLUTE] = typed if is_url(typed) else os.path.abspath(typed)
    (staging / output.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
