"""Offline conversion (``runtime.mode=offline``) through the ``osdpipe`` command, held against real FSDP.

A user's model (``userlm:build``) trains unwrapped and its full, FQN-keyed
optimizer state is the input. One process writes every rank's file of a
64- and a 1024-rank target, FSDP1 and FSDP2, with no process group. Then,
independently of osdpipe:

* gathered back, the files are the source: FSDP2's dim-0 chunks concatenate
  to each full ``exp_avg``; every FSDP1 rank equals real FSDP's;
* rank 0, a middle rank and the last equal what real FSDP builds for those
  ranks on PyTorch's fake process group (``fake_rank_files.py``: the model's
  parameters set to the source's ``exp_avg``, so FSDP's own cut of them is
  the expected state);
* the same conversion to 4 ranks online and offline gives byte-identical
  files, ``dcp`` checkpoints included; a 64-rank ``dcp`` checkpoint written
  offline resumes on a real 2-rank FSDP2 world (``fsdp2_resume.py``), as
  does an ``fsdp_full`` output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import fsdp2_resume
import pytest
import torch
from helpers import manifest_digests_hold, run_cli_cases, run_command, user_env
from oracle_probe import spawn_world

from osdpipe.core.compare import diff

TESTS = Path(__file__).resolve().parents[1] / "support"
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def full_source(tmp_path_factory) -> Path:
    """The user's unwrapped job: 2 Adam steps on token IDs; its state keyed by FQN, as an fsdp_full file."""
    import userlm

    return userlm.save_trained(tmp_path_factory.mktemp("user_job") / "optim.pt", steps=2)


#: Every conversion this module checks, run up front in one driver process (one rank server, one torch import):
#: name -> the overrides besides the model, the input and the output path.
CONVERSIONS = {
    "fsdp1-64": ("runtime.mode=offline", "target.kind=fsdp1", "target.world_size=64"),
    "fsdp2-64": ("runtime.mode=offline", "target.kind=fsdp2", "target.world_size=64"),
    "fsdp2-1024": ("runtime.mode=offline", "target.kind=fsdp2", "target.world_size=1024"),
    "fsdp2-8": ("runtime.mode=offline", "target.kind=fsdp2", "target.world_size=8"),
    **{
        f"{kind}-4-{mode}": (
            f"target.kind={kind}",
            "target.world_size=4",
            "target.use_orig_params=true" if kind == "fsdp1" else "target.wrap_root=true",
            *(["runtime.mode=offline"] if mode == "offline" else []),
        )
        for kind in ("fsdp1", "fsdp2") for mode in ("online", "offline")
    },
    **{
        f"dcp-{name}": ("target.kind=fsdp2", "target.wrap_root=true", "output.format=dcp", *args)
        for name, args in {
            "3-online": ["target.world_size=3"],
            "3-offline": ["target.world_size=3", "runtime.mode=offline"],
            "64-offline": ["target.world_size=64", "runtime.mode=offline"],
        }.items()
    },
    "fsdp_full-2": (
        "target.kind=fsdp2", "target.wrap_root=true", "target.world_size=2",
        "output.format=fsdp_full", "runtime.mode=offline",
    ),
    "hybrid-4": (
        "runtime.mode=offline", "target.world_size=4",
        "target.sharding_strategy=HYBRID_SHARD", "target.shard_group_size=2",
    ),
}


@pytest.fixture(scope="module")
def converted(full_source: Path, tmp_path_factory) -> dict[str, Path]:
    """Each of :data:`CONVERSIONS` through the ``osdpipe`` entry point: name -> its output directory."""
    root = tmp_path_factory.mktemp("offline")
    outs = {name: root / name for name in CONVERSIONS}
    argv = [
        ["model.factory=userlm:build", f"input.path={full_source}", "input.format=fsdp_full", "source.world_size=4",
         "target.wrap=[MixerBlock]", f"output.path={outs[name]}", *args]
        for name, args in CONVERSIONS.items()
    ]  # fmt: skip
    for name, result in zip(CONVERSIONS, run_cli_cases(argv, cwd=root, per_case_s=TIMEOUT_S, env=user_env())):
        assert result["code"] == 0, f"{name}: exit {result['code']}\n{result['stdout']}\n{result['stderr']}"
        assert "Traceback" not in result["stderr"], result["stderr"]
    return outs


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _real_fsdp_problems(kind: str, world: int, source: Path, out: Path, ranks: list[int]) -> list[str]:
    cmd = [sys.executable, str(TESTS / "fake_rank_files.py"), kind, str(world), str(source), str(out), *map(str, ranks)]
    result = run_command(cmd, cwd=out.parent, timeout=TIMEOUT_S, env=user_env())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _gathered_fsdp2(out: Path, world: int) -> dict[int, dict[str, torch.Tensor]]:
    """Every param ID's tensor state, its ranks' dim-0 chunks concatenated in rank order."""
    files = [torch.load(out / f"rank_{r}.pt", weights_only=True) for r in range(world)]
    return {
        pid: {
            name: torch.cat([f["state"][pid][name] for f in files]) for name, value in state.items() if value.dim() > 0
        }
        for pid, state in files[0]["state"].items()
    }


@pytest.mark.parametrize("kind,world", [("fsdp1", 64), ("fsdp2", 64), ("fsdp2", 1024)])
def test_offline_conversion_equals_real_fsdp(
    kind: str, world: int, full_source: Path, converted: dict[str, Path]
) -> None:
    out = converted[f"{kind}-{world}"]
    report = _report(out)
    assert report["ok"] and [c["name"] for c in report["checks"]] == ["roundtrip", "resume"], report["checks"]
    # No live target world offline: resume's storage part and its steps on bare optimizers still run, and say so.
    assert report["checks"][1]["detail"].startswith(
        "storage: no two state tensors share memory; steps: bare optimizers over the output's tensors"
    ), report["checks"][1]
    assert [(c["name"], c["why"]) for c in report["skipped_checks"]] == [
        ("reference", "needs a live target world (runtime.mode=online)"),
        ("load_step", "needs a live target world (runtime.mode=online)"),
        ("replicas", "applies only where a side has replica groups (HYBRID_SHARD, HSDP)"),
    ]
    assert "verify did not run reference: it needs a live target world (runtime.mode=online)" in report["warnings"], (
        report["warnings"]
    )
    assert sorted(p.name for p in out.glob("rank_*.pt")) == sorted(f"rank_{r}.pt" for r in range(world))
    assert not (out / ".staging").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["files"]) == world

    full = torch.load(full_source, weights_only=True)
    names = list(full["state"])  # the unwrapped optimizer's order, which FSDP2 keeps
    if kind == "fsdp2":
        gathered = _gathered_fsdp2(out, world)
        assert sorted(gathered) == list(range(len(names)))
        for pid, name in enumerate(names):
            for state_name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(gathered[pid][state_name], full["state"][name][state_name]), (name, state_name)
        # A parameter of fewer rows than ranks leaves the last ranks empty chunks, with state all the same.
        last = torch.load(out / f"rank_{world - 1}.pt", weights_only=True)
        assert last["state"][0]["exp_avg"].shape[0] == 0 and last["dtensor"][0]["placements"] == ["S(0)"]
        ranks = [0, world // 2, world - 1]
    else:
        ranks = list(range(world))  # every rank equal to real FSDP's is the source, gathered back
    assert _real_fsdp_problems(kind, world, full_source, out, ranks) == []


def test_real_fsdp_oracle_sees_one_wrong_element(full_source: Path, converted: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "out"
    shutil.copytree(converted["fsdp2-8"], out)
    path = out / "rank_0.pt"
    osd = torch.load(path, weights_only=True)
    osd["state"][2]["exp_avg"].view(-1)[5] += 1  # blocks.0.wk.weight
    torch.save(osd, path)
    assert _real_fsdp_problems("fsdp2", 8, full_source, out, [0, 1]) == [
        "rank 0, param ID 2: (1, 6) differs from real FSDP's (1, 6) shard"
    ]


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_online_and_offline_write_byte_identical_files(kind: str, converted: dict[str, Path]) -> None:
    online, offline = converted[f"{kind}-4-online"], converted[f"{kind}-4-offline"]
    for r in range(4):
        assert (online / f"rank_{r}.pt").read_bytes() == (offline / f"rank_{r}.pt").read_bytes(), f"rank_{r}.pt"


def test_offline_dcp_output_is_online_bytes_and_resumes_on_a_real_world(
    full_source: Path, converted: dict[str, Path]
) -> None:
    """A dcp checkpoint written offline: every file as online writes it,
    and a 64-rank one resumes on a 2-rank FSDP2 world."""
    online, offline, wide = converted["dcp-3-online"], converted["dcp-3-offline"], converted["dcp-64-offline"]
    files = sorted(str(p.relative_to(online)) for p in (online / "dcp").rglob("*") if p.is_file())
    assert files == ["dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/__2_0.distcp"]
    assert files == sorted(str(p.relative_to(offline)) for p in (offline / "dcp").rglob("*") if p.is_file())
    for name in files:
        assert (online / name).read_bytes() == (offline / name).read_bytes(), name
    manifest = json.loads((offline / "manifest.json").read_text())
    assert manifest["tensors"] == json.loads((online / "manifest.json").read_text())["tensors"]
    assert manifest_digests_hold(offline, manifest) == dict.fromkeys(files, True)  # hashed as written, checked by hand
    assert sorted(manifest["pieces"]) == [n for n in files if n.endswith(".distcp")], (
        "the .metadata has its sha256, each rank file its pieces'"
    )

    assert len(list((wide / "dcp").glob("*.distcp"))) == 64
    assert spawn_world(
        fsdp2_resume.resume, 2, (str(full_source), str(wide / "dcp"), "dcp"), timeout_s=TIMEOUT_S
    ) == [[], []]


def test_fsdp_full_output_resumes_an_fsdp2_job(full_source: Path, converted: dict[str, Path]) -> None:
    """The README's other FSDP2 load: set_optimizer_state_dict(full_state_dict=True) of an fsdp_full output, on a real
    2-rank world."""
    out = converted["fsdp_full-2"]
    assert spawn_world(
        fsdp2_resume.resume, 2, (str(full_source), str(out / "optim.pt"), "fsdp_full"), timeout_s=TIMEOUT_S
    ) == [[], []]


def test_hybrid_source_replicas_must_agree(converted: dict[str, Path], tmp_path: Path) -> None:
    """HYBRID_SHARD rank files (written offline), read from one replica group;
    one element changed in the other fails verify."""
    import shutil

    hybrid = tmp_path / "hybrid"
    shutil.copytree(converted["hybrid-4"], hybrid)
    # replicas alike
    assert diff(
        torch.load(hybrid / "rank_1.pt", weights_only=True), torch.load(hybrid / "rank_3.pt", weights_only=True)
    ) == []
    source = [
        f"input.path={hybrid}", "input.format=rank_local", "source.world_size=4", "source.wrap=[MixerBlock]",
        "source.sharding_strategy=HYBRID_SHARD", "source.shard_group_size=2", "target.world_size=2",
    ]  # fmt: skip
    env = user_env()
    # online, as the README shows it
    ok = run_command(
        [sys.executable, "-m", "osdpipe", "model.factory=userlm:build", *source, f"output.path={tmp_path / 'ok'}"],
        cwd=tmp_path,
        timeout=TIMEOUT_S,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr
    assert "check replicas   pass  the source's replica groups hold the same state bitwise" in ok.stdout
    osd = torch.load(hybrid / "rank_3.pt", weights_only=True)
    osd["state"][0]["exp_avg"].view(-1)[2] += 1
    torch.save(osd, hybrid / "rank_3.pt")
    bad = run_command(
        [
            sys.executable, "-m", "osdpipe", "model.factory=userlm:build", *source,
            "runtime.mode=offline", f"output.path={tmp_path / 'bad'}",
        ],
        cwd=tmp_path,
        timeout=TIMEOUT_S,
        env=env,
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith(
        "osdpipe: error: verify failed: check replicas: rank 1: source rank_3.pt: "
        "rank 3 vs rank 1['state'][0]['exp_avg']: 1 element(s) differ"
    ), bad.stderr
    assert not list((tmp_path / "bad").glob("rank_*.pt"))


def test_hybrid_output_replicas_are_compared(
    full_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline HYBRID_SHARD output: each rank's state is held against the rank of the first group with its shard.

    In one process (the offline driver, called directly) so that rank 3's
    output can be spoiled after rekey: only the ``replicas`` check runs, and
    it must name the rank, its counterpart and the tensor, and nothing is committed.
    """
    from helpers import planned

    from osdpipe.pipeline.execute import run_offline
    from osdpipe.pipeline.stages import STAGES
    from osdpipe.run.progress import Display
    from osdpipe.spec.reconcile import settle_and_validate

    def spec(out: Path):
        return settle_and_validate(
            {
                "model": {"factory": "userlm:build"},
                "source": {"world_size": 4, "wrap": ["MixerBlock"]},
                "target": {
                    "world_size": 4, "wrap": ["MixerBlock"], "sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2
                },
                "input": {"path": str(full_source), "format": "fsdp_full"},
                "output": {"path": str(out)},
                "pipeline": {"checks": ["replicas"]},
                "runtime": {"mode": "offline", "progress": False},
            }
        )

    good = run_offline(planned(spec(tmp_path / "good")), Display(False))
    assert good.ok and [(c.name, c.detail) for c in good.checks] == [
        ("replicas", "the output's replica groups hold the same state bitwise")
    ]

    rekey = STAGES["rekey"]

    def rekey_then_spoil_rank_3(ctx, sharded, tally):
        keyed = rekey(ctx, sharded, tally)
        if ctx.rank == 3:
            keyed.state_dict["state"][0]["exp_avg"].view(-1)[1] += 1
        return keyed

    monkeypatch.setitem(STAGES, "rekey", rekey_then_spoil_rank_3)
    bad = run_offline(planned(spec(tmp_path / "bad")), Display(False))
    assert not bad.ok and bad.files == {}
    assert [(c.name, c.detail) for c in bad.checks] == [
        ("replicas", "rank 3: output rank 3 differs from rank 1, which holds the same shard: 0.exp_avg")
    ]
    # staged only: the launcher drops it
    assert not list((tmp_path / "bad").glob("rank_*.pt")) and not (tmp_path / "bad" / "manifest.json").exists()


def test_one_process_holds_one_target_ranks_output_at_a_time(tmp_path: Path) -> None:
    """Offline to 4 ranks, about 34 MB of output each: the process's peak anonymous memory beyond its baseline is one
    rank's output and a little, never two ranks' (the rank played before is let go before the next is made)."""
    state, names = {}, []
    gen = torch.Generator().manual_seed(0)
    for i in range(4):  # the built-in mlp: width 2048, depth 4
        for name, shape in ((f"layers.{i}.weight", (2048, 2048)), (f"layers.{i}.bias", (2048,))):
            names.append(name)
            state[name] = {
                "step": torch.tensor(5.0),
                "exp_avg": torch.randn(shape, generator=gen),
                "exp_avg_sq": torch.rand(shape, generator=gen),
            }
    source = tmp_path / "optim.pt"
    # a real Adam's hyperparameters, as it saves them
    groups = [{**torch.optim.Adam([torch.zeros(1)]).defaults, "params": names}]
    torch.save({"state": state, "param_groups": groups}, source)
    del state
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "osdpipe", "model.factory=mlp", "model.kwargs.width=2048", "model.kwargs.depth=4",
           f"input.path={source}", "source.world_size=1", "source.wrap=[Linear]",
           "target.world_size=4", "target.wrap=[Linear]", "runtime.mode=offline",
           "pipeline.checks=[roundtrip]", f"output.path={out}"]  # fmt: skip
    result = run_command(cmd, cwd=tmp_path, timeout=TIMEOUT_S, env=user_env())
    assert result.returncode == 0, result.stderr
    report = _report(out)
    (memory,) = report["memory"]
    held, one_rank = memory["peak_anonymous"] - memory["baseline_anonymous"], max(report["output_bytes"])
    assert one_rank > 30e6
    assert held < one_rank + 16e6, f"{held / 1e6:.0f} MB held at the peak; one rank's output is {one_rank / 1e6:.0f} MB"
