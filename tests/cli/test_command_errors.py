"""What the ``osdpipe`` command says and leaves behind when something is wrong, run as a user runs it.

Every failure is one line on stderr (``osdpipe: error: ...``) naming the key,
file or parameter, with no traceback; the exit code is 2 for a bad command
line or config and 1 for a failed conversion; nothing lands outside
``output.path``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import clean_env, run_osdpipe, run_with_terminal_stderr

TIMEOUT_S = 240


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    lines = error_lines(result)
    assert result.returncode == code, explain(result)
    assert len(lines) == 1 and lines[0].startswith("osdpipe: error: "), explain(result)
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


# ------------------------------------------------------------ bad command lines


@pytest.mark.parametrize(
    "arg,words",
    [
        ("target.world_sise=2", ["target.world_sise", "not a known key"]),
        ("recipe=nope", ["recipe=nope", "halve_world_size"]),
        ("target.world_size=0", ["target.world_size"]),
        ("target.wrap=[Block", ["target.wrap=[Block", "cannot be parsed"]),
        ("model.factory=no_such_package.models:build", ["model", "no_such_package"]),
        ("optim.name=Adamm", ["optim.name", "Adamm"]),
        # a URL osdpipe does not write: not a local directory named 'ftp:' (the test sees nothing written)
        ("output.path=ftp://host/dir", ["output.path='ftp://host/dir'", "not ftp://"]),
        ("output.path=s3a://bucket/dir", ["not s3a://; write s3://bucket/dir"]),
        ("output.path=file:///tmp/out", ["not file://; write /tmp/out"]),
    ],
)
def test_bad_command_line_is_one_line_and_exit_2(arg: str, words: list[str], tmp_path: Path) -> None:
    start = time.monotonic()
    result = run_osdpipe(arg, cwd=tmp_path, timeout=60)
    assert_one_line_error(result, 2, *words)
    assert time.monotonic() - start < 30
    assert list(tmp_path.iterdir()) == [], "a bad command line wrote something"


def test_a_config_error_about_a_url_never_says_its_password(tmp_path: Path) -> None:
    """The line named the key with the value as typed before the message, which redacted it: the password showed."""
    result = run_osdpipe("input.path=s3://key:hunter2@bucket/ckpt", cwd=tmp_path, timeout=60)
    line = assert_one_line_error(result, 2, "input.path='s3://***@bucket/ckpt' names no bucket")
    assert "hunter2" not in result.stdout + result.stderr, line


@pytest.mark.parametrize(
    ("args", "says", "code"),
    [
        (["input.path=s3:/bucket/ckpt"], "osdpipe: error: config: input.path (got 's3:/bucket/ckpt'): ", 2),
        (["output.path=gs:/bucket/ckpt"], "osdpipe: error: config: output.path (got 'gs:/bucket/ckpt'): ", 2),
        (["inspect", "s3:/bucket/ckpt"], "osdpipe inspect: error: ", 1),
        (["check", "gs:/bucket/ckpt"], "osdpipe check: error: ", 2),
    ],
)
def test_a_url_a_slash_short_is_named_with_the_url_meant_and_nothing_written(
    args: list[str], says: str, code: int, tmp_path: Path
) -> None:
    """``s3:/bucket/ckpt`` is no URL (``://``): taken as a local path, an input said it did not exist, and an output
    landed in a directory named ``gs:`` beside the user. Each entry point names the URL meant."""
    result = run_osdpipe(*args, cwd=tmp_path, timeout=60)
    scheme = args[-1].split("=")[-1].split(":")[0]
    meant = args[-1].split("=")[-1].replace(":/", "://", 1)
    said = f"'{args[-1].split('=')[-1]}' is a slash short of a URL; write '{meant}'"
    assert result.returncode == code, explain(result)
    assert error_lines(result) == [says + said], explain(result)
    assert not (tmp_path / f"{scheme}:").exists() and not list(tmp_path.glob("outputs/**/*.pt"))


@pytest.mark.parametrize(("command", "argument", "code"), [("check", "OUTPUT_DIR", 2), ("inspect", "PATH", 1)])
def test_check_and_inspect_of_a_url_osdpipe_does_not_serve_say_so_in_one_line(
    command: str, argument: str, code: int, tmp_path: Path
) -> None:
    """check looked for ``hdfs:/namenode/ckpt/manifest.json`` on the disk and said that file did not exist; inspect
    named its argument ``input.path``. Each names its own argument, as its usage line does."""
    result = run_osdpipe(command, "hdfs://namenode/ckpt", cwd=tmp_path, timeout=60)
    assert result.returncode == code, explain(result)
    said = f"{argument}='hdfs://namenode/ckpt': osdpipe reads and writes s3:// and gs:// (and local paths), not hdfs://"
    assert error_lines(result) == [f"osdpipe {command}: error: {said}"], explain(result)


def test_sweep_with_a_bad_job_exits_2_and_runs_the_others(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = run_osdpipe("-m", "source.world_size=1", "target.world_size=1,0", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    assert "osdpipe: OK" in result.stdout, "the good job ran"
    assert json.loads((sweep / "0" / "report.json").read_text())["ok"] is True


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_unwritable_output_fails_fast_in_one_line(where: str, tmp_path: Path) -> None:
    if where == "under_a_file":
        (tmp_path / "a_file").write_text("not a directory")
        path = tmp_path / "a_file" / "out"
    else:
        path = Path("/proc")  # exists, and no one can create files in it (root included)
    result = run_osdpipe(f"output.path={path}", cwd=tmp_path, timeout=60)
    # exit 2: refused with the config, before any process started (not a wall-clock bound: a busy machine breaks one)
    assert_one_line_error(result, 2, "output.path")
    assert sorted(p.name for p in tmp_path.iterdir()) == (["a_file"] if where == "under_a_file" else [])


@pytest.mark.parametrize(
    ("signum", "code", "named"), [(signal.SIGINT, 130, "SIGINT (Ctrl-C)"), (signal.SIGTERM, 143, "SIGTERM")]
)
def test_a_run_stopped_before_it_wrote_anything_leaves_no_directory(
    signum: int, code: int, named: str, tmp_path: Path
) -> None:
    """Ctrl-C (or SIGTERM) during the Hydra job left an empty ``outputs/<date>/<time>/`` behind (and Ctrl-C a
    traceback): stopped as soon as Hydra made the job's directory, the command removes it, says so in one line and
    exits with 128 plus the signal's number."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "osdpipe"], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("outputs/*/*")):  # the job's directory: Hydra made it, the job has begun
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.005)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code, err
    assert err.strip().splitlines() == [f"osdpipe: error: stopped by {named}; run the command again to convert"], err
    assert list(tmp_path.iterdir()) == [], "a stopped run left what it made"


# ------------------------------------------------------ overwrite, stray files


def test_overwrite_replaces_the_previous_conversion_whole(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = run_osdpipe(
        "source.world_size=1", "source.state_dict_type=local", "target.world_size=3", f"output.path={out}", cwd=tmp_path
    )
    assert first.returncode == 0, explain(first)
    assert (out / "rank_2.pt").exists() and (out / "source" / "rank_local").is_dir()

    refused = run_osdpipe("source.world_size=1", "target.world_size=2", f"output.path={out}", cwd=tmp_path, timeout=60)
    assert_one_line_error(refused, 2, "output.overwrite=true")
    said = refused.stderr.strip()  # the words a prefix in object storage gets (tests/cloud/test_s3_output.py)
    assert said.startswith(f"osdpipe: error: config: output.path='{out}' already holds a conversion ("), said
    assert said.endswith("); choose another path or set output.overwrite=true"), said

    second = run_osdpipe(
        "source.world_size=1", "target.world_size=2", f"output.path={out}", "output.overwrite=true", cwd=tmp_path
    )
    assert second.returncode == 0, explain(second)
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(p.name for p in out.glob("rank_*.pt")) == sorted(manifest["files"]) == ["rank_0.pt", "rank_1.pt"]
    assert sorted(str(p.relative_to(out)) for p in (out / "source").rglob("*")) == ["source/optim.pt"], (
        "the old generated source stayed"
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json", "osdpipe.log", "rank_0.pt", "rank_1.pt", "report.json", "source"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "nothing is written outside output.path"


# ------------------------------------------------------------- non-finite state


@pytest.fixture(scope="module")
def nan_source(tmp_path_factory) -> tuple[Path, str]:
    """A generated FULL source with one NaN in one parameter's exp_avg."""
    root = tmp_path_factory.mktemp("nan")
    result = run_osdpipe(
        "source.world_size=1",
        "target.world_size=1",
        "pipeline.stages=[load,broadcast,flatten,shard,rekey,save]",
        f"output.path={root / 'gen'}",
        cwd=root,
    )
    assert result.returncode == 0, explain(result)
    osd = torch.load(root / "gen" / "source" / "optim.pt", weights_only=True)
    fqn = "block1.leaf2.lin.weight"
    osd["state"][fqn]["exp_avg"].view(-1)[5] = float("nan")
    torch.save(osd, root / "nan.pt")
    return root / "nan.pt", fqn


def test_nan_in_the_source_fails_naming_parameter_and_state(nan_source, tmp_path: Path) -> None:
    path, fqn = nan_source
    result = run_osdpipe(f"input.path={path}", f"output.path={tmp_path / 'out'}", cwd=tmp_path)
    line = assert_one_line_error(result, 1, fqn, "exp_avg", "source", "input.allow_nonfinite=true")
    assert "stage 'shard'" in line
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["osdpipe.log", "report.json"]


def test_allow_nonfinite_converts_it_and_load_step_passes(nan_source) -> None:
    """Also: a read-only current directory is no problem when output.path is given (/proc takes no files)."""
    path, fqn = nan_source
    out = path.parent / "allowed"
    result = run_osdpipe(f"input.path={path}", f"output.path={out}", "input.allow_nonfinite=true", cwd=Path("/proc"))
    assert result.returncode == 0, explain(result)
    assert "check load_step  pass" in result.stdout, result.stdout
    warnings = [line for line in error_lines(result) if line.startswith("osdpipe: warning:")]
    assert len(warnings) == 1 and fqn in warnings[0] and "NaN" in warnings[0], explain(result)
    got = [torch.load(p, weights_only=True) for p in sorted(out.glob("rank_*.pt"))]
    assert (
        sum(
            int(t.isnan().sum())
            for osd in got
            for s in osd["state"].values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim()
        )
        == 1
    )


def test_another_models_checkpoint_missing_a_parameter_fails_before_any_process(nan_source, tmp_path: Path) -> None:
    path, _ = nan_source
    osd = torch.load(path.parent / "gen" / "source" / "optim.pt", weights_only=True)
    del osd["state"]["block2.gate"]
    for group in osd["param_groups"]:
        group["params"].remove("block2.gate")
    torch.save(osd, tmp_path / "other_model.pt")
    result = run_osdpipe(
        f"input.path={tmp_path / 'other_model.pt'}", f"output.path={tmp_path / 'out'}", cwd=tmp_path, timeout=60
    )
    line = assert_one_line_error(result, 2, str(tmp_path / "other_model.pt"), "block2.gate", "model.factory")
    # found by the launcher's look at the source, before any world: a failure in a rank names its stage and rank
    # (a wall-clock bound said this before, and failed on a busy machine); the config does not describe the files,
    # and nothing is written (docs/errors.md)
    assert "stage '" not in line and "rank" not in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_model.pt"]


def test_nonfinite_scalar_state_is_named() -> None:
    from osdpipe.io.formats import SourceMeta, TensorRef
    from osdpipe.run.stages.broadcast import nonfinite_scalars

    meta = SourceMeta(
        state={
            "a.weight": {"step": torch.tensor(float("nan")), "exp_avg": TensorRef((2,), "float32")},
            "b.bias": {"step": torch.tensor(3.0), "lr": float("inf")},
        },
        param_groups=None,
    )
    assert nonfinite_scalars(meta) == ["a.weight step = nan", "b.bias lr = inf"]


# ------------------------------------------------------- help, version, progress


def test_help_is_osdpipes_own_and_version_names_torch(tmp_path: Path) -> None:
    result = run_osdpipe("--help", cwd=tmp_path, timeout=60)
    assert result.returncode == 0
    for text in ("Usage:", "input.path", "target.world_size", "recipe:", "--hydra-help", "Exit codes"):
        assert text in result.stdout, text
    hydra_help = run_osdpipe("--hydra-help", cwd=tmp_path, timeout=60)
    assert hydra_help.returncode == 0 and "Hydra" in hydra_help.stdout
    version = run_osdpipe("--version", cwd=tmp_path, timeout=60)
    import osdpipe

    assert (
        version.returncode == 0
        and f"osdpipe {osdpipe.__version__}" in version.stdout
        and f"torch {torch.__version__}" in version.stdout
    )
    assert list(tmp_path.iterdir()) == []


def test_progress_shows_on_a_terminal_and_not_in_ci(tmp_path: Path) -> None:
    args = ["source.world_size=1", "target.world_size=1", f"output.path={tmp_path / 'out'}"]
    env = clean_env()
    del env["CI"]  # a user's shell
    code, shown = run_with_terminal_stderr(args, tmp_path, env, TIMEOUT_S)
    assert code == 0, shown
    for phase in ("generating a source", "starting 1 rank", "stage shard", "stage verify"):
        assert f"osdpipe: {phase}" in shown, f"{phase!r} not shown: {shown!r}"
    code, shown = run_with_terminal_stderr([*args, "output.overwrite=true"], tmp_path, {**env, "CI": "true"}, TIMEOUT_S)
    assert code == 0 and "osdpipe: stage" not in shown, shown


@pytest.mark.parametrize(
    ("term", "size"),
    [("tmux-256color", (0, 0)), ("screen", (0, 0)), ("tmux-256color", (2, 80)), ("screen", (40, 100))],
    ids=["tmux-no-size", "screen-no-size", "tmux-two-rows", "screen-sized"],
)
def test_the_live_line_shows_in_a_multiplexers_terminal_whatever_size_it_reports(
    tmp_path: Path, term: str, size: tuple[int, int]
) -> None:
    """Under tmux or screen the line was not seen: tqdm took the line's width and the screen's height from the size
    the terminal reports, and one that reports none (0 x 0) or under 3 rows drew nothing. The line is drawn at the
    reported width (80 columns where there is none), never hidden for the height."""
    env = {**clean_env(), "TERM": term}
    del env["CI"]  # a user's shell
    env.pop("COLUMNS", None)
    args = ["runtime.mode=offline", "source.world_size=1", "target.world_size=1", f"output.path={tmp_path / 'out'}"]
    code, shown = run_with_terminal_stderr(args, tmp_path, env, TIMEOUT_S, size=size)
    assert code == 0, shown
    drawn = [line for line in shown.split("\r") if line.startswith("osdpipe: generating a source")]
    assert drawn, f"no live line: {shown!r}"
    width = (size[1] or 80) - 1
    assert all(len(line.rstrip("\n")) <= width for line in drawn), drawn
