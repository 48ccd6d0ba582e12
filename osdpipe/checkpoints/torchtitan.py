"""torchtitan: one DCP directory per step, from one ``dcp.save`` of the whole training state.

The model's state dict sits at the top level, one entry per parameter or
buffer FQN (v0.1 and earlier nested it under ``model``); ``optimizer`` is
``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``
(``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyperparameter>``);
``lr_scheduler``, ``dataloader`` (``dp_rank_<r>`` per data-parallel rank,
and ``world_size``) and ``train_state`` are torchtitan's own; any other
top-level entry is the user's.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from osdpipe.checkpoints.base import CheckpointLayout, Entry, WholeCheckpoint, register
from osdpipe.checkpoints.dcp_entries import dcp_items, is_dcp

#: The top-level keys torchtitan itself saves besides the model.
OPTIMIZER, OWN = "optimizer", ("lr_scheduler", "dataloader", "train_state")
_DP_RANK = re.compile(r"dp_rank_(\d+)")
_ORDER = {"model": 0, "optimizer": 1, "other": 2}


def _part(name: str) -> str:
    return "model" if name.startswith("model.") else "optimizer" if name == OPTIMIZER else "other"


def _flat_optimizer(items: list) -> str:
    """What a flattened optimizer entry holds: ``state.<fqn>.<name>`` keys, the state name being the last part (FQNs have dots, state names do not)."""
    state = [str(i.path[1]).removeprefix("state.").rpartition(".") for i in items if i.path[0] == OPTIMIZER and str(i.path[1]).startswith("state.")]
    names = sorted({name for _, _, name in state})
    return f"optimizer flattened (flatten_optimizer_state_dict=True): state {', '.join(names)} for {len({fqn for fqn, _, _ in state})} parameter(s)"


@register
class Torchtitan(CheckpointLayout):
    name = "torchtitan"
    looks_like = "a torchtitan step directory (one DCP checkpoint: the model's entries, optimizer, lr_scheduler, dataloader, train_state)"

    def recognizes(self, path: Path) -> bool:
        """A DCP directory with a flattened ``optimizer`` or one of torchtitan's own top-level keys."""
        if not is_dcp(path):
            return False
        items = dcp_items(path)
        tops = {i.path[0] for i in items}
        flat_optimizer = any(i.path[0] == OPTIMIZER and len(i.path) == 2 and str(i.path[1]).startswith("state.") for i in items)
        return flat_optimizer or bool(tops & set(OWN))

    def read(self, path: Path) -> WholeCheckpoint:
        items = dcp_items(path)
        where = f"{path.name}/ (DCP)"
        nested = any(i.path[0] == "model" and len(i.path) > 1 for i in items)
        groups: dict[str, list] = defaultdict(list)
        for item in items:
            top = str(item.path[0])
            if top == "dataloader" and len(item.path) > 1:  # each data-parallel rank's position, and the world that saved them
                groups[f"dataloader.{item.path[1]}"].append(item)
            elif (nested and top == "model") or (not nested and item.tensor and len(item.path) == 1 and top not in (OPTIMIZER, *OWN)):
                groups[f"model.{item.path[-1]}" if nested else f"model.{top}"].append(item)
            else:
                groups[top].append(item)
        entries = []
        for name, members in sorted(groups.items(), key=lambda kv: (_ORDER[_part(kv[0])], kv[0])):
            part = _part(name)
            rank = _DP_RANK.fullmatch(name.partition(".")[2])
            entries.append(Entry(name, part, where, sum(i.size for i in members), sum(i.tensor for i in members),
                                 int(rank[1]) if name.startswith("dataloader.") and rank else None))
        flat = any(i.path[0] == OPTIMIZER and len(i.path) == 2 for i in items)
        notes = ["the model's entries are nested under 'model' (torchtitan v0.1 and earlier)"] if nested else []
        if flat:
            notes.append(_flat_optimizer(items))
        return WholeCheckpoint(self.name, str(path), tuple(entries), str(path) if OPTIMIZER in groups else None, OPTIMIZER if OPTIMIZER in groups else None,
                               "flat" if flat else "nested", tuple(notes))
