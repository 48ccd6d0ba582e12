"""The ``osdpipe`` command end to end, in a subprocess, as a user runs it.

Each full run starts a source world and a target world (10-20 s on 2 cores),
so the runs here are few and small. Every subprocess runs in its own session
and is killed with its spawned ranks if it outlives ``TIMEOUT_S``: a hang
fails the test instead of the suite.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import clean_env, manifest_digests_hold, run_command, run_osdpipe
from omegaconf import OmegaConf

from osdpipe.run.launch import free_port
from osdpipe.spec.config import STAGE_ORDER, VERIFY_CHECKS

TIMEOUT_S = 240
REPO = Path(__file__).resolve().parents[2]
CONFIG_ERROR = "osdpipe: error: config:"


def osdpipe(*args: str, cwd: Path, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``python -m osdpipe *args`` in ``cwd``; on timeout kill it and its ranks and fail."""
    return run_osdpipe(*args, cwd=cwd, timeout=timeout)


def explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def rank_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("rank_*.pt"))}


def assert_ok(report: dict) -> None:
    assert report["ok"] is True, report
    assert report["error"] is None
    # every check ran, but replicas, which runs only where a side has replica groups
    assert [c["name"] for c in report["checks"] if c["name"] != "replicas"] == [
        c for c in VERIFY_CHECKS if c not in ("replicas", "universal")
    ]
    assert all(c["ok"] for c in report["checks"]), report["checks"]


# ------------------------------------------------------------------ plain run


def test_plain_osdpipe_runs_quickstart(tmp_path: Path) -> None:
    result = osdpipe(cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert "osdpipe: OK" in result.stdout

    reports = list(tmp_path.glob("outputs/*/*/report.json"))
    assert len(reports) == 1, reports
    out = reports[0].parent
    report = read_json(reports[0])
    assert_ok(report)

    # Stages: load..save in order, each timed and with the bytes it moved.
    assert [s["name"] for s in report["stages"]] == list(STAGE_ORDER)
    for s in report["stages"]:
        assert isinstance(s["seconds"], float) and s["seconds"] >= 0, s
        assert isinstance(s["bytes"], int) and s["bytes"] >= 0, s
    assert any(s["bytes"] > 0 for s in report["stages"])

    # Manifest: one rank_<r>.pt per target rank, each with its real digest, taken by hand as the manifest says.
    manifest = read_json(out / "manifest.json")
    world = manifest["config"]["target"]["world_size"]
    assert world == 3  # quickstart: 2 -> 3 ranks
    assert manifest["format"] == "rank_local"
    assert manifest["config"]["output"]["path"] == str(out)
    assert sorted(manifest["files"]) == sorted(f"rank_{r}.pt" for r in range(world))
    assert sorted(p.name for p in out.glob("rank_*.pt")) == sorted(manifest["files"])
    assert manifest_digests_hold(out, manifest) == dict.fromkeys(manifest["files"], True)
    assert sorted(manifest["pieces"]) == sorted(manifest["files"]), "every rank file is hashed in pieces"
    assert report["files"] == manifest["files"]
    assert not (out / ".staging").exists()

    # Memory: every target rank's peaks, the anonymous one sampled above its baseline.
    assert [m["process"] for m in report["memory"]] == [f"rank {r}" for r in range(world)]
    for m in report["memory"]:
        assert m["peak_rss"] > 50e6 and m["peak_anonymous"] >= m["baseline_anonymous"] > 0, m
    assert "  memory     peak RSS" in result.stdout

    # The README's run: FSDP1 to FSDP1 (the target follows the source), nothing to warn of; its online world's first
    # reader sent the source's metadata to the other ranks.
    assert manifest["config"]["target"]["kind"] == "fsdp1" and "warning" not in result.stderr, result.stderr
    broadcast = next(s for s in report["stages"] if s["name"] == "broadcast")
    assert broadcast["sent"] > 0 and f"{broadcast['sent']:,d} B sent to other ranks" in result.stdout


def test_an_offline_run_says_no_bytes_went_to_other_ranks(tmp_path: Path) -> None:
    """Offline one process plays every target rank: nothing crossed a process, yet the summary said the broadcast
    stage sent the source's metadata to the others ('6,760 B sent to other ranks')."""
    out = tmp_path / "out"
    result = osdpipe("runtime.mode=offline", "pipeline.checks=[roundtrip]", f"output.path={out}", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert "sent to other ranks" not in result.stdout, result.stdout
    assert [s["sent"] for s in read_json(out / "report.json")["stages"]] == [0] * len(STAGE_ORDER)


# ------------------------------------------------------------- determinism


def test_same_config_gives_byte_identical_output(tmp_path: Path) -> None:
    # Small but sharded: a 1-rank source, regrouped into Leaf units on 2 target ranks.
    args = ["recipe=change_wrapping", "source.world_size=1"]
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        result = osdpipe(*args, f"output.path={out}", cwd=tmp_path)
        assert result.returncode == 0, explain(result)
        assert_ok(read_json(out / "report.json"))
    a, b = (rank_files(out) for out in outs)
    assert sorted(a) == ["rank_0.pt", "rank_1.pt"]
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], f"{name} differs between two runs of the same config"
    ma, mb = (read_json(out / "manifest.json") for out in outs)
    assert ma["files"] == mb["files"] and ma["tensors"] == mb["tensors"]


# ------------------------------------------------------------------ bad config


def test_bad_config_exits_2_and_starts_nothing(tmp_path: Path) -> None:
    result = osdpipe("target.world_size=0", cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith(CONFIG_ERROR)]
    assert len(errors) == 1, explain(result)
    assert "target.world_size" in errors[0]
    assert "Traceback" not in result.stderr
    assert "osdpipe: OK" not in result.stdout
    assert not list(tmp_path.rglob("report.json"))
    assert not list(tmp_path.rglob("*.pt"))
    assert not list(tmp_path.rglob("manifest.json"))


def test_a_config_error_keeps_the_users_own_output_directory(tmp_path: Path) -> None:
    """The user made the directory: it is theirs, empty or not, and a job that never ran leaves it."""
    cwd, mine = tmp_path / "cwd", tmp_path / "cwd" / "myout"
    mine.mkdir(parents=True)
    result = osdpipe("model.factory=nosuch:build", "output.path=myout", cwd=cwd)
    assert result.returncode == 2, explain(result)
    assert mine.is_dir(), "a config error removed the directory the user made"
    assert list(cwd.iterdir()) == [mine]


def test_a_config_error_removes_what_it_made_outside_the_working_directory(tmp_path: Path) -> None:
    """Hydra made output.path and its missing parents for the job; the job never ran, so they go, and only they."""
    cwd, elsewhere = tmp_path / "cwd", tmp_path / "elsewhere"
    cwd.mkdir()
    elsewhere.mkdir()
    result = osdpipe("model.factory=nosuch:build", f"output.path={elsewhere / 'new' / 'out'}", cwd=cwd)
    assert result.returncode == 2, explain(result)
    assert elsewhere.is_dir() and list(elsewhere.iterdir()) == [], "left behind what osdpipe made"
    assert list(cwd.iterdir()) == []


def test_a_sweep_job_with_a_config_error_leaves_the_sweep_directory_the_user_named(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)  # the user's (an earlier sweep's job 0, emptied): never removed
    result = osdpipe("-m", "target.world_size=0,-1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    assert (sweep / "0").is_dir() and not (sweep / "1").exists()


def test_sweep_of_bad_configs_exits_2(tmp_path: Path) -> None:
    result = osdpipe("-m", "target.world_size=0,-1", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert len([line for line in result.stderr.splitlines() if line.startswith(CONFIG_ERROR)]) == 2, explain(result)
    assert result.returncode == 2, explain(result)


# -------------------------------------------------------------------- multirun


def test_multirun_one_directory_per_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = osdpipe("-m", "target.world_size=1,2", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")) == ["0", "1"]
    for job, world in (("0", 1), ("1", 2)):
        out = sweep / job
        assert_ok(read_json(out / "report.json"))
        manifest = read_json(out / "manifest.json")
        assert manifest["config"]["target"]["world_size"] == world
        assert manifest["config"]["output"]["path"] == str(out)
        assert sorted(p.name for p in out.glob("rank_*.pt")) == [f"rank_{r}.pt" for r in range(world)]
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("report.json"))


def test_multirun_goes_on_after_a_failed_job(tmp_path: Path) -> None:
    # Job 1's input exists but is no checkpoint: the config does not describe the files, which the launcher finds
    # before anything runs or is written (exit code 2, docs/errors.md); the sweep goes on.
    sweep = tmp_path / "sweep"
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a torch.save file")
    result = osdpipe("-m", f"input.path=null,{corrupt}", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    assert "osdpipe: OK" in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("osdpipe: error:")]
    assert len(errors) == 1 and str(corrupt) in errors[0] and "not a torch.save file" in errors[0], explain(result)

    good = read_json(sweep / "0" / "report.json")
    assert_ok(good)
    assert (sweep / "0" / "manifest.json").exists()
    assert not (sweep / "1").exists(), "the refused job wrote its directory"


def test_a_sweep_whose_jobs_share_an_output_path_keeps_the_first_jobs_conversion(tmp_path: Path) -> None:
    """``output.path`` given once for a whole sweep: the second job was refused as 'already holds a conversion' or,
    with ``output.overwrite=true``, replaced the first job's, and the sweep ended with one conversion of two. It is
    refused as the first job's path, one line, and the first job's conversion stays; a path that differs per job
    (``${hydra:job.num}``) gives each its own."""
    shared = tmp_path / "shared"
    result = osdpipe("-m", "target.world_size=2,3", f"output.path={shared}", "output.overwrite=true",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, explain(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("osdpipe: error:")]
    assert errors == [f"osdpipe: error: config: output.path='{shared}' was job 0's too: each job of a sweep writes a "
                      "conversion of its own; leave output.path out (each job writes into <sweep dir>/<job number>) "
                      "or make it differ per job ('output.path=/ckpt/sweep/${hydra:job.num}')"], explain(result)
    assert read_json(shared / "manifest.json")["config"]["target"]["world_size"] == 2
    each = tmp_path / "each"
    result = osdpipe("-m", "target.world_size=2,3", f"output.path={each}/${{hydra:job.num}}",
                     f"hydra.sweep.dir={tmp_path / 'sweep_each'}", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, explain(result)
    assert [read_json(each / job / "manifest.json")["config"]["target"]["world_size"] for job in "01"] == [2, 3]


# ---------------------------------------------------------------- entry point


def test_help_lists_groups_and_every_recipe(tmp_path: Path) -> None:
    result = osdpipe("--help", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, explain(result)
    recipe_line = next(line for line in result.stdout.splitlines() if line.startswith("recipe:"))
    assert sorted(r.strip() for r in recipe_line.removeprefix("recipe:").split(",")) == sorted(
        p.stem for p in (REPO / "recipes").glob("*.yaml")
    )
    for group in ("model:", "optim:", "source:", "target:", "pipeline:", "runtime:"):
        assert any(line.startswith(group) for line in result.stdout.splitlines()), group
    assert not (tmp_path / "outputs").exists()


def test_every_key_the_help_names_is_a_key_of_the_config(tmp_path: Path) -> None:
    """The help's "Main keys" are what a newcomer types first: each one (``model.kwargs.*``'s node, ``runtime.mode``
    of ``runtime.mode=offline``) is in the composed config, so that a key renamed or dropped cannot stay in the help."""
    shown = osdpipe("--help", cwd=tmp_path, timeout=60).stdout
    section = shown.split("Main keys", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    firsts = [re.split(r"\s{2,}", line.strip())[0] for line in section if line.strip() and not line.startswith(" " * 8)]
    keys = sorted({re.sub(r"(=.*|\.\*)$", "", key.strip()) for first in firsts for key in first.split(",")})
    assert {"input.path", "checkpoint", "output.checkpoint", "target.tp_size", "runtime.mode"} <= set(keys), keys
    config = OmegaConf.create(osdpipe("--cfg", "job", cwd=tmp_path, timeout=60).stdout)
    unknown = [key for key in keys if OmegaConf.select(config, key, default=KeyError) is KeyError]
    assert unknown == [], f"the help names keys the config does not have: {unknown}"


def test_cfg_job_prints_the_composed_config(tmp_path: Path) -> None:
    result = osdpipe("--cfg", "job", "target.world_size=5", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, explain(result)
    cfg = OmegaConf.create(result.stdout)
    assert cfg.target.world_size == 5
    assert cfg.target.wrap is None  # the model's own units
    assert cfg.source.world_size == 2  # from quickstart
    assert cfg.output.path is None  # Hydra's job directory
    assert "hydra" not in cfg
    assert not list(tmp_path.rglob("report.json"))


# ---------------------------------------------------------------- torchrun


def test_joins_an_existing_torchrun_world(tmp_path: Path) -> None:
    """The same command under torchrun: the ranks are torchrun's, one report, nothing outside output.path."""
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "osdpipe", "source.world_size=2", "target.world_size=2", f"output.path={out}",
    ]
    result = run_command(cmd, cwd=tmp_path, timeout=TIMEOUT_S)
    assert result.returncode == 0, explain(result)
    assert result.stdout.count("osdpipe: OK") == 1, explain(result)  # rank 0 alone prints the summary
    assert_ok(read_json(out / "report.json"))
    assert sorted(p.name for p in out.glob("rank_*.pt")) == ["rank_0.pt", "rank_1.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "a run with output.path writes nowhere else"


def test_checks_that_hold_the_whole_state_are_skipped_above_the_limit_and_said_so(tmp_path: Path) -> None:
    """On the user's own model (tests/support/userlm.py: token IDs in, no example_input, a factory without
    arguments)."""
    out = tmp_path / "out"
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "support"), env.get("PYTHONPATH", "")]
    )
    cmd = [
        sys.executable, "-m", "osdpipe",
        "model.factory=userlm:build", "pipeline.full_state_checks_max=1KB", f"output.path={out}",
    ]
    result = run_command(cmd, cwd=tmp_path, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, explain(result)
    report = read_json(out / "report.json")
    assert [c["name"] for c in report["checks"]] == ["roundtrip", "resume"]
    # resume needs no whole state for a param-ID keyed output: each rank's live target loads its own file and steps
    assert "steps: the fsdp1 target job loaded it" in report["checks"][1]["detail"], report["checks"][1]
    skipped = {c["name"]: c["why"] for c in report["skipped_checks"]}
    assert sorted(skipped) == ["load_step", "reference", "replicas"]
    assert re.fullmatch(
        r"needs the whole state on every rank or a live target model, "
        r"and the source holds [0-9.]+KB of tensor state, over pipeline.full_state_checks_max=1KB: "
        r"raise it \(or set it to null\) to run it",
        skipped["reference"],
    ), skipped["reference"]
    assert f"osdpipe: warning: verify did not run reference: it {skipped['reference']}" in result.stderr.splitlines()
    bad = run_command(
        [*cmd[:3], "pipeline.full_state_checks_max=lots", f"output.path={tmp_path / 'bad'}"],
        cwd=tmp_path,
        timeout=TIMEOUT_S,
        env=env,
    )
    assert (
        bad.returncode == 2
        and "'lots' is not a size; write bytes or a number with a unit: 512MB, 2GB, 1.5GiB" in bad.stderr
    ), explain(bad)


def test_an_earlier_conversions_output_path_converts_again(tmp_path: Path) -> None:
    """A user chaining conversions points ``input.path`` at the ``output.path`` they gave the last one (its
    ``manifest.json``, ``report.json`` and the checkpoint in it): the command converts the checkpoint that output
    holds, says so, and records it in the manifest; the DCP directory and the one ``fsdp_full`` file alike."""
    import usermodel
    from helpers import run_cli_cases, user_env

    source = usermodel.save_stepped(tmp_path / "optim.pt", dim=30)
    common = ["model.factory=usermodel:make", "model.kwargs.dim=30", "runtime.mode=offline"]
    first, second, third = tmp_path / "dcp_2", tmp_path / "full_3", tmp_path / "dcp_2_again"
    cases = [
        [*common, f"input.path={source}", "input.format=fsdp_full", "source.world_size=1", "target.kind=fsdp2",
         "target.world_size=2", "output.format=dcp", f"output.path={first}"],
        [*common, f"input.path={first}", "target.world_size=3", "output.format=fsdp_full", f"output.path={second}"],
        [*common, f"input.path={second}", "source.world_size=3", "target.kind=fsdp2", "target.world_size=2",
         "output.format=dcp", f"output.path={third}"],
    ]  # fmt: skip
    results = run_cli_cases(cases, cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())
    assert [r["code"] for r in results] == [0, 0, 0], [r["stderr"] for r in results]
    for result, given, held in ((results[1], first, first / "dcp"), (results[2], second, second / "optim.pt")):
        said = f"input.path={given} is an osdpipe output; converting the checkpoint it holds, {held}"
        assert said in result["stderr"], result["stderr"]
    assert json.loads((second / "manifest.json").read_text())["config"]["input"]["path"] == str(first / "dcp")
    assert json.loads((third / "manifest.json").read_text())["config"]["input"]["path"] == str(second / "optim.pt")
    assert all("check roundtrip  pass" in r["stdout"] for r in results[1:])


def test_a_conversion_into_the_directory_of_its_input_is_refused_and_the_input_kept(tmp_path: Path) -> None:
    """Pointing ``output.path`` at the earlier output being converted (or at the directory the input is in) with
    ``output.overwrite=true`` replaced it: the checkpoint converted was gone after the commit, and the new manifest
    named it as its source. Refused in one line before anything runs; every file of the input as it was."""
    import hashlib

    import usermodel
    from helpers import run_cli_cases, user_env

    source = usermodel.save_stepped(tmp_path / "optim.pt", dim=30)
    common = ["model.factory=usermodel:make", "model.kwargs.dim=30", "runtime.mode=offline"]
    earlier = tmp_path / "earlier"
    made = run_cli_cases([[*common, f"input.path={source}", "input.format=fsdp_full", "source.world_size=1",
                           "target.kind=fsdp2", "target.world_size=2", "output.format=dcp",
                           f"output.path={earlier}"]], cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())  # fmt: skip
    assert made[0]["code"] == 0, made[0]["stderr"]

    def files() -> dict[str, str]:
        return {str(p.relative_to(earlier)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(earlier.rglob("*")) if p.is_file()}  # fmt: skip

    before = files()
    cases = [[*common, f"input.path={given}", "target.world_size=3", f"output.path={out}", "output.overwrite=true"]
             for given, out in ((earlier, earlier), (earlier / "dcp", earlier), (earlier / "dcp", tmp_path))]
    for result, (given, out) in zip(run_cli_cases(cases, cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env()),
                                    ((earlier, earlier), (earlier / "dcp", earlier), (earlier / "dcp", tmp_path))):
        said = (f"osdpipe: error: config: output.path='{out}' holds input.path='{given}', the checkpoint it converts, "
                "and a conversion replaces what its output.path holds: give another output.path")
        assert result["code"] == 2 and result["stderr"].strip().splitlines() == [said], result["stderr"]
    assert files() == before
