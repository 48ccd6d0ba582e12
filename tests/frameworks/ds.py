"""Run real DeepSpeed ZeRO jobs on CPU, to make real ``engine.save_checkpoint`` folders (issue #31).

The tests need folders written by DeepSpeed itself (ZeRO stage 1, 2 or 3,
fp32 or bf16, over ``gloo`` with ``DS_ACCELERATOR=cpu``) and the state the
job held when it saved, gathered whole, to compare a reader's output with bit
for bit.  This module launches ``tests/frameworks/ds_job.py`` under
``torchrun --standalone``; that worker trains the test's own small model
(odd sizes so ZeRO's padding shows) and calls ``engine.save_checkpoint``.

API:

* :func:`save_all` -- one launch of ``ds_job.py`` on ``nproc`` ranks that, for each
  spec in turn, trains ``steps`` steps and ``save_checkpoint(out)``s; rank 0
  dumps the gathered state at save time next to the folder (:func:`dump_path`);
  then ``ds_to_universal`` runs on each folder's latest tag, in the job, and
  writes beside it (:func:`universal_path`).  Moments that DeepSpeed's own API
  could not give (see :func:`fill_moments_from_universal`) are filled in from
  that output.
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
import shutil
from pathlib import Path
from typing import Any

import torch
from frameworks.launch import run_logged, torchrun, worker_env

HERE = Path(__file__).resolve().parent
ENTRY = HERE / "ds_job.py"

#: Seconds each launched command took, appended as (label, seconds): for reports.
TIMINGS: list[tuple[str, float]] = []


def dump_path(folder: Path) -> Path:
    """Where :func:`save_all` puts the gathered state of ``folder`` (beside it, not inside:
    the folder holds exactly what ``save_checkpoint`` wrote)."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".dump.pt")


def universal_path(folder: Path) -> Path:
    """Where :func:`save_all` has ``ds_to_universal`` write, under the save's tag (beside the folder:
    ``ds_to_universal`` also writes a ``latest_universal`` file into the parent of its output folder).

    Its ``<tag>/zero/<fqn>/{fp32,exp_avg,exp_avg_sq}.pt`` hold, for stage 1/2, ``{"cat_dim": 0, "param": tensor shaped
    like the parameter}`` (and a ``step.pt`` with a 0-dim tensor); for stage 3, a bare flat tensor of the parameter's
    numel (and no ``step.pt``)."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".universal")


def latest_tag(folder: Path) -> str:
    """The tag the ``latest`` file of a save folder names (e.g. ``global_step2``)."""
    return (Path(folder) / "latest").read_text().strip()


def save_all(workdir: Path, nproc: int, specs: list[dict[str, Any]], *, timeout: float = 600) -> list[Path]:
    """Train and ``engine.save_checkpoint(spec["out"])`` each of ``specs``, in turn, in one launch on ``nproc`` CPU
    ranks, each followed by DeepSpeed's own ``ds_to_universal`` (:func:`universal_path`); return the folders.

    ``spec``: the keys of ``ds_job.py`` (out, stage, dtype, steps, tied; optional vocab, dim, hidden,
    grad_accum_dtype); ``dump`` defaults to :func:`dump_path` (out), ``universal`` to :func:`universal_path` (out).
    ``workdir`` receives the log. Where the job could not take the moments from DeepSpeed's API,
    :func:`fill_moments_from_universal` completes the dump.

    Why one launch: every rank's imports take longer than a save (``ds_job.main``); a save made after others is what
    DeepSpeed writes in a job of its own (``ds_job.train_and_save``). Compared once, with DeepSpeed 0.19.8, for the
    tests' six saves: every file of the folders, of ``ds_to_universal``'s output and every dump was the same, byte for
    byte or tensor for tensor, as from a launch per save, but for stage 3's padding in the last rank's flat fp32
    partition, memory DeepSpeed never writes, which two launches of the same save do not agree on either.
    """
    specs = [dict(spec) for spec in specs]
    for spec in specs:
        out = Path(spec["out"]).resolve()
        spec["out"] = str(out)
        spec["dump"] = str(Path(spec.get("dump") or dump_path(out)).resolve())
        spec["universal"] = str(Path(spec.get("universal") or universal_path(out)).resolve())
        out.parent.mkdir(parents=True, exist_ok=True)
        Path(spec["dump"]).unlink(missing_ok=True)
        shutil.rmtree(spec["universal"], ignore_errors=True)
    label = "save-" + "+".join(Path(spec["out"]).name for spec in specs)
    seconds = run_logged(
        torchrun(nproc, ENTRY, {"saves": specs}),
        workdir,
        label=label,
        timeout=timeout,
        what=f"DeepSpeed job ({nproc} ranks)",
        env=worker_env(DS_ACCELERATOR="cpu"),
    )
    TIMINGS.append((label, seconds))
    for spec in specs:
        out, dump = Path(spec["out"]), Path(spec["dump"])
        if not (out / "latest").is_file() or not dump.is_file():
            raise RuntimeError(f"DeepSpeed job left no folder {out} (with a 'latest' file) or no dump {dump}")
        universal = Path(spec["universal"]) / latest_tag(out)
        if not (universal / "zero").is_dir():
            raise RuntimeError(f"ds_to_universal wrote no {universal / 'zero'}")
        truth = torch.load(dump, weights_only=False)
        if truth.get("missing_moments"):
            fill_moments_from_universal(truth, universal)
            tmp = dump.with_name(dump.name + ".tmp")
            torch.save(truth, tmp)
            os.replace(tmp, dump)
    return [Path(spec["out"]) for spec in specs]


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
