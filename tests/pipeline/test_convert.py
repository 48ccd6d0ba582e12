"""Conversions on CPU/gloo, checked against PyTorch's own FSDP1 conversion independently of osdpipe's verify."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from conversions import TIMEOUT_S, convert_and_check, pytorch_says, spec_for
from helpers import planned, run_osdpipe, run_stages_by_hand

from osdpipe.layout.kinds import rank_layout
from osdpipe.pipeline.execute import execute
from osdpipe.pipeline.loop import combine
from osdpipe.pipeline.stages import STAGES
from osdpipe.run.collective import gather_to_all
from osdpipe.run.launch import run_local_world
from osdpipe.run.products import Tally
from osdpipe.spec.config import RunSpec


def _generate(spec: RunSpec) -> str:
    from osdpipe.run.generate import generate_rank

    return generate_rank(planned(spec))


# Source layouts for N = 1..4 and target layouts for M = 1..4: each pair is one conversion.
SOURCES = {
    1: dict(wrap=["Block"]),
    2: dict(wrap=["Leaf"], use_orig_params=True),
    3: dict(wrap=["Block", "Leaf"], sharding_strategy="SHARD_GRAD_OP"),
    4: dict(wrap=["block1", "block2.leaf2"], wrap_root=True),
}
TARGETS = {
    1: dict(wrap=["Leaf"]),
    2: dict(wrap=["Block"], use_orig_params=True),
    3: dict(wrap=["Block", "Leaf"]),
    4: dict(wrap=[], sharding_strategy="NO_SHARD"),
}


@pytest.fixture(scope="module")
def nested_sources(tmp_path_factory) -> dict[int, str]:
    """A trained FSDP1 source checkpoint (fsdp_full) for each source world size."""
    root = tmp_path_factory.mktemp("sources")
    paths = {}
    for n, layout in SOURCES.items():
        spec = spec_for(root / f"n{n}", source={"world_size": n, **layout})
        paths[n] = run_local_world(_generate, n, (spec,), timeout_s=TIMEOUT_S)[0]
    return paths


@pytest.mark.parametrize("m", sorted(TARGETS))
def test_n_to_m_matches_pytorch(m, nested_sources, tmp_path):
    """Every source world size 1..4 converts to target world size m, equal to PyTorch's conversion bitwise."""
    specs = [spec_for(tmp_path / f"{n}to{m}", target={"world_size": m, **TARGETS[m]}) for n in sorted(nested_sources)]
    sources = [nested_sources[n] for n in sorted(nested_sources)]
    per_rank = run_local_world(convert_and_check, m, (specs, sources), timeout_s=TIMEOUT_S)
    for rank, results in enumerate(per_rank):
        for n, (ok, failed_checks, problems) in zip(sorted(nested_sources), results):
            assert ok, f"{n}->{m} rank {rank}: verify failed: {failed_checks}"
            assert not problems, f"{n}->{m} rank {rank}: differs from FSDP.optim_state_dict_to_load: {problems}"


def _tamper_and_verify(spec: RunSpec, source: str, tamper: str) -> list[tuple[str, bool, str]]:
    ctx, products = run_stages_by_hand(spec, source, "fsdp_full", ("load", "broadcast", "flatten", "shard", "rekey"))
    keyed = products["rekey"]
    if dist.get_rank() == 1:
        state = keyed.state_dict["state"]
        key = sorted(state)[-1]  # block2's flat parameter: 488 elements, 244 per rank, no padding
        if tamper == "element":
            flat = state[key]["exp_avg"].view(-1)
            flat[flat.numel() // 2] += 1e-3
        elif tamper == "step":
            state[key]["step"] = state[key]["step"] + 1
        elif tamper == "padding":
            # ID 0 is the root's flat parameter (embed and head: 99 elements in chunks of 50),
            # so rank 1's shard ends in one element of padding.
            assert ctx.target_layout()[0].segments[-1].dest + ctx.target_layout()[0].segments[-1].length == 49
            state[0]["exp_avg"].view(-1)[-1] = 1.0
    verified = STAGES["verify"](ctx, keyed, Tally())
    # every rank's results, as the stage loop combines them
    return [(c.name, c.ok, c.detail) for c in combine(gather_to_all(list(verified.checks)))]


@pytest.mark.parametrize("transfer", ["shared", "scatter"])
@pytest.mark.parametrize("tamper", ["none", "element", "step", "padding"])
def test_verify_fails_when_one_element_is_wrong(tamper, transfer, nested_sources, tmp_path):
    """With ``scatter``, rank 1's bytes came from rank 0: its roundtrip compares them with rank 0's digests of the
    source."""
    spec = spec_for(
        tmp_path,
        target={"world_size": 2, "wrap": ["Block"]},
        runtime={"transfer": transfer, "memory_budget": "1KB" if transfer == "scatter" else None},
    )
    results = run_local_world(_tamper_and_verify, 2, (spec, nested_sources[2], tamper), timeout_s=TIMEOUT_S)[0]
    checks = {name: (ok, detail) for name, ok, detail in results}
    if tamper == "none":
        assert "roundtrip" in checks and all(ok for ok, _ in checks.values()), checks
        return
    assert not checks["roundtrip"][0], f"roundtrip missed a changed {tamper}: {checks}"
    assert "rank 1" in checks["roundtrip"][1]
    if tamper == "padding":
        assert "padding is not zero" in checks["roundtrip"][1], checks
    if tamper == "element" and transfer == "scatter":
        assert "differ from what rank 0 read from the source" in checks["roundtrip"][1], checks
    if transfer == "scatter":
        assert "reference" not in checks  # it needs the whole source on every rank
        return
    # PyTorch pads with zeros too, so its reference differs from every tampered result.
    assert not checks["reference"][0], f"reference missed a changed {tamper}: {checks}"


def _save_user_checkpoint(root: str) -> str:
    """Plain PyTorch, no osdpipe: FSDP1 on 4 ranks over a user's model, Adam, a few steps,
    then save FULL and SHARDED."""
    import torch.distributed.checkpoint as dcp
    import usermodel
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import (
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(
            usermodel.make(), auto_wrap_policy=ModuleWrapPolicy({usermodel.Tower}), device_id=torch.device("cpu")
        )
        optim = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)
        for step in range(3):
            torch.manual_seed(step)
            model(torch.randn(4, 7)).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
        full = FSDP.optim_state_dict(model, optim)
        if dist.get_rank() == 0:
            torch.save(full, os.path.join(root, "optim.pt"))
        with FSDP.state_dict_type(
            model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
        ):
            sharded = FSDP.optim_state_dict(model, optim)
        dcp.save({"optimizer": sharded}, checkpoint_id=os.path.join(root, "dcp"))
    return root


def _pytorch_check_worker(spec: RunSpec, full_path: str) -> list[str]:
    return pytorch_says(spec, full_path)


@pytest.mark.parametrize("fmt", ["fsdp_full", "dcp"])
@pytest.mark.parametrize("m", [2, 3])
def test_user_checkpoint_4_ranks_to_m(fmt, m, tmp_path_factory):
    """The issue's acceptance case: a plain-PyTorch checkpoint of a user model, 4 ranks -> m, rewrapped,
    use_orig_params flipped."""
    root = tmp_path_factory.getbasetemp() / "user_ckpt"
    if not (root / "optim.pt").exists():
        root.mkdir(exist_ok=True)
        run_local_world(_save_user_checkpoint, 4, (str(root),), timeout_s=TIMEOUT_S)
    out = tmp_path_factory.mktemp(f"user_{fmt}_{m}")
    spec = spec_for(
        out,
        model={"factory": "usermodel:make", "kwargs": {"dim": 7}},
        input={"path": str(root / ("optim.pt" if fmt == "fsdp_full" else "dcp")), "format": fmt, "key": "optimizer"},
        optim={"name": "AdamW", "lr": 0.01, "kwargs": {"weight_decay": 0.05}},
        target={"world_size": m, "wrap": ["Expert"], "use_orig_params": True},
    )
    report = execute(planned(spec))
    assert report.ok, report
    assert sorted(p.name for p in out.glob("rank_*.pt")) == [f"rank_{r}.pt" for r in range(m)]
    problems = run_local_world(_pytorch_check_worker, m, (spec, str(root / "optim.pt")), timeout_s=TIMEOUT_S)
    assert problems == [[]] * m, problems


def test_mixed_precision_target_matches_pytorch(nested_sources, tmp_path):
    """FSDP1 with MixedPrecision(param_dtype=bfloat16) and use_orig_params as the target, bitwise as
    optim_state_dict_to_load."""
    from dataclasses import replace

    from osdpipe.layout.models import build_model
    from osdpipe.layout.tree import describe

    target = {
        "world_size": 3, "wrap": ["Block"], "use_orig_params": True, "mixed_precision": {"param_dtype": "bfloat16"}
    }
    spec = spec_for(tmp_path / "out", input={"path": nested_sources[2]}, target=target)
    tree = describe(build_model("nested", {}, device="meta"))
    without_bf16 = replace(spec.target.spec(), param_dtype=None)
    assert rank_layout(tree, spec.target.spec(), 0) != rank_layout(tree, without_bf16, 0), "bf16 alignment differs"
    args = [
        f"input.path={nested_sources[2]}", "target.world_size=3", "target.wrap=[Block]", "target.use_orig_params=true"
    ]
    result = run_osdpipe(
        *args, "target.mixed_precision.param_dtype=bfloat16", f"output.path={tmp_path / 'out'}", cwd=tmp_path
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    problems = run_local_world(_pytorch_check_worker, 3, (spec, nested_sources[2]), timeout_s=TIMEOUT_S)
    assert problems == [[]] * 3, problems
