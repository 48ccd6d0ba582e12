"""FSDP2 x tensor parallel, end to end: a user's 2-D job's checkpoint converted every way,
through the ``osdpipe`` command.

The source is saved by the user's own code (``_save_job``), not by osdpipe:
dp 2 x tp 2 on gloo, a model osdpipe has never seen (``usertp``: a hidden
size tp does not divide, a tied embedding, a layer outside the plan), its
TP plan applied with torch's own styles, Adam stepped on gradients made from
the parameters. It saves each rank's ``optim.state_dict()`` (as the README
says, through ``osdpipe.to_rank_local``), a DCP directory with plain
``get_optimizer_state_dict`` + ``dcp.save``, and rank 0's full state.

Each conversion runs verify's checks: ``roundtrip`` (the output gathered back
equals the source bitwise), ``reference`` (the output equals what PyTorch's
own path builds on the target from the full state, on every rank) and
``resume`` (the target job loads the output as a user would, steps on, and
equals a job that resumed from the source). A failing check fails the
command, so exit 0 is the proof; the plain output is besides loaded here
into a fresh Adam and compared with the job's own full state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_cli_cases, run_command, user_env
from oracle_probe import spawn_world

#: End to end: worlds of 2 to 4 ranks, a few minutes in all.
pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1] / "support"
PLAN = "{blocks.*.up:colwise,blocks.*.down:rowwise,blocks.*.norm:sequence}"
MODEL = "model.factory=usertp:build"
SOURCE = [MODEL, "source.kind=fsdp2", "source.world_size=4", "source.tp_size=2", f"source.tp_plan={PLAN}"]
CHECKS = "pipeline.checks=[roundtrip,reference,load_step,resume]"
TIMEOUT_S = 180


def _save_job(out: str) -> None:
    """One rank of the user's dp 2 x tp 2 job: TP, then FSDP2, three Adam steps, then its three ways of saving."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import usertp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    import osdpipe

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = usertp.build()
    plan = {}
    for i in range(len(model.blocks)):
        plan |= {
            f"blocks.{i}.up": ColwiseParallel(),
            f"blocks.{i}.down": RowwiseParallel(),
            f"blocks.{i}.norm": SequenceParallel(),
        }
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        for p in model.parameters():  # elementwise on each rank's piece: no forward pass, which uneven TP sizes refuse
            p.grad = p.detach() * 0.5 + 0.1 * (step + 1)
        optim.step()
    root = Path(out)
    (root / "rank_local").mkdir(parents=True, exist_ok=True)
    torch.save(osdpipe.to_rank_local(optim.state_dict()), root / "rank_local" / f"rank_{rank}.pt")
    dcp.save({"optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=str(root / "dcp"))
    full = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save(full, root / "full.pt")
    dist.barrier()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp_job")
    spawn_world(_save_job, 4, (str(root),), timeout_s=TIMEOUT_S)
    return root


#: The issue's targets: FSDP2 1-D on 3 ranks, FSDP1 on 2, dp 4 x tp 1, one process, one full file, and HSDP x TP.
TARGETS = {
    "fsdp2_3": ["target.kind=fsdp2", "target.world_size=3"],
    "fsdp1_2": ["target.kind=fsdp1", "target.world_size=2"],
    "dp4_tp1": ["target.kind=fsdp2", "target.world_size=4", "target.tp_size=1"],
    "plain": ["target.kind=none", "target.world_size=1", "output.format=plain"],
    "fsdp_full": ["target.kind=fsdp2", "target.world_size=2", "output.format=fsdp_full"],
    "hsdp_tp": [
        "target.kind=fsdp2", "target.world_size=4", "target.shard_group_size=1",
        "target.tp_size=2", f"target.tp_plan={PLAN}",
        "pipeline.checks=[roundtrip,reference,load_step,resume,replicas]",
    ],
}


@pytest.fixture(scope="module")
def converted(saved: Path) -> dict[str, dict]:
    """Every target from the rank_local files, and two from the DCP directory."""
    inputs = {
        "rank_local": [f"input.path={saved / 'rank_local'}", "input.format=rank_local"],
        "dcp": [f"input.path={saved / 'dcp'}", "input.format=dcp"],
    }
    cases = {f"rank_local-{name}": [*inputs["rank_local"], *args] for name, args in TARGETS.items()}
    cases |= {f"dcp-{name}": [*inputs["dcp"], *TARGETS[name]] for name in ("fsdp1_2", "plain")}
    argv = [
        [*SOURCE, CHECKS, *args, f"output.path={saved / 'out' / name}", "runtime.progress=false"]
        for name, args in cases.items()
    ]
    results = run_cli_cases(argv, cwd=saved, per_case_s=TIMEOUT_S, env=user_env())
    return dict(zip(cases, results))


@pytest.mark.parametrize("case", [f"rank_local-{t}" for t in TARGETS] + ["dcp-fsdp1_2", "dcp-plain"])
def test_a_2d_jobs_checkpoint_converts_and_every_check_passes(
    converted: dict[str, dict], saved: Path, case: str
) -> None:
    result = converted[case]
    assert result["code"] == 0, result["stderr"]
    report = json.loads((saved / "out" / case / "report.json").read_text())
    checks = {c["name"]: c["ok"] for c in report["checks"]}
    expected = {"roundtrip", "reference", "load_step", "resume"} | ({"replicas"} if case.endswith("hsdp_tp") else set())
    assert checks == dict.fromkeys(expected, True), checks


@pytest.mark.parametrize("source", ["rank_local", "dcp"])
def test_the_plain_output_is_the_jobs_own_full_state(converted: dict[str, dict], saved: Path, source: str) -> None:
    """Loaded into a fresh Adam as a one-process fine-tune would, the state is what the job itself reported, and steps
    on."""
    import usertp

    assert converted[f"{source}-plain"]["code"] == 0, converted[f"{source}-plain"]["stderr"]
    full = torch.load(saved / "full.pt", weights_only=True)
    model = usertp.build()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    optim.load_state_dict(torch.load(saved / "out" / f"{source}-plain" / "optim.pt", weights_only=True))
    names = [n for n, _ in model.named_parameters()]
    assert len(optim.state) == len(names)
    for name, param in zip(names, model.parameters()):
        mine, theirs = optim.state[param], full["state"][name]
        assert set(mine) == set(theirs), name
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), f"{name} {key}"
        assert mine["step"].data_ptr() not in {
            optim.state[p]["step"].data_ptr() for p in model.parameters() if p is not param
        }
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    assert all(float(optim.state[p]["step"]) == 4.0 for p in model.parameters())


def test_generated_sources_to_and_from_2d_meshes(tmp_path: Path) -> None:
    """osdpipe's own FSDP1 source to dp 2 x tp 2 (rank_local, dcp, fsdp_full) and to replicate 2 x shard 1 x tp 2; an
    HSDP x TP source to FSDP2 on 3."""
    target = ["target.kind=fsdp2", "target.world_size=4", "target.tp_size=2", f"target.tp_plan={PLAN}"]
    fsdp1 = [MODEL, "source.world_size=2"]
    hsdp_tp = [
        MODEL, "source.kind=fsdp2", "source.world_size=4", "source.shard_group_size=1", "source.tp_size=2",
        f"source.tp_plan={PLAN}", "source.state_dict_type=local",
    ]
    cases = {
        "rank_local": [*fsdp1, CHECKS, *target],
        "dcp": [*fsdp1, CHECKS, *target, "output.format=dcp"],
        "fsdp_full": [*fsdp1, CHECKS, *target, "output.format=fsdp_full"],
        "hsdp": [*fsdp1, *target, "target.shard_group_size=1", "pipeline.checks=[roundtrip,reference,resume,replicas]"],
        "from_hsdp": [
            *hsdp_tp, "target.kind=fsdp2", "target.world_size=3",
            "pipeline.checks=[roundtrip,reference,resume,replicas]",
        ],
    }
    argv = [[*args, f"output.path={tmp_path / name}", "runtime.progress=false"] for name, args in cases.items()]
    for name, result in zip(cases, run_cli_cases(argv, cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())):
        assert result["code"] == 0, f"{name}: {result['stderr']}"
        checks = {c["name"]: c["ok"] for c in json.loads((tmp_path / name / "report.json").read_text())["checks"]}
        assert checks and all(checks.values()), f"{name}: {checks}"
        assert ("replicas" in checks) == (name in ("hsdp", "from_hsdp")), f"{name}: {checks}"
    files = sorted(p.name for p in (tmp_path / "rank_local").iterdir() if p.name.startswith("rank_"))
    assert files == [f"rank_{r}.pt" for r in range(4)]
    table = torch.load(tmp_path / "rank_local" / "rank_3.pt", weights_only=True)["dtensor"]
    described = {tuple(e["placements"]): (e["mesh"], e["mesh_dim_names"]) for e in table.values()}
    assert described[("_S(0, 2)", "S(0)")] == ([2, 2], ["dp", "tp"])
    assert described[("S(0)", "S(1)")] == ([2, 2], ["dp", "tp"])
    assert described[("S(0)",)] == ([2], ["dp"])


def test_a_dcp_output_that_pytorch_would_misplace_is_refused(tmp_path: Path) -> None:
    """dp 4 x tp 2 with 33 rows: PyTorch 2.13's offsets put rank 6's piece of a colwise weight one row off; nothing is
    written."""
    target = [
        "target.kind=fsdp2", "target.world_size=8", "target.tp_size=2", f"target.tp_plan={PLAN}", "runtime.mode=offline"
    ]
    out = tmp_path / "out"
    result = run_commanduser_env(
        [MODEL, "source.world_size=2", *target, "output.format=dcp", f"output.path={out}"], tmp_path
    )
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert (
        len(line.splitlines()) == 1
        and "output.format=dcp" in line
        and "rank_local" in line
        and "blocks.0.up.weight" in line
    ), line
    # refused before the source was generated: rank_local on such a mesh is test_the_offline_recipe_...
    assert not any(out.glob("**/*.pt"))


def run_commanduser_env(args: list[str], cwd: Path):
    """``osdpipe *args`` with the test's own modules importable."""
    return run_command([sys.executable, "-m", "osdpipe", *args], cwd=cwd, timeout=TIMEOUT_S, env=user_env())


def _llama_plan() -> dict[str, str]:
    import yaml

    return yaml.safe_load((TESTS.parents[1] / "conf" / "tp_plan" / "llama.yaml").read_text())


@pytest.mark.parametrize("world_size,tp_size,ranks", [(64, 2, [0, 33, 63]), (1024, 8, [0, 517, 1023])])
def test_large_meshes_are_what_real_fsdp2_over_tp_builds_on_the_fake_process_group(
    world_size: int, tp_size: int, ranks: list[int]
) -> None:
    """dp 32 x tp 2 (the ``llama_tp_offline`` recipe's mesh) and dp 128 x tp 8: each probed rank's real local tensors
    hold the elements osdpipe's layout says."""
    from oracle_probe import expected_values, meta_tree, run_fake_world, tree_marks

    from osdpipe.spec.config import validate
    from osdpipe.spec.plan import plan_run

    plan = plan_run(validate({
        "model": {"factory": "llama"}, "output": {"path": "/nonexistent/tp_oracle"}, "runtime": {"mode": "offline"},
        "target": {"kind": "fsdp2", "world_size": world_size, "tp_size": tp_size, "tp_plan": _llama_plan()},
    }))
    case = dict(
        kind="fsdp2_tp", factory="llama", kwargs={}, wrap=["LlamaBlock"], tp_size=tp_size, tp_plan=_llama_plan()
    )
    real = run_fake_world(world_size, ranks, [case], timeout_s=TIMEOUT_S)
    where = tree_marks(meta_tree("llama"))
    for rank in ranks:
        params = real[rank][0]["params"]
        layout = plan.optimizer_layout(rank)
        assert [p["fqn"] for p in params] == [t.key for t in layout]
        for p, tensor in zip(params, layout):
            assert tuple(p["local_shape"]) == tensor.shape, f"rank {rank} {tensor.key}"
            assert p["values"] == expected_values(tensor.numel, tensor.segments, where), (
                f"rank {rank} {tensor.key}: {p['placements']}"
            )
            assert tensor.placement is not None and tensor.placement.placements == tuple(p["placements"])


def test_the_offline_recipe_writes_each_ranks_piece_of_the_source(tmp_path: Path) -> None:
    """``recipe=llama_tp_offline``: ranks 0, 33 and 63's files hold, for every parameter,
    the source's elements real FSDP2 x TP puts there."""
    from oracle_probe import meta_tree, run_fake_world, tree_marks

    out = tmp_path / "out"
    result = run_commanduser_env(["recipe=llama_tp_offline", f"output.path={out}", "runtime.progress=false"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(list(out.glob("rank_*.pt"))) == 64
    source = torch.load(out / "source" / "optim.pt", weights_only=True)["state"]
    ranks = [0, 33, 63]
    case = dict(kind="fsdp2_tp", factory="llama", kwargs={}, wrap=["LlamaBlock"], tp_size=2, tp_plan=_llama_plan())
    real = run_fake_world(64, ranks, [case], timeout_s=TIMEOUT_S)
    where = tree_marks(meta_tree("llama"))
    for rank in ranks:
        written = torch.load(out / f"rank_{rank}.pt", weights_only=True)
        for pid, p in enumerate(real[rank][0]["params"]):
            # which elements of the parameter this rank holds
            held = torch.tensor(p["values"], dtype=torch.long) - where[p["fqn"]]
            for name in ("exp_avg", "exp_avg_sq"):
                got = written["state"][pid][name]
                assert tuple(got.shape) == tuple(p["local_shape"]), f"rank {rank} {p['fqn']} {name}"
                assert torch.equal(got.reshape(-1), source[p["fqn"]][name].reshape(-1)[held]), (
                    f"rank {rank} {p['fqn']} {name}"
                )


MESH_ERRORS = {
    "tp_size does not divide": (
        ["target.kind=fsdp2", "target.world_size=4", "target.tp_size=3"], ["target.tp_size=3", "world_size=4"]
    ),
    "shard group does not divide dp": (
        [
            "target.kind=fsdp2", "target.world_size=8", "target.tp_size=2", "target.shard_group_size=3",
            f"target.tp_plan={PLAN}",
        ],
        ["shard_group_size=3", "4 data-parallel ranks"],
    ),
    "kind without TP": (
        ["target.kind=fsdp1", "target.world_size=4", "target.tp_size=2"], ["tp_size=2", "kind=fsdp1", "kind=fsdp2"]
    ),
    "no plan": (["target.kind=fsdp2", "target.world_size=4", "target.tp_size=2"], ["tp_size=2", "tp_plan"]),
    "plan without TP": (["target.kind=fsdp2", f"target.tp_plan={PLAN}"], ["target.tp_plan", "tp_size"]),
    "unknown style": (
        ["target.kind=fsdp2", "target.world_size=4", "target.tp_size=2", "target.tp_plan={blocks.*.up:colwize}"],
        ["target.tp_plan", "colwize"],
    ),
    "pattern matches nothing": (
        ["target.kind=fsdp2", "target.world_size=4", "target.tp_size=2", "target.tp_plan={layers.*.wq:colwise}"],
        ["target.tp_plan", "layers.*.wq", "matches no module"],
    ),
}


def test_a_mesh_that_cannot_be_is_one_line_naming_the_key(tmp_path: Path) -> None:
    argv = [
        [MODEL, *args, f"output.path={tmp_path / name.replace(' ', '_')}"] for name, (args, _) in MESH_ERRORS.items()
    ]
    results = run_cli_cases(argv, cwd=tmp_path, per_case_s=60, env=user_env())
    for (name, (_, words)), result in zip(MESH_ERRORS.items(), results):
        lines = [line for line in result["stderr"].splitlines() if line.strip()]
        assert result["code"] == 2 and len(lines) == 1, f"{name}: {result['stderr']}"
        assert all(w in lines[0] for w in words), f"{name}: {lines[0]}"


def _numbered_job(out: str) -> tuple[dict[str, list[int]], dict[str, int], str]:
    """One rank of the user's dp 4 x tp 2 job with numbered parameters: what each local tensor holds,
    and how PyTorch's own dcp.save of it ends."""
    import fnmatch

    import torch.distributed.checkpoint as dcp
    import usertp
    from oracle_probe import fill_marked, local_values
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    model = usertp.build()
    where = fill_marked(model)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}
    plan = {
        n: styles[s]()
        for n, _ in model.named_modules()
        for p, s in usertp.PLAN.items()
        if n and fnmatch.fnmatchcase(n, p)
    }
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    held = {n: local_values(p.to_local()) for n, p in model.named_parameters()}
    try:
        dcp.save({"model": model.state_dict()}, checkpoint_id=out)
        saved = "saved"
    # DCP raises a CheckpointException (a BaseException) naming each rank's failure
    except BaseException as exc:  # noqa: BLE001
        saved = "overlapping chunks" if "overlapping" in str(exc).lower() else f"{type(exc).__name__}: {str(exc)[:200]}"
    return held, where, saved


def test_eight_real_processes_hold_what_the_layout_says_and_dcp_cannot_save_them(tmp_path: Path) -> None:
    """dp 4 x tp 2 on 8 gloo processes: every rank's local tensors are osdpipe's boxes; PyTorch's own dcp.save of the
    job fails ("overlapping chunks", its offset helper misplaces _StridedShard here), which is why osdpipe refuses a dcp
    output on this mesh."""
    import dataclasses

    import usertp
    from oracle_probe import expected_values, meta_tree

    from osdpipe.layout import kinds
    from osdpipe.layout.ranges import LayoutSpec
    from osdpipe.layout.tp import read_placements

    results = spawn_world(_numbered_job, 8, (str(tmp_path / "dcp"),), timeout_s=TIMEOUT_S)
    spec = LayoutSpec(kind="fsdp2", world_size=8, tp_size=2, tp_plan=tuple(usertp.PLAN.items()), wrap=("Block",))
    spec = dataclasses.replace(spec, tp_placements=read_placements("usertp:build", {}, spec))
    tree = meta_tree("usertp:build")
    for rank, (held, where, _) in enumerate(results):
        for tensor in kinds.rank_layout(tree, spec, rank):
            assert held[tensor.key] == expected_values(tensor.numel, tensor.segments, where), (
                f"rank {rank} {tensor.key}"
            )
    assert {saved for _, _, saved in results} == {"overlapping chunks"}
    assert kinds.get("fsdp2").dcp_load_problem(tree, spec) is not None
