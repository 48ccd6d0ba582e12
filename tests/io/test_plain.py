"""The ``plain`` format (an unwrapped model's own ``optim.state_dict()``) as input and output, and ``kind=none``.

A plain checkpoint keys its state by param ID: the position of each parameter
in the param groups of the optimizer that saved it, which is not necessarily
``named_parameters()`` order. The ID mapping is tested as pure functions; the
conversions are checked against PyTorch's own path (``FSDP.rekey_optim_state_dict``,
``FSDP.optim_state_dict_to_load``) independently of osdpipe's verify.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_osdpipe
from torch import nn

from osdpipe.core.compare import diff
from osdpipe.io.loading import without_records
from osdpipe.layout.idmap import IdMapError, map_ids
from osdpipe.layout.models import Block, build_model
from osdpipe.layout.tree import describe
from osdpipe.pipeline.execute import execute
from osdpipe.run.launch import run_local_world
from osdpipe.spec.config import RunSpec
from osdpipe.spec.plan import plan_run
from osdpipe.spec.reconcile import settle_and_validate

TIMEOUT_S = 120

#: The user's optimizer: block2 first, then head, embed and block1 with weight decay; named_parameters()
#: order is embed, block1, block2, head. Gates and embed.weight share a shape, as do the scales and embed.bias.
ID_GROUPS = [["block2.*"], ["head.*", "embed.*", "block1.*"]]
OPTIM_GROUPS = [{"params": ID_GROUPS[0]}, {"params": ID_GROUPS[1], "weight_decay": 0.1}]


def user_adam(model: nn.Module) -> torch.optim.Adam:
    """Plain PyTorch, as a user builds it over the unwrapped nested model: no osdpipe."""
    rest = [*model.head.parameters(), *model.embed.parameters(), *model.block1.parameters()]
    return torch.optim.Adam(
        [{"params": list(model.block2.parameters())}, {"params": rest, "weight_decay": 0.1}], lr=0.01
    )


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    for step in range(steps):
        batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed * 100 + step))
        optim.zero_grad(set_to_none=True)
        model(batch).pow(2).mean().backward()
        optim.step()


def all_finite(optim: torch.optim.Optimizer) -> bool:
    return all(
        bool(torch.isfinite(v).all())
        for s in optim.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.is_floating_point()
    )


def spec_for(out: Path, **sections) -> RunSpec:
    raw = {"output": {"path": str(out)}, "runtime": {"timeout_s": TIMEOUT_S, "progress": False}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return settle_and_validate(raw)


# ------------------------------------------------------------ the ID mapping, pure


def tree_of(*layers: nn.Module):
    with torch.device("meta"):
        return describe(nn.Sequential(*layers))


def adam_shapes(*shapes: tuple[int, ...]) -> dict[int, dict[str, tuple[int, ...]]]:
    return {i: {"exp_avg": s, "exp_avg_sq": s} for i, s in enumerate(shapes)}


def test_unique_shapes_map_whatever_the_order():
    tree = tree_of(nn.Linear(4, 3), nn.Linear(3, 2))  # (3, 4) (3,) (2, 3) (2,)
    # The optimizer got layer 1 first, in a group of its own.
    mapping = map_ids(tree, [[0, 1], [2, 3]], adam_shapes((2, 3), (2,), (3, 4), (3,)), None)
    assert mapping == {0: "1.weight", 1: "1.bias", 2: "0.weight", 3: "0.bias"}


def test_same_shape_parameters_with_state_and_no_groups_are_refused():
    tree = tree_of(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False), nn.Linear(4, 2))
    with pytest.raises(IdMapError) as info:
        map_ids(tree, [[0, 1, 2, 3]], adam_shapes((4, 4), (4, 4), (2, 4), (2,)), None)
    msg = str(info.value)
    assert "0.weight" in msg and "1.weight" in msg and "param ID(s) [0, 1]" in msg
    assert "input.param_groups=[[" in msg


def test_stateless_ids_map_only_when_it_cannot_matter():
    tree = tree_of(nn.Linear(4, 3), nn.Linear(3, 4))
    # SGD without momentum: no state at all. One group over every parameter: it holds the same parameters either way.
    assert sorted(map_ids(tree, [[0, 1, 2, 3]], {}, None).values()) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    # Two groups: which parameter is in which group (its hyperparameters) is unknown.
    with pytest.raises(IdMapError, match=r"no tensor state.*input\.param_groups"):
        map_ids(tree, [[0, 1], [2, 3]], {}, None)


def test_id_groups_map_by_position():
    tree = tree_of(nn.Linear(4, 3), nn.Linear(3, 4))  # 0.weight (3, 4), 1.weight (4, 3)
    saved, shapes = [[0, 1], [2, 3]], adam_shapes((4, 3), (4,), (3, 4), (3,))
    assert map_ids(tree, saved, shapes, [["1.*"], ["0.*"]]) == {0: "1.weight", 1: "1.bias", 2: "0.weight", 3: "0.bias"}
    # Patterns within a group keep their order, not named_parameters() order.
    flat = map_ids(tree, [[0, 1, 2, 3]], adam_shapes((4, 3), (3, 4), (3,), (4,)), [["1.weight", "0.weight", "*bias"]])
    assert flat == {0: "1.weight", 1: "0.weight", 2: "0.bias", 3: "1.bias"}


def test_id_groups_in_the_wrong_order_are_caught_by_shape():
    tree = tree_of(nn.Linear(4, 3), nn.Linear(3, 4))
    saved, shapes = [[0, 1], [2, 3]], adam_shapes((4, 3), (4,), (3, 4), (3,))
    with pytest.raises(IdMapError) as info:
        map_ids(tree, saved, shapes, [["0.*"], ["1.*"]])  # puts the (3, 4) weight where the (4, 3) one is
    msg = str(info.value)
    assert "param ID 0 maps to 0.weight of shape (3, 4)" in msg and "has shape (4, 3)" in msg
    assert "input.param_groups" in msg and "order" in msg


def test_id_groups_that_do_not_fit_the_checkpoint():
    tree = tree_of(nn.Linear(4, 3), nn.Linear(3, 4))
    shapes = adam_shapes((3, 4), (3,), (4, 3), (4,))
    with pytest.raises(IdMapError, match="has 1 param group.*gives 2"):
        map_ids(tree, [[0, 1, 2, 3]], shapes, [["0.*"], ["1.*"]])
    with pytest.raises(IdMapError, match=r"group 0 of the checkpoint holds 4.*matches 2"):
        map_ids(tree, [[0, 1, 2, 3]], shapes, [["0.*"]])
    with pytest.raises(IdMapError, match="matches no parameter"):
        map_ids(tree, [[0, 1, 2, 3]], shapes, [["nothing.*"]])
    with pytest.raises(IdMapError, match="none of its param groups holds"):
        map_ids(tree, [[0, 1, 2]], shapes, None)


# ------------------------------------------------- a user's plain checkpoint -> FSDP1


@pytest.fixture(scope="module")
def user_plain(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """A user's plain checkpoint (no process group, no osdpipe) and each parameter's exp_avg."""
    model = build_model("nested", {})
    optim = user_adam(model)
    train(model, optim, steps=2)
    path = tmp_path_factory.mktemp("user_plain") / "optim.pt"
    torch.save(optim.state_dict(), path)
    return str(path), {name: optim.state[p]["exp_avg"].clone() for name, p in model.named_parameters()}


def _pytorch_plain_to_fsdp(plain_path: str, out: str) -> tuple[list[str], bool]:
    """On each target rank: PyTorch's own path from the plain checkpoint, against osdpipe's rank file;
    then load and step."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = torch.load(plain_path, weights_only=True)
        unwrapped = build_model("nested", {})
        full = FSDP.rekey_optim_state_dict(plain, OptimStateKeyType.PARAM_NAME, unwrapped, optim=user_adam(unwrapped))
        model = FSDP(
            build_model("nested", {}), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
        )
        named = list(model.named_parameters())  # flat parameters: the root's (embed, head), block1's, block2's
        optim = torch.optim.Adam(
            [
                {"params": [p for n, p in named if "block2" in n]},
                {"params": [p for n, p in named if "block2" not in n], "weight_decay": 0.1},
            ],
            lr=0.01,
        )
        expected = FSDP.optim_state_dict_to_load(model, optim, full)
        got = torch.load(Path(out) / f"rank_{dist.get_rank()}.pt", weights_only=True)
        problems = diff(without_records(got), expected)
        optim.load_state_dict(got)
        train(model, optim, steps=1, seed=7)
    return problems, all_finite(optim)


def test_user_plain_checkpoint_with_shuffled_groups_to_fsdp1_matches_pytorch(user_plain, tmp_path):
    """A user's plain checkpoint from a model whose optimizer order differs from named_parameters(), and whose
    parameters share shapes, converts to FSDP1 on 2 ranks and matches PyTorch bitwise."""
    path, exp_avg = user_plain
    out = tmp_path / "out"
    spec = spec_for(
        out,
        source={"kind": "none", "world_size": 1},
        input={"path": path, "format": "plain", "param_groups": ID_GROUPS},
        target={"world_size": 2, "wrap": ["Block"]},
        optim={"param_groups": OPTIM_GROUPS},
    )
    report = execute(plan_run(spec))
    assert report.ok, report
    results = run_local_world(_pytorch_plain_to_fsdp, 2, (path, str(out)), timeout_s=TIMEOUT_S)
    for rank, (problems, finite) in enumerate(results):
        assert not problems, f"rank {rank} differs from FSDP.optim_state_dict_to_load: {problems}"
        assert finite, f"rank {rank}: non-finite state after a step"
    # The target's ID 0 is block2's flat parameter, which starts with block2.gate: the user's block2.gate
    # state is there, not that of block1.gate or embed.weight (same shape).
    rank0 = torch.load(out / "rank_0.pt", weights_only=True)
    gate = rank0["state"][0]["exp_avg"][:64]
    assert torch.equal(gate, exp_avg["block2.gate"].reshape(-1))
    assert (
        not torch.equal(gate, exp_avg["block1.gate"].reshape(-1))
        and not torch.equal(gate, exp_avg["embed.weight"].reshape(-1))
    )
    assert [g["params"] for g in rank0["param_groups"]] == [[0], [1, 2]]
    assert [g["weight_decay"] for g in rank0["param_groups"]] == [0, 0.1]


def test_user_plain_checkpoint_without_groups_says_how_to_fix_it(user_plain, tmp_path):
    path, _ = user_plain
    out = tmp_path / "out"
    spec = spec_for(  # the config is valid: only the checkpoint can tell that its IDs are ambiguous
        out,
        source={"kind": "none", "world_size": 1},
        input={"path": path, "format": "plain"},
        target={"world_size": 2, "wrap": ["Block"]},
        optim={"param_groups": OPTIM_GROUPS},
    )
    report = execute(plan_run(spec))
    assert not report.ok
    error = json.loads((out / "report.json").read_text())["error"]
    assert path in error and "input.param_groups=[[" in error  # found before any process started
    assert all(f in error for f in ("embed.weight", "block1.gate", "block2.gate")), error
    assert not list(out.glob("rank_*.pt"))


def test_a_checkpoint_read_in_the_other_format_says_so(user_plain, tmp_path):
    from osdpipe.io.formats.fsdp_full import FullReader
    from osdpipe.io.formats.plain import PlainReader

    with pytest.raises(ValueError, match="input.format=plain source.kind=none"):
        FullReader(user_plain[0]).meta()
    full = tmp_path / "full.pt"
    torch.save(
        {"state": {"head.bias": {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 0.1, "params": ["head.bias"]}]},
        full,
    )
    with pytest.raises(ValueError, match="keys its state by 'head.bias'.*input.format=fsdp_full"):
        PlainReader(str(full), describe(build_model("nested", {}, device="meta")), None).meta()


def test_plain_reader_meta_is_fqn_keyed(user_plain):
    """What every later stage sees: FQN-keyed state and groups in the optimizer's own order."""
    from osdpipe.io.formats.plain import PlainReader

    path, exp_avg = user_plain
    tree = describe(build_model("nested", {}, device="meta"))
    reader = PlainReader(path, tree, ID_GROUPS)
    meta = reader.meta()
    assert [g["params"][:2] for g in meta.param_groups] == [
        ["block2.gate", "block2.leaf1.scale"], ["head.weight", "head.bias"]
    ]
    assert meta.param_groups[1]["weight_decay"] == 0.1 and len(meta.state) == len(tree.params)
    assert torch.equal(reader.read([("block1.gate", "exp_avg")])[("block1.gate", "exp_avg")], exp_avg["block1.gate"])


# ---------------------------------------------------------------- FSDP1 -> plain


def test_fsdp1_to_plain_matches_pytorch_and_steps(tmp_path):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    out = tmp_path / "out"
    spec = spec_for(
        out,
        source={"world_size": 2, "wrap": ["Block"]},
        target={"kind": "none", "world_size": 1},
        output={"format": "plain"},
        optim={"param_groups": OPTIM_GROUPS},
    )
    report = execute(plan_run(spec))
    assert report.ok, report
    full = torch.load(out / "source" / "optim.pt", weights_only=True)
    got = torch.load(out / "optim.pt", weights_only=True)
    model = build_model("nested", {})
    optim = user_adam(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, model, optim=optim)
    assert diff(without_records(got), expected) == []
    # ID 0 is the first parameter of the first group: block2.gate, not named_parameters()' embed.weight.
    assert torch.equal(got["state"][0]["exp_avg"], full["state"]["block2.gate"]["exp_avg"])
    optim.load_state_dict(got)
    train(model, optim, steps=1, seed=7)
    assert all_finite(optim)


def test_reference_for_an_unwrapped_target_keys_groups_of_an_empty_state():
    """PyTorch's rekey_optim_state_dict returns a state with no entries unchanged (FQN-keyed groups);
    verify's reference must not."""
    from osdpipe.layout import kinds

    model = build_model("nested", {})
    optim = user_adam(model)  # no step taken: no state
    name = {p: n for n, p in model.named_parameters()}
    groups = [
        {**g, "params": [name[p] for p in live["params"]]}
        for g, live in zip(optim.state_dict()["param_groups"], optim.param_groups)
    ]
    assert kinds.get("none").to_load(model, optim, {"state": {}, "param_groups": groups}) == optim.state_dict()


# --------------------------------------------------------------------- recipes


@pytest.mark.parametrize(
    ("recipe", "files"), [("fsdp_to_plain", ["optim.pt"]), ("plain_to_fsdp", ["rank_0.pt", "rank_1.pt"])]
)
def test_recipe_runs_through_the_cli(recipe, files, tmp_path):
    out = tmp_path / "out"
    result = run_osdpipe(f"recipe={recipe}", f"output.path={out}", cwd=tmp_path)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] is True and all(c["ok"] for c in report["checks"]), report
    assert sorted(p.name for p in out.glob("*.pt")) == files

