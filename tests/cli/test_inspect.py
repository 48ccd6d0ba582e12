"""``osdpipe inspect`` and checkpoints that say what they are: the command, on what plain PyTorch jobs save.

A user's jobs on 4 ranks (``userlm``: token IDs, a tied head, no arguments)
save what users have: FSDP1's SHARDED_STATE_DICT and FSDP2's
``get_optimizer_state_dict`` through ``dcp.save``, and an AdamW job's FULL
state with ``torch.save``. ``osdpipe inspect`` must tell each one's format,
kind, world size, optimizer and parameter count, and so must it for a
``rank_local`` output of osdpipe's. A description that contradicts the files
is refused in one line with exit code 2 before anything is written, and a
rank file of another wrapping is refused by ``load_rank_local`` before
anything is loaded.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import userlm
from helpers import run_cli_cases, run_command, user_env

from osdpipe.run.launch import run_local_world

TIMEOUT_S = 240
PARAMS = 13  # userlm's parameters, the tied head counted once


def _save_jobs(root: str) -> None:
    """FSDP1 (SHARDED, DCP) with Adam, FSDP2 (DCP) with Adam, and FSDP1 (FULL, torch.save) with AdamW, on this world."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("Adam", "AdamW"):
            torch.manual_seed(0)
            model = FSDP(
                userlm.build(), auto_wrap_policy=ModuleWrapPolicy({userlm.MixerBlock}), device_id=torch.device("cpu")
            )
            optim = getattr(torch.optim, name)(model.parameters(), lr=1e-3)
            userlm.steps(model, optim, userlm.batches(0, 2))
            if name == "Adam":
                with FSDP.state_dict_type(
                    model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
                ):
                    dcp.save(
                        {"optimizer": FSDP.optim_state_dict(model, optim)},
                        checkpoint_id=os.path.join(root, "fsdp1_dcp"),
                    )
            else:
                full = FSDP.optim_state_dict(model, optim)
                if dist.get_rank() == 0:
                    torch.save(full, os.path.join(root, "adamw.pt"))
        torch.manual_seed(0)
        model = userlm.fully_shard_blocks(userlm.build())
        optim = torch.optim.Adam(model.parameters(), lr=1e-3)
        userlm.steps(model, optim, userlm.batches(0, 2))
        dcp.save({"optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=os.path.join(root, "fsdp2_dcp"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inspect")
    run_local_world(_save_jobs, 4, (str(root),), timeout_s=TIMEOUT_S)
    # osdpipe's own rank_local output: the AdamW file, converted with no optim.name and no source.* at all.
    cases = [
        [
            "model.factory=userlm:build",
            f"input.path={root / 'adamw.pt'}",
            "target.world_size=3",
            "target.wrap=[MixerBlock]",
            f"output.path={root / 'out'}",
        ]
    ]
    [result] = run_cli_cases(cases, cwd=root, per_case_s=TIMEOUT_S, env=user_env())
    assert result["code"] == 0, result["stderr"]
    return root


def _inspect(*args: str, cwd: Path) -> tuple[int, str, str]:
    result = run_command([sys.executable, "-m", "osdpipe", "inspect", *args], cwd=cwd, timeout=120, env=user_env())
    return result.returncode, result.stdout, result.stderr


# path -> (format, kind, world size, optimizer)
EXPECTED = {
    "fsdp1_dcp": ("dcp", "sharded", 4, "Adam"),
    "fsdp2_dcp": ("dcp", "sharded", 4, "Adam"),
    "adamw.pt": ("fsdp_full", "fsdp1", None, "AdamW"),
    "out": ("rank_local", "fsdp1", 3, "AdamW"),
}


@pytest.fixture(scope="module")
def inspected(checkpoints: Path) -> dict[str, tuple[dict, dict]]:
    """``osdpipe inspect PATH --json`` and ``osdpipe inspect PATH`` of each checkpoint, through the entry point (one
    process runs them all)."""
    cases = [["inspect", str(checkpoints / name), *extra] for name in EXPECTED for extra in (["--json"], [])]
    results = run_cli_cases(cases, cwd=checkpoints, per_case_s=120, env=user_env())
    return {name: (results[2 * i], results[2 * i + 1]) for i, name in enumerate(EXPECTED)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_inspect_says_what_a_checkpoint_is(name: str, inspected: dict[str, tuple[dict, dict]]) -> None:
    fmt, kind, world, optimizer = EXPECTED[name]
    as_json, as_text = inspected[name]
    assert as_json["code"] == 0, as_json["stderr"]
    facts = json.loads(as_json["stdout"])
    for key in ("format", "kind", "world_size", "optimizer", "params", "state_bytes", "steps"):
        assert key in facts, f"--json has no {key!r}"
    assert (facts["format"], facts["kind"], facts["world_size"], facts["optimizer"], facts["params"]) == (
        fmt, kind, world, optimizer, PARAMS
    ), facts
    assert facts["steps"] == [2.0, 2.0] and facts["state_bytes"] > 0
    assert as_text["code"] == 0, as_text["stderr"]
    text = as_text["stdout"]
    lines = {line.split()[0]: line for line in text.splitlines()[1:] if line.strip()}
    assert (
        fmt in lines["format"] and optimizer in lines["optimizer"] and f"{PARAMS} with state" in lines["parameters"]
    ), text
    assert (str(world) if world else "not recorded") in lines["world"], text
    command = next(line for line in text.splitlines() if "convert with osdpipe" in line)
    assert f"input.format={fmt}" in command and f"optim.name={optimizer}" in command, command


def test_inspect_names_an_fsdp1_full_files_units_from_its_shared_steps(inspected: dict[str, tuple[dict, dict]]) -> None:
    """The FULL file's step tensors are shared per unit: 3 MixerBlocks and the root, each with its parameters."""
    facts = json.loads(inspected["adamw.pt"][0]["stdout"])
    units = sorted(sorted(u["fqns"]) for u in facts["units"])
    assert len(units) == 4 and sorted(f for u in units for f in u) == sorted(facts["fqns"]), units
    assert ["blocks.0.norm.bias", "blocks.0.norm.weight", "blocks.0.wk.weight", "blocks.0.wq.weight"] in units


def test_the_converted_adamw_checkpoint_keeps_adamws_param_groups(checkpoints: Path) -> None:
    for rank in range(3):
        groups = torch.load(checkpoints / "out" / f"rank_{rank}.pt", weights_only=True)["param_groups"]
        # AdamW's default weight decay
        assert groups[0]["decoupled_weight_decay"] is True and groups[0]["weight_decay"] == 0.01, groups
    manifest = json.loads((checkpoints / "out" / "manifest.json").read_text())
    assert manifest["config"]["optim"]["name"] == "AdamW"


def test_inspect_refuses_what_is_not_a_checkpoint_and_a_bad_command_line(checkpoints: Path, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    code, _, err = _inspect(str(tmp_path / "notes.txt"), cwd=tmp_path)
    assert (
        code == 1 and err.startswith("osdpipe inspect: error: ") and err.count("\n") == 1 and "Traceback" not in err
    ), err
    code, _, err = _inspect("--bogus", str(tmp_path), cwd=tmp_path)
    assert code == 2 and "usage: osdpipe inspect PATH" in err, err
    code, _, err = _inspect(str(tmp_path / "missing"), cwd=tmp_path)  # named as inspect's PATH, not input.path
    assert err == (f"osdpipe inspect: error: {tmp_path / 'missing'} does not exist; give a checkpoint file or "
                   "directory (or an s3:// or gs:// URL)\n") and code == 1, (code, err)  # fmt: skip


# ---------------------------------------------------------------------------
# a description that contradicts the files
# ---------------------------------------------------------------------------

REFUSED = {
    "optim_on_adam": (
        ["input.path={root}/fsdp2_dcp", "optim.name=SGD"],
        "optim.name=SGD reads hyperparameters ['dampening', 'momentum', 'nesterov'], "
        "which the checkpoint's param groups",
    ),
    "amsgrad_on_adam": (
        ["input.path={root}/fsdp2_dcp", "optim.name=Adam", "optim.kwargs.amsgrad=true"],
        "optim.name=Adam keeps state ['max_exp_avg_sq'], which the checkpoint does not hold",
    ),
    "world_size_on_dcp": (
        ["input.path={root}/fsdp1_dcp", "source.world_size=2"],
        "source.world_size=2, but {root}/fsdp1_dcp was saved by 4 rank(s)",
    ),
    "format_on_dcp": (
        ["input.path={root}/fsdp2_dcp", "input.format=rank_local"],
        "input.format=rank_local, but {root}/fsdp2_dcp is a DCP checkpoint (.metadata): set input.format=dcp",
    ),
}


@pytest.fixture(scope="module")
def refused(checkpoints: Path, tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """Each refused description through the entry point (one process runs them all), and the output path it named."""
    root = tmp_path_factory.mktemp("refused")
    cases = [
        ["model.factory=userlm:build", *(a.format(root=checkpoints) for a in args), f"output.path={root / case}"]
        for case, (args, _) in REFUSED.items()
    ]
    results = run_cli_cases(cases, cwd=root, per_case_s=120, env=user_env())
    return {case: (result, root / case) for case, result in zip(REFUSED, results)}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_description_the_files_contradict_is_refused_in_one_line(
    case: str, refused: dict[str, tuple[dict, Path]], checkpoints: Path
) -> None:
    result, out = refused[case]
    said = REFUSED[case][1].format(root=checkpoints)
    assert result["code"] == 2, result["stderr"]
    assert (
        result["stderr"].startswith("osdpipe: error: config: ") and result["stderr"].count("\n") == 1
    ), result["stderr"]
    assert said in result["stderr"], result["stderr"]
    assert not out.exists(), "nothing is written"
    assert result["seconds"] < 60, (
        f"refused after {result['seconds']:.0f} s: before any rank starts, not after a timeout"
    )


def test_the_files_settle_what_was_not_given_over_a_recipes_values(checkpoints: Path, tmp_path: Path) -> None:
    """The README's DCP command with no input.format, input.key or source.world_size, on a recipe that says 2 source
    ranks (the 4-rank files win); and a learning rate that differs from the checkpoint's is a warning naming the value
    used."""
    args = [
        "recipe=fsdp2_to_fsdp1",
        "model.factory=userlm:build",
        f"input.path={checkpoints / 'fsdp1_dcp'}",
        "target.world_size=2",
        "optim.lr=0.5",
    ]
    [result] = run_cli_cases(
        [[*args, f"output.path={tmp_path / 'out'}"]], cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env()
    )
    assert result["code"] == 0, result["stderr"]
    config = json.loads((tmp_path / "out" / "manifest.json").read_text())["config"]
    assert (
        config["input"]["format"],
        config["input"]["key"],
        config["source"]["world_size"],
        config["optim"]["name"],
    ) == ("dcp", "optimizer", 4, "Adam")
    assert (
        "osdpipe: warning: optim.lr=0.5 differs from the checkpoint's lr=0.001 in param group 0; "
        "the output keeps the checkpoint's 0.001"
    ) in result["stderr"]
    groups = torch.load(tmp_path / "out" / "rank_0.pt", weights_only=True)["param_groups"]
    assert groups[0]["lr"] == 1e-3, groups


# ---------------------------------------------------------------------------
# loading checks what it loads
# ---------------------------------------------------------------------------


def _load_into(out: str, units: list[str]) -> str:
    """A job wrapped with FSDP1 units ``units`` loads this rank's file; the error it raises, or "" when it loaded."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import osdpipe
    from osdpipe.layout.models import NestedModel

    torch.manual_seed(0)
    model = NestedModel()
    chosen = {id(model.get_submodule(u)) for u in units}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(
            model,
            auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or id(module) in chosen,
            device_id=torch.device("cpu"),
        )
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        osdpipe.load_rank_local(optim, Path(out) / f"rank_{dist.get_rank()}.pt")
    except ValueError as exc:
        return str(exc)
    return ""


def test_load_rank_local_refuses_a_file_of_another_wrapping_with_as_many_units(tmp_path: Path) -> None:
    """Converted for units block1, block2 (+ root); loaded into units block1.leaf1, block2 (+ root): three flat
    parameters each."""
    [result] = run_cli_cases(
        [["target.world_size=2", f"output.path={tmp_path / 'out'}"]], cwd=tmp_path, per_case_s=TIMEOUT_S
    )
    assert result["code"] == 0, result["stderr"]
    right = run_local_world(_load_into, 2, (str(tmp_path / "out"), ["block1", "block2"]), timeout_s=TIMEOUT_S)
    assert right == ["", ""], right
    wrong = run_local_world(_load_into, 2, (str(tmp_path / "out"), ["block1.leaf1", "block2"]), timeout_s=TIMEOUT_S)
    for rank, error in enumerate(wrong):
        assert error.startswith(f"{tmp_path / 'out' / f'rank_{rank}.pt'}: param ID "), error
        assert "param ID 0 (_flat_param: embed.weight, embed.bias" in error and "has local shape" in error, error
        assert "convert the checkpoint to this job's layout" in error and "\n" not in error, error


# ---------------------------------------------------------------------------
# a checkpoint whose first moments are its second (PyTorch 2.13's FSDP1 use_orig_params FULL path on CPU)
# ---------------------------------------------------------------------------


def test_moments_that_are_one_another_are_said_a_generated_use_orig_params_source_has_distinct_ones(
    tmp_path: Path
) -> None:
    [result] = run_cli_cases(
        [["source.use_orig_params=true", "target.world_size=2", f"output.path={tmp_path / 'out'}"]],
        cwd=tmp_path,
        per_case_s=TIMEOUT_S,
    )
    assert result["code"] == 0 and "warning" not in result["stderr"], result["stderr"]
    source = tmp_path / "out" / "source" / "optim.pt"
    osd = torch.load(source, weights_only=True)
    assert all(not torch.equal(s["exp_avg"], s["exp_avg_sq"]) for s in osd["state"].values()), (
        "osdpipe's own FULL path keeps both moments"
    )
    code, out, _ = _inspect(str(source), "--json", cwd=tmp_path)
    assert code == 0 and json.loads(out)["moments_alike"] is False
    for s in osd["state"].values():
        s["exp_avg"] = s["exp_avg_sq"].clone()
    damaged = tmp_path / "damaged.pt"
    torch.save(osd, damaged)
    code, out, _ = _inspect(str(damaged), cwd=tmp_path)
    assert code == 0 and "warning: exp_avg equals exp_avg_sq for every parameter" in out, out
    [result] = run_cli_cases(
        [[f"input.path={damaged}", "target.world_size=2", f"output.path={tmp_path / 'again'}"]],
        cwd=tmp_path,
        per_case_s=TIMEOUT_S,
    )
    assert result["code"] == 0, result["stderr"]
    assert (
        f"osdpipe: warning: {damaged}: exp_avg equals exp_avg_sq for every parameter" in result["stderr"]
    ), result["stderr"]


# ------------------------------------------------------------- the printed command runs


def _printed_command(text: str) -> list[str]:
    """The words of the ``convert with osdpipe ...`` line, as a POSIX shell splits them."""
    import shlex

    (line,) = [line for line in text.splitlines() if line.strip().startswith("convert with osdpipe ")]
    words = shlex.split(line.strip().removeprefix("convert with osdpipe "))
    # placeholders a shell passes as they are
    assert "target.world_size=M" in words and "output.path=OUT_DIR" in words, line
    return words


def _filled(words: list[str], **fill: str) -> list[str]:
    """The command with only its placeholders filled in."""
    placeholders = {"target.world_size=M": "target.world_size", "output.path=OUT_DIR": "output.path",
                    "model.factory=PACKAGE.MODULE:FUNCTION": "model.factory"}
    return [f"{placeholders[w]}={fill[placeholders[w]]}" if w in placeholders else w for w in words]


def test_the_command_inspect_prints_for_a_users_full_file_runs_once_its_placeholders_are_filled(
    checkpoints: Path, tmp_path: Path
) -> None:
    """An FSDP1 FULL_STATE_DICT file of the user's own model names no model: the command asks for model.factory."""
    code, text, err = _inspect(str(checkpoints / "adamw.pt"), cwd=tmp_path)
    assert code == 0, err
    words = _printed_command(text)
    assert "model.factory=PACKAGE.MODULE:FUNCTION" in words, text
    filled = _filled(
        words, **{"model.factory": "userlm:build", "target.world_size": "2", "output.path": str(tmp_path / "o")}
    )
    [done] = run_cli_cases([filled], cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())
    assert done["code"] == 0, f"{filled}\n{done['stderr']}"
    assert json.loads((tmp_path / "o" / "report.json").read_text())["ok"] is True


def test_the_command_inspect_prints_for_an_osdpipe_output_names_its_layout_and_model_from_the_manifest(
    checkpoints: Path, tmp_path: Path
) -> None:
    """osdpipe's rank_local output (FSDP1 units of MixerBlock, use_orig_params, 3 ranks): the manifest says what the
    rank files cannot, so the command runs with only the target and the output filled in."""
    code, text, err = _inspect(str(checkpoints / "out"), cwd=tmp_path)
    assert code == 0, err
    words = _printed_command(text)
    assert {
        "source.kind=fsdp1",
        "source.world_size=3",
        "source.wrap=[MixerBlock]",
        "model.factory=userlm:build",
    } <= set(words), text
    filled = _filled(words, **{"target.world_size": "2", "output.path": str(tmp_path / "o")})
    [done] = run_cli_cases([filled], cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())
    assert done["code"] == 0, f"{filled}\n{done['stderr']}"


@pytest.mark.frameworks
def test_a_torchtitan_folder_of_a_model_not_in_its_registry_asks_for_the_factory_and_then_converts(
    tmp_path: Path
) -> None:
    """llama3 debugmodel with fuse_qkv=False has the registry model's state dict, not its parameters: inspect must not
    name the registry's model (its command would fail on the optimizer's names), and says which names do not fit."""
    pytest.importorskip("torchtitan")
    import titan_unfused
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    model = titan_unfused.build()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    flat = get_optimizer_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    folder = tmp_path / "checkpoints" / "step-1"
    dcp.save({**model.state_dict(), "optimizer": flat, "train_state": {"step": 1}}, checkpoint_id=str(folder))

    code, text, err = _inspect(str(tmp_path / "checkpoints"), cwd=tmp_path)
    assert code == 0, err
    words = _printed_command(text)
    assert "model.factory=PACKAGE.MODULE:FUNCTION" in words and not any(w.startswith("checkpoint.model") for w in words)
    assert "qkv_linear.wq.weight" in text and "give model.factory" in text, text
    filled = _filled(words, **{"model.factory": "titan_unfused:build", "target.world_size": "2",
                               "output.path": str(tmp_path / "o")})
    [done] = run_cli_cases([[*filled, "runtime.mode=offline"]], cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())
    assert done["code"] == 0, f"{filled}\n{done['stderr'][-3000:]}"
