"""save: write the target format atomically, with a manifest.

Every rank writes into ``<output.path>/.staging`` (made by the launcher, see
:mod:`osdpipe.output`); only when every rank has written and read its files
back does rank 0 write ``manifest.json`` there and commit the staged
conversion, replacing a previous one as a whole. Offline, the one process
writes each rank's files in turn and commits after the last
(:func:`commit_offline`). A failure on any rank leaves
the output directory as it was: nothing half-written. A run whose verify
failed writes no data.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from osdpipe import __version__, output
from osdpipe.collective import agree, barrier, gather_to_all, one_line
from osdpipe.compare import diff
from osdpipe.context import Context
from osdpipe.stages import stage


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tensor_digests(osd: dict[str, Any]) -> dict[str, str]:
    """sha256 of every state tensor's bytes, keyed ``<param key>.<state name>``: for partial checks."""
    out = {}
    for key, state in osd.get("state", {}).items():
        for name, value in (state.items() if isinstance(state, dict) else []):
            if torch.is_tensor(value):
                out[f"{key}.{name}"] = hashlib.sha256(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def _write_torch(osd: dict[str, Any], path: Path) -> None:
    torch.save(osd, path)
    problems = diff(torch.load(path, map_location="cpu", weights_only=True), osd)
    if problems:
        raise OSError(f"{path} does not read back as written: {problems[0]}")


def _write_dcp(ctx: Context, staging: Path) -> None:
    """Write the dim-0 pieces of every rank as one DCP checkpoint (DTensors sharded on dim 0)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    assert ctx.result is not None
    state: dict[str, Any] = {}
    if ctx.distributed:
        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (ctx.world_size,))
        for fqn, entries in ctx.result["state"].items():
            shape = ctx.tree.param(fqn).shape if ctx.tree.has_param(fqn) else None
            state[fqn] = {
                n: DTensor.from_local(v.to(mesh.device_type), mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
                if torch.is_tensor(v) and v.dim() > 0 and shape is not None
                else v
                for n, v in entries.items()
            } if isinstance(entries, dict) else entries
    else:
        state = ctx.result["state"]
    dcp.save({ctx.spec.output.key: {**ctx.result, "state": state}}, checkpoint_id=str(staging / "dcp"))


@stage("save")
def save(ctx: Context) -> None:
    if not all(c.ok for c in ctx.checks):
        return  # a result that failed verify is not written; report.json says where it differs
    assert ctx.result is not None
    out = Path(ctx.spec.output.path)
    staging = out / output.STAGING
    if ctx.rank == 0:
        staging.mkdir(parents=True, exist_ok=True)  # the launcher made it; the Python API's caller may not have
    barrier()
    fmt = ctx.spec.output.format
    written: dict[str, str] = {}
    error = None
    try:
        if fmt == "dcp":
            _write_dcp(ctx, staging)
        elif fmt == "rank_local" or ctx.rank == 0:  # fsdp_full and plain: one file, from rank 0
            name = f"rank_{ctx.rank}.pt" if fmt == "rank_local" else "optim.pt"
            _write_torch(ctx.result, staging / name)
            ctx.tensor_digests = {f"{name}:{k}": v for k, v in tensor_digests(ctx.result).items()}
            written[name] = sha256_file(staging / name)
            ctx.bytes_moved += (staging / name).stat().st_size
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error = one_line(exc)
    agree("save", error)  # on failure the launcher drops the staged run (output.abort)
    if ctx.offline:  # the driver commits once, after the last rank (commit_offline)
        ctx.saved = (written, ctx.tensor_digests)
        return
    per_rank = gather_to_all((written, ctx.tensor_digests))
    error = None
    if ctx.rank == 0:
        try:
            ctx.files = _commit(ctx, staging, per_rank)
        except Exception as exc:  # noqa: BLE001 - shared with every rank below
            error = one_line(exc)
    agree("save", error)


def commit_offline(ctx: Context, per_rank: list[tuple[dict[str, str], dict[str, str]]]) -> dict[str, str]:
    """Offline: commit the files every rank wrote (``per_rank``, in rank order), as rank 0 does online."""
    return _commit(ctx, Path(ctx.spec.output.path) / output.STAGING, per_rank)


def _commit(ctx: Context, staging: Path, per_rank: list[tuple[dict[str, str], dict[str, str]]]) -> dict[str, str]:
    """On rank 0: write the manifest into the staged conversion and commit it; returns the files and their sha256."""
    fmt = ctx.spec.output.format
    files = {k: v for w, _ in per_rank for k, v in w.items()}
    if fmt == "dcp":
        written_files = [p for p in sorted((staging / "dcp").rglob("*")) if p.is_file()]
        files = {str(p.relative_to(staging)): sha256_file(p) for p in written_files}
        ctx.bytes_moved += sum(p.stat().st_size for p in written_files)
    manifest = {
        "osdpipe_version": __version__,
        "torch_version": torch.__version__,
        "config": ctx.spec.model_dump(mode="json"),
        "format": fmt,
        "files": files,
        "tensors": {k: v for _, d in per_rank for k, v in sorted(d.items())},
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    output.commit(staging.parent)
    return files
