"""DeepSpeed's universal checkpoint (``ds_to_universal``) as a reference:
running DeepSpeed's own conversion, and where it differs from what was read.

Used by the ``universal`` check (:mod:`osdpipe.verify.checks.universal`); kept apart
from the check so that the comparison is a function of files and tensors
alone.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from osdpipe.core.compare import diff

#: What ``ds_to_universal`` writes per parameter, and the state each holds (``fp32``: the master weight).
UNIVERSAL_FILES = {"fp32": None, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "step": "step"}


def ds_to_universal(tag_folder: Path, out: Path, timeout_s: float) -> Path:
    """DeepSpeed's own conversion of the ``global_step<N>`` folder into ``out``, in a subprocess; ``out``.

    Raises:
        RuntimeError: it failed, with the last line it said.
    """
    command = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", str(tag_folder), "--output_folder", str(out),
        "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0 or not (out / "zero").is_dir():
        said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"DeepSpeed's ds_to_universal of {tag_folder} failed (exit {done.returncode}): {said}")
    return out


def universal_differences(
    folder: Path, weights: dict[str, torch.Tensor], state: dict[str, dict[str, Any]]
) -> tuple[list[str], list[str]]:
    """Where a universal checkpoint ``folder`` differs from the model's ``weights``
    (the fp32 masters and the buffers, by name) and the optimizer ``state`` (by FQN), bitwise.

    Stage 1/2 store each tensor as ``{"param": tensor}`` shaped like the
    parameter; stage 3 stores it flat, and with no ``step.pt``: compared by
    its elements. A tied name and a buffer have an ``fp32.pt`` alone (a
    buffer kept in the training dtype is stored upcast, which is exact, and
    compared so). A file of the universal checkpoint that osdpipe did not
    read, and a parameter's state read that it lacks, are differences too.

    Where DeepSpeed is wrong, the notes say so: in a bf16 or fp16 run it
    writes a tied name (a tied head) from the module's copy in the training
    dtype, not from the fp32 master that the parameter it is tied to holds
    (and that its own ``fp32.pt`` of that parameter holds). osdpipe keeps the
    master under every name of the parameter; such a name must equal the
    master rounded to the training dtype, and the note names it.

    Returns:
        The differences, and the notes.
    """
    zero = folder / "zero"
    theirs = sorted(p.name for p in zero.iterdir() if p.is_dir())
    problems = [
        f"osdpipe read {fqn}'s optimizer state, which ds_to_universal has not" for fqn in state if fqn not in theirs
    ]
    notes = []
    for fqn in theirs:
        for file, name in UNIVERSAL_FILES.items():
            path = zero / fqn / f"{file}.pt"
            if not path.is_file():
                continue
            mine = weights.get(fqn) if name is None else state.get(fqn, {}).get(name)
            if mine is None:
                problems.append(f"ds_to_universal has {fqn}'s {file}, which osdpipe did not read")
                continue
            stored = torch.load(path, map_location="cpu", weights_only=True)
            value = stored["param"] if isinstance(stored, dict) else stored
            if name is None and mine.dtype != value.dtype and mine.element_size() < value.element_size():
                mine = mine.to(value.dtype)  # a buffer in the training dtype, stored upcast: exact both ways
            found = diff(mine.reshape(-1), value.reshape(-1), path=f"{fqn}.{file}", limit=1)
            rounded = _rounded_as(mine, value) if found and name is None and fqn not in state else None
            if rounded is not None:
                notes.append(
                    f"DeepSpeed's ds_to_universal writes {fqn}, a tied name, from the module's {rounded} copy, "
                    "not from the fp32 master its parameter holds; "
                    "osdpipe keeps the master under every name, which rounds to DeepSpeed's copy"
                )
                continue
            problems += found
    return problems, notes


def _rounded_as(master: torch.Tensor, value: torch.Tensor) -> str | None:
    """The training dtype whose rounding of ``master`` is ``value``, exactly (``None``: none is)."""
    for dtype in (torch.bfloat16, torch.float16):
        if master.is_floating_point() and torch.equal(master.to(dtype).to(value.dtype), value):
            return str(dtype).removeprefix("torch.")
    return None
