"""Determinism and ``osdpipe check``, through the command, on a user's model.

The same conversion run again (another output directory), offline, under a
memory budget with ``runtime.transfer=scatter`` and made as it is written
(``pipeline.checks=[roundtrip]``) writes the same bytes, for
``rank_local``, ``fsdp_full`` and ``dcp`` outputs, and the same manifest
content (``content_sha256``: no paths, no timestamps, nothing of how it ran).
``osdpipe check`` passes on every one of them, from the manifest alone. With
one element of one tensor changed (the file rewritten), it fails with exit
code 1 and names the file, the tensor and the element; with a missing file,
the file; with no manifest, exit code 2. ``--load`` loads every format on its
target world and steps; a NaN in one rank's file fails it, naming that rank.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import run_cli_cases, user_env

TIMEOUT_S = 120
OUTPUTS = {
    "rank_local": ["target.world_size=3", "target.wrap=[MixerBlock]", "target.use_orig_params=true"],
    "fsdp_full": ["target.world_size=2", "target.wrap=[MixerBlock]", "output.format=fsdp_full"],
    "dcp": ["target.kind=fsdp2", "target.world_size=3", "target.wrap=[MixerBlock]", "output.format=dcp"],
}
RUNS = {
    "first": [],
    "again": [],
    "offline": ["runtime.mode=offline"],
    "budget_scatter": ["runtime.memory_budget=1KB", "runtime.transfer=scatter"],
    # the output made as save writes it (osdpipe.run.streamed_output): check derived it as zeros to compare with
    "budget_streamed": ["runtime.memory_budget=1KB", "pipeline.checks=[roundtrip]"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every output format, each converted four ways from the user's job (its FQN-keyed full state, 2 Adam steps)."""
    import userlm

    root = tmp_path_factory.mktemp("determinism")
    torch.manual_seed(0)
    model = userlm.build()
    torch.save(userlm.fqn_keyed(model, userlm.train(model, steps=2)), root / "optim.pt")
    source = [
        "model.factory=userlm:build",
        f"input.path={root / 'optim.pt'}",
        "input.format=fsdp_full",
        "source.world_size=1",
    ]
    cases = [
        [*source, *args, *extra, f"output.path={root / fmt / run}"]
        for fmt, args in OUTPUTS.items()
        for run, extra in RUNS.items()
    ]
    for result in run_cli_cases(cases, cwd=root, per_case_s=TIMEOUT_S, env=user_env()):
        assert result["code"] == 0, result["stderr"]
    return root


def _data_files(directory: Path) -> dict[str, bytes]:
    names = [
        p for p in directory.rglob("*") if p.is_file() and p.name not in ("report.json", "manifest.json", "osdpipe.log")
    ]
    return {str(p.relative_to(directory)): p.read_bytes() for p in names}


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
def test_the_same_conversion_writes_the_same_bytes_and_manifest_content(runs: Path, fmt: str) -> None:
    first = _data_files(runs / fmt / "first")
    assert first, "no data files"
    content = json.loads((runs / fmt / "first" / "manifest.json").read_text())
    for run in RUNS:
        assert _data_files(runs / fmt / run) == first, f"{fmt}: {run} wrote other bytes"
        manifest = json.loads((runs / fmt / run / "manifest.json").read_text())
        assert manifest["content_sha256"] == content["content_sha256"], f"{fmt}: {run}'s manifest content differs"
        # where it ran is kept, outside the content
        assert manifest["config"]["output"]["path"] == str(runs / fmt / run)
    assert "path" not in content["conversion"]["input"] and "runtime" not in content["conversion"]


def _check(*args: str, cwd: Path) -> list[dict]:
    cases: list[list[str]] = [["check", *a] for a in args]
    return run_cli_cases(cases, cwd=cwd, per_case_s=TIMEOUT_S, env=user_env())


def test_check_passes_on_every_run(runs: Path) -> None:
    results = _check(*[[str(runs / fmt / run)] for fmt in OUTPUTS for run in RUNS], cwd=runs)
    for result in results:
        assert result["code"] == 0, result["stderr"] + result["stdout"]
        assert (
            "check files" in result["stdout"] and "check roundtrip  pass  every" in result["stdout"]
        ), result["stdout"]


def test_check_names_the_file_tensor_and_element_after_one_element_changes(runs: Path, tmp_path: Path) -> None:
    import shutil

    spoiled = {}
    for fmt in ("rank_local", "fsdp_full"):
        out = tmp_path / fmt
        shutil.copytree(runs / fmt / "first", out)
        name = "rank_1.pt" if fmt == "rank_local" else "optim.pt"
        osd = torch.load(out / name, weights_only=True)
        key = sorted(
            k for k, s in osd["state"].items() if isinstance(s, dict) and "exp_avg" in s and s["exp_avg"].numel() > 3
        )[0]
        osd["state"][key]["exp_avg"].view(-1)[3] += 1.0
        torch.save(osd, out / name)
        spoiled[fmt] = (out, name, key)
    missing = tmp_path / "missing"
    shutil.copytree(runs / "dcp" / "first", missing)
    (missing / "dcp" / "__1_0.distcp").unlink()
    results = _check(
        *[[str(out)] for out, _, _ in spoiled.values()], [str(missing)], [str(tmp_path / "nothing")], cwd=tmp_path
    )
    for (fmt, (out, name, key)), result in zip(spoiled.items(), results, strict=False):
        assert result["code"] == 1, (fmt, result)
        text = result["stdout"] + result["stderr"]
        assert f"{out / name} differs from its digest in the manifest: tensor(s) {key}.exp_avg differ" in text, text
        assert f"['state'][{key!r}]['exp_avg']: 1 element(s) differ, first at flat index 3" in text, text
    assert (
        results[2]["code"] == 1 and f"{missing / 'dcp' / '__1_0.distcp'} is missing" in results[2]["stdout"]
    ), results[2]
    assert results[3]["code"] == 2 and "manifest.json does not exist" in results[3]["stderr"], results[3]


def _by_hand_snippet() -> str:
    """The Python the docs give for checking a file by hand (docs/formats.md, "Checking a file by hand"), as printed
    there."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "formats.md").read_text()
    section = page[page.index("### Checking a file by hand") :]
    return section[
        section.index("```python\n") + len("```python\n") : section.index("```", section.index("```python\n") + 3)
    ]


def test_the_docs_way_to_check_a_file_by_hand_finds_every_file_right_and_one_changed_byte(
    runs: Path, tmp_path: Path
) -> None:
    import hashlib
    import shutil
    import subprocess
    import sys

    snippet = _by_hand_snippet()
    for fmt in OUTPUTS:
        out = runs / fmt / "first"
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["pieces"] and "sha256sum" in manifest["digests"], "the manifest says how its digests are taken"
        printed = subprocess.run(
            [sys.executable, "-c", snippet], cwd=out, capture_output=True, text=True, check=True
        ).stdout.splitlines()
        assert sorted(printed) == sorted(f"ok   {name}" for name in manifest["files"]), printed
        # the tensors' digests are pieces of the files: each tensor's sha256 is the digest of a piece
        name = next(iter(manifest["pieces"]))
        data, at, pieces = (out / name).read_bytes(), 0, set()
        for n in manifest["pieces"][name]:
            pieces.add(hashlib.sha256(data[at : at + n]).hexdigest())
            at += n
        mine = {k: v for k, v in manifest["tensors"].items() if k.startswith(f"{name}:") and not k.endswith(".step")}
        assert mine and set(mine.values()) <= pieces, fmt
    spoiled = tmp_path / "spoiled"
    shutil.copytree(runs / "rank_local" / "first", spoiled)
    data = bytearray((spoiled / "rank_2.pt").read_bytes())
    data[len(data) // 2] ^= 1
    (spoiled / "rank_2.pt").write_bytes(bytes(data))
    printed = subprocess.run(
        [sys.executable, "-c", snippet], cwd=spoiled, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert sorted(printed) == ["BAD  rank_2.pt", "ok   rank_0.pt", "ok   rank_1.pt"], printed


def test_check_verifies_a_manifest_written_before_pieces_by_each_files_sha256(runs: Path, tmp_path: Path) -> None:
    """A manifest of an earlier osdpipe has no pieces: its files' digests are their sha256, and check holds them to
    it."""
    import hashlib
    import shutil

    old = tmp_path / "old"
    shutil.copytree(runs / "dcp" / "first", old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["files"] = {name: hashlib.sha256((old / name).read_bytes()).hexdigest() for name in manifest["files"]}
    del manifest["pieces"], manifest["digests"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    bad = tmp_path / "bad"
    shutil.copytree(old, bad)
    data = bytearray((bad / "dcp" / "__0_0.distcp").read_bytes())
    data[-100] ^= 1
    (bad / "dcp" / "__0_0.distcp").write_bytes(bytes(data))
    good, spoiled = _check([str(old)], [str(bad)], cwd=tmp_path)
    assert good["code"] == 0 and "file(s) match the manifest's digests" in good["stdout"], good
    assert (
        spoiled["code"] == 1
        and f"{bad / 'dcp' / '__0_0.distcp'} differs from its digest in the manifest" in spoiled["stdout"]
    ), spoiled


#: What ``--load`` runs each output on: the target world the conversion was for.
TARGET_WORLDS = {"rank_local": "3 fsdp1", "fsdp_full": "2 fsdp1", "dcp": "3 fsdp2"}


def test_check_load_loads_every_format_on_its_target_world_and_steps(runs: Path) -> None:
    results = _check(
        *[[str(runs / fmt / "first"), "--load"] for fmt in OUTPUTS],
        ["--lode", str(runs / "dcp" / "first")],
        [str(runs / "dcp" / "first"), "--lode"],
        cwd=runs,
    )
    for fmt, result in zip(OUTPUTS, results, strict=False):
        assert result["code"] == 0, result["stderr"] + result["stdout"]
        assert (
            f"check load       pass  on {TARGET_WORLDS[fmt]} rank(s): loaded; one step left all state finite"
            in result["stdout"]
        ), result["stdout"]
        resume = (
            f"check resume     pass  on {TARGET_WORLDS[fmt]} rank(s): storage: no two state tensors share memory; "
            f"steps: the {TARGET_WORLDS[fmt].split()[1]} target job"
        )
        assert resume in result["stdout"], result["stdout"]
    assert results[3]["code"] == 2, results[3]
    assert results[4]["code"] == 2 and "--lode is not an option" in results[4]["stderr"], results[4]


def test_check_load_names_the_rank_and_the_state_that_does_not_load_right(runs: Path, tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "rank_local"
    shutil.copytree(runs / "rank_local" / "first", out)
    osd = torch.load(out / "rank_1.pt", weights_only=True)
    key = sorted(k for k, s in osd["state"].items() if isinstance(s, dict) and s["exp_avg_sq"].numel() > 3)[0]
    osd["state"][key]["exp_avg_sq"].view(-1)[2] = float("nan")
    torch.save(osd, out / "rank_1.pt")
    [result] = _check([str(out), "--load"], cwd=tmp_path)
    assert result["code"] == 1, result
    line = next(line for line in result["stdout"].splitlines() if "check load" in line)
    assert "FAIL  rank 1: non-finite in the loaded state" in line and "exp_avg_sq (1 element)" in line, line
    assert "rank 0" not in line and "rank 2" not in line, line


def test_check_load_resume_names_a_step_two_parameters_of_a_file_share(runs: Path, tmp_path: Path) -> None:
    """A rank file edited to share one step tensor between two parameters (torch.save keeps it shared): resume fails,
    naming both values."""
    import shutil

    out = tmp_path / "rank_local"
    shutil.copytree(runs / "rank_local" / "first", out)
    osd = torch.load(out / "rank_1.pt", weights_only=True)
    first, second = sorted(k for k, s in osd["state"].items() if isinstance(s, dict))[:2]
    osd["state"][second]["step"] = osd["state"][first]["step"]
    torch.save(osd, out / "rank_1.pt")
    [result] = _check([str(out), "--load"], cwd=tmp_path)
    assert result["code"] == 1, result
    line = next(line for line in result["stdout"].splitlines() if "check resume" in line)
    assert "FAIL  rank 1: " in line, line
    assert re.search(
        r"step is (\d+)\.0 after 2 step\(s\) from the source's 2\.0; a job resuming from the source has 4\.0", line
    ), line
    assert "share memory" in line and "rank 0" not in line and "rank 2" not in line, line


def test_the_log_file_says_what_ran_at_its_level(runs: Path, tmp_path: Path) -> None:
    """osdpipe.log holds each stage, check and warning of report.json (info); debug adds digests and memory; a failure
    its error."""
    info = (runs / "rank_local" / "budget_scatter" / "osdpipe.log").read_text()
    report = json.loads((runs / "rank_local" / "budget_scatter" / "report.json").read_text())
    # scatter skips reference and load_step, and warns
    assert report["stages"] and report["checks"] and report["skipped_checks"] and report["warnings"], report
    for s in report["stages"]:
        assert (
            f"INFO    stage {s['name']}: {s['seconds']:.3f} s, {s['bytes']:,d} B read or written, "
            f"{s['sent']:,d} B sent to other ranks"
        ) in info, info
    for c in report["checks"]:
        assert f"check {c['name']}: pass: {c['detail']}" in info
    for c in report["skipped_checks"]:
        assert f"check {c['name']} did not run: it {c['why']}" in info
    for w in report["warnings"]:
        assert f"WARNING {w}" in info
    assert (
        "transfer scatter, memory budget 1KB" in info
        and "DEBUG" not in info
        and info.rstrip().endswith("ok: every stage ran and every check passed")
    )

    osd = torch.load(runs / "optim.pt", weights_only=True)
    next(iter(osd["state"].values()))["exp_avg"].view(-1)[0] = float("nan")
    torch.save(osd, tmp_path / "nan.pt")
    common = ["model.factory=userlm:build", "input.format=fsdp_full", "source.world_size=1", *OUTPUTS["rank_local"]]
    results = run_cli_cases(
        [[*common, f"input.path={runs / 'optim.pt'}", f"output.path={tmp_path / 'debug'}",
          "runtime.log_level=debug", "runtime.mode=offline"],
         [*common, f"input.path={tmp_path / 'nan.pt'}", f"output.path={tmp_path / 'failed'}",
          "runtime.log_level=warning", "runtime.mode=offline"]],
        cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env(),
    )  # fmt: skip
    assert [r["code"] for r in results] == [0, 1], results
    debug = (tmp_path / "debug" / "osdpipe.log").read_text()
    manifest = json.loads((tmp_path / "debug" / "manifest.json").read_text())
    for name, digest in manifest["files"].items():
        assert f"DEBUG   file {name} digest {digest}" in debug
    assert "DEBUG   memory of offline: peak RSS" in debug
    failed = (tmp_path / "failed" / "osdpipe.log").read_text()
    assert (
        "INFO" not in failed
        and "ERROR   failed: stage 'shard' failed" in failed
        and "the source holds NaN or Inf" in failed
    ), failed


def test_the_readme_ci_job_and_check_of_a_generated_or_moved_source(runs: Path, tmp_path: Path) -> None:
    """The README's CI steps (a recipe, offline, then check); check on a generated FSDP2 source (its dcp/); a source
    that moved."""
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(runs / "rank_local" / "first", moved)
    shutil.copy(runs / "optim.pt", tmp_path / "archived.pt")
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["config"]["input"]["path"] = str(tmp_path / "gone.pt")  # where it was: config is not hashed content
    manifest["input_path_absolute"] = str(tmp_path / "gone.pt")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    user = "model.factory=userlm:build"
    results = run_cli_cases(
        [[user, "recipe=halve_world_size", f"input.path={runs / 'optim.pt'}", f"output.path={tmp_path / 'ci'}",
          "runtime.mode=offline"],
         ["check", str(tmp_path / "ci")],
         [user, "source.kind=fsdp2", "source.state_dict_type=sharded", "source.world_size=2",
          "target.wrap=[MixerBlock]", f"output.path={tmp_path / 'generated'}", "runtime.mode=offline"],
         ["check", str(tmp_path / "generated")],
         ["check", str(moved)],
         ["check", str(moved), f"input.path={tmp_path / 'archived.pt'}"],
         ["check", str(moved), "input.nosuchkey=1"]],
        cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env(),
    )  # fmt: skip
    codes = [r["code"] for r in results]
    assert codes == [0, 0, 0, 0, 2, 0, 2], [(r["code"], r["stderr"]) for r in results]
    assert "roundtrip  pass" in results[1]["stdout"], results[1]
    # read as the dcp its world saved
    assert f"({tmp_path / 'generated' / 'source' / 'dcp'})" in results[3]["stdout"], results[3]["stdout"]
    assert (
        f"{tmp_path / 'gone.pt'}" in results[4]["stderr"] and "not there any more" in results[4]["stderr"]
    ), results[4]
    assert "pass input.path=" in results[4]["stderr"], results[4]
    assert f"({tmp_path / 'archived.pt'})" in results[5]["stdout"], results[5]
    assert "input.nosuchkey: not a key of the conversion's config" in results[6]["stderr"], results[6]


def test_check_runs_from_another_directory_on_a_conversion_given_a_relative_input_path(
    runs: Path, tmp_path: Path
) -> None:
    """The manifest keeps input.path as typed (relative to where the conversion ran) and its absolute path beside it."""
    ran_in, elsewhere = tmp_path / "ran_in", tmp_path / "elsewhere"
    (ran_in / "src").mkdir(parents=True)
    elsewhere.mkdir()
    (ran_in / "src" / "optim.pt").write_bytes((runs / "optim.pt").read_bytes())
    convert = ["model.factory=userlm:build", "input.path=src/optim.pt", "input.format=fsdp_full", "source.world_size=1",
               "target.world_size=2", "runtime.mode=offline", "output.path=out"]
    [converted] = run_cli_cases([convert], cwd=ran_in, per_case_s=TIMEOUT_S, env=user_env())
    assert converted["code"] == 0, converted["stderr"]
    manifest = json.loads((ran_in / "out" / "manifest.json").read_text())
    assert manifest["config"]["input"]["path"] == "src/optim.pt"
    assert manifest["input_path_absolute"] == str(ran_in / "src" / "optim.pt")
    [checked] = run_cli_cases([["check", str(ran_in / "out")]], cwd=elsewhere, per_case_s=TIMEOUT_S, env=user_env())
    assert checked["code"] == 0, checked["stderr"]
    assert "roundtrip  pass" in checked["stdout"] and str(ran_in / "src" / "optim.pt") in checked["stdout"], checked
