"""An output made as it is written (``osdpipe.run.streamed_output``), through the ``osdpipe`` command,
held against the output filled in memory.

Under ``runtime.memory_budget`` with ``pipeline.checks=[roundtrip]``, a rank's
state tensors are placeholders that save fills batch by batch as it writes
them. What must hold, each checked on the user's own models (``userlm``: token
IDs, a tied head; ``usermodel``: sizes the world sizes do not divide):

* every file is byte for byte what the in-memory path writes, online and
  offline, for rank files, one full file (``fsdp_full``, ``plain``) and DCP; the manifest's digests too;
  and the output resumes a real 2-rank FSDP2 job (``fsdp2_resume.py``);
* a rank holds the budget, not its output: its peak anonymous memory stays
  far below its output's size, where the same conversion filled in memory
  holds at least its output;
* what shard and roundtrip find in memory is found as the output is written:
  NaN in the source fails the save (nothing committed) or, allowed, converts
  with the warning; a filled batch that differs from the source fails it;
* a rank that must hold its output (a check that needs it) says so, once.
"""

from __future__ import annotations

import json
from pathlib import Path

import fsdp2_resume
import pytest
import torch
from helpers import run_cli_cases, user_env
from oracle_probe import spawn_world

TIMEOUT_S = 240
STREAMED = ("runtime.memory_budget=1KB", "pipeline.checks=[roundtrip]")
#: What roundtrip says when the elements are compared as save writes them (osdpipe.verify.checks.roundtrip).
COMPARED_AS_WRITTEN = "compared bitwise batch by batch as save writes them"


@pytest.fixture(scope="module")
def full_source(tmp_path_factory) -> Path:
    """The user's unwrapped language model after 2 Adam steps on token IDs: its FQN-keyed state as an fsdp_full file."""
    import userlm

    return userlm.save_trained(tmp_path_factory.mktemp("lm_job") / "optim.pt", steps=2)


def _lm(source: Path, out: Path, *extra: str) -> list[str]:
    return [
        "model.factory=userlm:build", f"input.path={source}", "input.format=fsdp_full", "source.world_size=1",
        f"output.path={out}", *extra,
    ]


#: Each output format (with its target), written in memory and as it is made, online and offline.
TARGETS = {
    "rank_local": ("target.kind=fsdp2", "target.world_size=3", "target.wrap=[MixerBlock]"),
    "dcp": (
        "target.kind=fsdp2", "target.world_size=3", "target.wrap=[MixerBlock]",
        "target.wrap_root=true", "output.format=dcp",
    ),
    "fsdp_full": ("target.kind=fsdp2", "target.world_size=2", "target.wrap_root=true", "output.format=fsdp_full"),
    "plain": ("target.kind=none", "target.world_size=1", "output.format=plain"),
}
VARIANTS = {
    "in_memory": ("pipeline.checks=[roundtrip]",),
    "streamed_online": STREAMED,
    "streamed_offline": (*STREAMED, "runtime.mode=offline"),
}


@pytest.fixture(scope="module")
def converted(full_source: Path, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("streamed")
    where = {(fmt, variant): root / fmt / variant for fmt in TARGETS for variant in VARIANTS}
    cases = [
        _lm(full_source, out, *TARGETS[fmt], *VARIANTS[variant], "runtime.timeout_s=60")
        for (fmt, variant), out in where.items()
    ]
    results = run_cli_cases(cases, cwd=root, per_case_s=TIMEOUT_S, env=user_env())
    for (fmt, variant), result in zip(where, results, strict=True):
        assert result["code"] == 0, f"{fmt} {variant}: {result['stderr']}"
    return where


def _files(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in ("report.json", "osdpipe.log", "manifest.json")
    }


@pytest.mark.parametrize("fmt", sorted(TARGETS))
def test_an_output_made_as_it_is_written_is_the_bytes_filled_in_memory(fmt: str, converted) -> None:
    held = converted[(fmt, "in_memory")]
    expected = _files(held)
    assert len([name for name in expected if not name.startswith("source")]) >= 1
    held_manifest = json.loads((held / "manifest.json").read_text())
    for variant in ("streamed_online", "streamed_offline"):
        out = converted[(fmt, variant)]
        assert _files(out) == expected, f"{fmt} {variant}: the files differ from those filled in memory"
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["files"] == held_manifest["files"] and manifest["tensors"] == held_manifest["tensors"], (
            f"{fmt} {variant}"
        )
        report = json.loads((out / "report.json").read_text())
        roundtrip = next(c for c in report["checks"] if c["name"] == "roundtrip")
        assert roundtrip["ok"] and COMPARED_AS_WRITTEN in roundtrip["detail"], (
            f"{fmt} {variant}: not made as written: {roundtrip}"
        )
        assert report["warnings"] == [], report["warnings"]
    roundtrip = next(c for c in json.loads((held / "report.json").read_text())["checks"] if c["name"] == "roundtrip")
    assert COMPARED_AS_WRITTEN not in roundtrip["detail"], "without a budget the output is filled in memory"


@pytest.mark.parametrize("fmt,path", [("dcp", "dcp"), ("fsdp_full", "optim.pt")])
def test_an_output_made_as_it_is_written_resumes_a_real_fsdp2_job(
    fmt: str, path: str, full_source: Path, converted
) -> None:
    out = converted[(fmt, "streamed_offline")] / path
    assert spawn_world(fsdp2_resume.resume, 2, (str(full_source), str(out), fmt), timeout_s=TIMEOUT_S) == [[], []]


# ---------------------------------------------------------------- memory


#: usermodel at this width: 18 * 900**2 parameters, about 58 MB of exp_avg and exp_avg_sq per rank of two.
WIDE = 900


@pytest.fixture(scope="module")
def wide_source(tmp_path_factory) -> Path:
    """The user's model (``usermodel:make``, widened) after one Adam step: its FQN-keyed state as an fsdp_full file."""
    import usermodel

    return usermodel.save_stepped(tmp_path_factory.mktemp("wide_job") / "optim.pt", WIDE)


def test_a_rank_made_as_it_is_written_holds_the_budget_not_its_output(wide_source: Path, tmp_path: Path) -> None:
    """Offline, one process plays both target ranks: filled in memory it holds a rank's output at its peak; made as
    written, far less."""
    budget = 4 << 20
    common = ["model.factory=usermodel:make", f"model.kwargs.dim={WIDE}", f"input.path={wide_source}",
              "input.format=fsdp_full", "source.world_size=1", "target.kind=fsdp1", "target.world_size=2",
              "target.use_orig_params=true",
              "runtime.mode=offline", f"runtime.memory_budget={budget}"]  # fmt: skip
    cases = {
        "streamed": [*common, "pipeline.checks=[roundtrip]"],
        # resume steps an optimizer over the output: it must be in memory
        "in_memory": [*common, "pipeline.checks=[roundtrip,resume]"],
    }
    results = run_cli_cases(
        [[*args, f"output.path={tmp_path / name}"] for name, args in cases.items()],
        cwd=tmp_path,
        per_case_s=TIMEOUT_S,
        env=user_env(),
    )
    reports = {}
    for name, result in zip(cases, results, strict=True):
        assert result["code"] == 0, f"{name}: {result['stderr']}"
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())
    output = max(reports["streamed"]["output_bytes"])
    assert output > 50 << 20 and reports["in_memory"]["output_bytes"] == reports["streamed"]["output_bytes"]
    held = {
        name: r["memory"][0]["peak_anonymous"] - r["memory"][0]["baseline_anonymous"] for name, r in reports.items()
    }
    assert held["in_memory"] >= output, (
        f"filled in memory, the rank held {held['in_memory']} bytes, less than its output of {output}"
    )
    assert held["streamed"] < budget + (24 << 20), (
        f"made as written, the rank held {held['streamed']} bytes beyond its baseline"
        f" (output {output}, budget {budget})"
    )
    warning = reports["in_memory"]["warnings"]
    assert warning == [
        f"a rank held its whole output in memory, more than runtime.memory_budget={_size(budget)}: "
        "check(s) resume need it in memory; pipeline.checks=[roundtrip] writes it as it is made"
    ], warning


def _size(n: int) -> str:
    from osdpipe.core.sizes import show_size

    return show_size(n)


# ---------------------------------------------------------------- what the fill finds


@pytest.fixture(scope="module")
def nan_source(full_source: Path, tmp_path_factory) -> tuple[Path, str]:
    """The user's state with one NaN in one parameter's exp_avg."""
    osd = torch.load(full_source, weights_only=True)
    fqn = "blocks.1.wq.weight"
    osd["state"][fqn]["exp_avg"].view(-1)[7] = float("nan")
    path = tmp_path_factory.mktemp("nan_job") / "optim.pt"
    torch.save(osd, path)
    return path, fqn


def test_nan_in_the_source_fails_a_save_made_as_written_and_commits_nothing(nan_source, tmp_path: Path) -> None:
    path, fqn = nan_source
    target = TARGETS["rank_local"]
    out = tmp_path / "out"
    allowed, in_memory = run_cli_cases(
        [_lm(path, out, *target, *STREAMED, "runtime.mode=offline", "input.allow_nonfinite=true"),
         _lm(path, tmp_path / "allowed_in_memory", *target, "pipeline.checks=[roundtrip]", "runtime.mode=offline",
             "input.allow_nonfinite=true")],
        cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env(),
    )  # fmt: skip
    assert allowed["code"] == 0 and in_memory["code"] == 0, (allowed["stderr"], in_memory["stderr"])
    report = json.loads((out / "report.json").read_text())
    assert (
        len(report["warnings"]) == 1
        and fqn in report["warnings"][0]
        and "input.allow_nonfinite=true" in report["warnings"][0]
    ), report["warnings"]
    committed = _files(out)
    assert committed == _files(tmp_path / "allowed_in_memory"), "allowed NaN converts as the in-memory path converts it"

    (refused,) = run_cli_cases(
        [_lm(path, out, *target, *STREAMED, "runtime.mode=offline", "output.overwrite=true")],
        cwd=tmp_path,
        per_case_s=TIMEOUT_S,
        env=user_env(),
    )
    errors = [line for line in refused["stderr"].splitlines() if line.startswith("osdpipe: error:")]
    assert refused["code"] == 1 and len(errors) == 1, refused["stderr"]
    for word in ("stage 'save'", fqn, "exp_avg", "first at flat index 7", "input.allow_nonfinite=true"):
        assert word in errors[0], f"{word!r} not in {errors[0]!r}"
    assert _files(out) == committed, "a save that failed left the previous conversion as it was"


def test_a_filled_batch_that_differs_from_the_source_fails_the_save(full_source: Path, tmp_path: Path) -> None:
    """roundtrip's comparison runs on every batch as it is filled: one element copied wrong (``tests/support/faults``)
    is named, and nothing is committed."""
    env = user_env(OSDPIPE_TEST_MISFILL="blocks.2.wk.weight:exp_avg_sq")
    out = tmp_path / "out"
    (result,) = run_cli_cases(
        [_lm(full_source, out, *TARGETS["rank_local"], *STREAMED, "runtime.mode=offline")],
        cwd=tmp_path,
        per_case_s=TIMEOUT_S,
        env=env,
    )
    errors = [line for line in result["stderr"].splitlines() if line.startswith("osdpipe: error:")]
    assert result["code"] == 1 and len(errors) == 1, result["stderr"]
    for word in ("stage 'save'", "roundtrip, comparing rank", "exp_avg_sq: differs from blocks.2.wk.weight["):
        assert word in errors[0], f"{word!r} not in {errors[0]!r}"
    assert not (out / "manifest.json").exists() and not list(out.glob("rank_*.pt")), (
        sorted(p.name for p in out.iterdir())
    )


def test_a_rank_that_must_hold_its_output_says_why_once(wide_source: Path, tmp_path: Path) -> None:
    """Every check by default: both ranks hold an output larger than the budget,
    and one warning names the checks and the way out."""
    out = tmp_path / "out"
    args = ["model.factory=usermodel:make", f"model.kwargs.dim={WIDE}", f"input.path={wide_source}",
            "input.format=fsdp_full", "source.world_size=1", "target.kind=fsdp1", "target.world_size=2",
              "target.use_orig_params=true",
            "runtime.mode=offline", "runtime.memory_budget=4MB", f"output.path={out}"]  # fmt: skip
    (result,) = run_cli_cases([args], cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())
    assert result["code"] == 0, result["stderr"]
    report = json.loads((out / "report.json").read_text())
    held = [w for w in report["warnings"] if w.startswith("a rank held its whole output in memory")]
    assert held == [
        "a rank held its whole output in memory, more than runtime.memory_budget=4MB: "
        "check(s) reference, load_step, resume, replicas need it in memory; "
        "pipeline.checks=[roundtrip] writes it as it is made"
    ], report["warnings"]
    roundtrip = next(c for c in report["checks"] if c["name"] == "roundtrip")
    assert roundtrip["ok"] and COMPARED_AS_WRITTEN not in roundtrip["detail"]
