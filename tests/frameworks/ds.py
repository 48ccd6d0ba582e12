"""Run real DeepSpeed ZeRO jobs on CPU, to make real ``engine.save_checkpoint`` folders (issue #31).

The tests need folders written by DeepSpeed itself (ZeRO stage 1, 2 or 3,
fp32 or bf16, over ``gloo`` with ``DS_ACCELERATOR=cpu``) and the state the
job held when it saved, gathered whole, to compare a reader's output with bit
for bit.  This module launches ``tests/frameworks/ds_job.py`` under
``torchrun --standalone``; that worker trains the test's own small model
(odd sizes so ZeRO's padding shows) and calls ``engine.save_checkpoint``.

API:

* :func:`save` -- train ``steps`` steps on ``nproc`` ranks and
  ``save_checkpoint(out)``; rank 0 dumps the gathered state at save time next
  to the folder (:func:`dump_path`).  Moments that DeepSpeed's own API could
  not give (see :func:`fill_moments_from_universal`) are filled in from
  ``ds_to_universal``'s output.
* :func:`universal` -- ``python -m deepspeed.checkpoint.ds_to_universal`` on
  the folder's latest tag, written beside the folder.
* :func:`fill_moments_from_universal` -- the per-parameter ``exp_avg`` /
  ``exp_avg_sq`` of a universal checkpoint, put into a dump.

A dump is ``{"fp32": {fqn: full fp32 master weight}, "lp": {fqn: full weight
the model computes with}, "state": {fqn: {"exp_avg", "exp_avg_sq", "step"}},
"param_groups": [{hyperparameters..., "params": [fqn, ...]}], "module":
engine.module_state_dict(), "lr_scheduler": its state_dict, "global_steps": N,
"initial": {fqn: fp32 weight before deepspeed.initialize},
"sources": {what: where it came from}, "missing_moments": [...], "info": {...}}``
with FQNs as ``model.named_parameters()`` of the unwrapped model names them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from frameworks.launch import run_logged, torchrun, worker_env

HERE = Path(__file__).resolve().parent
ENTRY = HERE / "ds_job.py"

#: Seconds each launched command took, appended as (label, seconds): for reports.
TIMINGS: list[tuple[str, float]] = []


def dump_path(folder: Path) -> Path:
    """Where :func:`save` puts the gathered state of ``folder`` (beside it, not inside:
    the folder holds exactly what ``save_checkpoint`` wrote)."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".dump.pt")


def universal_path(folder: Path) -> Path:
    """Where :func:`universal` writes (beside the folder: ``ds_to_universal`` also writes a
    ``latest_universal`` file into the parent of its output folder)."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".universal")


def latest_tag(folder: Path) -> str:
    """The tag the ``latest`` file of a save folder names (e.g. ``global_step2``)."""
    return (Path(folder) / "latest").read_text().strip()


def _run(cmd: list[str], workdir: Path, *, label: str, timeout: float, what: str) -> None:
    """Run one command with DeepSpeed's CPU accelerator (:func:`frameworks.launch.run_logged`);
    raise with the log's tail if it fails."""
    TIMINGS.append(
        (label, run_logged(cmd, workdir, label=label, timeout=timeout, what=what, env=worker_env(DS_ACCELERATOR="cpu")))
    )


def _torchrun(workdir: Path, nproc: int, spec: dict[str, Any], *, label: str, timeout: float) -> None:
    _run(torchrun(nproc, ENTRY, spec), workdir, label=label, timeout=timeout, what=f"DeepSpeed job ({nproc} ranks)")


def save(workdir: Path, nproc: int, spec: dict[str, Any], *, timeout: float = 300) -> Path:
    """Train and ``engine.save_checkpoint(spec["out"])`` on ``nproc`` CPU ranks; return the folder.

    ``spec``: the keys of ``ds_job.py`` (out, stage, dtype, steps, tied; optional
    vocab, dim, hidden, grad_accum_dtype); ``dump`` defaults to
    :func:`dump_path` (out).  ``workdir`` receives the logs.  Where the job could
    not take the moments from DeepSpeed's API, :func:`universal` runs and
    :func:`fill_moments_from_universal` completes the dump.
    """
    spec = dict(spec)
    out = Path(spec["out"]).resolve()
    spec["out"] = str(out)
    dump = Path(spec.get("dump") or dump_path(out)).resolve()
    spec["dump"] = str(dump)
    out.parent.mkdir(parents=True, exist_ok=True)
    dump.unlink(missing_ok=True)
    _torchrun(workdir, nproc, spec, label=f"save-{out.name}", timeout=timeout)
    if not (out / "latest").is_file() or not dump.is_file():
        raise RuntimeError(f"DeepSpeed job left no folder {out} (with a 'latest' file) or no dump {dump}")
    truth = torch.load(dump, weights_only=False)
    if truth.get("missing_moments"):
        folder = universal(out, workdir=workdir, timeout=timeout)
        fill_moments_from_universal(truth, folder)
        tmp = dump.with_name(dump.name + ".tmp")
        torch.save(truth, tmp)
        os.replace(tmp, dump)
    return out


def universal(folder: Path, *, workdir: Path | None = None, timeout: float = 300) -> Path:
    """``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state`` on the latest tag.

    Writes ``<folder>.universal/<tag>`` (and ``<folder>.universal/latest_universal``)
    with one worker for extraction and one for merging; returns
    ``<folder>.universal/<tag>``.  Its ``zero/<fqn>/{fp32,exp_avg,exp_avg_sq}.pt``
    hold, for stage 1/2, ``{"cat_dim": 0, "param": tensor shaped like the parameter}``
    (and a ``step.pt`` with a 0-dim tensor); for stage 3, a bare flat tensor of the
    parameter's numel (and no ``step.pt``).
    """
    folder = Path(folder).resolve()
    tag = latest_tag(folder)
    dest = universal_path(folder) / tag
    if dest.exists():
        import shutil

        shutil.rmtree(dest)
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(folder / tag),
        "--output_folder",
        str(dest),
        "--inject_missing_state",
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    _run(
        cmd,
        Path(workdir) if workdir else folder.parent,
        label=f"universal-{folder.name}",
        timeout=timeout,
        what="ds_to_universal",
    )
    if not (dest / "zero").is_dir():
        raise RuntimeError(f"ds_to_universal wrote no {dest / 'zero'}")
    return dest


def fill_moments_from_universal(truth: dict[str, Any], universal_folder: Path) -> dict[str, Any]:
    """Put ``exp_avg`` / ``exp_avg_sq`` of every parameter from a universal checkpoint into ``truth``.

    Why: in stage 1/2, ``safe_get_full_optimizer_state`` reads per-parameter
    fragments that DeepSpeed 0.19.8 links once, right after the first param
    group's first ``step``, when the later groups have no optimizer state yet:
    with two param groups, every parameter of the second group has no linked
    moments on any rank (see ``ds_job._moments_linked``).  ``ds_job.py`` checks
    that on every rank first and, where it fails, leaves the moments out and
    lists them in ``missing_moments``.  ``ds_to_universal`` cuts the moments
    out of the saved optimizer files with the saved ``param_slice_mappings``
    instead, per parameter, and writes them whole.  For stage 3 it writes flat
    tensors; they are reshaped to the parameter.

    Where the job also took the moments from the API after redoing DeepSpeed's
    linking (``moments_relinked_api``), the two must agree bit for bit, or this
    raises.
    """
    zero = Path(universal_folder) / "zero"
    keys = list(truth.get("missing_moments") or ("exp_avg", "exp_avg_sq"))
    for fqn, fp32 in truth["fp32"].items():
        for key in keys:
            saved = torch.load(zero / fqn / f"{key}.pt", weights_only=False)
            tensor = saved["param"] if isinstance(saved, dict) else saved  # stage 1/2: dict; stage 3: bare tensor
            if tensor.numel() != fp32.numel():
                raise RuntimeError(
                    f"universal {key} of {fqn} has {tensor.numel()} elements, the parameter {fp32.numel()}"
                )
            truth["state"][fqn][key] = tensor.reshape(fp32.shape).clone()
    relinked = truth.get("moments_relinked_api") or {}
    for fqn, moments in relinked.items():
        for key, tensor in moments.items():
            mine = truth["state"][fqn][key]
            if tensor.dtype != mine.dtype or tensor.shape != mine.shape or not torch.equal(tensor, mine):
                raise RuntimeError(f"{key} of {fqn}: ds_to_universal and the re-linked API disagree")
    truth["sources"]["exp_avg/exp_avg_sq"] = (
        f"python -m deepspeed.checkpoint.ds_to_universal ({universal_folder}), zero/<fqn>/<key>.pt['param']: "
        "safe_get_full_optimizer_state had no linked fragment on some rank"
        + ("; equal bit for bit to safe_get_full_optimizer_state after re-linking" if relinked else "")
    )
    truth["missing_moments"] = []
    return truth
