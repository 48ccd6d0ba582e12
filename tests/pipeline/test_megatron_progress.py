"""A Megatron conversion reads its source and its output's read-back whole, which takes minutes for a large save: the
live line shows each of those stages' bytes read, up to the save's stored bytes, as they are read."""

from __future__ import annotations

from pathlib import Path

from synthetic_megatron import synthetic_save

from osdpipe.io.formats.dcp_reader import DcpCheckpoint
from osdpipe.io.formats.megatron import iteration_folder, stored_bytes
from osdpipe.run.progress import Display


class Recorded(Display):
    """The live line, drawn (on stderr) and remembered: each phase, and each amount it drew in it."""

    def __init__(self) -> None:
        super().__init__(True)
        self.drawn: dict[str, list[tuple[int, int | None]]] = {}
        self._phase = ""

    def phase(self, text: str, unit: str = "item") -> None:
        self._phase = f"{text} [{unit}]"
        self.drawn[self._phase] = []
        super().phase(text, unit)

    def _show(self, done: int, total: int | None) -> None:
        self.drawn[self._phase].append((done, total))
        super()._show(done, total)


def test_the_load_and_verify_stages_show_the_bytes_read_up_to_the_saves_whole(tmp_path: Path) -> None:
    from osdpipe.pipeline.megatron import convert
    from osdpipe.spec.megatron import MegatronJob

    source = synthetic_save(tmp_path, tp=2)
    job = MegatronJob(str(source), str(tmp_path / "out"), 1, 1, 2, None, False)
    display = Recorded()
    try:
        convert(job, job.config(), display)
    finally:
        display.close()
    assert list(display.drawn) == [f"megatron: stage {s} [{u}]" for s, u in
                                   (("load", "B"), ("shard", "item"), ("verify", "B"), ("save", "item"))]
    for stage, folder in (("load", source), ("verify", tmp_path / "out")):
        drawn = display.drawn[f"megatron: stage {stage} [B]"]
        total = stored_bytes(DcpCheckpoint(str(iteration_folder(folder)), None))
        assert len(drawn) >= 2 and drawn[-1] == (total, total), (stage, drawn)  # the first read, and the last
        assert all(t == total for _, t in drawn) and [d for d, _ in drawn] == sorted({d for d, _ in drawn}), drawn
