"""save: write the target format atomically, with a manifest.

Every rank writes into ``<output.path>/.staging`` (made by the launcher, see
:mod:`osdpipe.output`), hashing as it writes (:mod:`osdpipe.digest`); only
when every rank has written its files and checked their structure does the
process that plays rank 0 write ``manifest.json`` there and commit the staged
conversion (:func:`commit`, called by :mod:`osdpipe.loop` after the last
rank), replacing a previous one as a whole. A failure on any rank leaves
the output directory as it was: nothing half-written. A run whose verify
failed writes no data.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from osdpipe import __version__, output
from osdpipe.collective import agree, barrier, gather_to_all, one_line
from osdpipe.compare import diff
from osdpipe.context import Context
from osdpipe.digest import save_hashed, tensor_digests

#: Where a ``dcp`` output's checkpoint directory goes, under ``output.path``.
DCP_DIR = "dcp"


@dataclass
class RankFiles:
    """What one target rank wrote: each file's sha256, each tensor's, and for ``dcp`` DCP's record of each item's place."""

    files: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, str] = field(default_factory=dict)
    dcp_results: list[Any] = field(default_factory=list)


def _write_torch(osd: dict[str, Any], path: Path) -> RankFiles:
    """``torch.save`` the state, with its digests taken as it is written, then check the file's structure.

    The bytes were checked by verify while in memory, and hashed on their way
    to disk; reading them back would be a second full pass. The check reads
    the file's index only (``mmap``): the zip structure, every key, dtype
    and shape, and the small values.
    """
    digest, per_tensor = save_hashed(osd, path)
    problems = diff(torch.load(path, map_location="cpu", weights_only=True, mmap=True), osd, tensor_bytes=False)
    if problems:
        raise OSError(f"{path} does not read back as written: {problems[0]}")
    return RankFiles({path.name: digest}, {f"{path.name}:{k}": v for k, v in per_tensor.items()})


def _write_dcp(ctx: Context, staging: Path) -> RankFiles:
    """Write this rank's dim-0 pieces into the DCP checkpoint under ``staging/dcp`` (see :mod:`osdpipe.formats.dcp_writer`)."""
    from osdpipe.formats import dcp_writer

    assert ctx.result is not None
    key = ctx.spec.output.key
    if "dcp_plan" not in ctx.shared:  # the same for every rank: offline, planned once for all of them
        ctx.shared["dcp_plan"] = dcp_writer.plan(key, ctx.result, ctx.tree, ctx.world_size)
    state = dcp_writer.rank_state(ctx.result, ctx.tree, ctx.world_size, ctx.rank, local=True)
    with ThreadPoolExecutor(max_workers=1) as pool:  # the tensors' digests from memory while DCP writes them
        digests = pool.submit(tensor_digests, ctx.result)
        results, file_digests = dcp_writer.write_rank(staging / DCP_DIR, key, state, ctx.rank, ctx.shared["dcp_plan"])
    files = {f"{DCP_DIR}/{name}": digest for name, digest in sorted(file_digests.items())}
    tensors = {f"{next(iter(files))}:{k}": v for k, v in digests.result().items()} if files else {}
    return RankFiles(files, tensors, results)


def save(ctx: Context) -> None:
    """Stage this rank's files; :func:`commit` commits every rank's once the last has written (see :mod:`osdpipe.loop`)."""
    if not all(gather_to_all(all(c.ok for c in ctx.checks))):
        return  # a result that failed verify is not written; report.json says where it differs (every rank returns: the collectives below stay in step)
    assert ctx.result is not None
    out = Path(ctx.spec.output.path)
    staging = out / output.STAGING
    if ctx.rank == 0:
        staging.mkdir(parents=True, exist_ok=True)  # the launcher made it; the Python API's caller may not have
    barrier()
    fmt = ctx.spec.output.format
    mine = RankFiles()
    error = None
    try:
        if fmt == "dcp":
            mine = _write_dcp(ctx, staging)
        elif fmt == "rank_local" or ctx.rank == 0:  # fsdp_full and plain: one file, from rank 0
            mine = _write_torch(ctx.result, staging / (f"rank_{ctx.rank}.pt" if fmt == "rank_local" else "optim.pt"))
        ctx.bytes_moved += sum((staging / name).stat().st_size for name in mine.files)
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error = one_line(exc)
    agree("save", error, rank=ctx.rank)  # on failure the launcher drops the staged run (output.abort)
    ctx.saved = mine


#: Config sections that say how a conversion ran, not what it produced: left out of the manifest's hashed content.
RUN_SECTIONS = ("runtime", "pipeline")
#: Keys of the input and output sections that name places, not content.
PLACE_KEYS = ("path", "overwrite")


def conversion_of(config: dict[str, Any]) -> dict[str, Any]:
    """What defines the converted bytes: the config without paths and without how it ran (mode, transfer, budget, checks)."""
    out = {k: v for k, v in config.items() if k not in RUN_SECTIONS}
    for side in ("input", "output"):
        out[side] = {k: v for k, v in config[side].items() if k not in PLACE_KEYS}
    return out


def content_sha256(content: dict[str, Any]) -> str:
    """sha256 of the manifest's content (versions, conversion, files, tensor digests): equal for two runs that wrote the same bytes."""
    import hashlib

    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def commit(ctx: Context, per_rank: list[RankFiles]) -> dict[str, str]:
    """Finish a DCP checkpoint, write the manifest into the staged conversion and commit it; returns the files and their sha256.

    Called once, by the process that plays rank 0, with what every rank
    staged (``per_rank``, in rank order).
    """
    staging = Path(ctx.spec.output.path) / output.STAGING
    fmt = ctx.spec.output.format
    files = {k: v for r in per_rank for k, v in r.files.items()}
    if fmt == "dcp":
        from osdpipe.formats import dcp_writer

        files[f"{DCP_DIR}/.metadata"] = dcp_writer.finish(staging / DCP_DIR, ctx.shared["dcp_plan"], [r.dcp_results for r in per_rank])
        ctx.bytes_moved += (staging / DCP_DIR / ".metadata").stat().st_size
    config = ctx.spec.model_dump(mode="json")
    content = {
        "osdpipe_version": __version__,
        "torch_version": torch.__version__,
        "conversion": conversion_of(config),
        "format": fmt,
        "files": dict(sorted(files.items())),
        "tensors": {k: v for r in per_rank for k, v in sorted(r.tensors.items())},
    }
    manifest = {**content, "content_sha256": content_sha256(content), "config": config}
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    output.commit(staging.parent)
    return files
