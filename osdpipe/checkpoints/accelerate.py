"""accelerate: ``Accelerator.save_state``'s folder, with FSDP.

SHARDED_STATE_DICT gives ``pytorch_model_fsdp_<i>/`` (DCP of
``{"model": model.state_dict()}``) and ``optimizer_<i>/`` (DCP of
``{"optimizer": FSDP.optim_state_dict(...)}``); FULL_STATE_DICT gives
``pytorch_model_fsdp.bin`` and ``optimizer.bin``. Beside them:
``scheduler.bin``, ``random_states_<r>.pkl`` per process,
``custom_checkpoint_<i>.pkl``, and when used ``sampler.bin``,
``dl_state_dict.bin``, ``scaler.pt``. Every other file is listed too.
"""

from __future__ import annotations

import re
from pathlib import Path

from osdpipe.checkpoints.base import CheckpointLayout, Entry, WholeCheckpoint, register
from osdpipe.checkpoints.dcp_entries import dcp_items, is_dcp

_MODEL_DIR = re.compile(r"pytorch_model_fsdp_(\d+)")
_OPTIMIZER_DIR = re.compile(r"optimizer_(\d+)")
_FULL_FILES = {"pytorch_model_fsdp.bin": "model", "optimizer.bin": "optimizer"}
_PER_RANK = re.compile(r"random_states_(\d+)\.pkl")


@register
class Accelerate(CheckpointLayout):
    name = "accelerate"
    looks_like = "an accelerate save_state folder (pytorch_model_fsdp_0/, optimizer_0/, scheduler.bin, random_states_<r>.pkl, ...)"

    def recognizes(self, path: Path) -> bool:
        if not path.is_dir():
            return False
        return any((_MODEL_DIR.fullmatch(p.name) or _OPTIMIZER_DIR.fullmatch(p.name)) and is_dcp(p) for p in path.iterdir()) or any(
            (path / name).is_file() for name in _FULL_FILES
        )

    def read(self, path: Path) -> WholeCheckpoint:
        entries: list[Entry] = []
        optimizer: tuple[str, str] | None = None
        for child in sorted(path.iterdir()):
            if child.is_dir() and is_dcp(child) and (_MODEL_DIR.fullmatch(child.name) or _OPTIMIZER_DIR.fullmatch(child.name)):
                part = "model" if _MODEL_DIR.fullmatch(child.name) else "optimizer"
                items = dcp_items(child)
                entries.append(Entry(child.name, part, f"{child.name}/ (DCP)", sum(i.size for i in items), sum(i.tensor for i in items)))
                if part == "optimizer" and optimizer is None:
                    optimizer = (str(child), "optimizer")
            elif child.is_file():
                part = _FULL_FILES.get(child.name, "other")
                rank = _PER_RANK.fullmatch(child.name)
                entries.append(Entry(child.name, part, child.name, child.stat().st_size, 0, int(rank[1]) if rank else None))
                if part == "optimizer" and optimizer is None:
                    optimizer = (str(child), "")
            else:
                entries.append(Entry(child.name, "other", f"{child.name}/", sum(f.stat().st_size for f in child.rglob("*") if f.is_file())))
        return WholeCheckpoint(self.name, str(path), tuple(entries), optimizer[0] if optimizer else None, optimizer[1] or None if optimizer else None)
