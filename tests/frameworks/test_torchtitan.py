"""Real torchtitan saves, the ``osdpipe`` command converts, real torchtitan resumes (issue 30).

torchtitan 0.3.0's own trainer trains its default ``llama3`` ``debugmodel``
(fused ``wqkv``, saved by its hooks as ``wq``/``wk``/``wv``) with FSDP2 on
CPU/gloo (:mod:`frameworks.titan`). osdpipe converts the checkpoint folder as
a user would, naming the model torchtitan's way. torchtitan then resumes from
the output with its own ``--checkpoint.folder``, and the state it loaded,
gathered whole, equals the state it loads from the source, bit for bit; one
more step gives a finite loss (the same loss, where the data-parallel degree
and so the data order are the source's).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from frameworks import titan
from helpers import run_command, user_env

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

#: What a user runs for a torchtitan checkpoint of the default llama3 model (the target's world and the output added).
CONVERT = ["checkpoint=torchtitan", "model=torchtitan", "model.kwargs.name=llama3", "model.kwargs.flavor=debugmodel"]
#: What torchtitan is told when the data-parallel degree changed: its data loader's state is kept per dp rank.
NEW_DP_DEGREE = ["--checkpoint.exclude-from-loading", "dataloader"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """torchtitan on 2 ranks, 2 steps, a full checkpoint in folder A; and the state torchtitan loads from it on 2 ranks."""
    work = tmp_path_factory.mktemp("titan")
    assets = titan.make_assets(work / "assets")
    folder = work / "A"
    titan.train(work, 2, 2, folder=folder, assets=assets)
    loaded = titan.resume_and_dump(work, 2, folder, assets=assets, name="source")
    return work, assets, folder, loaded


def _convert(work: Path, name: str, *overrides: str) -> Path:
    out = work / name
    done = run_command([sys.executable, "-m", "osdpipe", *CONVERT, *overrides, f"output.path={out}"], cwd=work, timeout=400, env=user_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_default_llama3_converts_2_to_4_and_back_to_2_and_torchtitan_resumes_each_at_its_step(source) -> None:
    work, assets, folder, want = source
    four = _convert(work, "four", f"input.path={folder}", "target.world_size=4")
    assert sorted(p.name for p in four.iterdir() if p.is_dir()) == ["step-2"]  # where torchtitan's --checkpoint.folder resumes
    got = titan.resume_and_dump(work, 4, four, assets=assets, extra=NEW_DP_DEGREE, name="four")
    assert got["step"] == 2 and titan.compare_dumps(want, got) == []
    assert math.isfinite(got["loss_after"])

    two = _convert(work, "two", f"input.path={four / 'step-2'}", "target.world_size=2")
    got = titan.resume_and_dump(work, 2, two, assets=assets, name="two")  # the source's dp degree: its data loader loads too
    assert titan.compare_dumps(want, got, parts=("step", "model", "optim", "lr_scheduler", "loss_after")) == []


def test_offline_to_8_ranks_resumes_on_2(source) -> None:
    work, assets, folder, want = source
    eight = _convert(work, "eight", f"input.path={folder}", "target.world_size=8", "runtime.mode=offline")
    assert len(list((eight / "step-2").glob("*.distcp"))) == 8
    got = titan.resume_and_dump(work, 2, eight, assets=assets, extra=NEW_DP_DEGREE, name="eight")
    assert titan.compare_dumps(want, got) == []
