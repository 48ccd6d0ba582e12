"""A new check is its catalog line and its module, a new format its module and its registry line:
nothing else in osdpipe names them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from osdpipe.io import formats  # noqa: E402
from osdpipe.io.formats.fsdp_full import FsdpFull  # noqa: E402
from osdpipe.pipeline.execute import execute  # noqa: E402
from osdpipe.spec import checks  # noqa: E402
from osdpipe.spec.config import InputConfig, OutputConfig  # noqa: E402
from osdpipe.spec.plan import plan_run  # noqa: E402
from osdpipe.spec.reconcile import settle_and_validate  # noqa: E402
from osdpipe.verify import checks as check_runs  # noqa: E402


def offline(out: Path, **pipeline: object) -> dict:
    return {
        "output": {"path": str(out)},
        "target": {"world_size": 3},
        "pipeline": pipeline,
        "runtime": {"mode": "offline", "progress": False, "timeout_s": 120},
    }


def test_a_check_is_its_catalog_line_and_its_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dummycheck

    monkeypatch.setattr(
        checks, "CHECKS", (*checks.CHECKS, checks.Check("counted", "every rank holds state", "digests"))
    )
    monkeypatch.setitem(check_runs.RUNS, "counted", dummycheck)
    spec = settle_and_validate(offline(tmp_path / "out", checks=["roundtrip", "counted"]))
    report = execute(plan_run(spec))
    assert report.ok, report.error
    assert [(c.name, c.ok) for c in report.checks] == [("roundtrip", True), ("counted", True)]
    # every rank ran it; the first rank's words stand for all
    assert report.checks[1].detail.startswith("rank 0 holds ")
    assert "counted" in json.dumps(json.loads((tmp_path / "out" / "report.json").read_text())["checks"])


def test_an_unregistered_check_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown check\(s\) \['counted'\]; the checks are \['roundtrip'"):
        settle_and_validate(offline(tmp_path / "out", checks=["counted"]))


class WholeFile(FsdpFull):
    """``fsdp_full`` under another file name: if anything but the format named the file,
    the conversion or check would miss it."""

    def output_path(self, directory: Path, rank: int) -> Path:
        return directory / "whole.pt"

    def write(self, result, staging, rank, **where):  # noqa: ANN001, ANN003, ANN201
        from osdpipe.io.formats.base import write_torch_file

        return write_torch_file(result, staging / "whole.pt")


def test_where_a_format_writes_is_its_own_business(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(formats.FORMATS, "fsdp_full", WholeFile())
    out = tmp_path / "out"
    report = execute(
        plan_run(settle_and_validate({**offline(out), "output": {"path": str(out), "format": "fsdp_full"}}))
    )
    assert report.ok, report.error
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".pt") == ["whole.pt"]
    assert "whole.pt" in json.loads((out / "manifest.json").read_text())["files"]
    whole = torch.load(out / "whole.pt", weights_only=True)
    assert set(whole["state"]) and all(isinstance(k, str) for k in whole["state"])  # FQN-keyed, every parameter whole


def test_the_config_offers_exactly_the_registered_formats() -> None:
    assert set(get_args(InputConfig.model_fields["format"].annotation)) == set(formats.FORMATS)
    assert set(get_args(OutputConfig.model_fields["format"].annotation)) == {
        n for n, f in formats.FORMATS.items() if f.written
    }


def test_the_config_offers_exactly_the_registered_checkpoint_layouts() -> None:
    """The schema's choices (torch-free, so a bad value is said at once),
    the conf group's options and the registry name the same layouts."""
    from pathlib import Path

    from osdpipe.io import checkpoints
    from osdpipe.spec.config import CheckpointConfig

    assert set(get_args(CheckpointConfig.model_fields["layout"].annotation)) == set(checkpoints.LAYOUTS)
    group = Path(__file__).resolve().parents[2] / "conf" / "checkpoint"
    assert {p.stem for p in group.glob("*.yaml")} == set(checkpoints.LAYOUTS)
