"""Config composition: Hydra's compose API plus osdpipe.spec.config.validate, with no subprocess and no process group.

The CLI composes ``pkg://osdpipe.conf`` with ``@hydra.main`` and validates the
resolved job config; these tests compose the same package the same way, so a
recipe or group file that breaks composition or validation fails here in
well under a second, long before a world is started.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from composing import compose_raw
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from osdpipe.spec.config import STAGE_ORDER, ConfigError, RunSpec, output_takes_input, validate

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def compose_spec(overrides: list[str] = (), *, output_dir: str | Path | None = None) -> RunSpec:
    return validate(compose_raw(overrides, output_dir=output_dir))


def config_error(overrides: list[str], tmp_path: Path) -> str:
    """The ConfigError message the overrides provoke (with output.path a fresh directory), from the spec or, for what
    the model answers, the plan."""
    from osdpipe.spec.plan import plan_run

    with pytest.raises(ConfigError) as info:
        plan_run(compose_spec([f"output.path={tmp_path / 'out'}", *overrides]))
    return str(info.value)


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.c": value}`` for every non-dict leaf of a nested dict."""
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def select(raw: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        raw = raw[part]
    return raw


# --------------------------------------------------------------------- recipes


def test_recipes_exist_and_reach_hydra() -> None:
    """Every recipes/*.yaml is a choice of Hydra's recipe group (through the symlink conf/recipe -> ../recipes), and
    nothing else is."""
    assert RECIPES, f"no recipes found in {REPO / 'recipes'}"
    link = REPO / "conf" / "recipe"
    assert link.is_symlink() and link.resolve() == (REPO / "recipes").resolve(), (
        f"{link} should be a symlink to ../recipes"
    )
    with initialize_config_module(version_base="1.3", config_module="osdpipe.conf"):
        options = GlobalHydra.instance().config_loader().get_group_options("recipe")
    assert sorted(options) == [p.stem for p in RECIPES]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_composes_and_validates(recipe: Path, tmp_path: Path) -> None:
    raw = compose_raw([f"recipe={recipe.stem}"], output_dir=tmp_path)
    spec = validate(raw)
    assert spec.output.path == str(tmp_path)
    # The recipe is applied last: every value it sets is the composed value.
    for key, value in leaves(OmegaConf.to_container(OmegaConf.load(recipe))).items():
        # Hydra's own settings (a sweep's params, what a recipe composes in), not the job's config
        if key.startswith(("hydra.", "defaults")):
            continue
        assert select(raw, key) == value, (
            f"{recipe.name} sets {key}={value!r} but the composed config has {select(raw, key)!r}"
        )


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_header(recipe: Path) -> None:
    lines = recipe.read_text().splitlines()
    header = []
    for line in lines:  # the leading comment block, which is where Hydra reads "# @package"
        if not line.startswith("#"):
            break
        header.append(line)
    assert header and header[0].strip() == "# @package _global_", (
        f"{recipe.name}: first line must be '# @package _global_'"
    )
    command = re.compile(rf"\bosdpipe (?:-m )?recipe={re.escape(recipe.stem)}(?![\w-])")  # -m: a recipe that is a sweep
    if recipe.stem == "quickstart":
        command = re.compile(rf"\bosdpipe(?: recipe={re.escape(recipe.stem)})?(?![\w=-])")
    assert any(command.search(line) for line in header), (
        f"{recipe.name}: no comment line showing `osdpipe recipe={recipe.stem}`: {header}"
    )


def test_default_is_quickstart(tmp_path: Path) -> None:
    """Plain `osdpipe` runs quickstart; output.path is Hydra's run directory."""
    raw = compose_raw([], output_dir=tmp_path)
    assert raw == compose_raw(["recipe=quickstart"], output_dir=tmp_path)
    spec = validate(raw)
    assert spec.output.path == str(tmp_path)
    assert spec.pipeline.stages == list(STAGE_ORDER)
    assert spec.input.path is None


# ------------------------------------------------------------------- overrides


def test_overrides_win_over_the_recipe(tmp_path: Path) -> None:
    # change_wrapping sets target.world_size=2; the command line wins over it.
    spec = compose_spec(["recipe=change_wrapping", "target.world_size=3", f"output.path={tmp_path}"])
    assert spec.target.world_size == 3
    assert spec.target.wrap == ["Leaf"]
    assert spec.output.path == str(tmp_path)


def test_model_group_override(tmp_path: Path) -> None:
    spec = compose_spec(["model=transformer"], output_dir=tmp_path)
    assert spec.model.factory == "transformer"
    assert spec.model.kwargs == {}  # the factory's own defaults
    assert spec.source.wrap == spec.target.wrap == ["TransformerBlock"]  # its fsdp_units


# ------------------------------------------------------------ a user's own model


def test_user_factory_inherits_no_kwargs_or_units(tmp_path: Path) -> None:
    """model.factory alone: the built-in model's kwargs and units do not leak into a factory without arguments."""
    spec = compose_spec(["model.factory=userlm:build"], output_dir=tmp_path)
    assert spec.model.factory == "userlm:build" and spec.model.kwargs == {}
    assert spec.source.wrap == spec.target.wrap == []  # the root only
    spec = compose_spec(["model.factory=userlm:build", "model.units=[MixerBlock]"], output_dir=tmp_path)
    assert spec.source.wrap == spec.target.wrap == ["MixerBlock"]
    spec = compose_spec(["model.factory=userlm:build", "source.wrap=[MixerBlock]"], output_dir=tmp_path)
    assert (spec.source.wrap, spec.target.wrap) == (["MixerBlock"], [])


def test_kwargs_take_new_keys_without_a_plus(tmp_path: Path) -> None:
    from osdpipe.cli.compose import open_dict_overrides

    spec = compose_spec(
        open_dict_overrides(["model=mlp", "model.kwargs.width=16", "optim=sgd", "optim.kwargs.nesterov=true"]),
        output_dir=tmp_path,
    )
    assert spec.model.kwargs == {"width": 16}
    assert spec.optim.kwargs == {"momentum": 0.9, "nesterov": True}


def test_optim_group_override(tmp_path: Path) -> None:
    spec = compose_spec(["optim=sgd"], output_dir=tmp_path)
    assert spec.optim.name == "SGD"
    assert spec.optim.kwargs == {"momentum": 0.9}


def test_combined_overrides(tmp_path: Path) -> None:
    spec = compose_spec(
        ["target.world_size=3", "model=transformer", "optim=sgd", "recipe=halve_world_size"], output_dir=tmp_path
    )
    assert (spec.target.world_size, spec.source.world_size) == (3, 4)
    assert (spec.model.factory, spec.optim.name) == ("transformer", "SGD")


# ----------------------------------------------------------------- bad configs


def test_unknown_stage(tmp_path: Path) -> None:
    msg = config_error(["pipeline.stages=[load,broadcast,flatten,shard,rekey,bogus]"], tmp_path)
    assert "pipeline.stages" in msg and "bogus" in msg
    assert "known stages are" in msg and all(s in msg for s in STAGE_ORDER)


def test_required_stage_cannot_be_skipped(tmp_path: Path) -> None:
    msg = config_error(["pipeline.stages=[load,broadcast,flatten,shard,verify,save]"], tmp_path)
    assert "pipeline.stages" in msg and "'rekey'" in msg
    assert "cannot be skipped" in msg and "only verify and save can" in msg


def test_out_of_order_stages(tmp_path: Path) -> None:
    msg = config_error(["pipeline.stages=[load,flatten,broadcast,shard,rekey]"], tmp_path)
    assert "pipeline.stages" in msg and "out of order" in msg


def test_nonexistent_input_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "optim.pt"
    msg = config_error([f"input.path={missing}"], tmp_path)
    assert msg.startswith("input.path") and str(missing) in msg
    assert "does not exist" in msg and "point input.path at a checkpoint" in msg


def test_world_size_zero(tmp_path: Path) -> None:
    msg = config_error(["target.world_size=0"], tmp_path)
    assert msg.splitlines() == [msg]  # one problem, one line
    assert msg.startswith("target.world_size (got 0)")
    assert "greater than or equal to 1" in msg


def test_unknown_key(tmp_path: Path) -> None:
    msg = config_error(["+target.foo=1"], tmp_path)
    assert msg.startswith("target.foo (got 1)")
    assert "is not a known key" in msg and "spelling" in msg


def test_wrap_root_false_needs_units(tmp_path: Path) -> None:
    msg = config_error(["target.wrap_root=false", "target.wrap=[]"], tmp_path)
    assert msg.startswith("target")
    assert "wrap_root=false" in msg and "list the modules to wrap in wrap" in msg


def test_optimizer_hyperparameter_it_does_not_take(tmp_path: Path) -> None:
    msg = config_error(["+optim.kwargs.momentum=0.9"], tmp_path)  # Adam is the default optimizer
    assert "optim.kwargs" in msg and "'momentum'" in msg and "torch.optim.Adam does not take" in msg
    assert "it takes" in msg and "'betas'" in msg
    # The same key is fine for the optimizer that takes it.
    assert compose_spec(["optim=sgd", f"output.path={tmp_path / 'ok'}"]).optim.kwargs["momentum"] == 0.9


def test_optim_kwargs_lr_is_a_config_error(tmp_path: Path) -> None:
    assert "optim.lr" in config_error(["+optim.kwargs.lr=0.1"], tmp_path)


def test_unknown_wrap_name_is_a_config_error(tmp_path: Path) -> None:
    msg = config_error(["target.wrap=[NoSuchModule]"], tmp_path)
    assert "target.wrap" in msg and "NoSuchModule" in msg and "Block" in msg


def test_unimportable_model_is_a_config_error(tmp_path: Path) -> None:
    assert "model.factory" in config_error(["model.factory=no_such_pkg.models:build"], tmp_path)


def test_dcp_input_must_be_a_directory(tmp_path: Path) -> None:
    ckpt = tmp_path / "optim.pt"
    ckpt.write_bytes(b"not a directory")
    msg = config_error([f"input.path={ckpt}", "input.format=dcp"], tmp_path)
    assert f"input.path={str(ckpt)!r}" in msg
    assert "a dcp input is a directory" in msg and "input.format=fsdp_full" in msg


def test_fsdp_full_input_must_be_a_file(tmp_path: Path) -> None:
    msg = config_error([f"input.path={tmp_path}", "input.format=fsdp_full"], tmp_path)
    assert "is a directory" in msg and "input.format=dcp" in msg


def test_existing_conversion_needs_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "rank_0.pt").write_bytes(b"")
    msg = config_error([], tmp_path)
    assert "output.path" in msg and "output.overwrite=true" in msg
    assert compose_spec([f"output.path={out}", "output.overwrite=true"]).output.overwrite


def test_unknown_layout_kind_names_the_kinds(tmp_path: Path) -> None:
    message = config_error(["target.kind=fsdp3"], tmp_path)
    assert "target.kind" in message and "fsdp3" in message and "fsdp1" in message and "none" in message, message


@pytest.mark.parametrize(
    ("output_path", "input_path", "overlap"),
    [
        ("out", "out", "holds"),
        ("out", "out/dcp", "holds"),
        ("out/", "./out/dcp/", "holds"),
        (".", "out/optim.pt", "holds"),
        ("out", "outside/optim.pt", None),
        ("out", "out_2/dcp", None),  # a sibling that shares the name's start
        ("out/dcp/again", "out/dcp", "is inside"),  # written among the source's files
        ("out/dcp_2", "out/dcp", None),
        ("linked/again", "out/dcp", "is inside"),  # linked -> out/dcp: compared resolved
        ("s3://bucket/out", "s3://bucket/out/dcp", "holds"),
        ("s3://bucket", "s3://bucket/any/key", "holds"),
        ("s3://bucket/out/dcp/again", "s3://bucket/out/dcp", "is inside"),
        ("s3://bucket/any/key", "s3://bucket", "is inside"),
        ("s3://bucket/out", "s3://bucket/out_2", None),
        ("s3://bucket/out_2", "s3://bucket/out", None),
        ("s3://bucket/out", "s3://other/out/dcp", None),
        ("s3://bucket/out", "gs://bucket/out/dcp", None),
        ("s3://bucket/out", "out/dcp", None),
        ("out", None, None),  # the source generated: written inside the output by design
    ],
)
def test_an_output_path_that_holds_its_input_or_lies_inside_it_is_refused(
    output_path: str, input_path: str | None, overlap: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversion replaces what its output.path holds: one that holds the input would take the checkpoint it
    converts with it (``output.overwrite=true``), and its manifest would name a source that is gone. One inside the
    input is written among the source checkpoint's own files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out" / "dcp").mkdir(parents=True)
    (tmp_path / "linked").symlink_to(tmp_path / "out" / "dcp")
    said = output_takes_input(output_path, input_path)
    assert (said is not None) == (overlap is not None), said
    if overlap is not None:
        assert said.startswith(f"output.path={output_path!r} {overlap} input.path={input_path!r}"), said
