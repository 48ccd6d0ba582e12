"""Whole training checkpoints: torchtitan's and accelerate's, inspected and converted whole through the ``osdpipe``
command.

The checkpoints are written by plain PyTorch code as the frameworks lay them
out (``whole_jobs.py``: FSDP2 and FSDP1 on 4 gloo ranks, the user's model
with a tied embedding and a persistent buffer, Adam with a ``LambdaLR``,
``train_state``, ``dataloader`` and one entry of the user's).

``osdpipe inspect`` must say which layout it is, where the model and the
optimizer are, and list every other entry with its size, marking those that
belong to one source rank; nothing in the folder may go unnamed.

A conversion (``checkpoint=torchtitan|accelerate``) must pass every verify
check, list every entry in its report, and give what the framework itself
resumes: loaded as torchtitan loads a step folder (one ``dcp.load`` of the
same structure) or as accelerate's ``load_state`` loads a folder, or with
``osdpipe.load_rank_local``, the model and the optimizer equal PyTorch's own
reshard of the source bitwise (DCP's load of the source on the target
world), the scheduler, ``train_state``, ``dataloader`` and the user's entry
are unchanged, every other accelerate file is byte-identical, and two more
real training steps leave both jobs equal bitwise.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import whole_jobs
from helpers import clean_env, run_cli_cases, run_command, user_env
from oracle_probe import spawn_world

#: End to end: three 4-rank worlds save the checkpoints.
pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1] / "support"
TIMEOUT_S = 180


def _inspect(path: Path, *extra: str) -> dict:
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    result = run_command(
        [sys.executable, "-m", "osdpipe", "inspect", str(path), *extra], cwd=path.parent, timeout=TIMEOUT_S, env=env
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if "--json" in extra else {"text": result.stdout}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("whole")
    spawn_world(whole_jobs.save_torchtitan, 4, (str(root / "titan"),), timeout_s=TIMEOUT_S)
    spawn_world(whole_jobs.save_torchtitan, 4, (str(root / "titan_v01"), True), timeout_s=TIMEOUT_S)
    spawn_world(whole_jobs.save_accelerate, 4, (str(root / "accelerate"),), timeout_s=TIMEOUT_S)
    spawn_world(whole_jobs.save_accelerate_full, 4, (str(root / "accelerate_full"),), timeout_s=TIMEOUT_S)
    return root


def _model_keys() -> set[str]:
    import userlm

    return set(userlm.build().state_dict())  # both names of the tied weight, as get_model_state_dict gives them


@pytest.mark.parametrize("folder", ["titan", "titan_v01"])
def test_a_torchtitan_step_lists_its_model_optimizer_and_every_other_entry(saved: Path, folder: str) -> None:
    shown = _inspect(saved / folder / "step-2", "--json")
    whole = shown["checkpoint"]
    assert whole["layout"] == "torchtitan"
    names = {e["name"]: e for e in whole["entries"]}
    model = {n.removeprefix("model.") for n, e in names.items() if e["part"] == "model"}
    assert model == _model_keys()
    assert (
        [n for n, e in names.items() if e["part"] == "optimizer"] == ["optimizer"]
        and names["optimizer"]["tensors"] == 3 * 13
    )
    others = {n for n, e in names.items() if e["part"] == "other"}
    assert others == {
        *whole_jobs.TITAN_OTHER, *(f"dataloader.dp_rank_{r}" for r in range(4)), "dataloader.world_size"
    } - {"dataloader"}
    assert {n: e["source_rank"] for n, e in names.items() if e["source_rank"] is not None} == {
        f"dataloader.dp_rank_{r}": r for r in range(4)
    }
    assert all(e["size"] > 0 for e in names.values())
    assert (whole["optimizer_key"], whole["optimizer_keys"]) == ("optimizer", "flat")
    assert any("exp_avg, exp_avg_sq, step for 13 parameter(s)" in n for n in whole["notes"])
    assert any("nested under 'model'" in n for n in whole["notes"]) == (folder == "titan_v01")


def test_an_accelerate_folder_lists_every_file_and_reads_its_optimizer(saved: Path) -> None:
    folder = saved / "accelerate" / "checkpoint_0"
    shown = _inspect(folder, "--json")
    whole = shown["checkpoint"]
    assert whole["layout"] == "accelerate"
    names = {e["name"]: e for e in whole["entries"]}
    assert set(names) == {p.name for p in folder.iterdir()}, "every file and directory of the folder is named"
    assert {n for n, e in names.items() if e["part"] == "model"} == {"pytorch_model_fsdp_0"}
    assert {n for n, e in names.items() if e["part"] == "optimizer"} == {"optimizer_0"}
    assert {n for n, e in names.items() if e["part"] == "other"} == set(whole_jobs.ACCELERATE_FILES)
    assert {n: e["source_rank"] for n, e in names.items() if e["source_rank"] is not None} == {
        f"random_states_{r}.pkl": r for r in range(4)
    }
    assert all(names[n]["size"] == (folder / n).stat().st_size for n in whole_jobs.ACCELERATE_FILES)
    optimizer = shown["optimizer"]
    assert (
        optimizer["format"], optimizer["key"], optimizer["world_size"], optimizer["optimizer"], optimizer["params"]
    ) == ("dcp", "optimizer", 4, "Adam", 13)
    text = _inspect(folder)["text"]
    assert (
        "layout       accelerate" in text
        and "converts the whole checkpoint" in text
        and "random_states_3.pkl" in text
    )
    # the files tell the rest (the format, the world, the optimizer); only the user can name their model
    assert (
        "convert with osdpipe checkpoint=accelerate model.factory=PACKAGE.MODULE:FUNCTION"
        f" input.path={folder} target.world_size=M output.path=OUT_DIR"
    ) in text


@pytest.mark.parametrize("folder", ["titan", "titan_v01"])
def test_a_torchtitan_optimizer_converts_and_equals_the_jobs_own_full_state(saved: Path, folder: str) -> None:
    """The flattened optimizer entry (``state.<fqn>.<name>``) reads as any DCP optimizer state:
    to one process, it is what the job reported."""
    import torch
    import userlm

    out = saved / f"{folder}_plain"
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    args = [
        "model.factory=userlm:build", f"input.path={saved / folder / 'step-2'}",
        "source.kind=fsdp2", "target.kind=none", "target.world_size=1",
        "output.format=plain", "pipeline.checks=[roundtrip,reference,resume]", f"output.path={out}",
        "runtime.progress=false",
    ]
    result = run_command([sys.executable, "-m", "osdpipe", *args], cwd=saved, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr
    full = torch.load(saved / folder / "full_optim.pt", weights_only=True)
    model = userlm.build()
    optim = torch.optim.Adam(model.parameters(), lr=1.0)
    optim.load_state_dict(torch.load(out / "optim.pt", weights_only=True))
    # the scheduler's lr, kept from the source
    assert optim.param_groups[0]["lr"] == full["param_groups"][0]["lr"] != 1.0
    for name, param in model.named_parameters():
        for key, value in full["state"][name].items():
            assert torch.equal(optim.state[param][key], value), f"{name} {key}"


# ---------------------------------------------------------------------------- conversions


#: 300 bytes a file: the user's model (1.3 KB) exports in several safetensors shards.
SHARD_BYTES = 300
CHECKS = "pipeline.checks=[roundtrip,reference,load_step,resume]"
TITAN = [
    "checkpoint=torchtitan", "model.factory=userlm:build",
    "source.kind=fsdp2", "source.world_size=4", "target.kind=fsdp2",
]
CONVERSIONS = {
    "titan_dcp_2": [
        "input.path={saved}/titan/step-2", *TITAN, "target.world_size=2",
        "output.format=dcp", "output.model_format=safetensors", f"output.max_shard_size={SHARD_BYTES}",
    ],
    "titan_rank_local_3": [
        "input.path={saved}/titan/step-2", *TITAN, "target.world_size=3", "output.format=rank_local"
    ],
    "titan_v01_dcp_2": ["input.path={saved}/titan_v01/step-2", *TITAN, "target.world_size=2", "output.format=dcp"],
    "accelerate_dcp_2": [
        "checkpoint=accelerate", "model.factory=userlm:build", "input.path={saved}/accelerate/checkpoint_0",
        "source.kind=fsdp1", "source.world_size=4", "source.wrap=[MixerBlock]",
        "target.kind=fsdp1", "target.world_size=2", "target.wrap=[MixerBlock]",
        "output.format=dcp",
    ],
    "accelerate_rank_local_2": [
        "checkpoint=accelerate", "model.factory=userlm:build", "input.path={saved}/accelerate/checkpoint_0",
        "source.kind=fsdp1", "source.world_size=4", "source.wrap=[MixerBlock]",
        "target.kind=fsdp2", "target.world_size=2",
        "output.format=rank_local",
    ],
    "accelerate_full_dcp_2": [
        "checkpoint=accelerate", "model.factory=userlm:build", "input.path={saved}/accelerate_full/checkpoint_0",
        "source.kind=fsdp1", "source.world_size=4", "source.wrap=[MixerBlock]",
        "target.kind=fsdp1", "target.world_size=2", "target.wrap=[MixerBlock]",
        "output.format=dcp",
    ],
    "accelerate_full_full_2": [
        "checkpoint=accelerate", "model.factory=userlm:build", "input.path={saved}/accelerate_full/checkpoint_0",
        "source.kind=fsdp1", "source.world_size=4", "source.wrap=[MixerBlock]",
        "target.kind=fsdp1", "target.world_size=2", "target.wrap=[MixerBlock]", "target.use_orig_params=true",
        "output.format=fsdp_full",
    ],
    "titan_pytorch_2": ["input.path={saved}/titan/step-2", *TITAN, "target.world_size=2", "output.checkpoint=pytorch"],
    "titan_accelerate_2": [
        "input.path={saved}/titan/step-2", *TITAN, "target.world_size=2", "output.checkpoint=accelerate"
    ],
    "accelerate_pytorch_2": [
        "checkpoint=accelerate", "model.factory=userlm:build", "input.path={saved}/accelerate/checkpoint_0",
        "source.kind=fsdp1", "source.world_size=4", "source.wrap=[MixerBlock]",
        "target.kind=fsdp2", "target.world_size=2",
        "output.checkpoint=pytorch",
    ],
}


@pytest.fixture(scope="module")
def converted(saved: Path) -> dict[str, Path]:
    """Each of :data:`CONVERSIONS` through the entry point, in one driver process;
    name -> its output directory. Each must pass every check."""
    outs = {name: saved / "out" / name for name in CONVERSIONS}
    argv = [
        [*(a.format(saved=saved) for a in args), CHECKS, f"output.path={outs[name]}", "runtime.progress=false"]
        for name, args in CONVERSIONS.items()
    ]
    for name, result in zip(CONVERSIONS, run_cli_cases(argv, cwd=saved, per_case_s=TIMEOUT_S, env=user_env())):
        assert result["code"] == 0, f"{name}: {result['stderr']}"
        report = json.loads((outs[name] / "report.json").read_text())
        assert {c["name"]: c["ok"] for c in report["checks"]} == dict.fromkeys(
            ["roundtrip", "reference", "load_step", "resume"], True
        ), name
        resume = next(c["detail"] for c in report["checks"] if c["name"] == "resume")
        assert "from the checkpoint's own weights" in resume, name
    return outs


@pytest.mark.parametrize(
    "name,source",
    [
        ("titan_dcp_2", "titan/step-2"),
        ("titan_v01_dcp_2", "titan_v01/step-2"),
        ("accelerate_dcp_2", "accelerate/checkpoint_0"),
    ],
)
def test_the_report_lists_every_entry_and_what_became_of_it(
    converted: dict[str, Path], saved: Path, name: str, source: str
) -> None:
    report = json.loads((converted[name] / "report.json").read_text())
    listed = {e["name"]: e for e in report["entries"]}
    shown = {e["name"] for e in _inspect(saved / source, "--json")["checkpoint"]["entries"]}
    assert set(listed) == shown, "nothing in the input goes unnamed"
    for entry in listed.values():
        converted_or_carried = "converted" if entry["part"] in ("model", "optimizer") else "carried over unchanged"
        assert entry["fate"].startswith(converted_or_carried), entry
        assert ("source_rank" in entry) == ("describes rank" in entry["fate"]), entry
    assert sum("source_rank" in e for e in listed.values()) == 4


def _same(got, want, where: str) -> None:
    from osdpipe.core.compare import diff

    problems = diff(got, want, limit=5)
    assert not problems, f"{where}: {problems}"


def test_torchtitan_to_2_ranks_resumes_as_pytorchs_own_reshard_loaded_as_torchtitan_loads_it(
    converted: dict[str, Path], saved: Path
) -> None:
    """The dcp output, loaded as torchtitan loads a step folder on 2 ranks, is what DCP's own load of the source gives
    there, bitwise, before and after two more steps."""
    source = str(saved / "titan" / "step-2")
    # torchtitan's step folder
    outputs = [str(converted["titan_dcp_2"] / "step-2"), str(converted["titan_v01_dcp_2"] / "step-2")]
    worlds = spawn_world(whole_jobs.resume_torchtitan, 2, ([source, *outputs],), timeout_s=TIMEOUT_S)
    for rank, (theirs, mine, v01) in enumerate(worlds):
        for label, got in (("v0.2", mine), ("v0.1 nested", v01)):
            _same(got["loaded"], theirs["loaded"], f"rank {rank} {label} loaded")
            _same(got["resumed"], theirs["resumed"], f"rank {rank} {label} after two steps")
        assert mine["loaded"]["train_state"] == {"step": 2, "ntokens_seen": 4096}
        _same(mine["loaded"]["user_notes"], whole_jobs.user_notes(), f"rank {rank} the user's entry")
    import torch.distributed.checkpoint as dcp

    model_keys = {p[0] for p in dcp.FileSystemReader(outputs[1]).read_metadata().planner_data.values()}
    assert "model" in model_keys and "embed.weight" not in model_keys, "a v0.1 checkpoint's model stays under 'model'"


def test_torchtitan_dataloader_entries_are_carried_over_as_stored(converted: dict[str, Path], saved: Path) -> None:
    """Each data-parallel rank's position and the saving world's size:
    the same stored bytes in the output, loaded the same."""
    from osdpipe.io.formats.dcp_reader import DcpCheckpoint

    source = DcpCheckpoint(str(saved / "titan" / "step-2"), None)
    output = DcpCheckpoint(str(converted["titan_dcp_2"] / "step-2"), None)
    carried = [f for f, p in source.paths.items() if p[0] in whole_jobs.TITAN_OTHER]
    assert len(carried) >= 7
    for flat in carried:
        if not source.is_tensor(flat) and source.stored(flat) is not None:
            assert output.stored(flat) == source.stored(flat), flat
        else:
            _same(output.read_item(flat), source.read_item(flat), flat)


def test_torchtitan_to_3_rank_files_loads_with_load_rank_local_and_resumes_as_pytorchs_own_reshard(
    converted: dict[str, Path], saved: Path
) -> None:
    """Each rank's file, loaded with osdpipe.load_rank_local (the model given): PyTorch's own reshard on 3 ranks,
    bitwise, before and after two steps; every other entry in the file as the source saved it."""
    source = str(saved / "titan" / "step-2")
    ranks = spawn_world(
        whole_jobs.resume_rank_local, 3, (str(converted["titan_rank_local_3"]), source), timeout_s=TIMEOUT_S
    )
    for rank, (mine, theirs) in enumerate(ranks):
        _same(mine["loaded"]["model"], theirs["loaded"]["model"], f"rank {rank} model")
        _same(mine["loaded"]["optim"], theirs["loaded"]["optim"], f"rank {rank} optimizer")
        _same(mine["loaded"]["scheduler"], theirs["loaded"]["scheduler"], f"rank {rank} scheduler")
        _same(mine["resumed"], theirs["resumed"], f"rank {rank} after two steps")
        entries = mine["entries"]
        assert entries["train_state"] == {"step": 2, "ntokens_seen": 4096}
        _same(entries["user_notes"], whole_jobs.user_notes(), f"rank {rank} the user's entry")
        assert (
            sorted(entries["dataloader"]) == sorted([*(f"dp_rank_{r}" for r in range(4)), "world_size"])
            and entries["dataloader"]["world_size"] == 4
        )


def test_accelerate_to_2_ranks_resumes_as_load_state_does_and_every_other_file_is_byte_identical(
    converted: dict[str, Path], saved: Path
) -> None:
    source, output = saved / "accelerate" / "checkpoint_0", converted["accelerate_dcp_2"] / "dcp"
    ranks = spawn_world(whole_jobs.resume_accelerate, 2, ([str(source), str(output)],), timeout_s=TIMEOUT_S)
    for rank, (theirs, mine) in enumerate(ranks):
        _same(mine["loaded"], theirs["loaded"], f"rank {rank} loaded")
        _same(mine["resumed"], theirs["resumed"], f"rank {rank} after two steps")
    for name in whole_jobs.ACCELERATE_FILES:
        assert (output / name).read_bytes() == (source / name).read_bytes(), name
    assert sorted(p.name for p in output.iterdir()) == sorted(
        [*whole_jobs.ACCELERATE_FILES, "optimizer_0", "pytorch_model_fsdp_0"]
    )


def test_accelerate_to_fsdp2_rank_files_keeps_every_other_file_beside_them(
    converted: dict[str, Path], saved: Path
) -> None:
    """FSDP1 on 4 ranks -> FSDP2 rank files for 2 (README: "accelerate's other files go beside them"): each rank file
    loads with osdpipe.load_rank_local into an FSDP2 job, model given, and holds what accelerate's own load of the
    source gives that job (the checks in the fixture compare with PyTorch); every other file of the folder lies beside
    the rank files, byte for byte."""
    source, output = saved / "accelerate" / "checkpoint_0", converted["accelerate_rank_local_2"]
    for name in whole_jobs.ACCELERATE_FILES:
        assert (output / name).read_bytes() == (source / name).read_bytes(), name
    assert sorted(p.name for p in output.iterdir() if p.suffix in (".pt", ".pkl", ".bin")) == sorted(
        [*whole_jobs.ACCELERATE_FILES, "rank_0.pt", "rank_1.pt"]
    )
    manifest = json.loads((output / "manifest.json").read_text())
    assert set(whole_jobs.ACCELERATE_FILES) <= set(manifest["files"]), (
        "the carried files are part of the conversion (an overwrite replaces them)"
    )
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved_model = str(source / "pytorch_model_fsdp_0")  # the source's model, read by DCP itself in this process
    metadata = dcp.FileSystemReader(saved_model).read_metadata().state_dict_metadata
    want = {
        "model": {
            k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }
    }
    dcp.load(want, checkpoint_id=saved_model)
    for rank, loaded in enumerate(spawn_world(whole_jobs.load_rank_files, 2, (str(output),), timeout_s=TIMEOUT_S)):
        assert set(want["model"]) <= set(loaded["model"]) and set(loaded["model"]) == _model_keys(), (
            f"rank {rank}: {sorted(loaded['model'])}"
        )
        _same({k: loaded["model"][k] for k in want["model"]}, want["model"], f"rank {rank} model")
        assert loaded["finite"] and loaded["lr"] != 1e-2, f"rank {rank}: the scheduler's lr, and two more finite steps"


def test_accelerates_full_variant_converts_to_the_sharded_folder_and_resumes_as_the_full_one_does(
    converted: dict[str, Path], saved: Path
) -> None:
    """FULL_STATE_DICT (pytorch_model_fsdp.bin, optimizer.bin) of 4 ranks -> the SHARDED folder for 2 ranks: loaded as
    load_state loads each, the same model and optimizer bitwise, before and after two steps; every other file
    byte-identical."""
    source, output = saved / "accelerate_full" / "checkpoint_0", converted["accelerate_full_dcp_2"] / "dcp"
    ranks = spawn_world(whole_jobs.resume_accelerate, 2, ([str(source), str(output)],), timeout_s=TIMEOUT_S)
    for rank, (theirs, mine) in enumerate(ranks):
        _same(mine["loaded"], theirs["loaded"], f"rank {rank} loaded")
        _same(mine["resumed"], theirs["resumed"], f"rank {rank} after two steps")
    carried = sorted(p.name for p in source.iterdir() if p.name not in ("pytorch_model_fsdp.bin", "optimizer.bin"))
    assert carried == sorted(["scheduler.bin", *(f"random_states_{r}.pkl" for r in range(4))])
    for name in carried:
        assert (output / name).read_bytes() == (source / name).read_bytes(), name
    assert sorted(p.name for p in output.iterdir()) == sorted([*carried, "optimizer_0", "pytorch_model_fsdp_0"])
    manifest = json.loads((output.parent / "manifest.json").read_text())
    assert manifest["source_rank_files"] == {f"dcp/random_states_{r}.pkl": r for r in range(4)}, (
        "each file of one rank of the saving world, marked"
    )
    titan = json.loads((converted["titan_dcp_2"] / "manifest.json").read_text())
    assert "source_rank_files" not in titan, (
        "torchtitan's per-rank data-loader entries are items of the step folder, not files"
    )


def test_the_safetensors_export_is_the_full_model_sharded_by_max_shard_size(
    converted: dict[str, Path], saved: Path
) -> None:
    """safetensors.torch.load_file reads every file; together they are the job's full model state dict, bitwise, the
    tied weight stored once (under its first name, as save_pretrained stores it); the index is exact; each shard within
    the limit (a larger tensor alone)."""
    import torch
    from safetensors.torch import load_file

    out = converted["titan_dcp_2"]
    full = torch.load(saved / "titan" / "full_model.pt", weights_only=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    exported = {}
    for name in files:
        tensors = load_file(out / name)
        assert {k for k, f in index["weight_map"].items() if f == name} == set(tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= SHARD_BYTES or len(tensors) == 1, f"{name}: {size} bytes"
        exported.update(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in exported.values())
    assert "head.weight" not in exported and "feature_scale" in exported, (
        "the tied head is the embedding, stored once; the buffer is there"
    )
    _same(exported, {k: v for k, v in full.items() if k != "head.weight"}, "export")
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(files) | {"model.safetensors.index.json"} <= set(manifest["files"])


REFUSED = {
    "full output": (
        ["checkpoint=torchtitan", "source.kind=fsdp2", "output.format=fsdp_full"],
        ["checkpoint=torchtitan", "output.format=dcp or rank_local"],
    ),
    "fsdp1 rank files": (
        ["checkpoint=accelerate", "source.kind=fsdp1", "target.kind=fsdp1"],
        ["output.format=rank_local", "set output.format=dcp"],
    ),
    "export of an optimizer": (
        ["output.model_format=safetensors"],
        ["output.model_format=safetensors", "checkpoint=torchtitan, accelerate, pytorch or deepspeed"],
    ),
    "torchtitan trains FSDP2": (
        ["checkpoint=torchtitan", "source.kind=fsdp1", "output.format=dcp"],
        ["checkpoint=torchtitan", "source.kind=fsdp2"],
    ),
    "a whole layout out of an optimizer": (
        ["output.checkpoint=pytorch"],
        ["output.checkpoint=pytorch", "optimizer's alone", "checkpoint="],
    ),
    "torchtitan out of accelerate": (
        ["checkpoint=accelerate", "source.kind=fsdp1", "output.checkpoint=torchtitan", "output.format=dcp"],
        [
            "output.checkpoint=torchtitan",
            "the files of checkpoint=accelerate do not say",
            "set output.checkpoint=pytorch",
        ],
    ),
    "torchtitan out of pytorch": (
        ["checkpoint=pytorch", "source.kind=fsdp2", "output.checkpoint=torchtitan", "output.format=dcp"],
        [
            "output.checkpoint=torchtitan",
            "the files of checkpoint=pytorch do not say",
            "set output.checkpoint=pytorch",
        ],
    ),
    "deepspeed is read, not trained": (["checkpoint=deepspeed"], ["checkpoint=deepspeed", "input.path"]),
    "torchtitan's model without its flavor": (
        ["checkpoint=torchtitan", "checkpoint.model=llama3"],
        ["checkpoint.model and checkpoint.flavor go together"],
    ),
    "torchtitan's names for another layout": (
        ["checkpoint=accelerate", "checkpoint.model=llama3", "checkpoint.flavor=8B"],
        ["set checkpoint=torchtitan"],
    ),
    "torchtitan's model and another": (
        [
            "checkpoint=torchtitan", "checkpoint.model=llama3", "checkpoint.flavor=debugmodel",
            "model.factory=userlm:build",
        ],
        [
            "checkpoint.model=llama3 checkpoint.flavor=debugmodel names torchtitan's own model",
            "model.factory=userlm:build",
        ],
    ),
}


def test_a_users_own_top_level_tensor_is_carried_and_reported_as_carried(tmp_path: Path) -> None:
    """A torchtitan step whose user put a tensor of their own at the top level, beside the model's: what a conversion
    carries (its shape and dtype, enough to plan the output's DCP items on a rank that does not hold it) and what the
    report calls it."""
    import torch
    import torch.distributed.checkpoint as dcp
    import userlm

    from osdpipe.io.checkpoints import get
    from osdpipe.io.checkpoints.base import fates
    from osdpipe.io.checkpoints.output import carried_state
    from osdpipe.io.formats import dcp_writer
    from osdpipe.layout.tree import describe

    model = userlm.build()
    step = tmp_path / "step-1"
    dcp.save(
        {**model.state_dict(), "ema_scale": torch.full((4,), 0.5), "train_state": {"step": 1, "ntokens_seen": 64}},
        checkpoint_id=str(step),
    )
    carrying = get("torchtitan").carried(str(step), "dcp", describe(model))
    assert carrying.model_key is None and carrying.item_tensors == {"ema_scale": ((4,), "float32")}
    fate = {row["name"]: (row["part"], row["fate"]) for row in fates(carrying)}
    assert fate["ema_scale"] == ("other", "carried over unchanged"), fate
    assert {n.removeprefix("model.") for n, (part, _) in fate.items() if part == "model"} == _model_keys()
    planned = carried_state(carrying, None)  # what a rank that does not hold the items plans with
    assert planned["ema_scale"].device.type == "meta" and planned["ema_scale"].shape == (4,)
    dcp_writer.plan(lambda r: planned if r == 0 else {}, 2)  # DCP's planner takes it


def test_another_frameworks_entries_go_under_its_name_in_a_torchtitan_step_folder_of_its_step() -> None:
    """``output.checkpoint=torchtitan`` from a DeepSpeed save: ``step-<N>`` of the step its files say, the model at the
    top level, and DeepSpeed's ``lr_scheduler`` under ``deepspeed`` (torchtitan would load an ``lr_scheduler`` into its
    own scheduler); the report says where each went, and the checks look for each there. A source that does not say its
    step is refused."""
    from dataclasses import replace

    import pytest

    from osdpipe.io.checkpoints import get
    from osdpipe.io.checkpoints.base import CarriedData, Carrying, Entry, fates
    from osdpipe.io.checkpoints.output import carried_state
    from osdpipe.io.formats.base import InputError

    source = Carrying(
        "/ckpt/ds/global_step7",
        ("lr_scheduler.last_epoch", "global_steps"),
        (("lr_scheduler", "last_epoch"), ("global_steps",)),
        entries=(Entry("lr_scheduler", "other", "mp_rank_00_model_states.pt", 10),),
        model_key="model",
        layout="deepspeed",
        step=7,
    )
    titan = get("torchtitan")
    adopted = titan.adopt(source)
    assert (adopted.folder, adopted.model_key, adopted.under) == ("step-7", None, "deepspeed")
    assert [adopted.written_flat(f) for f in adopted.items] == [
        "deepspeed.lr_scheduler.last_epoch", "deepspeed.global_steps"
    ]
    assert fates(adopted)[0]["fate"].startswith("carried over unchanged, under 'deepspeed'")
    written = carried_state(adopted, CarriedData(values={"lr_scheduler.last_epoch": 6, "global_steps": 7}))
    assert written == {"deepspeed": {"lr_scheduler": {"last_epoch": 6}, "global_steps": 7}}
    assert titan.adopt(replace(source, layout="torchtitan")) == replace(source, layout="torchtitan"), (
        "its own checkpoint stays as it is"
    )
    assert get("pytorch").adopt(source).under is None, (
        "PyTorch's layout has no entries of its own: they stay where they were"
    )
    with pytest.raises(InputError, match="do not say at which step"):
        titan.adopt(replace(source, step=None))


def test_what_a_whole_checkpoint_cannot_be_asked_is_one_line(tmp_path: Path) -> None:
    argv = [[*args, f"output.path={tmp_path / str(i)}"] for i, (args, _) in enumerate(REFUSED.values())]
    results = run_cli_cases(argv, cwd=tmp_path, per_case_s=60, env=user_env())
    for (name, (_, words)), result in zip(REFUSED.items(), results):
        lines = [line for line in result["stderr"].splitlines() if line.strip()]
        assert result["code"] == 2 and len(lines) == 1, f"{name}: {result['stderr']}"
        assert all(w in lines[0] for w in words), f"{name}: {lines[0]}"


def test_another_frameworks_checkpoint_is_refused_naming_the_checkpoint_that_reads_it(
    saved: Path, tmp_path: Path
) -> None:
    """A folder given as another framework's (an accelerate folder as torchtitan's, a torchtitan step as accelerate's,
    either as a Megatron-LM save): one line, exit 2, naming the ``checkpoint=`` that reads it, nothing written. Before,
    the stage that looked for its files failed (exit 1, a report in ``output.path``; torchtitan's: as an internal
    error)."""
    accelerate, titan = saved / "accelerate" / "checkpoint_0", saved / "titan" / "step-2"
    cases = {given: (accelerate, "set checkpoint=accelerate") for given in ("torchtitan", "deepspeed", "megatron")}
    cases["accelerate"] = (titan, "set checkpoint=torchtitan")
    argv = [[f"checkpoint={given}", f"input.path={path}", "target.world_size=2", f"output.path={tmp_path / given}"]
            for given, (path, _) in cases.items()]
    for (given, (path, said)), result in zip(cases.items(), run_cli_cases(argv, cwd=tmp_path, per_case_s=60,
                                                                           env=user_env())):  # fmt: skip
        lines = [line for line in result["stderr"].splitlines() if line.strip()]
        assert result["code"] == 2 and len(lines) == 1, f"{given}: {result['stderr']}"
        assert lines[0].startswith(f"osdpipe: error: config: input.path: {path} is ") and lines[0].endswith(said), (
            given, lines[0])
        assert f"not what checkpoint={given} reads" in lines[0] and not (tmp_path / given).exists(), lines[0]


def test_inspect_of_a_whole_conversions_output_path_describes_the_checkpoint_it_holds(
    converted: dict[str, Path], tmp_path: Path
) -> None:
    """The folder ``output.path`` holds (``dcp/``: accelerate's files) is what inspect reads and its command converts;
    before, inspect read ``dcp/`` as an optimizer's DCP and failed."""
    out = converted["accelerate_dcp_2"]
    result = run_command([sys.executable, "-m", "osdpipe", "inspect", str(out)], cwd=tmp_path, timeout=TIMEOUT_S,
                         env=user_env())  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "layout       accelerate" in result.stdout and f"input.path={out / 'dcp'}" in result.stdout, result.stdout


def test_another_models_checkpoint_is_refused_before_any_process_naming_the_weights(
    saved: Path, tmp_path: Path
) -> None:
    result = run_command(
        [
            sys.executable, "-m", "osdpipe",
            "checkpoint=torchtitan", "model.factory=usertp:build", f"input.path={saved / 'titan' / 'step-2'}",
            "source.kind=fsdp2", "source.world_size=4", "target.kind=fsdp2",
            "output.format=dcp", f"output.path={tmp_path / 'out'}",
        ],
        cwd=tmp_path, timeout=TIMEOUT_S, env=user_env(),
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    # the config does not describe the files: exit code 2, nothing written (docs/errors.md)
    assert result.returncode == 2 and len(lines) == 1 and str(saved / "titan" / "step-2") in lines[0], result.stderr
    assert "model.factory" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == [], "a refused run wrote something"


def test_one_wrong_weight_fails_roundtrip_and_resume_and_nothing_is_written(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline, in this process: rank 1's converted weights are spoiled in one element after rekey;
    both checks name it, nothing is committed."""
    from helpers import planned

    from osdpipe.pipeline.execute import run_offline
    from osdpipe.pipeline.stages import STAGES
    from osdpipe.run.progress import Display
    from osdpipe.spec.reconcile import settle_and_validate

    sys.path.insert(0, str(TESTS))
    spec = settle_and_validate({
        "model": {"factory": "userlm:build"}, "checkpoint": {"layout": "torchtitan"},
        "input": {"path": str(saved / "titan" / "step-2"), "format": "dcp"},
        "source": {"kind": "fsdp2", "world_size": 4}, "target": {"kind": "fsdp2", "world_size": 2},
        "output": {"path": str(tmp_path / "out"), "format": "dcp"}, "runtime": {"mode": "offline", "progress": False},
        "pipeline": {"checks": ["roundtrip", "resume"]},
    })
    assert run_offline(planned(spec), Display(False)).ok
    rekey = STAGES["rekey"]

    def rekey_then_spoil(ctx, sharded, tally):
        keyed = rekey(ctx, sharded, tally)
        if ctx.rank == 1:
            keyed.weights["blocks.1.wk.weight"].view(-1)[4] += 1
        return keyed

    monkeypatch.setitem(STAGES, "rekey", rekey_then_spoil)
    bad_spec = spec.model_copy(update={"output": spec.output.model_copy(update={"path": str(tmp_path / "bad")})})
    bad = run_offline(planned(bad_spec), Display(False))
    details = {c.name: c.detail for c in bad.checks}
    assert not bad.ok and bad.files == {}
    assert "rank 1: blocks.1.wk.weight.weights: differs from blocks.1.wk.weight[" in details["roundtrip"], (
        details["roundtrip"]
    )
    assert "rank 1: " in details["resume"] and "blocks.1.wk.weight (the parameter)" in details["resume"], (
        details["resume"]
    )
    assert not (tmp_path / "bad" / "step-2").exists() and not (tmp_path / "bad" / "manifest.json").exists()


def test_osdpipe_check_proves_a_whole_conversion_later_and_names_one_wrong_weight(
    converted: dict[str, Path], tmp_path: Path
) -> None:
    """``osdpipe check`` (the files against the manifest, every rank's parts derived again from the source) passes on
    each output, and ``--load`` loads one as its framework would and resumes; a rank file with one weight changed fails,
    naming the file and the weight."""
    import shutil

    import torch

    spoiled = tmp_path / "spoiled"
    shutil.copytree(converted["titan_rank_local_3"], spoiled)
    file = spoiled / "rank_1.pt"
    whole = torch.load(file, weights_only=True)
    whole["model"]["blocks.2.wq.weight"].view(-1)[3] += 1
    torch.save(whole, file)
    shown = ("titan_dcp_2", "titan_v01_dcp_2", "accelerate_dcp_2", "accelerate_rank_local_2", "accelerate_full_full_2")
    cases = [["check", str(converted[name])] for name in shown]
    cases += [["check", str(converted["titan_rank_local_3"]), "--load"], ["check", str(spoiled)]]
    results = run_cli_cases(cases, cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())
    for case, result in zip(cases[:-1], results[:-1]):
        assert result["code"] == 0, f"{case}: {result['stdout']}{result['stderr']}"
    loaded = results[len(shown)]["stdout"]
    assert "check resume     pass" in loaded and "from the checkpoint's own weights" in loaded
    bad = results[-1]
    assert bad["code"] == 1, bad
    assert f"{file}: ['model']['blocks.2.wq.weight']: 1 element(s) differ, first at flat index 3" in bad["stdout"], (
        bad["stdout"]
    )
    assert (
        f"{file} differs from its digest in the manifest: tensor(s) model.blocks.2.wq.weight differ" in bad["stdout"]
    ), bad["stdout"]


def _gathered(dcp_dir: Path, work: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = work / f"gathered-{dcp_dir.parent.name}-{dcp_dir.name}.pt"
    dcp_to_torch_save(str(dcp_dir), str(whole))
    return torch.load(whole, weights_only=False)


def test_torchtitan_and_accelerate_checkpoints_convert_to_pytorchs_own_layout(
    converted: dict[str, Path], saved: Path, tmp_path: Path
) -> None:
    """``output.checkpoint=pytorch``: one DCP directory of ``model`` and ``optim`` (the fixture's checks load it as a
    PyTorch job does and step it); gathered whole, the source's model and optimizer state bit for bit, torchtitan's own
    entries and the user's at the top level as stored, accelerate's other files beside ``dcp/`` byte for byte."""
    titan_source = _gathered(saved / "titan" / "step-2", tmp_path)
    titan = _gathered(converted["titan_pytorch_2"] / "dcp", tmp_path)
    assert set(titan) == {"model", "optim", *whole_jobs.TITAN_OTHER}
    _same(
        titan["model"], {k: v for k, v in titan_source.items() if k in titan["model"]}, "torchtitan -> pytorch: model"
    )
    assert set(titan["model"]) == _model_keys()
    flat = {k.removeprefix("state."): v for k, v in titan_source["optimizer"].items() if k.startswith("state.")}
    _same(
        {f"{fqn}.{name}": v for fqn, state in titan["optim"]["state"].items() for name, v in state.items()},
        flat,
        "torchtitan -> pytorch: optimizer",
    )
    for name in whole_jobs.TITAN_OTHER:
        _same(titan[name], titan_source[name], f"torchtitan -> pytorch: {name}")

    source = saved / "accelerate" / "checkpoint_0"
    accelerate = _gathered(converted["accelerate_pytorch_2"] / "dcp", tmp_path)
    assert set(accelerate) == {"model", "optim"}
    _same(
        accelerate["model"],
        _gathered(source / "pytorch_model_fsdp_0", tmp_path)["model"],
        "accelerate -> pytorch: model",
    )
    _same(
        accelerate["optim"]["state"],
        _gathered(source / "optimizer_0", tmp_path)["optimizer"]["state"],
        "accelerate -> pytorch: optimizer",
    )
    for name in whole_jobs.ACCELERATE_FILES:
        assert (converted["accelerate_pytorch_2"] / name).read_bytes() == (source / name).read_bytes(), name


def test_a_torchtitan_checkpoint_converts_to_accelerates_layout_its_own_entries_in_a_file_beside(
    converted: dict[str, Path], saved: Path, tmp_path: Path
) -> None:
    """``output.checkpoint=accelerate`` from torchtitan: ``save_state``'s two DCP directories (the fixture's checks load
    them as ``load_state`` does and step), the source's model and optimizer bit for bit; torchtitan's own entries and
    the user's, which accelerate has no place for, as their values in ``torchtitan.pt`` beside them."""
    import torch

    titan_source = _gathered(saved / "titan" / "step-2", tmp_path)
    out = converted["titan_accelerate_2"] / "dcp"
    assert sorted(p.name for p in out.iterdir()) == ["optimizer_0", "pytorch_model_fsdp_0", "torchtitan.pt"]
    model = _gathered(out / "pytorch_model_fsdp_0", tmp_path)["model"]
    assert set(model) == _model_keys()
    _same(model, {k: v for k, v in titan_source.items() if k in model}, "torchtitan -> accelerate: model")
    optimizer = _gathered(out / "optimizer_0", tmp_path)["optimizer"]
    flat = {k.removeprefix("state."): v for k, v in titan_source["optimizer"].items() if k.startswith("state.")}
    _same(
        {f"{fqn}.{name}": v for fqn, state in optimizer["state"].items() for name, v in state.items()},
        flat,
        "torchtitan -> accelerate: optimizer",
    )
    carried = torch.load(out / "torchtitan.pt", weights_only=True)
    assert set(carried) == set(whole_jobs.TITAN_OTHER)
    for name in whole_jobs.TITAN_OTHER:
        _same(carried[name], titan_source[name], f"torchtitan -> accelerate: {name}")


@pytest.mark.parametrize("name,folder", [("titan_dcp_2", "step-2"), ("titan_pytorch_2", "dcp")])
def test_osdpipe_check_proves_a_whole_dcp_output_and_finds_one_changed_element(
    converted: dict[str, Path], tmp_path: Path, name: str, folder: str
) -> None:
    """``osdpipe check`` compares the step folder (torchtitan) or dcp/ (PyTorch's layout) with its source, model,
    optimizer and carried items; a copy with one element of the model changed (its bytes, and the manifest's digests,
    rewritten to hide it) fails."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    def check(directory: Path) -> tuple[int, str]:
        done = run_command(
            [sys.executable, "-m", "osdpipe", "check", str(directory)], cwd=tmp_path, timeout=TIMEOUT_S, env=user_env()
        )
        return done.returncode, done.stdout + done.stderr

    code, said = check(converted[name])
    assert code == 0 and "check roundtrip  pass" in said, said
    changed = tmp_path / name
    shutil.copytree(converted[name], changed)
    target = changed / folder
    reader = dcp.FileSystemReader(str(target))
    key = next(k for k in reader.read_metadata().state_dict_metadata if k.endswith("embed.weight"))
    state = {key: torch.empty(reader.read_metadata().state_dict_metadata[key].size)}
    dcp.load(state, storage_reader=reader)
    manifest = json.loads((changed / "manifest.json").read_text())
    for item in sorted(target.glob("*.distcp")):  # find the element's bytes in the data files and change them in place
        data = bytearray(item.read_bytes())
        at = data.find(state[key].reshape(-1)[:4].numpy().tobytes())
        if at >= 0:
            data[at] ^= 0x40
            item.write_bytes(bytes(data))
            manifest["files"].pop(f"{folder}/{item.name}", None)  # the files check is not what this test is about
            break
    else:
        raise AssertionError(f"no data file holds {key}'s first elements")
    (changed / "manifest.json").write_text(json.dumps(manifest))
    code, said = check(changed)
    assert code == 1 and "check roundtrip  FAIL" in said and "embed.weight" in said, said
