"""Real DeepSpeed saves ZeRO checkpoints, the ``osdpipe`` command converts them for PyTorch jobs (issue 31).

DeepSpeed 0.19.8 trains the tests' own model (:mod:`frameworks.ds_job`: odd
sizes so ZeRO's padding shows, two param groups, a persistent buffer, tied
embeddings or not) on 2 or 4 CPU ranks, for each ZeRO stage in fp32 and bf16
(:data:`SAVES`), and calls ``engine.save_checkpoint``; the same job gathers
what it held at that moment through DeepSpeed's own API (:mod:`frameworks.ds`)
and runs DeepSpeed's own ``ds_to_universal`` on the save. One launch makes
every save of a world size, one after the other (:func:`saves`).

osdpipe reads the save folder without DeepSpeed's code and writes, in PyTorch's
layout (``checkpoint=deepspeed``: model and optimizer), each save for FSDP2 on
one world and, as a torchtitan step folder, on the other (2 and 3 ranks, the
pairs alternating over the saves, :data:`WORLDS` says why), one save also for
DDP (:data:`TARGETS`), one with the model as safetensors; one save's optimizer
alone (``input.format=deepspeed``, found by itself). Its own checks load each
output into that job (``set_model_state_dict``, ``set_optimizer_state_dict``)
and step it. The other frameworks load what osdpipe writes for them: every
torchtitan step folder, which torchtitan's own ``CheckpointManager`` loads
(:mod:`frameworks.titan_load`); an accelerate folder, which accelerate's own
``load_state`` loads; every save as one plain file, which plain torch loads.
The asked-for ``universal`` check runs DeepSpeed's own ``ds_to_universal``.
``osdpipe inspect`` prints a command that runs as printed, and two saves
copied to S3 convert as their local copies do.

The output, gathered whole, holds bit for bit, under each parameter's name:
DeepSpeed's fp32 master weights as the model's weights (not the bf16 copy),
the module's buffer, the moments and the step, DeepSpeed's param groups, and
its ``lr_scheduler`` and ``global_steps`` carried under their own names. The
truth is DeepSpeed's API and its own ``ds_to_universal`` output (where the API
has no moments: in stage 1/2 DeepSpeed links them after the first group's
first step, so the second group's never are; see :mod:`frameworks.ds_job`).
Each bad input gets one line and leaves no output.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from frameworks import ds, titan_load
from frameworks.launch import run_logged, torchrun, worker_env
from helpers import run_cli_cases, run_command, user_env

from osdpipe.io.formats.deepspeed import ZeroReader
from osdpipe.io.output import conversion_entries

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

#: The saves issue 31 names: each ZeRO stage, fp32 and bf16, on 2 and 4 ranks,
#: with tied embeddings on and off between them.
SAVES = {
    "zero1-bf16-4": {"stage": 1, "dtype": "bf16", "tied": False, "ranks": 4},
    "zero2-fp32-4": {"stage": 2, "dtype": "fp32", "tied": True, "ranks": 4},
    "zero2-bf16-2": {"stage": 2, "dtype": "bf16", "tied": True, "ranks": 2},
    "zero3-fp32-2": {"stage": 3, "dtype": "fp32", "tied": False, "ranks": 2},
    "zero3-bf16-4": {"stage": 3, "dtype": "bf16", "tied": True, "ranks": 4},
}
#: Each save's two FSDP2 target worlds, ``(whole, titan)``: that of its conversion in PyTorch's layout (:data:`TARGETS`)
#: and that of its torchtitan step folder (:data:`CONVERSIONS`). Both outputs are compared bit for bit with DeepSpeed's
#: state (masters, moments, steps, param groups, buffer, its own entries) and pass osdpipe's four checks, so with the
#: two worlds different every save is written for FSDP2 on 2 and on 3 ranks, once each (it was twice: PyTorch's layout
#: for both worlds, besides torchtitan's). The layout math cuts the source's partitions (stage 1/2: flat groups; stage
#: 3: per parameter; on 2 or 4 ranks; the dtype plays no part) into the target's shards. The worlds alternate over the
#: saves so that the conversion to PyTorch's layout alone still writes each source kind and each source world for both
#: target worlds: stage 1/2 for 2 (zero2-fp32-4) and 3 (zero1-bf16-4, zero2-bf16-2), stage 3 for 2 (zero3-fp32-2) and 3
#: (zero3-bf16-4), 4 ranks for 2 (zero2-fp32-4) and 3 (zero1-bf16-4, zero3-bf16-4), 2 ranks for 2 (zero3-fp32-2) and 3
#: (zero2-bf16-2); and torchtitan's own load, on 2 ranks, takes a tied and an untied model written for 2 (zero2-bf16-2,
#: zero3-bf16-4; zero1-bf16-4) and for 3, resharding them (zero2-fp32-4; zero3-fp32-2).
WORLDS = {"zero1-bf16-4": (3, 2), "zero2-fp32-4": (2, 3), "zero2-bf16-2": (3, 2), "zero3-fp32-2": (2, 3),
          "zero3-bf16-4": (3, 2)}  # fmt: skip
#: What each save converts to in PyTorch's layout: FSDP2 on its :data:`WORLDS` (DCP), one with the model as
#: safetensors beside it; and one save to DDP's rank files (each the whole model and optimizer, as a plain job saves
#: them) with the model as safetensors.
TARGETS = {
    **{
        f"{name}-fsdp2-{whole}": (
            name, ["target.kind=fsdp2", f"target.world_size={whole}", "output.checkpoint=pytorch"]
        )
        for name, (whole, _) in WORLDS.items()
    },
    "zero2-fp32-4-ddp-2": (
        "zero2-fp32-4",
        ["target.kind=ddp", "target.world_size=2", "output.format=rank_local", "output.model_format=safetensors"],
    ),
}
TARGETS["zero3-bf16-4-fsdp2-3"][1].append("output.model_format=safetensors")
#: A ZeRO-3 fp32 save on 2 ranks, as ``zero3-fp32-2`` but of a model of other sizes (same stage, same world,
#: partitions of other lengths): for :func:`_damaged`'s "rank file of another model".
OTHER_MODEL = {"stage": 3, "dtype": "fp32", "tied": False, "dim": 12, "hidden": 20, "steps": 1, "ranks": 2}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _gathered(dcp_dir: Path, work: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = work / "gathered.pt"
    dcp_to_torch_save(str(dcp_dir), str(whole))
    return torch.load(whole, weights_only=True)


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> dict[str, Path]:
    """Each of :data:`SAVES` and ``other-model`` (:data:`OTHER_MODEL`), trained and saved once for the module, with
    DeepSpeed's own universal checkpoint beside it.

    One DeepSpeed launch per world size (:func:`frameworks.ds.save_all`), not one per save: a launch's imports, on
    every rank, take longer than its save (``ds_job.main``). On two cores, within the same hour, the six launches and
    five runs of ``ds_to_universal`` these two replace took 265 s, the two 84 s. Each save is still made from a fresh
    seed, model and engine (``ds_job.train_and_save``)."""
    root = tmp_path_factory.mktemp("deepspeed")
    specs = {**SAVES, "other-model": OTHER_MODEL}
    made = {}
    for ranks in sorted({spec["ranks"] for spec in specs.values()}, reverse=True):
        names = [name for name, spec in specs.items() if spec["ranks"] == ranks]
        jobs = [
            {"steps": 2, **{k: v for k, v in specs[name].items() if k != "ranks"}, "out": str(root / name)}
            for name in names
        ]
        made.update(zip(names, ds.save_all(root, ranks, jobs), strict=True))
    return made


ALL_CHECKS = ("roundtrip", "reference", "load_step", "resume")


def _argv(folder: Path, out: Path, *extra: str) -> list[str]:
    """The ``osdpipe`` command's overrides for the save ``folder``, with the job's own model
    (FSDP2 on 3 ranks, DCP, unless ``extra`` says)."""
    tied = str(SAVES[folder.name]["tied"]).lower()
    return [f"input.path={folder}", "model.factory=frameworks.ds_job:DsLM", f"+model.kwargs.tied={tied}",
            "target.kind=fsdp2", "target.world_size=3", "output.format=dcp", f"output.path={out}", *extra]


def _passed(out: Path, code: int | str, said: str, checks: tuple[str, ...] = ALL_CHECKS) -> dict:
    """The report of a conversion into ``out`` that exited ``code`` (``said``: its stderr), which every check
    (``checks``: those that run) passed."""
    assert code == 0, said[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert {c["name"]: c["ok"] for c in report["checks"]} == dict.fromkeys(checks, True), report["checks"]
    return report


#: The ``universal`` check, asked for where a test names it: DeepSpeed's own ``ds_to_universal``, run by osdpipe.
WITH_UNIVERSAL = (*ALL_CHECKS, "universal")
#: Every conversion of a local save (the ``osdpipe`` command's overrides after :func:`_argv`'s), run by
#: :func:`converted` in one driver process: each save to PyTorch's layout (:data:`TARGETS`), to one plain file and to a
#: torchtitan step folder (:data:`WORLDS`); the optimizer alone; an accelerate folder. ``(save, overrides)`` by case.
CONVERSIONS = {
    **{
        f"whole/{target}": (name, ["checkpoint=deepspeed", *overrides])
        for target, (name, overrides) in TARGETS.items()
    },
    **{
        f"plain/{name}": (
            name,
            [
                "checkpoint=deepspeed", "target.kind=none", "target.world_size=1",
                "output.format=plain", "output.model_format=safetensors",
            ],
        )
        for name in SAVES
    },
    **{
        f"titan/{name}": (name, ["checkpoint=deepspeed", "output.checkpoint=torchtitan", f"target.world_size={titan}"])
        for name, (_, titan) in WORLDS.items()
    },
    # input.format=deepspeed, found by itself; checkpoint=optimizer
    "optimizer/zero3-fp32-2": ("zero3-fp32-2", []),
    "accelerate/zero2-bf16-2": (
        "zero2-bf16-2",
        [
            "checkpoint=deepspeed", "output.checkpoint=accelerate", "target.world_size=2",
            f"pipeline.checks=[{','.join(WITH_UNIVERSAL)}]",
        ],
    ),
}


@pytest.fixture(scope="module")
def converted(saves: dict[str, Path], tmp_path_factory) -> dict[str, tuple[Path, int | str, str]]:
    """Each of :data:`CONVERSIONS` through the ``osdpipe`` entry point, all in one driver process (torch imported, the
    ranks' fork server started, once; a command of its own took about 5 s more each): case -> its output directory, exit
    code and stderr."""
    root = tmp_path_factory.mktemp("converted")
    outs = {case: root / case.replace("/", "-") for case in CONVERSIONS}
    argv = [_argv(saves[name], outs[case], *overrides) for case, (name, overrides) in CONVERSIONS.items()]
    results = run_cli_cases(argv, cwd=root, per_case_s=400, env=user_env())
    return {case: (outs[case], r["code"], r["stderr"]) for case, r in zip(CONVERSIONS, results)}


def _assert_the_optimizer_is_deepspeeds(got: dict, truth: dict, universal: Path) -> None:
    assert set(got["state"]) == set(truth["state"]), "every optimized parameter, tied ones once"
    wrong = [
        f"{fqn}.{key}"
        for fqn, want in truth["state"].items()
        for key in ("exp_avg", "exp_avg_sq")
        if got["state"][fqn][key].shape != want[key].shape
        or not torch.equal(_bits(got["state"][fqn][key]), _bits(want[key]))
    ]
    assert wrong == []
    assert all(float(got["state"][fqn]["step"]) == float(want["step"]) for fqn, want in truth["state"].items())
    groups = [(sorted(g["params"]), g["weight_decay"], g["lr"]) for g in got["param_groups"]]
    assert groups == [(sorted(g["params"]), g["weight_decay"], g["lr"]) for g in truth["param_groups"]]
    # and DeepSpeed's own ds_to_universal, which stores each state per parameter
    for fqn, state in got["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            stored = torch.load(universal / "zero" / fqn / f"{key}.pt", weights_only=False)
            want = stored["param"] if isinstance(stored, dict) else stored  # stage 3 writes it flat
            assert torch.equal(_bits(state[key]), _bits(want.reshape(state[key].shape))), (
                f"{fqn}.{key} differs from ds_to_universal's"
            )


def _by_name(rank_file: dict, groups: list[dict]) -> dict:
    """A DDP job's rank file, its optimizer keyed by parameter name: as ``optim.state_dict()`` numbers them, each
    group's IDs are its parameters in the order the job gave them (``groups``: the job's param groups, by name)."""
    osd = rank_file["optim"]
    names = {
        i: name
        for mine, theirs in zip(osd["param_groups"], groups, strict=True)
        for i, name in zip(mine["params"], theirs["params"], strict=True)
    }
    return {
        **rank_file,
        "optim": {
            "state": {names[i]: s for i, s in osd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]],
        },
    }


def _assert_the_model_is_deepspeeds(model: dict, truth: dict, universal: Path) -> None:
    """``model`` (a state dict by name) holds DeepSpeed's fp32 masters, bit for bit, as its dump and its own
    ``ds_to_universal`` hold them."""
    assert [fqn for fqn, want in truth["fp32"].items() if not torch.equal(_bits(model[fqn]), _bits(want))] == []
    for fqn in truth["fp32"]:
        fp32 = torch.load(universal / "zero" / fqn / "fp32.pt", weights_only=False)
        fp32 = fp32["param"] if isinstance(fp32, dict) else fp32
        assert torch.equal(_bits(model[fqn]), _bits(fp32.reshape(model[fqn].shape))), (
            f"{fqn} differs from ds_to_universal's fp32"
        )


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_zero_save_converts_whole_with_deepspeeds_state_bit_for_bit(
    tmp_path: Path, saves: dict[str, Path], converted: dict, target: str
) -> None:
    name, overrides = TARGETS[target]
    folder = saves[name]
    truth = torch.load(ds.dump_path(folder), weights_only=False)
    universal = ds.universal_path(folder) / ds.latest_tag(folder)
    out, code, said = converted[f"whole/{target}"]
    report = _passed(out, code, said)
    if (out / "dcp").is_dir():
        got = _gathered(out / "dcp", tmp_path)
    else:  # DDP's rank files: every rank the whole state
        assert sorted(p.name for p in out.glob("rank_*.pt")) == ["rank_0.pt", "rank_1.pt"]
        got = _by_name(torch.load(out / "rank_1.pt", weights_only=True), truth["param_groups"])
    _assert_the_optimizer_is_deepspeeds(got["optim"], truth, universal)

    # the model's weights are DeepSpeed's fp32 masters (training moved every one: in bf16 they are not the module's
    # copy), under every name
    assert all(not torch.equal(truth["fp32"][fqn], truth["initial"][fqn].float()) for fqn in truth["fp32"])
    model = got["model"]
    assert set(model) == set(truth["module"]), "the model's state dict: a tied weight under both names, the buffer"
    _assert_the_model_is_deepspeeds(model, truth, universal)
    if SAVES[name]["tied"]:
        assert torch.equal(model["head.weight"], model["tok.weight"])
    assert torch.equal(_bits(model["pos"]), _bits(truth["module"]["pos"]))

    # DeepSpeed's own entries a PyTorch job has no place for are carried under their names;
    # those of its own layout are named as left out
    assert got["lr_scheduler"] == truth["lr_scheduler"] and got["global_steps"] == truth["global_steps"] == 2
    fates = {e["name"]: e["fate"] for e in report["entries"]}
    assert (
        fates["param_shapes"].startswith("left out")
        and fates["module"].startswith("left out")
        and fates["lr_scheduler"].startswith("carried")
    )
    if "output.model_format=safetensors" in overrides:
        from safetensors.torch import load_file

        exported = load_file(out / "model.safetensors")
        assert [
            fqn for fqn, want in truth["fp32"].items() if fqn in exported and not torch.equal(exported[fqn], want)
        ] == []
        assert set(exported) == set(truth["module"]) - {"head.weight"}, (
            "a tied weight once, as save_pretrained stores it"
        )


def _unflattened(optimizer: dict, groups: list[dict]) -> dict:
    """torchtitan's flattened optimizer entry (``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyperparameter>``) as a
    state dict keyed by FQN, its param groups those of ``groups`` (DeepSpeed's) with the hyperparameters the entry gives
    their first parameter."""
    state: dict = {}
    for key, value in optimizer.items():
        if key.startswith("state."):
            fqn, _, name = key.removeprefix("state.").rpartition(".")
            state.setdefault(fqn, {})[name] = value
    hyper = ("lr", "weight_decay")
    return {
        "state": state,
        "param_groups": [
            {**{h: optimizer[f"param_groups.{g['params'][0]}.{h}"] for h in hyper}, "params": g["params"]}
            for g in groups
        ],
    }




@pytest.mark.parametrize("name", list(WORLDS))
def test_a_zero_save_becomes_a_torchtitan_step_folder_of_its_step(
    tmp_path: Path, saves: dict[str, Path], converted: dict, name: str
) -> None:
    """``output.checkpoint=torchtitan``: one ``step-<N>`` folder of DeepSpeed's ``global_steps``, the model at the top
    level, the optimizer flattened, DeepSpeed's own entries under ``deepspeed``, where torchtitan's ``lr_scheduler``
    would take them for its own; and the run says what torchtitan needs to load a step folder without its dataloader,
    lr_scheduler and train_state."""
    folder = saves[name]
    truth = torch.load(ds.dump_path(folder), weights_only=False)
    out, code, said = converted[f"titan/{name}"]
    report = _passed(out, code, said)
    step = out / f"step-{truth['global_steps']}"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [step.name]
    got = _gathered(step, tmp_path)
    assert [fqn for fqn, want in truth["fp32"].items() if not torch.equal(_bits(got[fqn]), _bits(want))] == [], (
        "the fp32 masters, at the top level"
    )
    assert torch.equal(_bits(got["pos"]), _bits(truth["module"]["pos"]))
    _assert_the_optimizer_is_deepspeeds(
        _unflattened(got["optimizer"], truth["param_groups"]), truth, ds.universal_path(folder) / ds.latest_tag(folder)
    )
    assert (
        got["deepspeed"]["lr_scheduler"] == truth["lr_scheduler"]
        and got["deepspeed"]["global_steps"] == truth["global_steps"]
    )
    assert not {"lr_scheduler", "dataloader", "train_state"} & set(got), "torchtitan's own entries are not made up"
    fates = {e["name"]: e["fate"] for e in report["entries"]}
    assert fates["lr_scheduler"].startswith("carried over unchanged, under 'deepspeed'")
    assert any(
        "--checkpoint.exclude-from-loading dataloader,lr_scheduler,train_state" in w for w in report["warnings"]
    ), report["warnings"]

    # torchtitan's own CheckpointManager, so told, loads it into an FSDP2 job of the same model on 2 ranks, which takes
    # a step
    loaded = _torchtitan_loads(out, truth, name, tmp_path)
    assert loaded["found"] and loaded["step"] == 0 and math.isfinite(loaded["loss"])
    assert [
        fqn for fqn, want in truth["fp32"].items() if not torch.equal(_bits(loaded["model"][fqn]), _bits(want))
    ] == []
    _assert_the_optimizer_is_deepspeeds(loaded["optim"], truth, ds.universal_path(folder) / ds.latest_tag(folder))


def test_a_zero_save_becomes_an_accelerate_folder_that_load_state_reads(
    tmp_path: Path, saves: dict[str, Path], converted: dict
) -> None:
    """``output.checkpoint=accelerate``: ``save_state``'s SHARDED folder for FSDP2 on 2 ranks, DeepSpeed's own entries
    in ``deepspeed.pt`` beside it; accelerate 1.15's own ``load_state``, in a fresh FSDP2 job of the same model and
    param groups (no scheduler, as the run says), loads DeepSpeed's masters and optimizer state bit for bit and takes a
    step."""
    from frameworks import accel

    name = "zero2-bf16-2"
    folder = saves[name]
    truth = torch.load(ds.dump_path(folder), weights_only=False)
    out, code, stderr = converted[f"accelerate/{name}"]
    # and DeepSpeed's own ds_to_universal, run by the check
    report = _passed(out, code, stderr, WITH_UNIVERSAL)
    assert sorted(p.name for p in (out / "dcp").iterdir()) == ["deepspeed.pt", "optimizer_0", "pytorch_model_fsdp_0"]
    carried = torch.load(out / "dcp" / "deepspeed.pt", weights_only=True)
    assert carried["lr_scheduler"] == truth["lr_scheduler"] and carried["global_steps"] == truth["global_steps"]
    assert any("call load_state before preparing a scheduler" in w for w in report["warnings"]), report["warnings"]
    said = next(c["detail"] for c in report["checks"] if c["name"] == "universal")
    # where DeepSpeed's own output is wrong
    assert "writes head.weight, a tied name, from the module's bfloat16 copy" in said, said

    job = {
        "model": "frameworks.ds_job:DsLM",
        "kwargs": {"tied": SAVES[name]["tied"]},
        "wrap": "DsBlock",
        "groups": [
            [g["params"], {k: g[k] for k in ("lr", "betas", "eps", "weight_decay")}] for g in truth["param_groups"]
        ],
    }
    loaded = accel.load(
        tmp_path,
        2,
        out / "dcp",
        fsdp_version=2,
        state_dict_type="SHARDED_STATE_DICT",
        tied=SAVES[name]["tied"],
        job=job,
    )
    assert [
        fqn for fqn, want in truth["fp32"].items() if not torch.equal(_bits(loaded["model"][fqn]), _bits(want))
    ] == []
    assert torch.equal(_bits(loaded["model"]["pos"]), _bits(truth["module"]["pos"]))
    _assert_the_optimizer_is_deepspeeds(loaded["optim"], truth, ds.universal_path(folder) / ds.latest_tag(folder))


def test_the_universal_check_finds_one_element_that_is_not_deepspeeds(saves: dict[str, Path]) -> None:
    """The ``universal`` check's comparison: the state DeepSpeed's job held equals its ``ds_to_universal`` output (stage
    3 stores it flat, stage 2 shaped); one element changed, one parameter missing or one too many are each found."""
    from osdpipe.io.formats.ds_universal import universal_differences

    for name in ("zero2-fp32-4", "zero3-fp32-2"):
        folder = saves[name]
        truth = torch.load(ds.dump_path(folder), weights_only=False)
        universal = ds.universal_path(folder) / ds.latest_tag(folder)
        # every name (a tied head, the buffer), the masters where there are
        weights = {**truth["module"], **truth["fp32"]}
        assert universal_differences(universal, weights, truth["state"]) == ([], []), name
        fqn = next(iter(truth["state"]))
        moved = {
            **truth["state"], fqn: {**truth["state"][fqn], "exp_avg_sq": truth["state"][fqn]["exp_avg_sq"].clone()}
        }
        moved[fqn]["exp_avg_sq"].view(-1)[3] += 1e-3
        found, _ = universal_differences(universal, weights, moved)
        assert len(found) == 1 and f"{fqn}.exp_avg_sq" in found[0], found
        assert any(
            f"has {fqn}'s exp_avg, which osdpipe did not read" in p
            for p in universal_differences(universal, weights, {k: v for k, v in truth["state"].items() if k != fqn})[0]
        )
        assert any("extra.weight's optimizer state, which ds_to_universal has not" in p
                   for p in universal_differences(universal, weights, {**truth["state"], "extra.weight": {}})[0])


def _torchtitan_loads(folder: Path, truth: dict, name: str, work: Path) -> dict:
    """What torchtitan's ``CheckpointManager`` (``--checkpoint.folder`` ``folder``, without dataloader, lr_scheduler and
    train_state) loads into a 2-rank FSDP2 job of the DeepSpeed job's model and param groups
    (:mod:`frameworks.titan_load`)."""
    groups = [
        [
            "^(" + "|".join(re.escape(fqn) for fqn in g["params"]) + ")$",
            {k: g[k] for k in ("lr", "betas", "eps", "weight_decay")},
        ]
        for g in truth["param_groups"]
    ]
    spec = {
        "folder": str(folder),
        "model": "frameworks.ds_job:DsLM",
        "kwargs": {"tied": SAVES[name]["tied"]},
        "groups": groups,
        "exclude": ["dataloader", "lr_scheduler", "train_state"],
        "dump": str(work / "titan_loaded.pt"),
    }
    run_logged(
        torchrun(2, Path(titan_load.__file__), spec),
        work,
        label="titan-load",
        timeout=300,
        what="torchtitan's load of",
        env=worker_env(),
    )
    return torch.load(spec["dump"], weights_only=False)


@pytest.mark.parametrize("name", list(SAVES))
def test_a_zero_save_becomes_one_plain_file_that_a_single_process_job_loads(
    saves: dict[str, Path], converted: dict, name: str
) -> None:
    """One process, no wrapper (``target.kind=none output.format=plain``): ``rank_0.pt`` is what a plain job
    ``torch.save``s, ``{"model": model.state_dict(), "optim": optim.state_dict(), ...}``, with the model as safetensors
    beside it. The job's own model takes the weights strictly and its own AdamW the optimizer state, DeepSpeed's bit for
    bit."""
    from frameworks.ds_job import DsLM, param_groups
    from safetensors.torch import load_file

    folder = saves[name]
    truth = torch.load(ds.dump_path(folder), weights_only=False)
    out, code, said = converted[f"plain/{name}"]
    _passed(out, code, said)
    saved = torch.load(out / "rank_0.pt", weights_only=True)
    model = DsLM(tied=SAVES[name]["tied"])
    model.load_state_dict(saved["model"], strict=True)
    groups, _ = param_groups(model)
    optim = torch.optim.AdamW(groups)
    optim.load_state_dict(saved["optim"])
    assert [fqn for fqn, p in model.named_parameters() if not torch.equal(_bits(p), _bits(truth["fp32"][fqn]))] == []
    by_name = {fqn: optim.state[p] for fqn, p in model.named_parameters()}
    assert [fqn for fqn, want in truth["state"].items() for key in ("exp_avg", "exp_avg_sq", "step")
            if not torch.equal(_bits(by_name[fqn][key]), _bits(want[key].to(by_name[fqn][key].dtype)))] == []
    assert [g["weight_decay"] for g in optim.param_groups] == [g["weight_decay"] for g in truth["param_groups"]]
    assert saved["lr_scheduler"] == truth["lr_scheduler"] and saved["global_steps"] == truth["global_steps"]
    exported = load_file(out / "model.safetensors")
    assert [fqn for fqn, want in truth["fp32"].items() if not torch.equal(exported[fqn], want)] == []
    # and DeepSpeed's own ds_to_universal, tensor by tensor
    universal = ds.universal_path(folder) / ds.latest_tag(folder)
    _assert_the_optimizer_is_deepspeeds(_by_name(saved, truth["param_groups"])["optim"], truth, universal)
    _assert_the_model_is_deepspeeds(saved["model"], truth, universal)


def test_the_optimizer_alone_converts_and_the_masters_read_are_deepspeeds(
    tmp_path: Path, saves: dict[str, Path], converted: dict
) -> None:
    """No ``checkpoint=``: ``input.format=deepspeed`` is found from the files, and the optimizer alone is converted (for
    FSDP2 on 3 ranks); osdpipe's reader gives DeepSpeed's fp32 masters bit for bit."""
    folder = saves["zero3-fp32-2"]
    truth = torch.load(ds.dump_path(folder), weights_only=False)
    out, code, said = converted["optimizer/zero3-fp32-2"]
    _passed(out, code, said)
    got = _gathered(out / "dcp", tmp_path)
    assert list(got) == ["optim"], "the optimizer alone"
    _assert_the_optimizer_is_deepspeeds(got["optim"], truth, ds.universal_path(folder) / ds.latest_tag(folder))
    reader = ZeroReader(str(folder))
    masters = reader.read([(fqn, "fp32") for fqn in truth["fp32"]])
    assert [
        fqn for fqn, want in truth["fp32"].items() if not torch.equal(_bits(masters[(fqn, "fp32")]), _bits(want))
    ] == []


@pytest.fixture(scope="module")
def other_model(saves: dict[str, Path]) -> Path:
    """The save of :data:`OTHER_MODEL`, made in the launch of the other 2-rank saves."""
    return saves["other-model"]


def _damaged(kind: str, folder: Path, other: Path, other_model: Path) -> None:
    """Damage the copy ``folder`` of a 2-rank fp32 ZeRO-3 save as ``kind`` says (``other``: a save of another stage;
    ``other_model``: of another model)."""
    tag = folder / ds.latest_tag(folder)
    rank1 = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if kind == "missing rank file":
        rank1.unlink()
    elif kind == "truncated rank file":
        rank1.write_bytes(rank1.read_bytes()[: rank1.stat().st_size // 2])
    elif kind == "latest names no folder":
        (folder / "latest").write_text("global_step9")
    elif kind == "ranks of two saves":
        other_tag = other / ds.latest_tag(other)
        shutil.copy(next(other_tag.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")), rank1)
    elif kind == "rank file of another model":
        shutil.copy(other_model / ds.latest_tag(other_model) / rank1.name, rank1)
    elif kind == "tensor parallel":
        states = next(tag.glob("*mp_rank_00_model_states.pt"))  # stage 3: zero_pp_rank_0_mp_rank_00_model_states.pt
        shutil.copy(states, tag / states.name.replace("mp_rank_00", "mp_rank_01"))


#: Each bad input, and what its one line must say.
DAMAGE = {
    "missing rank file": "records a world of 2 rank(s), but the folder holds 1",
    "truncated rank file": "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "latest names no folder": "names 'global_step9', which is not a folder",
    "ranks of two saves": "mixes files of different saves",
    "rank file of another model": "the file is not of this save",
    "tensor parallel": "not yet",
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_bad_save_gets_one_line_and_leaves_no_output(
    tmp_path: Path, saves: dict[str, Path], other_model: Path, kind: str
) -> None:
    folder = tmp_path / "zero3-fp32-2"
    shutil.copytree(saves["zero3-fp32-2"], folder)
    _damaged(kind, folder, saves["zero2-fp32-4"], other_model)
    out = tmp_path / "out"
    done = run_command(
        [
            sys.executable, "-m", "osdpipe", "checkpoint=deepspeed", f"input.path={folder}",
            "model.factory=frameworks.ds_job:DsLM", "+model.kwargs.tied=false",
            "target.kind=fsdp2", "target.world_size=2", f"output.path={out}",
        ],
        cwd=tmp_path, timeout=300, env=user_env(),
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and lines, done.stdout[-2000:]
    errors = [line for line in lines if "error" in line]
    assert len(errors) == 1 and DAMAGE[kind] in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not out.exists() or conversion_entries(out) == [], "nothing is committed"


def test_inspects_command_runs_as_printed_with_the_model_built_from_the_files(
    tmp_path: Path, saves: dict[str, Path]
) -> None:
    """No model.factory: the files name every parameter, shape and buffer. The command ``inspect`` prints runs with only
    the target's world and the output filled in; the output is DeepSpeed's state bit for bit and loads, strictly, into
    the job's own model."""
    from frameworks.ds_job import DsLM

    folder = saves["zero2-bf16-2"]
    shown = run_command(
        [sys.executable, "-m", "osdpipe", "inspect", str(folder), "--json"], cwd=tmp_path, timeout=300, env=user_env()
    )
    assert shown.returncode == 0, shown.stderr
    command = json.loads(shown.stdout)["checkpoint"]["command"]
    assert "model.factory" not in command and command.startswith("osdpipe checkpoint=deepspeed "), command
    out = tmp_path / "out"
    args = command.replace("target.world_size=M", "target.world_size=3").replace("OUT_DIR", str(out)).split()[1:]
    done = run_command([sys.executable, "-m", "osdpipe", *args], cwd=tmp_path, timeout=400, env=user_env())
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert {c["name"]: c["ok"] for c in report["checks"]} == {
        "roundtrip": True, "reference": True, "load_step": True, "resume": True
    }
    conversion = json.loads((out / "manifest.json").read_text())["conversion"]
    assert (
        conversion["target"]["kind"] == "fsdp2"
        and conversion["model"]["factory"] == "osdpipe.io.checkpoints.deepspeed:saved_model"
    )
    truth = torch.load(ds.dump_path(folder), weights_only=False)
    got = _gathered(out / "dcp", tmp_path)
    _assert_the_optimizer_is_deepspeeds(got["optim"], truth, ds.universal_path(folder) / ds.latest_tag(folder))
    model = DsLM(tied=True)
    model.load_state_dict(got["model"], strict=True)  # the job's own model takes every name, shape and dtype
    assert [fqn for fqn, p in model.named_parameters() if not torch.equal(_bits(p), _bits(truth["fp32"][fqn]))] == []


def test_a_zero_save_in_s3_converts_whole_byte_for_byte_as_its_local_copy(
    saves: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's own ZeRO-2 bf16 and ZeRO-3 saves, copied into a bucket of an S3 server on 127.0.0.1 (moto's), convert
    from ``s3://`` (``latest`` followed, every file read by its records' ranges) into the bytes their local copies
    convert into; DeepSpeed's ``ds_to_universal`` cannot read a URL, so ``universal`` says it did not run."""
    from cloud.cloudenv import s3_bucket

    with s3_bucket(monkeypatch, tmp_path) as bucket:
        cases: dict[str, list[str]] = {}
        for name in ("zero2-bf16-2", "zero3-bf16-4"):
            bucket.fs().put(f"{saves[name]}/", f"{bucket.bucket}/{name}/", recursive=True)
            checks = "pipeline.checks=[roundtrip,reference,load_step,resume,universal]"
            for side, where in (("local", str(saves[name])), ("s3", bucket.url(name))):
                out = tmp_path / f"{name}-{side}"
                cases[f"{name}-{side}"] = [
                    *_argv(saves[name], out, "checkpoint=deepspeed", "target.world_size=2", checks)[1:],
                    f"input.path={where}",
                ]
        results = dict(zip(cases, run_cli_cases(list(cases.values()), cwd=tmp_path, per_case_s=400, env=user_env()),
                           strict=True))  # fmt: skip
    for name in ("zero2-bf16-2", "zero3-bf16-4"):
        local, remote = results[f"{name}-local"], results[f"{name}-s3"]
        assert local["code"] == 0 and remote["code"] == 0, (local["stderr"], remote["stderr"])

        def files(directory: Path) -> dict[str, bytes]:
            return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
                    if p.is_file() and p.name not in ("report.json", "osdpipe.log", "manifest.json")}  # fmt: skip

        assert files(tmp_path / f"{name}-local") == files(tmp_path / f"{name}-s3")
        report = json.loads((tmp_path / f"{name}-s3" / "report.json").read_text())
        ran = {c["name"]: c["ok"] for c in report["checks"]}
        assert ran == {"roundtrip": True, "reference": True, "load_step": True, "resume": True}, report["checks"]
        assert any("universal" in w and "local disk" in w for w in report.get("warnings", [])), report.get("warnings")
