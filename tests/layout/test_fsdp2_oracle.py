"""Hold osdpipe's FSDP2 layout (``kind="fsdp2"``) against real ``fully_shard`` DTensors.

osdpipe never asks PyTorch where an FSDP2 parameter's elements live: it
computes it (:meth:`osdpipe.layout.kinds.fsdp2.FSDP2.rank_layout`: one local tensor
per parameter, in ``model.parameters()`` order, the dim-0 chunk ``torch.chunk``
cuts, one segment, ``Shard(0)`` or HSDP's ``(Replicate(), Shard(0))``). Every
conversion into or out of an FSDP2 job copies by that math, so it is held here
against the real thing:

* **Real worlds** (gloo, CPU, 1-4 ranks): one spawned world per world size
  wraps every case of :func:`_cases` with real ``fully_shard`` (through
  ``osdpipe.layout.kinds.get("fsdp2").wrap`` and, for some cases, with hand-written
  ``fully_shard`` calls, so that osdpipe is not only checked against itself)
  on a model whose every element holds a value naming it
  (:func:`oracle_probe.fill_marked`). Each rank sends back, per parameter, its
  FQN, global and local shape, placements, mesh shape and local values, and
  the optimizer state after one Adam step on DTensor gradients; the test
  process compares them with ``rank_layout`` of the ``meta`` model: keys,
  order, shapes, placements, and that each segment is exactly the elements
  the rank holds.
* **Large worlds** (64 and 1024 ranks) on PyTorch's fake process group, a few
  ranks each, one rank at a time, in one subprocess per world size
  (``tests/support/oracle_probe.py``): construction only, no collective.
* **Pure math**: every element of every parameter is held exactly once per
  replica group, as ``torch.chunk`` cuts it; and the config refuses FSDP2
  settings that ``fully_shard`` has no meaning for.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from oracle_probe import (
    direct_fully_shard,
    expected_values,
    fill_marked,
    fsdp2_params,
    marks,
    run_fake_world,
    tree_marks,
    tree_of,
    world_once,
)
from pydantic import ValidationError

from osdpipe.layout.kinds import rank_layout
from osdpipe.layout.models import build_model
from osdpipe.layout.ranges import LayoutSpec, LocalTensor, Placement, Segment, shard_group
from osdpipe.layout.tree import ModuleTree, ParamInfo
from osdpipe.spec.config import LayoutConfig

WORLD_SIZES = (1, 2, 3, 4)
#: Per world: 2-5 s to spawn, plus wrapping and stepping every case on every rank.
WORLD_TIMEOUT_S = 120.0
#: Per fake-process-group subprocess (import torch, then a few ranks of construction).
FAKE_TIMEOUT_S = 120.0
FAKE_WORLD_SIZES = (64, 1024)

#: label -> (built-in factory, kwargs)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "nested": ("nested", {}),
    "nested_odd": ("nested", {"dim": 5, "hidden": 3, "blocks": 3}),  # 5 and 3 rows: uneven chunks at 2-4 ranks
    "transformer": ("transformer", {}),  # tok_embed.weight is tied to lm_head.weight
    # 2-3 rows: empty shards at 3-4 ranks
    "transformer_tiny": ("transformer", {"vocab": 7, "dim": 3, "hidden": 2, "layers": 1}),
    "mlp": ("mlp", {"width": 5, "depth": 3}),
    "mlp1": ("mlp", {"width": 1, "depth": 2}),  # one row: only shard 0 holds anything
}


@dataclass(frozen=True)
class Case:
    """One way of wrapping one model with ``fully_shard`` in a world."""

    model: str
    wrap: tuple[str, ...] = ()
    shard_group_size: int | None = None  # HSDP: mesh (world // s, s)
    param_dtype: str | None = None  # MixedPrecisionPolicy.param_dtype (changes no layout)
    direct: bool = False  # wrapped by hand-written fully_shard calls, not by osdpipe's FSDP2.wrap

    def spec(self, world_size: int) -> LayoutSpec:
        return LayoutSpec(
            kind="fsdp2",
            world_size=world_size,
            wrap=self.wrap,
            param_dtype=self.param_dtype,
            shard_group_size=self.shard_group_size,
        )

    @property
    def label(self) -> str:
        parts = [self.model, f"wrap[{','.join(self.wrap)}]"]
        if self.shard_group_size:
            parts.append(f"hsdp{self.shard_group_size}")
        if self.param_dtype:
            parts.append(f"mp_{self.param_dtype}")
        if self.direct:
            parts.append("direct")
        return "-".join(parts)


def _cases(world_size: int) -> list[Case]:
    """Every case of a world of ``world_size`` ranks: plain FSDP2, then HSDP on each shard group size that divides
    it."""
    wraps = {
        "nested": (
            (), ("Block",), ("Leaf",), ("Block", "Leaf"), ("block1", "block2.leaf1"), ("embed", "block2.leaf2.out")
        ),
        "nested_odd": (("Block",),),
        "transformer": ((), ("TransformerBlock",), ("layers.1",)),
        "transformer_tiny": (("TransformerBlock", "LayerNorm"),),
        "mlp": ((), ("Linear",), ("layers.0", "layers.2")),
        "mlp1": (("Linear",),),
    }
    out = [Case(model, wrap) for model, ws in wraps.items() for wrap in ws]
    out += [
        Case("nested", ("Block",), param_dtype="bfloat16"),
        Case("nested", ("Block", "Leaf"), direct=True),
        Case("transformer", (), direct=True),
    ]
    for size in (s for s in (1, 2, 3, 4) if world_size % s == 0):
        out += [Case("nested_odd", ("Block",), shard_group_size=size), Case("mlp1", ("Linear",), shard_group_size=size)]
        out += [Case("transformer_tiny", ("TransformerBlock",), shard_group_size=size)]
    if world_size % 2 == 0:
        out.append(Case("nested", ("Leaf",), shard_group_size=2, direct=True))
    return out


CASES = [(world_size, case) for world_size in WORLD_SIZES for case in _cases(world_size)]


def _tree(label: str) -> ModuleTree:
    return tree_of(MODELS, label)


# ---------------------------------------------------------------------------
# What real FSDP2 says (runs on every spawned rank)
# ---------------------------------------------------------------------------


def _adam_state(model: torch.nn.Module, tree: ModuleTree, spec: LayoutSpec, rank: int) -> dict[str, Any]:
    """One Adam step on osdpipe's synthetic DTensor gradients; per parameter, what its optimizer state holds."""
    from torch.distributed.tensor import DTensor

    from osdpipe.run.live_jobs import set_synthetic_grads

    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        set_synthetic_grads(list(model.parameters()), rank_layout(tree, spec, rank), seed=0, step=1)
        optim.step()
    except Exception as exc:  # noqa: BLE001 - reported per case
        return dict(error=f"{type(exc).__name__}: {exc}")
    states: list[dict[str, Any] | None] = []
    for p in model.parameters():
        state = optim.state.get(p)
        if not state:
            states.append(None)
            continue
        avg = state["exp_avg"]
        states.append(
            dict(
                keys=tuple(sorted(state)),
                dtensor=isinstance(avg, DTensor),
                local_shape=tuple(avg.to_local().shape) if isinstance(avg, DTensor) else tuple(avg.shape),
                placements=tuple(str(x) for x in avg.placements) if isinstance(avg, DTensor) else None,
                step=float(state["step"]),
            )
        )
    return dict(states=states)


def _fsdp2_world(cases: list[Case], world_size: int) -> list[dict[str, Any]]:
    """Wrap every case with real ``fully_shard`` and step it; return what each parameter and its state hold, as plain
    data."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from osdpipe.layout import kinds

    torch.set_num_threads(1)
    rank = dist.get_rank()
    meshes: dict[tuple[int, ...], Any] = {}  # the hand-made meshes of the direct cases, made once per shape
    out = []
    for case in cases:
        factory, kwargs = MODELS[case.model]
        model = build_model(factory, kwargs, seed=0)
        fill_marked(model)
        spec = case.spec(world_size)
        if case.direct:
            shape = (
                (world_size // case.shard_group_size, case.shard_group_size) if case.shard_group_size else (world_size,)
            )
            if shape not in meshes:
                meshes[shape] = init_device_mesh(
                    "cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard")[-len(shape) :]
                )
            model = direct_fully_shard(model, list(case.wrap), meshes[shape])
        else:
            model = kinds.get("fsdp2").wrap(model, spec)
        tree = _tree(case.model)
        out.append(dict(params=fsdp2_params(model), step=_adam_state(model, tree, spec, rank)))
    return out


def _world(world_size: int) -> list[list[dict[str, Any]]]:
    """Every rank's answer for every case of ``world_size`` (one spawned world per size, failures included)."""
    cases = [case for ws, case in CASES if ws == world_size]
    return world_once("FSDP2", _fsdp2_world, world_size, (cases, world_size), WORLD_TIMEOUT_S)


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------


def _check_param(t: LocalTensor, got: dict[str, Any], info: ParamInfo, where: dict[str, int] | None) -> list[str]:
    """Differences between one real DTensor parameter and the layout's local tensor for it."""
    errors = []
    if tuple(got["shape"]) != info.shape:
        errors.append(f"global shape {tuple(got['shape'])}, the meta model's {info.shape}")
    if tuple(got["local_shape"]) != t.shape:
        errors.append(f"local shape {tuple(got['local_shape'])}, layout {t.shape}")
    real = Placement(tuple(got["mesh"]), tuple(got["placements"]), tuple(got["mesh_dim_names"]))
    # names are a job's own (this one's are torchtitan's)
    if t.placement is None or (real.mesh, real.placements) != (t.placement.mesh, t.placement.placements):
        errors.append(f"placement {real}, layout {t.placement}")
    if t.fqns != (t.key,) or t.flat or not t.stepped:
        errors.append(
            f"layout tensor has fqns={t.fqns} flat={t.flat} stepped={t.stepped}; expected ({t.key},), False, True"
        )
    if len(t.segments) > 1 or any(s.dest != 0 or s.fqn != t.key for s in t.segments):
        errors.append(f"layout segments {t.segments}: expected at most one, of {t.key}, at dest 0")
    if where is not None and got["values"] is not None:
        want = expected_values(t.numel, t.segments, where)
        if list(got["values"]) != want:
            held = [v - where[t.key] for v in got["values"]]
            errors.append(
                f"holds elements {_ranges(held)} of the flattened parameter,"
                f" layout says {[(s.start, s.start + s.length) for s in t.segments]}"
            )
    return errors


def _ranges(elements: list[int]) -> list[tuple[int, int]]:
    """``[0, 1, 2, 5, 6]`` as ``[(0, 3), (5, 7)]``: which elements a rank holds, short."""
    out: list[tuple[int, int]] = []
    for e in elements:
        if out and out[-1][1] == e:
            out[-1] = (out[-1][0], e + 1)
        else:
            out.append((e, e + 1))
    return out


def _check(
    tree: ModuleTree, spec: LayoutSpec, rank: int, got: dict[str, Any], where: dict[str, int] | None
) -> list[str]:
    """Differences between one rank's real FSDP2 parameters (and Adam state, when stepped) and ``rank_layout``."""
    if "error" in got:
        return [f"wrapping failed: {got['error']}"]
    tensors = rank_layout(tree, spec, rank)
    keys = [t.key for t in tensors]
    real = [p["fqn"] for p in got["params"]]
    if real != keys:
        return [f"model.parameters() are {real}, the layout's keys {keys}"]
    errors = []
    for t, p in zip(tensors, got["params"]):
        errors += [f"{t.key}: {e}" for e in _check_param(t, p, tree.param(t.key), where)]
    step = got.get("step")
    if step is None:
        return errors
    if "error" in step:
        return [*errors, f"Adam step on synthetic gradients failed: {step['error']}"]
    for t, p, state in zip(tensors, got["params"], step["states"], strict=True):
        if state is None:
            errors.append(
                f"{t.key}: no optimizer state after a step (layout: stepped={t.stepped}, local shape {t.shape})"
            )
            continue
        if not state["dtensor"] or state["local_shape"] != t.shape or state["placements"] != tuple(p["placements"]):
            errors.append(
                f"{t.key}: exp_avg is {state}, expected a DTensor of local shape {t.shape}"
                f" placed {tuple(p['placements'])}"
            )
        if state["step"] != 1.0 or not {"exp_avg", "exp_avg_sq", "step"} <= set(state["keys"]):
            errors.append(
                f"{t.key}: state {state['keys']} at step {state['step']}, expected exp_avg, exp_avg_sq, step at 1"
            )
    return errors


@pytest.mark.parametrize("world_size,case", CASES, ids=[f"ws{ws}-{case.label}" for ws, case in CASES])
def test_layout_matches_fully_shard(world_size: int, case: Case) -> None:
    results = _world(world_size)  # spawned once per world size, timed out by WORLD_TIMEOUT_S
    i = [c for ws, c in CASES if ws == world_size].index(case)
    tree, spec = _tree(case.model), case.spec(world_size)
    errors = []
    for rank, per_rank in enumerate(results):
        errors += [f"rank {rank}/{world_size}: {e}" for e in _check(tree, spec, rank, per_rank[i], tree_marks(tree))]
    if errors:
        pytest.fail(f"{case.label} (world size {world_size}):\n  " + "\n  ".join(errors), pytrace=False)


def test_real_worlds_hold_empty_and_uneven_shards() -> None:
    """The cases above reach what matters: 0-row shards (stepped all the same), uneven chunks, HSDP replicas."""
    seen = {"empty": 0, "uneven": 0, "replica": 0}
    for world_size, case in CASES:
        spec = case.spec(world_size)
        for rank in range(world_size):
            for t in rank_layout(_tree(case.model), spec, rank):
                full_rows = _tree(case.model).param(t.key).shape[0]
                seen["empty"] += t.shape[0] == 0
                seen["uneven"] += 0 < t.shape[0] < -(-full_rows // shard_group(spec, rank)[0])
            seen["replica"] += spec.replicas > 1 and rank >= spec.shard_group_size
    assert all(seen.values()), seen


# ---------------------------------------------------------------------------
# Large worlds on the fake process group
# ---------------------------------------------------------------------------

#: label -> (built-in factory, kwargs): tiny widths leave most of 64 or 1024 ranks empty;
#: 2047 rows leave the last one a partial chunk.
FAKE_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp3": ("mlp", {"width": 3, "depth": 2}),
    "lm2047": ("transformer", {"vocab": 2047, "dim": 4, "hidden": 6, "layers": 1}),
    "nested": ("nested", {}),
}


def _fake_ranks(world_size: int) -> list[int]:
    """Rank 0, a middle one, the last, and one just past the few that hold rows of the tiny models (it holds none)."""
    return [0, world_size // 2 + 1, world_size - 1, 5]


def _fake_cases(world_size: int) -> list[Case]:
    out = [
        Case("mlp3", ()),
        Case("mlp3", ("Linear",)),
        Case("lm2047", ("TransformerBlock",)),
        Case("nested", ("Block", "Leaf")),
    ]
    for size in (8, world_size // 16):  # (N/8, 8) and (16, N/16): (16, 64) at 1024 ranks
        out += [Case("mlp3", ("Linear",), shard_group_size=size), Case("lm2047", (), shard_group_size=size)]
    return out


def _fake_tree(label: str) -> ModuleTree:
    return tree_of(FAKE_MODELS, label)


@functools.cache
def _fake_world(world_size: int) -> dict[int, list[dict[str, Any]]]:
    """Every probed rank's answer for every fake case (one subprocess for the world size, one rank after the other)."""
    cases = [
        dict(
            kind="fsdp2",
            factory=FAKE_MODELS[c.model][0],
            kwargs=FAKE_MODELS[c.model][1],
            wrap=list(c.wrap),
            shard_group_size=c.shard_group_size,
        )
        for c in _fake_cases(world_size)
    ]
    return run_fake_world(world_size, _fake_ranks(world_size), cases, FAKE_TIMEOUT_S)


@pytest.mark.parametrize("world_size", FAKE_WORLD_SIZES)
def test_large_worlds_match_fully_shard_on_a_fake_group(world_size: int) -> None:
    results = _fake_world(world_size)
    errors = []
    for i, case in enumerate(_fake_cases(world_size)):
        spec, tree = case.spec(world_size), _fake_tree(case.model)
        where = marks([(p.fqn, p.numel) for p in tree.params])
        for rank in _fake_ranks(world_size):
            errors += [
                f"{case.label} rank {rank}/{world_size}: {e}" for e in _check(tree, spec, rank, results[rank][i], where)
            ]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("world_size", FAKE_WORLD_SIZES)
def test_large_world_ranks_reach_empty_and_partial_shards(world_size: int) -> None:
    """The probed ranks hold, between them, a full chunk, a partial last chunk and an empty shard,
    with and without HSDP."""
    kinds_seen: set[tuple[bool, str]] = set()
    for case in _fake_cases(world_size):
        spec, tree = case.spec(world_size), _fake_tree(case.model)
        for rank in _fake_ranks(world_size):
            for t in rank_layout(tree, spec, rank):
                chunk = -(-tree.param(t.key).shape[0] // shard_group(spec, rank)[0])
                what = "empty" if t.shape[0] == 0 else "full" if t.shape[0] == chunk else "partial"
                kinds_seen.add((spec.shard_group_size is not None, what))
    assert kinds_seen == {(h, w) for h in (False, True) for w in ("empty", "full", "partial")}, sorted(kinds_seen)


# ---------------------------------------------------------------------------
# Pure math
# ---------------------------------------------------------------------------


def _random_tree(rng: random.Random, n: int) -> ModuleTree:
    shapes = [(1,), (2,), (3, 1), (5, 2), (7,), (0, 3), (64,), (65, 2), (1023,), (1025, 1), (2048,)]
    shapes += [tuple(rng.randrange(1, 40) for _ in range(rng.randrange(1, 4))) for _ in range(n)]
    params = tuple(ParamInfo(fqn=f"p{i}", shape=s, dtype="float32", owner="") for i, s in enumerate(shapes))
    return ModuleTree(modules=(("", "Model"),), params=params)


def _groups(world_size: int) -> list[int | None]:
    """No HSDP, then a few shard group sizes that divide ``world_size`` (1 and the whole world included)."""
    if world_size > 64:  # every rank of a 1024-rank world is checked: a few groups suffice
        return [None, 8, 64]
    return [None, *sorted({s for s in (1, 2, 3, 8, 64, world_size) if world_size % s == 0})]


@pytest.mark.parametrize("world_size", (1, 2, 3, 5, 8, 64, 1024))
def test_every_element_is_held_once_per_replica_group(world_size: int) -> None:
    """Per replica group, the ranks' segments tile every parameter exactly once, as ``torch.chunk`` cuts it on dim 0."""
    tree = _random_tree(random.Random(world_size), 12)
    for size in _groups(world_size):
        spec = LayoutSpec(kind="fsdp2", world_size=world_size, shard_group_size=size)
        shards = size or world_size
        mesh = (
            Placement((spec.replicas, shards), ("R", "S(0)"), ("replicate", "shard"))
            if size
            else Placement((world_size,), ("S(0)",), ("shard",))
        )
        layouts = [rank_layout(tree, spec, rank) for rank in range(world_size)]
        for j, p in enumerate(tree.params):
            # torch.chunk's rows per shard (missing trailing chunks hold none),
            # and where each starts in the flattened view
            rows = [len(c) for c in torch.arange(p.shape[0]).chunk(shards)] if p.shape[0] else []
            rows += [0] * (shards - len(rows))
            row_numel = p.numel // p.shape[0] if p.shape[0] else 0
            for rank in range(world_size):
                index = rank % shards
                t = layouts[rank][j]
                where = f"ws={world_size} s={size} rank={rank} {p.fqn}{p.shape}"
                assert shard_group(spec, rank) == (shards, index), where
                assert t.shape == (rows[index], *p.shape[1:]), (
                    f"{where}: shape {t.shape}, torch.chunk gives {rows[index]} rows"
                )
                start, length = sum(rows[:index]) * row_numel, rows[index] * row_numel
                want = (Segment(p.fqn, start, length, 0),) if length else ()
                assert t.segments == want, f"{where}: segments {t.segments}, torch.chunk gives {want}"
                assert t.placement == mesh, f"{where}: placement {t.placement}, expected {mesh}"
            # per replica group the chunks tile the parameter: each element once
            assert sum(rows) == p.shape[0], f"ws={world_size} s={size}: {p.fqn} rows {rows}"
        for rank in range(world_size - shards):
            assert layouts[rank] == layouts[rank + shards], (
                f"ws={world_size} s={size}: ranks {rank} and {rank + shards} differ"
            )


def test_every_element_is_held_once_small() -> None:
    """Element by element, against ``torch.chunk`` itself, for small worlds (the test above counts rows)."""
    tree = _random_tree(random.Random(0), 6)
    for world_size in (1, 2, 3, 4, 6):
        for size in _groups(world_size):
            spec = LayoutSpec(kind="fsdp2", world_size=world_size, shard_group_size=size)
            shards = size or world_size
            for p in tree.params:
                full = torch.arange(p.numel).view(p.shape)
                pieces = full.chunk(shards, dim=0) if p.shape[0] else ()
                for group in range(spec.replicas):
                    counts = [0] * p.numel
                    for index in range(shards):
                        t = next(t for t in rank_layout(tree, spec, group * shards + index) if t.key == p.fqn)
                        held = [i for s in t.segments for i in range(s.start, s.start + s.length)]
                        want = pieces[index].flatten().tolist() if index < len(pieces) else []
                        assert held == want, (
                            f"ws={world_size} s={size} shard {index}: {p.fqn}{p.shape} holds {held}, torch.chunk {want}"
                        )
                        for i in held:
                            counts[i] += 1
                    assert all(c == 1 for c in counts), (
                        f"ws={world_size} s={size}: {p.fqn} held {sorted(set(counts))} times"
                    )


@pytest.mark.parametrize(
    "settings,key",
    [
        (dict(sharding_strategy="NO_SHARD"), "sharding_strategy"),
        (dict(sharding_strategy="HYBRID_SHARD", shard_group_size=2), "sharding_strategy"),
        (dict(wrap_root=False, wrap=["Block"]), "wrap_root"),
        (dict(world_size=4, shard_group_size=3), "shard_group_size"),
    ],
    ids=["no_shard", "hybrid_strategy", "no_root", "group_not_dividing"],
)
def test_config_refuses_what_fully_shard_cannot_do(settings: dict[str, Any], key: str) -> None:
    with pytest.raises(ValidationError) as info:
        LayoutConfig(kind="fsdp2", **{"world_size": 4, **settings})
    assert key in str(info.value), f"{settings}: the error does not name {key}: {info.value}"


def test_config_accepts_hsdp_and_full_shard() -> None:
    for settings in (
        dict(),
        dict(shard_group_size=2),
        dict(shard_group_size=4),
        dict(shard_group_size=1),
        dict(sharding_strategy="SHARD_GRAD_OP"),
    ):
        assert LayoutConfig(kind="fsdp2", world_size=4, **settings).spec().kind == "fsdp2"
