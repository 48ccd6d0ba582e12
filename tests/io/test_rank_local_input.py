"""``rank_local`` as an input: per-rank ``optim.state_dict()`` files of real FSDP1 jobs,
read back as PyTorch's full state.

Real FSDP1 models train two steps on CPU/gloo and save each rank's own
``optim.state_dict()`` together with PyTorch's full optimizer state dict;
the reader, given only the files and the source layout, must reproduce the
full state bitwise, param groups included. Then the ``rank_local_reshard``
recipe and one more conversion from its files run end to end.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import run_osdpipe

from osdpipe.core.compare import diff
from osdpipe.io.formats import TensorRef
from osdpipe.io.formats.rank_local import RankLocalReader
from osdpipe.layout.kinds import rank_layout
from osdpipe.layout.models import build_model
from osdpipe.layout.tree import ModuleTree, describe
from osdpipe.pipeline.execute import execute
from osdpipe.run.launch import run_local_world
from osdpipe.run.live_jobs import live_target, train_step
from osdpipe.spec.config import RunSpec
from osdpipe.spec.plan import plan_run
from osdpipe.spec.reconcile import settle_and_validate

TRANSFORMER = {"factory": "transformer", "kwargs": {"vocab": 32, "dim": 16, "hidden": 24, "layers": 2, "seq": 6}}
GROUPS = [{"params": ["*gate", "*scale"], "weight_decay": 0.1}, {"params": ["embed.*", "head.*", "*lin*", "*out*"]}]

# name -> (world size, config sections). Cases of one world size train in one world.
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "block_flat_3": (3, {"source": {"world_size": 3, "wrap": ["Block"]}}),
    "transformer_orig_3": (
        3, {"model": TRANSFORMER, "source": {"world_size": 3, "wrap": ["TransformerBlock"], "use_orig_params": True}}
    ),
    "leaf_orig_groups_2": (
        2, {"source": {"world_size": 2, "wrap": ["Leaf"], "use_orig_params": True}, "optim": {"param_groups": GROUPS}}
    ),
    "no_shard_2": (2, {"source": {"world_size": 2, "wrap": ["Block"], "sharding_strategy": "NO_SHARD"}}),
    "transformer_tied_2": (2, {"model": TRANSFORMER, "source": {"world_size": 2, "wrap": ["TransformerBlock"]}}),
}


def spec_of(root: Path, name: str) -> RunSpec:
    return settle_and_validate({"output": {"path": str(root / name / "out")}, **CASES[name][1]})


def tree_of(spec: RunSpec) -> ModuleTree:
    return describe(build_model(spec.model.factory, spec.model.kwargs, device="meta"))


def pytorch_full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """PyTorch's full optimizer state dict, without CPU offload.

    With ``offload_to_cpu=True`` (the default, and what ``kinds.fsdp1.FSDP1.full_state``
    uses) and ``use_orig_params=True`` on a CPU world, torch 2.13 returns every
    tensor state of a flat parameter as a view of one reused gather buffer
    (``.cpu()`` does not copy a CPU tensor), so ``exp_avg`` comes back equal
    to ``exp_avg_sq``; without offload it clones each one.
    """
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
        ):
            return FSDP.optim_state_dict(model, optim)


def _train_and_save(root: str, names: list[str]) -> None:
    """On each rank: train every case two steps, save this rank's optim.state_dict() and
    (rank 0) PyTorch's full state."""
    rank = dist.get_rank()
    for name in names:
        spec = spec_of(Path(root), name)
        tree = tree_of(spec)
        model, optim = live_target(spec, spec.source.spec(), tree, rank)
        for step in range(2):
            train_step(spec, model, optim, step, rank_layout(tree, spec.source.spec(), rank), tree)
        directory = Path(root) / name
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(optim.state_dict(), directory / f"rank_{rank}.pt")
        full = pytorch_full_state(model, optim)
        if rank == 0:
            torch.save(full, directory / "full.pt")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rank_local_sources")
    for world in sorted({n for n, _ in CASES.values()}):
        names = [name for name, (n, _) in CASES.items() if n == world]
        run_local_world(_train_and_save, world, (str(root), names), backend="gloo", timeout_s=120)
    return root


def reader_of(root: Path, name: str, **source: Any) -> RankLocalReader:
    spec = spec_of(root, name)
    id_groups = [g.params for g in spec.optim.param_groups] or None
    return RankLocalReader(str(root / name), tree_of(spec), spec.source.model_copy(update=source).spec(), id_groups)


def rebuild(reader: RankLocalReader) -> dict[str, Any]:
    """The full state dict the reader describes: meta() for names, scalars and groups, read() for tensors."""
    meta = reader.meta()
    items = [(fqn, n) for fqn, entries in meta.state.items() for n, v in entries.items() if isinstance(v, TensorRef)]
    tensors = reader.read(items)
    state = {fqn: {n: tensors.get((fqn, n), v) for n, v in entries.items()} for fqn, entries in meta.state.items()}
    return {"state": state, "param_groups": meta.param_groups}


@pytest.mark.parametrize("name", list(CASES))
def test_reader_gives_pytorchs_full_state(sources: Path, name: str) -> None:
    full = torch.load(sources / name / "full.pt", weights_only=True)
    got = rebuild(reader_of(sources, name))
    assert not diff(got, full, limit=10), diff(got, full, limit=10)
    assert list(got["state"]) and len(got["param_groups"]) == len(full["param_groups"])
    any_state = next(iter(got["state"].values()))
    assert not torch.equal(any_state["exp_avg"], any_state["exp_avg_sq"])  # the full state compared against is sound


def test_reader_reads_only_what_it_is_asked(sources: Path) -> None:
    reader = reader_of(sources, "block_flat_3")
    one = reader.read([("block1.leaf2.lin.weight", "exp_avg")])
    full = torch.load(sources / "block_flat_3" / "full.pt", weights_only=True)
    assert list(one) == [("block1.leaf2.lin.weight", "exp_avg")]
    assert not diff(one[("block1.leaf2.lin.weight", "exp_avg")], full["state"]["block1.leaf2.lin.weight"]["exp_avg"])


def test_wrong_world_size_names_the_files(sources: Path) -> None:
    with pytest.raises(ValueError, match=r"rank_0\.pt \.\. rank_1\.pt for source\.world_size=2.*unexpected rank_2\.pt"):
        reader_of(sources, "block_flat_3", world_size=2)
    with pytest.raises(ValueError, match=r"source\.world_size=4.*missing rank_3\.pt"):
        reader_of(sources, "block_flat_3", world_size=4)


def test_wrong_sharding_strategy_is_a_shape_error(sources: Path) -> None:
    reader = reader_of(sources, "block_flat_3", sharding_strategy="NO_SHARD")
    with pytest.raises(
        ValueError,
        match=r"rank 0, param ID 0: state exp_avg has shape \(\d+,\) but the source layout says \(\d+,\) "
        r".*use_orig_params",
    ):
        reader.meta()


@pytest.mark.parametrize("wrong", [{"use_orig_params": True}, {"wrap": ["Leaf"]}], ids=["use_orig_params", "wrap"])
def test_wrong_layout_is_a_count_error(sources: Path, wrong: dict[str, Any]) -> None:
    with pytest.raises(
        ValueError,
        match=r"rank 0: its optimizer holds 3 parameter\(s\) in 1 group\(s\), "
        r"but the source layout gives it \d+ .*source\.wrap",
    ):
        reader_of(sources, "block_flat_3", **wrong).meta()


def test_missing_param_groups_are_named(sources: Path) -> None:
    spec = spec_of(sources, "leaf_orig_groups_2")
    reader = RankLocalReader(str(sources / "leaf_orig_groups_2"), tree_of(spec), spec.source.spec(), None)
    with pytest.raises(
        ValueError,
        match=r"rank 0: the file's param groups hold IDs \[0\.\.\d+\], \[\d+\.\.\d+\] "
        r"but the groups of input\.param_groups",
    ):
        reader.meta()


def test_rank_without_state_for_its_elements_is_an_error(sources: Path, tmp_path: Path) -> None:
    """Elements held only by a rank that has no state for them are refused, never zero-filled."""
    name = "leaf_orig_groups_2"
    intact = reader_of(sources, name)
    split = next(pid for pid in range(len(intact.order)) if all(intact.tensor(r, pid).has_elements for r in range(2)))
    for r in range(2):
        osd = torch.load(sources / name / f"rank_{r}.pt", weights_only=True)
        if r == 1:
            del osd["state"][split]
        torch.save(osd, tmp_path / f"rank_{r}.pt")
    spec = spec_of(sources, name)
    reader = RankLocalReader(
        str(tmp_path), tree_of(spec), spec.source.spec(), [g.params for g in spec.optim.param_groups]
    )
    with pytest.raises(
        ValueError, match=rf"lie on rank\(s\) \[1\] under the source layout, which have no state for param ID {split}\b"
    ):
        reader.meta()


# ---------------------------------------------------------------- end to end


def test_recipe_then_another_conversion_of_its_files(tmp_path: Path) -> None:
    out = tmp_path / "recipe"
    result = run_osdpipe("recipe=rank_local_reshard", f"output.path={out}", cwd=tmp_path)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    report = json.loads((out / "report.json").read_text())
    assert report["ok"], report
    assert sorted(p.name for p in (out / "source" / "rank_local").iterdir()) == [f"rank_{r}.pt" for r in range(4)]
    assert sorted(p.name for p in out.glob("rank_*.pt")) == ["rank_0.pt", "rank_1.pt"]

    # The recipe's 4 source files (Block units, flat state), to 2 ranks of per-parameter shards in Leaf units.
    spec = settle_and_validate(
        {
            "input": {"path": str(out / "source" / "rank_local"), "format": "rank_local"},
            "source": {"world_size": 4, "wrap": ["Block"]},
            "target": {"world_size": 2, "wrap": ["Leaf"], "use_orig_params": True},
            "output": {"path": str(tmp_path / "converted"), "format": "rank_local"},
            "runtime": {"backend": "gloo", "timeout_s": 120, "progress": False},
        }
    )
    report = execute(plan_run(spec))
    assert report.ok, report
    checks = {c.name: c for c in report.checks}
    assert checks["reference"].ok and checks["roundtrip"].ok and checks["load_step"].ok, report.checks
    assert sorted(p.name for p in (tmp_path / "converted").glob("rank_*.pt")) == ["rank_0.pt", "rank_1.pt"]
