"""What ``osdpipe inspect`` prints, run as it prints it: a newcomer's way through the command.

``inspect`` names the overrides that describe a checkpoint and leaves the target and the output to fill in
(``target.world_size=M output.path=OUT_DIR``). Run as printed:

* an FSDP2 checkpoint converts for FSDP2: the target's kind follows the source's where ``target.kind`` is not given,
  and where the files do not tell the source's kind a warning says which kind the run chose;
* an osdpipe output (PyTorch's own layout among them) is described by its ``manifest.json``: the model that built it
  (``model.factory``, ``model.kwargs``) and the target it was written for, as the new ``source.*``;
* the source the README's default run generated, kept in ``outputs/<date>/<time>/source/``, is named by that
  output's manifest (the model ``nested``), and the folder itself, which holds ``optim.pt`` alone, is that file.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from helpers import run_cli_cases, user_env

TIMEOUT_S = 240
#: A run that makes a source and converts it, checked by roundtrip alone: the sources below are what count.
QUICK = "pipeline.checks=[roundtrip]"
#: inspect's placeholders for the target, the output and a model the files do not name, as the reader fills them in.
FILLED = {
    "target.world_size=M": "target.world_size=3",
    "output.path=OUT_DIR": "output.path={out}",
    "model.factory=PACKAGE.MODULE:FUNCTION": "model.factory=nested",
}


def _as_printed(stdout: str, out: Path) -> list[str]:
    """The arguments of inspect's ``convert with osdpipe ...`` line, its placeholders filled in."""
    line = next(line for line in stdout.splitlines() if line.strip().startswith("convert with osdpipe "))
    words = shlex.split(line.strip().removeprefix("convert with osdpipe "))
    assert "target.world_size=M" in words and "output.path=OUT_DIR" in words, line
    return [FILLED.get(w, w).format(out=out) for w in words]


def _target(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())["config"]["target"]


def _warnings(result: dict) -> list[str]:
    return [line for line in result["stderr"].splitlines() if line.startswith("osdpipe: warning: ")]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """The README's default run (no arguments), FSDP2 jobs' checkpoints (rank files and DCP) that osdpipe trains, and
    an output in PyTorch's layout of a user's model."""
    root = tmp_path_factory.mktemp("inspect_then_convert")
    cases = [
        [],
        ["source.kind=fsdp2", "source.state_dict_type=local", "target.kind=fsdp2", QUICK,
         f"output.path={root / 'ranks'}"],
        ["source.kind=fsdp2", "source.state_dict_type=sharded", "target.kind=fsdp2", QUICK,
         f"output.path={root / 'dcp'}"],
        ["checkpoint=pytorch", "model.factory=usermodel:make", "model.kwargs.dim=5", "target.kind=fsdp2",
         "target.world_size=2", QUICK, f"output.path={root / 'pytorch'}"],
    ]  # fmt: skip
    results = run_cli_cases(cases, cwd=root, per_case_s=TIMEOUT_S, env=user_env())
    assert [r["code"] for r in results] == [0] * len(cases), [r["stderr"] for r in results]
    assert _warnings(results[0]) == [], "the README's default run warns"
    (default,) = root.glob("outputs/*/*")
    assert _target(default)["kind"] == "fsdp1", "the README's default run converts FSDP1 to FSDP1"
    shutil.copytree(root / "dcp" / "source" / "dcp", root / "fsdp2_dcp")  # away from the manifest that names it
    return root


@pytest.fixture(scope="module")
def inspected(made: Path) -> dict[str, dict]:
    """``osdpipe inspect`` of each, and of the default run's ``source/`` folder."""
    (default,) = made.glob("outputs/*/*")
    paths = {
        "fsdp2 ranks": made / "ranks" / "source" / "rank_local",
        "fsdp2 dcp": made / "fsdp2_dcp",
        "pytorch output": made / "pytorch",
        "default source": default / "source" / "optim.pt",
        "default source folder": default / "source",
    }
    results = run_cli_cases([["inspect", str(p)] for p in paths.values()], cwd=made, per_case_s=120, env=user_env())
    return dict(zip(paths, results, strict=True))


@pytest.fixture(scope="module")
def converted(made: Path, inspected: dict[str, dict]) -> dict[str, dict]:
    """Each inspected checkpoint converted with the command inspect printed, run as printed."""
    names = [n for n in inspected if n != "default source folder"]
    for name in names:
        assert inspected[name]["code"] == 0, (name, inspected[name]["stderr"])
    cases = [_as_printed(inspected[n]["stdout"], made / "again" / n.replace(" ", "_")) for n in names]
    results = run_cli_cases(cases, cwd=made, per_case_s=TIMEOUT_S, env=user_env())
    return dict(zip(names, results, strict=True))


def test_an_fsdp2_checkpoint_converts_for_fsdp2_as_inspect_prints_its_command(
    made: Path, converted: dict[str, dict]
) -> None:
    """The target defaulted to FSDP1, root-only wrapped, and nothing said so."""
    result = converted["fsdp2 ranks"]
    assert result["code"] == 0, result["stderr"]
    assert _target(made / "again" / "fsdp2_ranks")["kind"] == "fsdp2"
    assert _warnings(result) == [], result["stderr"]


def test_where_the_files_do_not_tell_the_kind_the_run_says_which_it_chose(
    made: Path, converted: dict[str, dict]
) -> None:
    """FSDP1's SHARDED_STATE_DICT and FSDP2 save DCP byte for byte alike (and no manifest says which saved this one):
    the target is source.kind's, and said."""
    result = converted["fsdp2 dcp"]
    assert result["code"] == 0, result["stderr"]
    kind = _target(made / "again" / "fsdp2_dcp")["kind"]
    warned = [w for w in _warnings(result) if "target.kind=" in w]
    assert len(warned) == 1 and f"target.kind={kind}" in warned[0] and "do not say" in warned[0], result["stderr"]


def test_inspect_of_an_output_in_pytorchs_layout_names_its_manifests_model_and_target(
    made: Path, inspected: dict[str, dict], converted: dict[str, dict]
) -> None:
    shown = inspected["pytorch output"]
    assert shown["code"] == 0, shown["stderr"]
    command = _as_printed(shown["stdout"], Path("OUT"))
    assert "PACKAGE.MODULE:FUNCTION" not in shown["stdout"], shown["stdout"]
    for word in ("checkpoint=pytorch", "model.factory=usermodel:make", "model.kwargs.dim=5", "source.kind=fsdp2",
                 "source.world_size=2"):  # fmt: skip
        assert word in command, (word, command)
    assert converted["pytorch output"]["code"] == 0, converted["pytorch output"]["stderr"]
    assert _target(made / "again" / "pytorch_output")["kind"] == "fsdp2"


@pytest.mark.parametrize("name", ["default source", "default source folder"])
def test_the_default_runs_source_is_named_by_its_outputs_manifest(name: str, inspected: dict[str, dict]) -> None:
    """``outputs/<date>/<time>/source/optim.pt``: the placeholder was to be ``nested``, which no user can guess; its
    folder, which holds it alone, failed with exit 1 and 'point input.path at a checkpoint'."""
    shown = inspected[name]
    assert shown["code"] == 0, shown["stderr"]
    assert shown["stdout"].splitlines()[0].endswith("/source/optim.pt"), shown["stdout"]
    command = _as_printed(shown["stdout"], Path("OUT"))
    for word in ("model.factory=nested", "source.kind=fsdp1", "source.world_size=2", "source.wrap=[Block]"):
        assert word in command, (word, command)


def test_the_default_runs_source_converts_as_printed(converted: dict[str, dict]) -> None:
    assert converted["default source"]["code"] == 0, converted["default source"]["stderr"]
    assert _warnings(converted["default source"]) == [], converted["default source"]["stderr"]


def test_what_inspect_cannot_read_it_says_of_its_path(tmp_path: Path) -> None:
    """inspect has no input.path: its messages name its PATH."""
    (tmp_path / "two").mkdir()
    for name in ("a.pt", "b.pt"):
        (tmp_path / "two" / name).write_text("not a checkpoint")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "notes.pt").write_text("not a checkpoint")
    results = run_cli_cases([["inspect", str(tmp_path / d)] for d in ("two", "one")], cwd=tmp_path, per_case_s=60)
    for result in results:
        lines = result["stderr"].splitlines()
        assert result["code"] == 1 and len(lines) == 1 and lines[0].startswith("osdpipe inspect: error: "), result
        assert "input.path" not in lines[0] and "PATH" in lines[0], lines[0]
    assert "point PATH at a checkpoint" in results[0]["stderr"]
    assert f"{tmp_path / 'one' / 'notes.pt'} is damaged or not a torch.save file" in results[1]["stderr"]
