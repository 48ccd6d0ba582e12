"""``fsdp_full``: one ``torch.save`` file holding the FQN-keyed full optimizer state dict."""

from __future__ import annotations

from typing import Any

import torch

from osdpipe.formats import SourceMeta, describe_value


def load_full(path: str, fmt: str = "fsdp_full") -> dict[str, Any]:
    """Load a full optimizer state dict (``fsdp_full`` or ``plain``), memory-mapped so that only touched bytes are read."""
    try:
        osd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises several types for a bad file
        raise ValueError(f"cannot read {path} as a {fmt} checkpoint (a torch.save file): {exc}") from exc
    if not isinstance(osd, dict) or "state" not in osd:
        raise ValueError(f"{path} is not an optimizer state dict: it has no 'state' key (keys: {list(osd)[:5] if isinstance(osd, dict) else type(osd).__name__})")
    return osd


class FullReader:
    """Reads an ``fsdp_full`` file; every rank maps the same file and touches only its ranges."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._osd: dict[str, Any] | None = None

    @property
    def osd(self) -> dict[str, Any]:
        if self._osd is None:
            self._osd = load_full(self.path)
        return self._osd

    def meta(self) -> SourceMeta:
        state = self.osd["state"]
        if any(isinstance(pid, int) for g in self.osd.get("param_groups") or [] for pid in g.get("params", [])):
            raise ValueError(
                f"{self.path} keys its state by param ID, as an unwrapped model's optim.state_dict() does, not by FQN; "
                "read it as input.format=plain source.kind=none source.world_size=1"
            )
        per_param = {k: {n: describe_value(v) for n, v in s.items()} for k, s in state.items() if isinstance(k, str) and isinstance(s, dict)}
        extra = {k: v for k, v in state.items() if k not in per_param}
        return SourceMeta(state=per_param, param_groups=self.osd.get("param_groups"), extra=extra)

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        state = self.osd["state"]
        return {(fqn, name): state[fqn][name] for fqn, name in items}


def save_full(osd: dict[str, Any], path: str) -> None:
    torch.save(osd, path)
