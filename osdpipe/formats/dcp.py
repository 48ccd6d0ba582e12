"""``dcp``: a ``torch.distributed.checkpoint`` directory with the optimizer state under one key.

FSDP1's SHARDED_STATE_DICT optimizer state saved with DCP lands here as
``<key>.state.<fqn>.<name>`` entries; the metadata's planner data maps each
flat key back to its path, so FQNs with dots are never guessed from strings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from osdpipe.formats import SourceMeta, TensorRef


class DcpReader:
    """Reads a DCP checkpoint without a process group, one batch of keys at a time."""

    def __init__(self, path: str, key: str) -> None:
        self.path, self.key = path, key
        try:
            self.metadata = FileSystemReader(path).read_metadata()
        except Exception as exc:
            raise ValueError(f"cannot read DCP metadata in {path}: {exc}; is it a torch.distributed.checkpoint directory?") from exc
        self.paths: dict[str, tuple[Any, ...]] = dict(self.metadata.planner_data or {})
        if not any(p[:1] == (key,) for p in self.paths.values()):
            tops = sorted({str(p[0]) for p in self.paths.values()})
            raise ValueError(f"DCP checkpoint {path} has no top-level key {key!r} (it has {tops}); set input.key")

    def _load(self, flat_keys: set[str]) -> dict[str, Any]:
        if not flat_keys:
            return {}
        # no_dist: each rank reads its own keys when it needs them, with no
        # collective, so ranks never wait on each other here. The planner
        # builds the state dict from the checkpoint's own metadata. Both are
        # private in torch 2.13: they are what _load_state_dict_from_keys uses,
        # minus its collective when a process group exists.
        out: dict[str, Any] = {}
        _load_state_dict(out, storage_reader=FileSystemReader(self.path), planner=_EmptyStateDictLoadPlanner(keys=flat_keys), no_dist=True)
        return out

    def _flat_key(self, *path: Any) -> str:
        return ".".join(str(p) for p in (self.key, *path))

    def meta(self) -> SourceMeta:
        small = {k for k, p in self.paths.items() if p[:1] == (self.key,) and not (isinstance(self.metadata.state_dict_metadata[k], TensorStorageMetadata) and len(self.metadata.state_dict_metadata[k].size) > 0)}
        loaded = self._load(small).get(self.key, {})
        state: dict[str, dict[str, Any]] = {}
        for flat, path in self.paths.items():
            if path[:2] != (self.key, "state") or len(path) != 4:
                continue
            fqn, name = path[2], path[3]
            md = self.metadata.state_dict_metadata[flat]
            if isinstance(md, TensorStorageMetadata) and len(md.size) > 0:
                state.setdefault(fqn, {})[name] = TensorRef(tuple(md.size), str(md.properties.dtype).removeprefix("torch."))
            else:
                state.setdefault(fqn, {})[name] = loaded["state"][fqn][name]
        groups = loaded.get("param_groups")
        if isinstance(groups, dict):  # flattened lists come back keyed by index
            groups = [groups[i] for i in sorted(groups)]
        return SourceMeta(state=state, param_groups=groups)

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        wanted = {self._flat_key("state", fqn, name): (fqn, name) for fqn, name in items}
        loaded = self._load(set(wanted)).get(self.key, {}).get("state", {})
        return {(fqn, name): loaded[fqn][name] for fqn, name in wanted.values()}
