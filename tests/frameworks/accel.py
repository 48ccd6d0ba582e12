"""Run real accelerate FSDP jobs on CPU, to make and check real ``save_state`` folders.

The tests need folders written by ``Accelerator.save_state`` itself (FSDP1 or
FSDP2, SHARDED_STATE_DICT or FULL_STATE_DICT, over ``gloo``) and a way to see
exactly what state accelerate holds after ``Accelerator.load_state`` into a
fresh model and a fresh optimizer, as a user resumes, so that a converted
folder can be compared bit for bit with the original.  This module launches
``tests/frameworks/accel_job.py`` under ``torchrun --standalone``; that worker
forces accelerate's FSDP path on CPU (see its docstring) and otherwise runs
accelerate's own ``prepare``/``backward``/``save_state``/``load_state``.

API:

* :func:`save` -- train ``steps`` steps and ``save_state``; rank 0 also dumps
  the gathered state at save time next to the folder (:func:`dump_path`).
* :func:`load` -- a fresh job: ``load_state`` into a fresh model/optimizer,
  dump the gathered state, take one more step ("loss_after").
* :func:`compare` -- bitwise differences between two dumps.
* :func:`describe` -- what a ``save_state`` folder holds (files, DCP metadata
  keys, the FULL_STATE_DICT ``.bin`` structure), for reports and assertions.

A dump is ``{"model": {fqn: tensor}, "optim": {"state": {fqn: {name: tensor}},
"param_groups": [{..., "params": [fqn, ...]}]}, "param_groups": [hyper-
parameters per group], "scheduler": scheduler.state_dict(), "step": int,
"info": {...}}`` plus ``"loss_after"`` from :func:`load`.  ``info`` holds the
losses, the world size and, for :func:`load`, ``after_load_per_rank``: what
each rank's optimizer held right after ``load_state`` (before the dump's
``get_optimizer_state_dict``, which initializes an empty optimizer state with a
zero-gradient step).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from frameworks.launch import run_logged, torchrun, worker_env

HERE = Path(__file__).resolve().parent
ENTRY = HERE / "accel_job.py"

StateDictType = Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"]

#: Seconds each torchrun call took, appended as (label, seconds): for reports.
TIMINGS: list[tuple[str, float]] = []


def dump_path(folder: Path) -> Path:
    """Where :func:`save` puts the gathered state of ``folder`` (beside it, not inside:
    the folder holds exactly what ``save_state`` wrote)."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".dump.pt")


def _env() -> dict[str, str]:
    """:func:`frameworks.launch.worker_env`, without the variables accelerate would read its plugin from (the worker
    passes its own)."""
    env = worker_env(TOKENIZERS_PARALLELISM="false", ACCELERATE_LOG_LEVEL="warning")
    return {k: v for k, v in env.items() if not k.startswith(("ACCELERATE_USE_", "FSDP_"))}


def trainer(workdir: Path, nproc: int, spec: dict[str, Any], *, label: str, timeout: float = 240) -> dict[str, Any]:
    """The HF Trainer with FSDP on ``nproc`` CPU ranks (``accel_trainer_job.py``: keys out, version, state_dict_type,
    max_steps, resume, tied); what rank 0 reports of it (global step, optimizer state held after the resume, losses)."""
    _torchrun(workdir, nproc, spec, label=label, timeout=timeout, entry=HERE / "accel_trainer_job.py")
    lines = [
        line
        for line in (Path(workdir) / f"{label}.log").read_text(errors="replace").splitlines()
        if line.startswith("RESULT ")
    ]
    return json.loads(lines[-1].removeprefix("RESULT "))


def _torchrun(
    workdir: Path, nproc: int, spec: dict[str, Any], *, label: str, timeout: float, entry: Path = ENTRY
) -> None:
    """Launch one job and wait; raise with the log's tail if it fails or hangs
    (:func:`frameworks.launch.run_logged`)."""
    elapsed = run_logged(
        torchrun(nproc, entry, spec),
        workdir,
        label=label,
        timeout=timeout,
        what=f"accelerate job ({nproc} ranks)",
        env=_env(),
    )
    TIMINGS.append((label, elapsed))


def _spec(
    mode: str,
    folder: Path,
    dump: Path,
    steps: int,
    fsdp_version: int,
    state_dict_type: StateDictType,
    tied: bool,
    use_orig_params: bool,
) -> dict[str, Any]:
    if fsdp_version not in (1, 2):
        raise ValueError(f"fsdp_version must be 1 or 2, not {fsdp_version!r}")
    if state_dict_type not in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        raise ValueError(f"state_dict_type must be SHARDED_STATE_DICT or FULL_STATE_DICT, not {state_dict_type!r}")
    return {
        "mode": mode,
        "folder": str(Path(folder).resolve()),
        "dump": str(Path(dump).resolve()),
        "steps": steps,
        "fsdp_version": fsdp_version,
        "state_dict_type": state_dict_type,
        "tied": tied,
        "use_orig_params": use_orig_params,
    }


def save(
    workdir: Path,
    nproc: int,
    steps: int,
    *,
    out: Path,
    fsdp_version: int,
    state_dict_type: StateDictType,
    tied: bool,
    use_orig_params: bool = True,
    timeout: float = 240,
) -> Path:
    """Train ``steps`` steps on ``nproc`` ranks and ``Accelerator.save_state(out)``.

    Rank 0 writes the gathered state at save time to :func:`dump_path` (out),
    the reference a loaded (or converted and loaded) folder must reproduce.
    ``workdir`` receives the torchrun log.  Returns ``out``.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = _spec("save", out, dump_path(out), steps, fsdp_version, state_dict_type, tied, use_orig_params)
    _torchrun(workdir, nproc, spec, label=f"save-{out.name}", timeout=timeout)
    if not out.is_dir() or not dump_path(out).is_file():
        raise RuntimeError(f"save job left no folder {out} or dump {dump_path(out)}")
    return out


def load(
    workdir: Path,
    nproc: int,
    folder: Path,
    *,
    fsdp_version: int,
    state_dict_type: StateDictType,
    tied: bool,
    use_orig_params: bool = True,
    steps: int | None = None,
    prime: bool = False,
    job: dict[str, Any] | None = None,
    timeout: float = 240,
) -> dict[str, Any]:
    """``Accelerator.load_state(folder)`` in a fresh job on ``nproc`` ranks; return its dump.

    Fresh model, fresh optimizer that has not stepped, prepared by
    accelerate, as a user resumes.  The dump is taken right after
    ``load_state`` (so it compares with the saving job's dump); then one more
    training step runs and its mean loss is ``dump["loss_after"]`` (finite,
    or the job fails); ``dump["loss_next"]`` is the mean loss on the next
    batch after that step's update (it depends on the loaded optimizer state,
    which ``loss_after`` does not).  ``steps`` only labels the dump and picks the next
    batch; it defaults to the saving job's step count when its dump exists.

    ``job`` names another job's model, its block class and its param groups
    (see ``accel_job.main``), prepared with no scheduler.

    ``prime`` gives the fresh optimizer a state before ``load_state`` (a
    zero-gradient step at lr 0, as ``get_optimizer_state_dict`` does): FSDP1
    SHARDED_STATE_DICT loads optimizer state only into state that exists, so
    without it a never-stepped optimizer loads none (``after_load_per_rank``
    shows ``optim_state_len`` 0).
    """
    folder = Path(folder)
    if steps is None:
        src = dump_path(folder)
        steps = int(torch.load(src, weights_only=False)["step"]) if src.is_file() else 0
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    label = f"load-{folder.name}-{nproc}r-fsdp{fsdp_version}" + ("-primed" if prime else "")
    dump = workdir / f"{label}.dump.pt"
    dump.unlink(missing_ok=True)
    spec = _spec("load", folder, dump, steps, fsdp_version, state_dict_type, tied, use_orig_params)
    spec["prime"] = prime
    if job is not None:  # another job's model (accel_job.main): no scheduler
        spec["job"] = job
    _torchrun(workdir, nproc, spec, label=label, timeout=timeout)
    return torch.load(dump, weights_only=False)


# ----------------------------------------------------------------- compare


def _bitwise(a: Any, b: Any) -> str | None:
    """None when equal bit for bit (tensors: dtype, shape, bytes), else why not."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype:
            return f"dtype {a.dtype} vs {b.dtype}"
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        x, y = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
        if torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return None
        if x.is_floating_point():
            diff = (x.double() - y.double()).abs().max().item()
            return f"values differ (max abs diff {diff:.3e})"
        return "values differ"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        # FSDP2's FULL_STATE_DICT load broadcasts the param groups from rank 0,
        # which turns AdamW's betas tuple into a list: same values, not state.
        if len(a) != len(b):
            return f"{a!r} vs {b!r}"
        whys = [_bitwise(x, y) for x, y in zip(a, b)]
        return None if not any(whys) else f"{a!r} vs {b!r}"
    if isinstance(a, float) and isinstance(b, float):
        return None if a == b or (a != a and b != b) else f"{a!r} vs {b!r}"
    return None if a == b else f"{a!r} vs {b!r}"


def _compare_maps(where: str, a: Mapping[str, Any], b: Mapping[str, Any], out: list[str]) -> None:
    for key in sorted(set(a) | set(b), key=str):
        if key not in a:
            out.append(f"{where}[{key}]: only in second")
        elif key not in b:
            out.append(f"{where}[{key}]: only in first")
        else:
            why = _bitwise(a[key], b[key])
            if why:
                out.append(f"{where}[{key}]: {why}")


def compare(a: Mapping[str, Any], b: Mapping[str, Any], *, groups: bool = True, scheduler: bool = True) -> list[str]:
    """Bitwise differences between two dumps; [] when they hold the same state.

    Model per key; optimizer per FQN and state name (``step`` included);
    with ``groups`` the optimizer's param groups (hyperparameters and the FQNs
    each holds); with ``scheduler`` the scheduler's state dict.
    """
    out: list[str] = []
    _compare_maps("model", a["model"], b["model"], out)
    sa, sb = a["optim"].get("state", {}), b["optim"].get("state", {})
    for fqn in sorted(set(sa) | set(sb), key=str):
        if fqn not in sa or fqn not in sb:
            out.append(f"optim.state[{fqn}]: only in {'second' if fqn not in sa else 'first'}")
            continue
        _compare_maps(f"optim.state[{fqn}]", sa[fqn], sb[fqn], out)
    if groups:
        ga, gb = a["optim"].get("param_groups", []), b["optim"].get("param_groups", [])
        if len(ga) != len(gb):
            out.append(f"optim.param_groups: {len(ga)} groups vs {len(gb)}")
        for i, (x, y) in enumerate(zip(ga, gb)):
            _compare_maps(f"optim.param_groups[{i}]", x, y, out)
    if scheduler:
        _compare_maps("scheduler", a.get("scheduler", {}), b.get("scheduler", {}), out)
    return out


# ---------------------------------------------------------------- describe


def _dcp_keys(path: Path) -> dict[str, str]:
    """Each key of a DCP ``.metadata`` with what it holds (tensor size/dtype or bytes)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(path)).read_metadata()
    keys: dict[str, str] = {}
    for key, item in meta.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            keys[key] = f"tensor{tuple(item.size)} {item.properties.dtype} in {len(item.chunks)} chunk(s)"
        else:
            keys[key] = "bytes"
    return keys


def _structure(value: Any, depth: int = 0) -> Any:
    """A printable outline of a loaded object: tensors as shape/dtype, long maps cut."""
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    if isinstance(value, Mapping):
        items = list(value.items())
        shown = {str(k): _structure(v, depth + 1) for k, v in items[: 40 if depth < 2 else 6]}
        if len(items) > len(shown):
            shown["..."] = f"{len(items) - len(shown)} more"
        return shown
    if isinstance(value, (list, tuple)):
        return [_structure(v, depth + 1) for v in value[:40]]
    return value


def describe(folder: Path) -> dict[str, Any]:
    """What a ``save_state`` folder holds: files and sizes, DCP keys, ``.bin`` outlines."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    result: dict[str, Any] = {"files": files, "dcp": {}, "bin": {}}
    for sub in sorted(folder.iterdir()):
        if sub.is_dir() and (sub / ".metadata").is_file():
            result["dcp"][sub.name] = _dcp_keys(sub)
        elif sub.suffix == ".bin":
            result["bin"][sub.name] = _structure(torch.load(sub, weights_only=False, map_location="cpu"))
    return result
