"""Each stage on hand-made products, with no process group and no file read: (ctx, previous product, tally) -> product.

The source is a few tensors in memory behind the reader protocol; the
context is one rank of a solo world playing a 2-rank FSDP1 target over a
user's model (``usermodel:make``, ``dim=2``) whose root flat parameter
(``out``: 15 elements) does not divide evenly, so rank 1's shard of it is padded.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from osdpipe.io import output  # noqa: E402
from osdpipe.io.formats import SourceMeta, TensorRef  # noqa: E402
from osdpipe.run.context import Context  # noqa: E402
from osdpipe.run.products import (  # noqa: E402
    CheckResult,
    Described,
    Flattened,
    Keyed,
    Opened,
    Sharded,
    Staged,
    Tally,
    Verified,
    find,
)
from osdpipe.run.stages.broadcast import broadcast  # noqa: E402
from osdpipe.run.stages.flatten import flatten  # noqa: E402
from osdpipe.run.stages.rekey import rekey  # noqa: E402
from osdpipe.run.stages.save import save  # noqa: E402
from osdpipe.run.stages.shard import shard  # noqa: E402
from osdpipe.run.world import SoloWorld  # noqa: E402
from osdpipe.spec.plan import Plan, plan_run  # noqa: E402
from osdpipe.spec.reconcile import settle_and_validate  # noqa: E402

WORLD = 2


class MemoryReader:
    """A source held in memory: full tensors per FQN and state name, read by flat ranges."""

    def __init__(self, tensors: dict[str, dict[str, Any]], param_groups: list[dict[str, Any]] | None) -> None:
        self.tensors, self.param_groups = tensors, param_groups

    def meta(self) -> SourceMeta:
        described = {
            fqn: {
                name: TensorRef(tuple(v.shape), str(v.dtype).removeprefix("torch.")) if v.dim() > 0 else v
                for name, v in state.items()
            }
            for fqn, state in self.tensors.items()
        }
        return SourceMeta(described, self.param_groups)

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        return {(f, n): self.tensors[f][n] for f, n in items}

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[fqn][name].reshape(-1)[start:stop]

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        pass


def make_plan(tmp_path: Path, **sections: Any) -> Plan:
    raw = {
        "model": {"factory": "usermodel:make", "kwargs": {"dim": 2, "experts": 1, "towers": 2}},
        "source": {"world_size": 1},
        "target": {"world_size": WORLD, "wrap": ["Tower"]},
        "output": {"path": str(tmp_path / "out"), "format": "rank_local"},
        "runtime": {"mode": "offline", "progress": False},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return plan_run(settle_and_validate(raw))


def source_tensors(plan: Plan, step: float = 3.0) -> dict[str, dict[str, Any]]:
    """Adam state for every parameter: exp_avg counts up through the whole model,
    exp_avg_sq is its square, step is ``step``."""
    out, start = {}, 0
    for p in plan.tree.params:
        values = torch.arange(start, start + p.numel, dtype=torch.float32).reshape(p.shape)
        out[p.fqn] = {"exp_avg": values, "exp_avg_sq": values * values, "step": torch.tensor(step)}
        start += p.numel
    return out


def one_group(plan: Plan) -> list[dict[str, Any]]:
    return [{"params": [p.fqn for p in plan.tree.params], "lr": 0.01, "betas": (0.9, 0.999)}]


def described(plan: Plan, tensors: dict[str, dict[str, Any]] | None = None) -> Described:
    reader = MemoryReader(tensors or source_tensors(plan), one_group(plan))
    return Described(reader, None, reader.meta())


def at(plan: Plan, rank: int) -> Context:
    return Context(plan, SoloWorld(WORLD), rank)


def sharded_on(plan: Plan, rank: int, source: Described | None = None) -> Sharded:
    ctx = at(plan, rank)
    return shard(ctx, flatten(ctx, source or described(plan), Tally()), Tally())


def test_broadcast_describes_the_source_and_refuses_a_nonfinite_step(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    reader = MemoryReader(source_tensors(plan), one_group(plan))
    got = broadcast(at(plan, 0), Opened(reader, (0, 1)), tally := Tally())
    assert set(got.meta.state) == {p.fqn for p in plan.tree.params}
    assert got.meta.state["out.weight"]["exp_avg"] == TensorRef((5, 2), "float32")
    assert tally.sent == 0  # played apart in one process: the metadata crossed no process
    bad = MemoryReader(source_tensors(plan, step=float("nan")), one_group(plan))
    with pytest.raises(ValueError, match="NaN or Inf: .* step = nan"):
        broadcast(at(plan, 0), Opened(bad, (0, 1)), Tally())
    allowed = make_plan(tmp_path, input={"allow_nonfinite": True})
    broadcast(at(allowed, 0), Opened(bad, (0, 1)), tally := Tally())
    assert len(tally.warnings) == 1 and "input.allow_nonfinite=true" in tally.warnings[0]


def test_flatten_describes_each_local_tensor_and_refuses_a_unit_whose_steps_differ(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    for rank in range(WORLD):
        flat = flatten(at(plan, rank), described(plan), Tally())
        layout = plan.target_layout(rank)
        assert set(flat.entries) == {t.key for t in layout if t.stepped}
        for tensor in layout:
            entry = flat.entries[tensor.key]
            assert entry["exp_avg"] == TensorRef(tensor.shape, "float32") and float(entry["step"]) == 3.0
    tensors = source_tensors(plan)
    tensors["towers.0.mix"]["step"] = torch.tensor(4.0)  # one parameter of tower 0's flat parameter stepped once more
    with pytest.raises(ValueError, match="must have the same scalar state 'step'"):
        flatten(at(plan, 0), described(plan, tensors), Tally())


def test_shard_cuts_each_rank_its_ranges_and_pads_with_zeros(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    tensors = source_tensors(plan)
    covered: dict[str, int] = {}
    for rank in range(WORLD):
        sharded = sharded_on(plan, rank)
        for tensor in plan.target_layout(rank):
            got = sharded.state[tensor.key]["exp_avg"].reshape(-1)
            expected = torch.zeros(got.numel())
            for seg in tensor.segments:
                expected[seg.dest : seg.dest + seg.length] = (
                    tensors[seg.fqn]["exp_avg"].reshape(-1)[seg.start : seg.start + seg.length]
                )
                covered[seg.fqn] = covered.get(seg.fqn, 0) + seg.length
            assert torch.equal(got, expected), (rank, tensor.key)
    assert covered == {p.fqn: p.numel for p in plan.tree.params}, "the ranks together cover every source element once"
    padded = [t for t in plan.target_layout(WORLD - 1) if sum(s.length for s in t.segments) < t.numel]
    assert padded, "the model's sizes leave rank 1 a padded shard: the case this test is for"


def test_shard_finds_nan_in_the_bytes_it_reads(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    tensors = source_tensors(plan)
    tensors["out.bias"]["exp_avg_sq"][2] = float("inf")
    found = []
    for rank in range(WORLD):
        try:
            sharded_on(plan, rank, described(plan, tensors))
        except ValueError as exc:
            found.append((rank, str(exc)))
    assert len(found) == 1 and "out.bias exp_avg_sq (1 element(s), first at flat index 2)" in found[0][1], found


def test_rekey_keys_by_the_target_optimizers_ids_and_keeps_the_sources_hyperparameters(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    sharded = sharded_on(plan, 0)
    keyed = rekey(at(plan, 0), sharded, Tally())
    state = keyed.state_dict["state"]
    assert sorted(state) == list(range(len(plan.target_layout(0))))
    for key, pid in keyed.keys.items():
        assert state[pid] is sharded.state[key]
    assert keyed.state_dict["param_groups"] == [{"params": sorted(state), "lr": 0.01, "betas": (0.9, 0.999)}]
    two_groups = MemoryReader(
        source_tensors(plan),
        [{"params": ["out.weight"], "lr": 0.1}, {"params": [p.fqn for p in plan.tree.params][:-2], "lr": 0.01}],
    )
    with pytest.raises(ValueError, match="the source has 2 param group"):
        rekey(at(plan, 0), sharded_on(plan, 0, Described(two_groups, None, two_groups.meta())), Tally())


def test_fqn_keyed_output_keeps_canonical_names(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, output={"format": "fsdp_full"})
    keyed = rekey(at(plan, 0), sharded_on(plan, 0), Tally())
    assert set(keyed.state_dict["state"]) == {p.fqn for p in plan.tree.params}
    # FSDP1's flat parameters: the root's (out) first
    in_optimizer_order = [f for t in plan.optimizer_layout(0) for f in t.fqns]
    assert (
        keyed.state_dict["param_groups"][0]["params"] == in_optimizer_order
        and sorted(in_optimizer_order) == sorted(keyed.state_dict["state"])
    )


def test_save_stages_nothing_when_a_check_failed_and_the_files_when_all_passed(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    ctx = at(plan, 0)
    keyed = rekey(ctx, sharded_on(plan, 0), Tally())
    staging = Path(plan.spec.output.path) / output.STAGING
    failed = save(ctx, Verified(keyed, (CheckResult("roundtrip", False, "one element differs"),), ()), Tally())
    assert failed.files is None and not (staging.exists() and any(staging.iterdir()))
    passed = save(ctx, Verified(keyed, (CheckResult("roundtrip", True, "equal"),), ()), tally := Tally())
    assert passed.files is not None and sorted(passed.files.files) == ["rank_0.pt"]
    assert tally.moved == (staging / "rank_0.pt").stat().st_size > 0
    written = torch.load(staging / "rank_0.pt", weights_only=True)
    assert torch.equal(written["state"][0]["exp_avg"], keyed.state_dict["state"][0]["exp_avg"])


def test_every_product_holds_the_ones_it_was_made_from(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    sharded = sharded_on(plan, 0)
    keyed = rekey(at(plan, 0), sharded, Tally())
    staged = Staged(Verified(keyed, (), ()), None)
    assert find(staged, Keyed) is keyed and find(staged, Sharded) is sharded
    assert find(staged, Flattened) is sharded.flat and find(staged, Described) is sharded.source
    assert find(keyed, Verified) is None  # verify did not run before rekey


def test_a_plan_travels_without_what_it_computed(tmp_path: Path) -> None:
    import pickle

    plan = make_plan(tmp_path)
    layout = plan.target_layout(1)
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and not again._kept and again.target_layout(1) == layout


def test_a_run_builds_its_meta_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation (the model's default units), the plan, and every rank of an offline run share one meta model."""
    from osdpipe.layout import models
    from osdpipe.pipeline.execute import execute

    built = []
    real = models.build_model
    monkeypatch.setattr(models, "_last_meta", None)
    monkeypatch.setattr(models, "build_model", lambda *a, **k: built.append(k.get("device")) or real(*a, **k))
    spec = settle_and_validate(
        {
            "output": {"path": str(tmp_path / "out")},
            "target": {"world_size": 3},
            "runtime": {"mode": "offline", "progress": False},
        }
    )
    plan = plan_run(spec)
    report = execute(plan)
    assert report.ok, report.error
    assert built.count("meta") == 1, built


def test_a_plan_keeps_only_the_last_layouts_it_was_asked_for(tmp_path: Path) -> None:
    """A solo world asks about every rank: the plan must not hold 1024 ranks' layouts at once,
    and what it recomputes is the same."""
    from osdpipe.spec.plan import KEPT_LAYOUTS

    plan = make_plan(tmp_path, target={"world_size": 16})
    first = plan.target_layout(0)
    for rank in range(16):
        plan.target_layout(rank)
    assert len(plan._kept) <= KEPT_LAYOUTS
    assert plan.target_layout(0) == first


def test_the_resume_reference_steps_on_the_targets_device(tmp_path: Path) -> None:
    """A CUDA job's Adam rounds ``exp_avg_sq`` as CUDA's kernels do, one bit off the CPU's: the ``resume`` check's
    reference steps where the target stepped (the meta device stands in for a GPU here: only where it steps is
    asked), and on the CPU where it is not told."""
    from osdpipe.verify.resume_training import reference_for

    plan = make_plan(tmp_path)
    reader = MemoryReader(source_tensors(plan), None)  # the configured optimizer's hyperparameters
    reference = reference_for(plan.spec, reader.meta(), reader, plan.tree)
    fqn = plan.tree.params[0].fqn
    [(param, state)] = reference.pieces([(fqn, 0, 2)], torch.device("meta"))
    assert param.device.type == "meta" and state["exp_avg_sq"].device.type == "meta"
    [(param, state)] = reference.pieces([(fqn, 0, 2)])
    assert param.device.type == "cpu" and state["exp_avg_sq"].device.type == "cpu"
