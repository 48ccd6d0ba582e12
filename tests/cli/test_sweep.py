"""The summary of a sweep: ``osdpipe -m ...`` prints a table and writes ``sweep.json`` and ``sweep.png``.

One real sweep of 48 offline jobs (a user's model, no process group, so each
job costs a fraction of a second) holds every kind of outcome the command can
reach cheaply: conversions that succeed, a NaN source that fails stage
``shard``, and bad configs, which write no report.json: a damaged file (the
config does not describe the files: refused before anything runs,
docs/errors.md) and HYBRID_SHARD targets whose shard group does not divide the
world size. The table, ``sweep.json`` and the PNG are each held
against the jobs' own ``report.json`` files and against what each job's
overrides say it must have done. The pure functions are tested directly,
with outcomes (a failed check) the sweep cannot reach cheaply.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import clean_env, run_command

from osdpipe.cli import sweep

#: End to end: it starts worlds, minutes in all (`python -m pytest -m "not slow"` leaves it out, for a quick loop; CI
#: runs it).
pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1] / "support"
TIMEOUT_S = 180

SOURCES = ("good.pt", "nan.pt", "corrupt.pt")
SOURCE_WORLDS = (2, 4)
TARGET_WORLDS = (1, 2, 3, 4)
USE_ORIG_PARAMS = ("false", "true")
FIXED = [
    "model.factory=userlm:build", "runtime.mode=offline",
    "target.sharding_strategy=HYBRID_SHARD", "target.shard_group_size=2",
]


def explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


# ------------------------------------------------------------ the real sweep


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """The user's unwrapped job's state as an fsdp_full file; the same with a NaN; and a file that is no checkpoint."""
    import userlm

    directory = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    model = userlm.build()
    full = userlm.fqn_keyed(model, userlm.train(model, steps=2))
    torch.save(full, directory / "good.pt")
    full["state"]["blocks.1.wq.weight"]["exp_avg"].view(-1)[3] = float("nan")
    torch.save(full, directory / "nan.pt")
    (directory / "corrupt.pt").write_bytes(b"not a torch.save file")
    return directory


def expected_jobs(sources: Path) -> list[dict]:
    """Every job of the sweep in Hydra's order (the last override varies fastest), with the outcome it must have."""
    jobs = []
    for num, (name, source_world, target_world, orig) in enumerate(
        itertools.product(SOURCES, SOURCE_WORLDS, TARGET_WORLDS, USE_ORIG_PARAMS)
    ):
        if target_world % 2:
            # a shard group of 2 cannot divide 1 or 3 ranks: the config is refused before the input is read
            kind = "config"
        else:
            kind = {"good.pt": "ok", "nan.pt": "stage", "corrupt.pt": "config"}[name]
        overrides = {
            "input.path": str(sources / name),
            "source.world_size": str(source_world),
            "target.world_size": str(target_world),
            "target.use_orig_params": orig,
        }
        jobs.append({"job": num, "kind": kind, "overrides": overrides, "target_world": target_world})
    return jobs


@pytest.fixture(scope="module")
def swept(sources: Path, tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path, list[dict]]:
    """Run the sweep once: the command's result, the sweep directory, and the jobs it must have run."""
    cwd = tmp_path_factory.mktemp("cwd")
    sweep_dir = cwd / "sweep"
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    args = [
        "-m", *FIXED,
        f"input.path={','.join(str(sources / s) for s in SOURCES)}",
        f"source.world_size={','.join(map(str, SOURCE_WORLDS))}",
        f"target.world_size={','.join(map(str, TARGET_WORLDS))}",
        f"target.use_orig_params={','.join(USE_ORIG_PARAMS)}",
        f"hydra.sweep.dir={sweep_dir}",
    ]  # fmt: skip
    result = run_command([sys.executable, "-m", "osdpipe", *args], cwd=cwd, timeout=TIMEOUT_S, env=env)
    return result, sweep_dir, expected_jobs(sources)


def report_of(sweep_dir: Path, job: int) -> dict | None:
    path = sweep_dir / str(job) / "report.json"
    return json.loads(path.read_text()) if path.exists() else None


def numbers_from(report: dict | None) -> tuple[float | None, int | None, int | None]:
    """Stage seconds, bytes and peak RSS as the test reads them from report.json."""
    if not report or not report["stages"]:
        return None, None, max((m["peak_rss"] for m in (report or {}).get("memory", [])), default=None)
    seconds = round(sum(s["seconds"] for s in report["stages"]), 6)
    return seconds, sum(s["bytes"] for s in report["stages"]), max(m["peak_rss"] for m in report["memory"])


def test_a_failed_job_never_stops_the_sweep_and_a_bad_config_outranks_it(swept) -> None:
    result, sweep_dir, jobs = swept
    assert result.returncode == 2, explain(result)
    ran = json.loads((sweep_dir / "sweep.json").read_text())["jobs"]
    # 3 sources x 2 x 4 world sizes x 2: at least 16, as the issue asks
    assert ran == len(jobs) == 48, f"the sweep ran {ran} of its {len(jobs)} jobs"
    for job in jobs:
        report = report_of(sweep_dir, job["job"])
        if job["kind"] == "config":
            assert report is None, f"job {job['job']}: a bad config wrote a report"
        else:
            assert report is not None, f"job {job['job']} ({job['kind']}) wrote no report.json: the sweep stopped?"
            assert report["ok"] is (job["kind"] == "ok"), (job, report["error"])


def test_sweep_json_agrees_with_every_report(swept) -> None:
    _, sweep_dir, jobs = swept
    summary = json.loads((sweep_dir / "sweep.json").read_text())
    assert summary["jobs"] == len(jobs) and summary["exit_code"] == 2
    assert [r["job"] for r in summary["rows"]] == [j["job"] for j in jobs], "a row is missing, extra or out of order"
    assert summary["counts"] == {k: sum(j["kind"] == k for j in jobs) for k in sweep.OUTCOME_KINDS}
    assert sorted(map(sweep.shown_override, summary["common_overrides"])) == sorted(FIXED)
    for job, row in zip(jobs, summary["rows"]):
        report = report_of(sweep_dir, job["job"])
        assert row["kind"] == job["kind"], (job, row)
        varying = dict(sweep.split_override(o) for o in row["overrides"] if o not in summary["common_overrides"])
        # Hydra writes false as False
        assert {k: v.lower() if v in ("True", "False") else v for k, v in varying.items()} == job["overrides"]
        assert row["exit_code"] == {"ok": 0, "config": 2}.get(job["kind"], 1)
        seconds, moved, peak = numbers_from(report)
        assert (row["stage_seconds"], row["bytes"], row["peak_rss"]) == (seconds, moved, peak), job
        assert row["wall_seconds"] > 0
        if job["kind"] == "ok":
            assert row["outcome"] == "ok" and seconds > 0 and moved > 0 and peak > 0
        elif job["kind"] == "stage":
            assert report["error"].startswith("stage 'shard' failed")
            assert row["outcome"].startswith("stage shard: the source holds NaN or Inf"), row["outcome"]
        elif job["overrides"]["input.path"].endswith("corrupt.pt") and job["target_world"] % 2 == 0:
            assert row["outcome"].startswith("config: ") and "corrupt.pt" in row["outcome"], row["outcome"]
        else:
            assert row["outcome"] == (
                f"config: target: shard_group_size=2 does not divide world_size={job['target_world']}"
            ), row["outcome"]


def table_rows(stdout: str) -> tuple[list[str], list[list[str]]]:
    """The console table's header and rows (columns are two or more spaces apart)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("job  "))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = []
    for line in lines[start + 1 :]:
        if not re.match(r"\s*\d+  ", line):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return header, rows


def test_console_table_agrees_with_every_report(swept) -> None:
    result, sweep_dir, jobs = swept
    assert (
        f"sweep summary: {len(jobs)} jobs: 8 ok, 8 stage failed, 32 config error; exit code 2" in result.stdout
    )
    assert "every job: " + " ".join(FIXED) in result.stdout
    header, rows = table_rows(result.stdout)
    keys = ["input.path", "source.world_size", "target.world_size", "target.use_orig_params"]
    assert header == ["job", *keys, "outcome", "stage s", "wall s", "bytes", "peak RSS MB"]
    assert [int(r[0]) for r in rows] == [j["job"] for j in jobs]
    for job, cells in zip(jobs, rows):
        seconds, moved, peak = numbers_from(report_of(sweep_dir, job["job"]))
        values = dict(zip(keys, cells[1:5]))
        # the directory every source shares is left out
        assert values["input.path"] == Path(job["overrides"]["input.path"]).name
        assert [values[k].lower() for k in keys[1:]] == [job["overrides"][k] for k in keys[1:]]
        outcome = cells[5]
        assert (
            outcome == "ok"
            if job["kind"] == "ok"
            else outcome.startswith({"stage": "stage shard:", "failed": "failed:", "config": "config:"}[job["kind"]])
        )
        assert cells[6] == ("-" if seconds is None else f"{seconds:.3f}")
        assert cells[8] == ("-" if moved is None else f"{moved:,d}")
        assert cells[9] == ("-" if peak is None else f"{peak / 1e6:.1f}")


def png_text_chunks(data: bytes) -> dict[str, str]:
    """The PNG's tEXt chunks (after checking its signature and that every chunk is whole)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    chunks, offset = {}, 8
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        body = data[offset + 8 : offset + 8 + length]
        assert len(body) == length, "a truncated PNG"
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            chunks[key.decode("latin-1")] = value.decode("latin-1")
        offset += 12 + length
    assert kind == b"IEND"
    return chunks


def test_png_is_a_readable_matrix_of_the_reports(swept) -> None:
    _, sweep_dir, jobs = swept
    data = (sweep_dir / "sweep.png").read_bytes()
    width, height = struct.unpack(">II", data[16:24])
    assert 600 <= width <= 3000 and 400 <= height <= 2000, (width, height)
    drawn = json.loads(png_text_chunks(data)["Description"])
    summary = json.loads((sweep_dir / "sweep.json").read_text())
    assert drawn == summary["matrix"]
    assert drawn["row_keys"] == ["input.path", "source.world_size"]
    assert drawn["column_keys"] == ["target.world_size", "target.use_orig_params"]
    assert (
        len(drawn["rows"]) == len(SOURCES) * len(SOURCE_WORLDS)
        and len(drawn["columns"]) == len(TARGET_WORLDS) * len(USE_ORIG_PARAMS)
    )
    assert sorted((c["row"], c["column"]) for c in drawn["cells"]) == sorted(itertools.product(range(6), range(8))), (
        "one cell per job"
    )
    for cell in drawn["cells"]:
        job = jobs[cell["job"]]
        seconds, _, _ = numbers_from(report_of(sweep_dir, job["job"]))
        assert cell["kind"] == job["kind"]
        assert drawn["rows"][cell["row"]] == (
            f"{Path(job['overrides']['input.path']).name}\n{job['overrides']['source.world_size']}"
        )
        assert drawn["columns"][cell["column"]].lower() == (
            f"{job['target_world']}\n{job['overrides']['target.use_orig_params']}"
        )
        assert cell["seconds"] == seconds
        if seconds is not None:
            assert cell["text"].endswith(f"\n{sweep.seconds_text(seconds)} s")


# ------------------------------------------------------------ pure functions


def record(
    num: int, overrides: list[str], exit_code: int = 0, error: str | None = None, directory: str = "/nowhere"
) -> sweep.JobRecord:
    return sweep.JobRecord(num, tuple(overrides), exit_code, error, 0.5, directory, "/sweep")


OK_REPORT = {
    "ok": True, "error": None, "checks": [{"name": "roundtrip", "ok": True, "detail": "equal"}],
    "stages": [{"name": "load", "seconds": 0.25, "bytes": 0}, {"name": "shard", "seconds": 0.5, "bytes": 100},
               {"name": "save", "seconds": 0.125, "bytes": 300}],
    "memory": [{"process": "rank 0", "peak_rss": 2_000_000}, {"process": "rank 1", "peak_rss": 3_000_000}],
}  # fmt: skip
CHECK_REPORT = {
    **OK_REPORT,
    "ok": False,
    "checks": [
        {"name": "roundtrip", "ok": True, "detail": ""},
        {"name": "replicas", "ok": False, "detail": "rank 1: 1 element(s) differ"},
    ],
}
STAGE_REPORT = {
    "ok": False,
    "error": "stage 'load' failed on ranks 0, 1: rank_3.pt is missing; give source.world_size=3",
    "checks": [],
    "stages": [],
    "memory": [],
}
INPUT_REPORT = {
    "ok": False, "error": "/ckpt/optim.pt: not a torch.save file (truncated?)", "checks": [], "stages": [], "memory": []
}


@pytest.mark.parametrize(
    ("exit_code", "error", "report", "kind", "outcome"),
    [
        (0, None, OK_REPORT, "ok", "ok"),
        (1, "verify failed: ...", CHECK_REPORT, "check", "check replicas: rank 1: 1 element(s) differ"),
        (1, "stage 'load' failed ...", STAGE_REPORT, "stage", "stage load: rank_3.pt is missing"),
        (1, "...", INPUT_REPORT, "failed", "failed: /ckpt/optim.pt: not a torch.save file"),
        (
            2,
            "config: target: shard_group_size=2 does not divide world_size=3; choose a divisor",
            None,
            "config",
            "config: target: shard_group_size=2 does not divide world_size=3",
        ),
        # a stale report never counts
        (2, "config: target.world_size (got 0): must be >= 1", OK_REPORT, "config", "config: target.world_size"),
        (
            2,
            "output.path: cannot create /proc/x (Permission denied)",
            None,
            "config",
            "config: output.path: cannot create /proc/x",
        ),
        (1, "internal error: KeyError: 'x'", None, "failed", "failed: internal error: KeyError: 'x'"),
    ],
)
def test_outcome_of_each_way_a_job_ends(
    exit_code: int, error: str | None, report: dict | None, kind: str, outcome: str
) -> None:
    assert sweep.outcome_of(exit_code, error, report) == (kind, outcome)


def test_report_numbers_sum_stages_and_take_the_largest_peak() -> None:
    assert sweep.report_numbers(OK_REPORT) == {"stage_seconds": 0.875, "bytes": 400, "peak_rss": 3_000_000}
    assert sweep.report_numbers(STAGE_REPORT) == {"stage_seconds": None, "bytes": None, "peak_rss": None}
    assert sweep.report_numbers(None) == {"stage_seconds": None, "bytes": None, "peak_rss": None}


def test_overrides_split_and_shorten() -> None:
    assert sweep.split_override("+target.world_size=2") == ("target.world_size", "2")
    assert sweep.shown_override("model.factory=userlm\\:build") == "model.factory=userlm:build"
    assert sweep.shorten("a b c; what to do") == "a b c"
    assert sweep.shorten("word " * 30, width=12) == "word word…"


def synthetic_rows() -> list[dict]:
    """Four jobs of a 2 x 2 sweep (source.world_size x target.world_size) with a common override."""
    reports = {0: OK_REPORT, 1: CHECK_REPORT, 2: STAGE_REPORT, 3: None}
    records = [
        record(num, ["runtime.mode=offline", f"source.world_size={s}", f"target.world_size={t}"],
               exit_code=code, error=err)
        for num, (s, t), code, err in zip(range(4), itertools.product((2, 4), (1, 3)), (0, 1, 1, 2),
                                          (None, "verify failed", "stage", "config: bad"))
    ]  # fmt: skip
    return [sweep.job_row(r, reports[r.num]) for r in records]


def test_matrix_cells_place_each_job_by_its_source_and_target() -> None:
    matrix = sweep.matrix_cells(synthetic_rows())
    assert (matrix.rows, matrix.columns) == (["2", "4"], ["1", "3"])
    assert (matrix.row_keys, matrix.column_keys, matrix.subtitle) == (
        ["source.world_size"], ["target.world_size"], "runtime.mode=offline"
    )
    assert [(c["row"], c["column"], c["job"], c["kind"]) for c in matrix.cells] == [
        (0, 0, 0, "ok"), (0, 1, 1, "check"), (1, 0, 2, "stage"), (1, 1, 3, "config")
    ]
    assert [c["text"] for c in matrix.cells] == [
        "ok\n0.875 s", "check replicas\n0.875 s", "load failed", "config error"
    ]
    assert [c["seconds"] for c in matrix.cells] == [0.875, 0.875, None, None]


def test_matrix_puts_other_varying_keys_in_columns_and_shortens_paths() -> None:
    records = [
        record(n, [f"input.path=/ckpts/{src}/optim.pt", f"optim.name={name}"])
        for n, (src, name) in enumerate(itertools.product(("a", "b"), ("Adam", "SGD")))
    ]  # fmt: skip
    matrix = sweep.matrix_cells([sweep.job_row(r, OK_REPORT) for r in records])
    assert (matrix.rows, matrix.columns) == (["a/optim.pt", "b/optim.pt"], ["Adam", "SGD"])
    assert (matrix.row_keys, matrix.column_keys) == (["input.path"], ["optim.name"])
    assert sweep.axis_title("source", matrix.row_keys) == "source: input.path"


@pytest.mark.parametrize(
    ("column", "shared"),
    [
        (["/ckpts/a/optim.pt", "/ckpts/b/optim.pt"], "/ckpts"),
        (["runs/a", "runs/b"], "runs"),
        (["/ckpts/a", "/ckpts"], None),  # one of them: each shown whole
        (["/local/out", "s3://bucket/out"], None),  # crashed the summary: a URL is not a local path
        (["out/a", "/tmp/out/b"], None),  # crashed it too: relative beside absolute
        (["s3://bucket/out_2", "s3://bucket/out_3"], None),
        (["a", "b"], None),
    ],
)
def test_paths_are_shortened_only_where_they_share_a_local_directory(column: list[str], shared: str | None) -> None:
    assert sweep.shared_directory(column) == shared


def test_a_sweep_over_a_local_and_a_bucket_output_is_summarized() -> None:
    records = [record(n, [f"output.path={path}"]) for n, path in enumerate(("/local/out", "s3://bucket/out"))]
    rows = [sweep.job_row(r, OK_REPORT) for r in records]
    assert [v["output.path"] for v in sweep.shown_values(rows, [])] == ["/local/out", "s3://bucket/out"]
    assert "s3://bucket/out" in sweep.table_text(rows, exit_code=0)


def test_table_text_has_a_row_per_job_and_says_what_the_numbers_are() -> None:
    text = sweep.table_text(synthetic_rows(), exit_code=2)
    header, rows = table_rows(text)
    assert header == [
        "job", "source.world_size", "target.world_size", "outcome", "stage s", "wall s", "bytes", "peak RSS MB"
    ]
    assert rows[0] == ["0", "2", "1", "ok", "0.875", "0.50", "400", "3.0"]
    assert rows[2] == ["2", "4", "1", "stage load: rank_3.pt is missing", "-", "0.50", "-", "-"]
    assert [r[3] for r in rows] == [
        "ok", "check replicas: rank 1: 1 element(s) differ", "stage load: rank_3.pt is missing", "config: bad"
    ]
    assert "4 jobs: 1 ok, 1 check failed, 1 stage failed, 1 config error; exit code 2" in text
    assert (
        "stage s: sum of report.json's stage seconds" in text
        and "wall s:" in text
        and "bytes: sum of report.json's stage bytes" in text
    )


def test_the_title_of_sweep_png_lies_inside_the_picture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Overrides every job shares, wide letters and all, made a centered title line wider than the figure: it was cut
    on both sides. Each line of the title, measured as drawn in the saved picture, is inside it."""
    from matplotlib.figure import Figure

    saved = []
    save = Figure.savefig

    def keep(fig: Figure, *args: object, **kwargs: object) -> None:
        saved.append(fig)
        save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    common = ("runtime.mode=offline model.factory=MyWorkModels.Models:BuildWideModelWithMoE optim.name=AdamW "
              "output.format=DCP source.kind=FSDP2 target.kind=FSDP2 runtime.workers=2 "
              "pipeline.checks=[roundtrip,reference,load_step] runtime.memory_budget=16GB")  # fmt: skip
    matrix = replace(sweep.matrix_cells(synthetic_rows()), subtitle=common)
    title = "osdpipe sweep, 12 jobs: 3 ok, 2 check failed, 4 stage failed, 3 config error; exit code 2"
    sweep.draw_matrix(matrix, tmp_path / "sweep.png", title)
    [fig] = saved
    [drawn] = [t for t in fig.texts if t.get_text() == fig.get_suptitle()]
    extent, picture = drawn.get_window_extent(fig.canvas.get_renderer()), fig.bbox
    assert picture.x0 <= extent.x0 and extent.x1 <= picture.x1, (extent, picture)
    assert picture.y0 <= extent.y0 and extent.y1 <= picture.y1, (extent, picture)
    assert drawn.get_text().replace("\n", " ").startswith(f"{title} every job: {common[:40]}")


def test_summary_reads_reports_and_writes_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "report.json").write_text(json.dumps(OK_REPORT))
    records = [
        sweep.JobRecord(0, ("target.world_size=2",), 0, None, 1.0, str(tmp_path / "0"), str(tmp_path / "sweep")),
        sweep.JobRecord(1, ("target.world_size=0",), 2, "config: target.world_size (got 0): must be >= 1", 0.1,
                        str(tmp_path / "1"), str(tmp_path / "sweep")),
    ]  # fmt: skip
    assert sweep.summarize_sweep(records, exit_code=2) is None
    summary = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [(r["job"], r["kind"], r["bytes"]) for r in summary["rows"]] == [(0, "ok", 400), (1, "config", None)]
    assert png_text_chunks((tmp_path / "sweep" / "sweep.png").read_bytes())["Description"] == (
        json.dumps(summary["matrix"])
    )
    assert "2 jobs: 1 ok, 1 config error; exit code 2" in capsys.readouterr().out


def test_summary_without_matplotlib_is_one_line_and_keeps_sweep_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_matplotlib(*args: object) -> None:
        raise ModuleNotFoundError("No module named 'matplotlib'")

    monkeypatch.setattr(sweep, "draw_matrix", no_matplotlib)
    problem = sweep.summarize_sweep(
        [sweep.JobRecord(0, ("a=1",), 1, "boom", 0.1, str(tmp_path / "0"), str(tmp_path))], exit_code=1
    )
    assert problem is not None and "\n" not in problem and "pip install matplotlib" in problem
    assert (tmp_path / "sweep.json").exists() and not (tmp_path / "sweep.png").exists()


def test_summary_into_an_unwritable_place_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    problem = sweep.summarize_sweep(
        [sweep.JobRecord(0, ("a=1",), 0, None, 0.1, str(tmp_path / "0"), str(tmp_path / "a_file" / "sweep"))],
        exit_code=0,
    )
    assert problem is not None and "\n" not in problem and problem.startswith("sweep summary: cannot write"), problem


def test_plain_runs_do_not_import_matplotlib() -> None:
    code = "import sys, osdpipe.cli.compose; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env())
    assert result.stdout.strip() == "False", result.stderr


# ------------------------------------------------------------------ the recipe


def test_recipe_sweeps_at_least_16_valid_configurations(tmp_path: Path) -> None:
    """``osdpipe -m recipe=sweep_world_sizes``: its sweeper params make >= 16 jobs, and every job's config validates."""
    from hydra import compose, initialize_config_module

    from osdpipe.cli.compose import job_config
    from osdpipe.spec.reconcile import settle_and_validate

    with initialize_config_module(version_base="1.3", config_module="osdpipe.conf"):
        params = compose(
            "config", overrides=["recipe=sweep_world_sizes"], return_hydra_config=True
        ).hydra.sweeper.params
        assert sorted(params) == ["source.world_size", "target.sharding_strategy", "target.world_size"]
        axes = [[f"{key}={value}" for value in str(values).split(",")] for key, values in params.items()]
        combinations = list(itertools.product(*axes))
        assert len(combinations) >= 16
        for overrides in combinations:
            cfg = compose("config", overrides=["recipe=sweep_world_sizes", *overrides])
            settle_and_validate(job_config(cfg, str(tmp_path)))
