"""The default: the input is an optimizer's state alone,
in ``input.format`` (under ``input.key`` for ``dcp``), converted as it always was.

It converts no model and carries nothing over; ``osdpipe inspect`` never
takes a checkpoint for one of these, since every optimizer checkpoint is.
"""

from __future__ import annotations

from pathlib import Path

from osdpipe.io.checkpoints.base import CheckpointLayout, Part, WholeCheckpoint, register


@register
class OptimizerOnly(CheckpointLayout):
    name = "optimizer"
    looks_like = "an optimizer checkpoint (fsdp_full, dcp, plain or rank_local)"
    whole = False
    input_formats = ("fsdp_full", "dcp", "plain", "rank_local")
    output_formats = ("rank_local", "fsdp_full", "dcp", "plain")

    def recognizes(self, path: Path) -> bool:
        return False  # every checkpoint holds an optimizer: only a whole checkpoint is recognized as one

    def read(self, path: Path) -> WholeCheckpoint:
        return WholeCheckpoint(self.name, str(path), ())

    def optimizer_part(self, path: str, input_format: str, written_in: CheckpointLayout | None = None) -> Part:
        raise NotImplementedError("the optimizer layout's input is input.path itself")
