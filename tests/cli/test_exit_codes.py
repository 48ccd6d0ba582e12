"""docs/errors.md held to the command: every refusal the page calls exit code 2, run as a user runs it.

The page says a bad command line or config, an ``output.path`` that cannot be
written or overlaps ``input.path``, another framework's checkpoint, a Megatron
grid the model does not split, and an input whose files the config does not
describe (damaged, not a checkpoint, a rank or data file missing or short,
another model's, state that does not fit ``source.*``) are exit code 2,
"before any process starts": one line on stderr, and nothing written (no
output directory, no ``report.json``). Each row below is one such claim,
through the ``osdpipe`` entry point in a driver process (``cli_driver.py``).
The refusals of a store that answers (no such bucket, access denied, refused
credentials) need one: ``tests/cloud/test_s3_bad.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_cli_cases, run_osdpipe, user_env
from synthetic_megatron import synthetic_save

TIMEOUT_S = 240
#: Quick answers from a store that is not there (the default options wait out retries: docs/running.md).
QUICK = "runtime.storage_options={s3:{endpoint_url:'http://127.0.0.1:9',config_kwargs:{connect_timeout:1,read_timeout:1,retries:{max_attempts:1}}}}"  # noqa: E501
#: A run that makes a source and writes it, and nothing it need not: the stages that convert and save.
MADE = "pipeline.stages=[load,broadcast,flatten,shard,rekey,save]"

#: (case, the command's arguments, words its one line holds); ``{root}`` is the folder of the inputs below, ``{out}``
#: the case's own output.path (it must not come to exist).
CASES = [
    # the command line or the config
    ("unknown key", ["target.world_sise=2", "output.path={out}"], ["target.world_sise", "not a known key"]),
    ("unknown recipe", ["recipe=nope", "output.path={out}"], ["recipe=nope"]),
    ("bad value", ["target.world_size=0", "output.path={out}"], ["target.world_size"]),
    ("output under a file", ["output.path={root}/a_file/out"], ["output.path", "a_file"]),
    ("output holds the input", ["input.path={root}/holder/optim.pt", "output.path={root}/holder"],
     ["output.path=", "holds input.path="]),
    ("output inside the input", ["input.path={root}/dcp_a", "output.path={root}/dcp_a/converted"],
     ["output.path=", "is inside input.path="]),
    ("output inside the input, through a link", ["input.path={root}/dcp_b", "output.path={root}/linked/converted"],
     ["is inside input.path="]),
    ("input inside the output", ["input.path={root}/nest/dcp", "output.path={root}/nest"], ["holds input.path="]),
    ("another framework's checkpoint", ["checkpoint=torchtitan", "input.path={root}/zero", "output.path={out}"],
     ["checkpoint=deepspeed"]),
    ("a Megatron grid the model does not split",
     ["checkpoint=megatron", "input.path={root}/megatron/tp1", "target.tp_size=3", "target.world_size=3",
      "output.path={out}"], ["target.tp_size"]),
    ("a URL a slash short", ["input.path=s3:/bucket/ckpt", "output.path={out}"], ["write 's3://bucket/ckpt'"]),
    ("an endpoint that does not answer", ["input.path=s3://bucket/ckpt", QUICK, "output.path={out}"],
     ["s3://bucket/ckpt"]),
    ("an output endpoint that does not answer", ["input.path={root}/optim.pt", QUICK, "output.path=s3://bucket/out"],
     ["s3://bucket/out"]),
    # the input's files, read before any process starts
    ("a truncated file", ["input.path={root}/truncated.pt", "output.path={out}"], ["truncated.pt"]),
    ("an overwritten file", ["input.path={root}/overwritten.pt", "output.path={out}"], ["overwritten.pt"]),
    ("not a torch checkpoint", ["input.path={root}/notes.pt", "output.path={out}"],
     ["notes.pt", "not a torch.save file"]),
    ("not an optimizer state dict", ["input.path={root}/weights.pt", "output.path={out}"],
     ["weights.pt", "not an optimizer state dict"]),
    ("a missing rank file", ["input.path={root}/ranks_missing", "input.format=rank_local", "output.path={out}"],
     ["rank_1.pt"]),
    ("a missing DCP data file", ["input.path={root}/dcp_missing", "output.path={out}"], ["dcp_missing"]),
    ("a short DCP data file", ["input.path={root}/dcp_short", "output.path={out}"], ["dcp_short"]),
    ("another model's names", ["input.path={root}/renamed.pt", "output.path={out}"], ["block2.nosuch"]),
    ("another model's shapes", ["input.path={root}/optim.pt", "model.kwargs.dim=9", "output.path={out}"],
     ["optim.pt"]),
    ("another model's dtypes", ["input.path={root}/float64.pt", "output.path={out}"], ["float64"]),
    ("another model's weights in a whole checkpoint",
     ["checkpoint=pytorch", "input.path={root}/whole", "model.kwargs.dim=9", "output.path={out}"],
     ["the checkpoint's", "but the model's"]),
    ("state that does not fit source.*",
     ["input.path={root}/ranks", "input.format=rank_local", "source.wrap=[]", "output.path={out}"], ["ranks"]),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Sources osdpipe generates (FULL, DCP, rank files, PyTorch's whole layout: ``nested``, saved by 2 and 3 ranks),
    and each made wrong in one way."""
    root = tmp_path_factory.mktemp("exit_codes")
    made = {
        "full": ["source.world_size=2"],
        "dcp": ["source.world_size=2", "source.state_dict_type=sharded"],
        "ranks": ["source.world_size=3", "source.state_dict_type=local"],
        "whole": ["checkpoint=pytorch", "source.world_size=2"],
    }
    results = run_cli_cases(
        [[*args, "target.world_size=1", MADE, f"output.path={root / 'gen' / name}"] for name, args in made.items()],
        cwd=root, per_case_s=TIMEOUT_S, env=user_env(),
    )  # fmt: skip
    assert [r["code"] for r in results] == [0] * len(made), [r["stderr"] for r in results]
    generated = root / "gen"
    shutil.copy(generated / "full" / "source" / "optim.pt", root / "optim.pt")
    shutil.copytree(generated / "dcp" / "source" / "dcp", root / "dcp")
    shutil.copytree(generated / "ranks" / "source" / "rank_local", root / "ranks")
    shutil.copytree(generated / "whole" / "source" / "checkpoint", root / "whole")
    shutil.rmtree(generated)

    (root / "a_file").write_text("not a directory")
    (root / "holder").mkdir()
    shutil.copy(root / "optim.pt", root / "holder" / "optim.pt")
    for name in ("dcp_a", "dcp_b", "nest/dcp"):
        shutil.copytree(root / "dcp", root / name)
    (root / "linked").symlink_to(root / "dcp_b")
    (root / "zero").mkdir()  # a DeepSpeed ZeRO save, as its files' names show one
    (root / "zero" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    synthetic_save(root / "megatron", tp=1)

    data = (root / "optim.pt").read_bytes()
    (root / "truncated.pt").write_bytes(data[: len(data) // 2])
    (root / "overwritten.pt").write_bytes(data[:-2048] + bytes(2048))
    (root / "notes.pt").write_text("my notes on the run\n")
    torch.save({"weight": torch.zeros(3)}, root / "weights.pt")
    shutil.copytree(root / "ranks", root / "ranks_missing")
    (root / "ranks_missing" / "rank_1.pt").unlink()
    for name in ("dcp_missing", "dcp_short"):
        shutil.copytree(root / "dcp", root / name)
    (root / "dcp_missing" / "__1_0.distcp").unlink()
    short = root / "dcp_short" / "__1_0.distcp"
    short.write_bytes(short.read_bytes()[:100])

    osd = torch.load(root / "optim.pt", weights_only=True)
    renamed = {**osd, "state": {("block2.nosuch" if k == "block2.gate" else k): v for k, v in osd["state"].items()}}
    renamed["param_groups"] = [
        {**g, "params": ["block2.nosuch" if p == "block2.gate" else p for p in g["params"]]}
        for g in osd["param_groups"]
    ]
    torch.save(renamed, root / "renamed.pt")
    widened = {**osd, "state": {k: {n: (v.double() if torch.is_tensor(v) and v.dim() else v) for n, v in s.items()}
                                for k, s in osd["state"].items()}}  # fmt: skip
    torch.save(widened, root / "float64.pt")
    return root


def _filled(arg: str, root: Path, out: Path) -> str:
    return arg.replace("{root}", str(root)).replace("{out}", str(out))


def _tree(root: Path) -> dict[str, tuple[bool, int]]:
    """Every path under ``root`` (links not followed), with whether it is a directory and its size."""
    return {str(p.relative_to(root)): (p.is_dir() and not p.is_symlink(), p.lstat().st_size) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def refused(inputs: Path) -> tuple[dict[str, dict], set[str]]:
    """Each case through the entry point (one driver process), and what changed in the folder of inputs (a path made,
    removed or of another size)."""
    before = _tree(inputs)
    cases = [[_filled(a, inputs, inputs / "out" / str(i)) for a in args] for i, (_, args, _) in enumerate(CASES)]
    results = run_cli_cases(cases, cwd=inputs, per_case_s=TIMEOUT_S, env=user_env())
    after = _tree(inputs)
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    return {name: result for (name, _, _), result in zip(CASES, results, strict=True)}, changed


@pytest.mark.parametrize(("case", "words"), [(name, words) for name, _, words in CASES])
def test_every_refusal_docs_errors_md_calls_exit_2_is_exit_2_in_one_line_with_nothing_written(
    case: str, words: list[str], refused: tuple[dict[str, dict], set[str]], inputs: Path
) -> None:
    results, changed = refused
    result = results[case]
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    explained = f"{case}: exit {result['code']}\n{result['stderr']}"
    assert result["code"] == 2, explained
    assert len(lines) == 1 and lines[0].startswith("osdpipe: error: "), explained
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    index, args = next((i, a) for i, (name, a, _) in enumerate(CASES) if name == case)
    values = [Path(_filled(a.split("=", 1)[-1], inputs, inputs / "out" / str(index))) for a in args]
    named = [v.relative_to(inputs) for v in values if v.is_relative_to(inputs)]  # the paths the case names
    touched = sorted(c for c in changed if any(Path(c).is_relative_to(n) for n in named))
    assert touched == [], f"{case}: wrote {touched}"
    assert not (inputs / "outputs").exists(), explained


def test_no_refused_run_wrote_anything(refused: tuple[dict[str, dict], set[str]]) -> None:
    assert refused[1] == set(), "a refused run wrote into the folder of its inputs, or changed one"


def test_a_sweep_with_a_bad_job_or_a_shared_output_path_is_exit_2_and_the_refused_job_writes_nothing(
    tmp_path: Path,
) -> None:
    """docs/errors.md: in a sweep, any job's bad config is exit code 2, and so is a job given an earlier job's
    output.path; the refused job writes nothing (the sweep's own summary is the sweep's)."""
    bad = run_osdpipe("-m", "target.world_size=0,-1", f"hydra.sweep.dir={tmp_path / 'bad'}", cwd=tmp_path, timeout=120)
    errors = [line for line in bad.stderr.splitlines() if line.startswith("osdpipe: error: ")]
    assert bad.returncode == 2 and len(errors) == 2 and all("target.world_size" in e for e in errors), bad.stderr
    assert sorted(p.name for p in (tmp_path / "bad").iterdir()) == ["multirun.yaml", "sweep.json", "sweep.png"]
    shared = run_osdpipe("-m", "source.world_size=1", "target.world_size=1,2", f"output.path={tmp_path / 'one'}",
                         MADE, f"hydra.sweep.dir={tmp_path / 'shared'}", cwd=tmp_path)  # fmt: skip
    errors = [line for line in shared.stderr.splitlines() if line.startswith("osdpipe: error: ")]
    assert shared.returncode == 2 and len(errors) == 1 and "was job 0's too" in errors[0], shared.stderr
    manifest = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert manifest["config"]["target"]["world_size"] == 1, "the refused job replaced the first job's conversion"
    assert not (tmp_path / "shared" / "1").exists()
