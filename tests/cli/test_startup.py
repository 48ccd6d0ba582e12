"""Start-up: help, the version and a config error are said without importing torch, and say what the slow path would.

Importing torch takes about two seconds; a command line that only asks for
help, or that a schema check refuses, must not pay for it. Each command runs
as a user runs it, under ``python -X importtime``, whose report on stderr
names every module the process imported. Timings live in
``benchmarks/startup.py``, not here.

The fast paths answer without Hydra (``--help``) or before it composes a
config (an override the schema refuses on its own); the tests below hold
their answers to Hydra's and to the composed config's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import clean_env, run_command

from osdpipe.cli.entry import plain_overrides

#: Command lines answered before Hydra: nothing imports torch (no fork server starts either), with the exit code and
#: words of the one line said.
EARLY = {
    "help": (["--help"], 0, []),
    "help_short": (["-h"], 0, []),
    "version": (["--version"], 0, []),
    "inspect_help": (["inspect", "--help"], 0, []),
    "check_help": (["check", "--help"], 0, []),
    "world_size_zero": (["target.world_size=zero"], 2, ["config: target.world_size (got 'zero')", "valid integer"]),
    "world_size_0": (["target.world_size=0"], 2, ["config: target.world_size (got 0)", "greater than or equal to 1"]),
    "mode_bogus": (["runtime.mode=bogus"], 2, ["config: runtime.mode (got 'bogus')", "'online' or 'offline'"]),
    "unknown_key": (["target.nope=1"], 2, ["target.nope: not a known key", "spelling"]),
}

#: Config errors found once Hydra composed the config: the launcher process still imports no torch
#: (the fork server may start beside it).
COMPOSED = {
    "rule_between_keys": (
        ["runtime.mode=offline", "runtime.transfer=scatter"], ["runtime.transfer=scatter", "runtime.transfer=shared"]
    ),
    "list_value": (["pipeline.stages=[load,bogus]"], ["config: pipeline.stages", "bogus", "known stages are"]),
    "sweep_of_bad_jobs": (
        ["-m", "target.world_size=0,-1", "hydra.sweep.dir=sweep"], ["config: target.world_size (got 0)"]
    ),
}

#: Runs the command as ``python -m osdpipe`` does, then says on stderr whether this process imported torch.
TELL_TORCH = """
import atexit, runpy, sys
atexit.register(lambda: sys.stderr.write("torch imported\\n" if "torch" in sys.modules else "no torch\\n"))
sys.argv = ["osdpipe", *sys.argv[1:]]
runpy.run_module("osdpipe", run_name="__main__")
"""


def osdpipe(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -X importtime -m osdpipe *args``: stderr holds the import report and what osdpipe said."""
    return run_command(
        [sys.executable, "-X", "importtime", "-m", "osdpipe", *args], cwd=cwd, timeout=120, env=clean_env()
    )


def imported(stderr: str) -> list[str]:
    """The modules ``-X importtime`` reports (``import time: self | cumulative | name``)."""
    return [
        line.rsplit("|", 1)[1].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    ]


def said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("import time:")]


def assert_one_line(result: subprocess.CompletedProcess[str], words: list[str]) -> None:
    lines = said(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("osdpipe: error: "), lines
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"


@pytest.mark.parametrize("case", list(EARLY))
def test_answered_without_torch(case: str, tmp_path: Path) -> None:
    args, code, words = EARLY[case]
    result = osdpipe(*args, cwd=tmp_path)
    modules = imported(result.stderr)
    assert "osdpipe.cli.entry" in modules, "-X importtime reported nothing"
    torch = [m for m in modules if m == "torch" or m.startswith("torch.")]
    assert not torch, f"osdpipe {' '.join(args)} imported {torch[:5]}"
    assert "hydra" not in modules, "answered before Hydra"
    assert result.returncode == code, f"exit {result.returncode}\n{result.stdout}\n{said(result.stderr)}"
    if words:
        assert_one_line(result, words)
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", list(COMPOSED))
def test_a_composed_config_error_imports_no_torch(case: str, tmp_path: Path) -> None:
    args, words = COMPOSED[case]
    result = run_command([sys.executable, "-c", TELL_TORCH, *args], cwd=tmp_path, timeout=120, env=clean_env())
    *lines, told = result.stderr.splitlines()
    assert told == "no torch", result.stderr
    assert result.returncode == 2, result.stderr
    errors = [line for line in lines if line.startswith("osdpipe: error: ")]
    assert errors and all(word in errors[0] for word in words), lines
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("report.json"))


def test_the_probe_sees_torch_where_a_config_needs_it(tmp_path: Path) -> None:
    """A factory that does not import is found by building the model: past the schema, with torch
    (so "no torch" above means something)."""
    result = run_command(
        [sys.executable, "-c", TELL_TORCH, "model.factory=no_such_package.models:build"],
        cwd=tmp_path,
        timeout=120,
        env=clean_env(),
    )
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == "torch imported", result.stderr


def test_version_names_the_installed_versions(tmp_path: Path) -> None:
    from importlib.metadata import version

    result = osdpipe("--version", cwd=tmp_path)
    assert result.stdout.strip() == f"osdpipe 0.1.0 (torch {version('torch')}, hydra {version('hydra-core')})"


def test_help_is_hydras(tmp_path: Path) -> None:
    """``osdpipe --help`` (read without Hydra) prints what Hydra's own help prints
    (given an override, Hydra answers)."""
    fast = osdpipe("--help", cwd=tmp_path)
    hydra = osdpipe("--help", "runtime.debug=false", cwd=tmp_path)
    assert "hydra" in imported(hydra.stderr) and "hydra" not in imported(fast.stderr)
    assert fast.returncode == hydra.returncode == 0
    assert fast.stdout == hydra.stdout
    assert "recipe: " in fast.stdout and "Config groups" in fast.stdout


# ------------------------------------------------- the overrides checked alone


#: Values as a command line writes them; each Hydra reads as a bool, int, float, None, a string or a sweep.
TOKENS = [
    "0", "007", "+1", "-3", "1_000", "1.5", ".5", "5.", "1e3", "-1.5",
    "inf", "NaN", "true", "True", "FALSE", "yes", "null", "NULL",
    "zero", "fsdp1", "FULL_SHARD", "_HYBRID_SHARD_ZERO2",
    "/tmp/x", "/tmp/a-b/c.pt", "pkg.mod:fn", "a@b", "1GB", "1.5GiB", "e5",
    "a,b", "${x}", "./rel", "-foo", "x+y", "[a,b]", "'quoted'", "",
]  # fmt: skip


def test_plain_overrides_are_typed_as_hydra_types_them() -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for token in TOKENS:
        ours = plain_overrides([f"k={token}"])
        assert ours is not None
        if "k" not in ours:
            continue  # left to Hydra
        theirs = parser.parse_override(f"k={token}").value()
        assert (ours["k"], type(ours["k"])) == (theirs, type(theirs)), token
    assert plain_overrides(["-m", "k=1"]) is None and plain_overrides(["--cfg", "job"]) is None
    assert plain_overrides(["+k=1", "~j", "recipe=quickstart"]) == {"recipe": "quickstart"}


@pytest.mark.parametrize(
    "override",
    [
        "target.world_size=zero",
        "source.world_size=0",
        "runtime.mode=bogus",
        "output.format=pt",
        "output.overwrite=maybe",
        "runtime.memory_budget=10",
        "target.mixed_precision.param_dtype=int8",
        "target.wrap=Block",
        "input.path=/no/such/checkpoint.pt",
        "target.nope=1",
        "runtime.mixed_precision.param_dtype=bfloat16",
        "optim.kwargs=1",
    ],
)
def test_an_override_refused_alone_is_said_as_the_composed_config_says_it(override: str, tmp_path: Path) -> None:
    """The early check (before Hydra) and the composed config's check say the same line for the same override."""
    from composing import compose_raw
    from hydra.errors import HydraException

    from osdpipe.cli.compose import hydra_message
    from osdpipe.spec.config import ConfigError, check_overrides, check_schema

    values = plain_overrides([override])
    assert values and len(values) == 1
    with pytest.raises(ConfigError) as early:
        check_overrides(values)
    try:
        check_schema(compose_raw([override], output_dir=tmp_path))
    except ConfigError as exc:
        composed = str(exc)
    except HydraException as exc:
        composed = hydra_message(exc)
    else:
        pytest.fail(f"{override} passed the composed config's check")
    assert str(early.value) == composed


def test_what_cannot_be_judged_alone_passes() -> None:
    from osdpipe.spec.config import check_overrides

    check_overrides(
        {
            "target.world_size": 3,
            "model.kwargs.depth": "x",  # an open dict: the factory's to refuse
            "model": "mlp",  # a config group
            "recipe": "halve_world_size",
            "hydra.job.name": "x",
            "target.kind": "fsdp3",  # the kind registry's to refuse, after the schema
            "optim.name": "Adamm",  # the optimizer's, likewise
            "output.path": "/tmp/anywhere",
        }
    )
