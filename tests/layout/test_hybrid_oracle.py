"""Hold osdpipe's FSDP1 hybrid-sharding layout against real ``FullyShardedDataParallel``, and FSDP1 in large worlds.

osdpipe says that FSDP1 with ``HYBRID_SHARD`` or ``_HYBRID_SHARD_ZERO2`` and
``shard_group_size=s`` lays out exactly as ``FULL_SHARD`` in a world of ``s``
ranks, rank ``r`` holding shard ``r % s`` (:func:`osdpipe.layout.ranges.shard_group`),
every replica group alike. Conversions into and out of a hybrid job copy by
that math, so it is held here against the real thing, as
``test_layout_oracle.py`` holds FULL_SHARD, SHARD_GRAD_OP and NO_SHARD:

* **A real world** (gloo, CPU, 4 ranks, spawned once): every combination of
  :data:`COMBOS` (shard groups of 1, 2 and 4 ranks, ``use_orig_params`` off
  and on, several wrappings) is wrapped by ``osdpipe.layout.kinds.get("fsdp1").wrap``,
  and some by hand-written ``FullyShardedDataParallel`` calls on a hand-made
  mesh, on a model whose every element holds a value naming it
  (:func:`oracle_probe.fill_marked`). Each rank sends back its
  FlatParameter metadata (``_fqns``, ``_numels_with_padding``,
  ``_shard_param_infos``, the local numel, the shard process group) and its
  local values; the test process compares them with
  :func:`~osdpipe.layout.kinds.fsdp1.flat_param_layouts` and ``rank_layout`` of the
  ``meta`` model, and checks that ranks ``r`` and ``r + s`` hold the same
  shards, in the layout and for real.
* **Large worlds** (64 and 1024 ranks) on PyTorch's fake process group, a few
  ranks each, one rank at a time, in one subprocess per world size
  (``tests/support/oracle_probe.py``): FULL_SHARD and hybrid construction only, no
  collective.
* **Pure math**: :func:`~osdpipe.layout.ranges.shard_group`, hybrid as FULL_SHARD
  of one shard group, and the config's refusals of shard groups that make
  no sense.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
from oracle_probe import (
    direct_fsdp1,
    expected_values,
    fill_marked,
    fsdp1_metadata,
    run_fake_world,
    tree_marks,
    tree_of,
    world_once,
)
from pydantic import ValidationError

from osdpipe.layout.kinds import rank_layout
from osdpipe.layout.kinds.fsdp1 import flat_param_key, flat_param_layouts, shards
from osdpipe.layout.models import build_model
from osdpipe.layout.ranges import HYBRID_STRATEGIES, LayoutSpec, Segment, chunk_bounds, shard_group
from osdpipe.layout.tree import ModuleTree
from osdpipe.spec.config import LayoutConfig

WORLD_SIZE = 4
#: The world: 3-5 s to spawn, plus wrapping every combination on every rank.
WORLD_TIMEOUT_S = 120.0
#: Per fake-process-group subprocess (import torch, then a few ranks of construction).
FAKE_TIMEOUT_S = 120.0
FAKE_WORLD_SIZES = (64, 1024)

#: label -> (built-in factory, kwargs)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "nested": ("nested", {}),
    "transformer": ("transformer", {}),  # tok_embed.weight is tied to lm_head.weight
    "mlp": ("mlp", {"width": 5, "depth": 3}),  # odd numels: 25 + 5 per layer
    "mlp1": ("mlp", {"width": 1, "depth": 2}),  # 2-element units: trailing ranks of a group hold only padding
    # large worlds: 3-wide layers leave most of 64 or 1024 ranks with padding only; 2047 rows, a partial last chunk
    "mlp3": ("mlp", {"width": 3, "depth": 2}),
    "lm2047": ("transformer", {"vocab": 2047, "dim": 4, "hidden": 6, "layers": 1}),
}


@dataclass(frozen=True)
class Combo:
    """One way of wrapping one model with FSDP1."""

    model: str
    wrap: tuple[str, ...] = ()
    strategy: str = "HYBRID_SHARD"
    use_orig_params: bool = False
    shard_group_size: int | None = 2
    wrap_root: bool = True
    param_dtype: str | None = None
    direct: bool = False  # FullyShardedDataParallel called by hand on a hand-made mesh, not osdpipe's FSDP1.wrap

    def spec(self, world_size: int) -> LayoutSpec:
        return LayoutSpec(
            kind="fsdp1",
            world_size=world_size,
            sharding_strategy=self.strategy,  # type: ignore[arg-type]
            use_orig_params=self.use_orig_params,
            wrap=self.wrap,
            wrap_root=self.wrap_root,
            param_dtype=self.param_dtype,
            shard_group_size=self.shard_group_size,
        )

    @property
    def label(self) -> str:
        parts = [self.model, f"wrap[{','.join(self.wrap)}]", self.strategy, "orig" if self.use_orig_params else "flat"]
        if self.shard_group_size:
            parts.append(f"s{self.shard_group_size}")
        if not self.wrap_root:
            parts.append("noroot")
        if self.param_dtype:
            parts.append(f"mp_{self.param_dtype}")
        if self.direct:
            parts.append("direct")
        return "-".join(parts)


def _combos() -> list[Combo]:
    """Hybrid combinations for a world of 4: shard groups of 1 (FSDP1 then does NO_SHARD), 2 and 4 ranks."""
    wraps = {
        "nested": ((), ("Block",), ("Block", "Leaf"), ("block1", "block2.leaf1")),
        "transformer": ((), ("TransformerBlock",)),
        "mlp": ((), ("Linear",)),
        "mlp1": (("Linear",),),
    }
    out = []
    for model, model_wraps in wraps.items():
        for wrap in model_wraps:
            for orig in (False, True):
                out += [Combo(model, wrap, "HYBRID_SHARD", orig, size) for size in (1, 2, 4)]
                out.append(Combo(model, wrap, "_HYBRID_SHARD_ZERO2", orig, 2))
    out += [Combo("nested", ("Block",), "HYBRID_SHARD", orig, 2, wrap_root=False) for orig in (False, True)]
    out += [Combo("nested", ("Block",), "HYBRID_SHARD", True, 2, param_dtype="bfloat16")]  # aligned to 8 fp32 elements
    out += [
        Combo("nested", ("Block",), "HYBRID_SHARD", False, 2, direct=True),
        Combo("transformer", (), "_HYBRID_SHARD_ZERO2", True, 2, direct=True),
    ]
    return out


COMBOS = _combos()


def _tree(label: str) -> ModuleTree:
    return tree_of(MODELS, label)


# ---------------------------------------------------------------------------
# What real FSDP1 says (runs on every spawned rank)
# ---------------------------------------------------------------------------


def _hybrid_world(combos: list[Combo], world_size: int) -> list[dict[str, Any]]:
    """Wrap every combination with real FSDP1; return its FlatParameter metadata and local values as plain data."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from osdpipe.layout import kinds

    warnings.simplefilter("ignore")  # FSDP1's deprecation, the shard-group-of-1 NO_SHARD switch
    import torch

    torch.set_num_threads(1)
    meshes: dict[tuple[int, int], Any] = {}  # the hand-made meshes of the direct combinations
    out = []
    for combo in combos:
        factory, kwargs = MODELS[combo.model]
        model = build_model(factory, kwargs, seed=0)
        fill_marked(model)
        try:
            if combo.direct:
                shape = (world_size // combo.shard_group_size, combo.shard_group_size)
                if shape not in meshes:
                    meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("inter", "intra"))
                wrapped = direct_fsdp1(model, list(combo.wrap), combo.strategy, combo.use_orig_params, meshes[shape])
            else:
                wrapped = kinds.get("fsdp1").wrap(model, combo.spec(world_size))
            out.append(fsdp1_metadata(wrapped))
        except Exception as exc:  # noqa: BLE001 - reported per combination
            out.append(dict(error=f"{type(exc).__name__}: {exc}"))
    return out


def _world() -> list[list[dict[str, Any]]]:
    """Every rank's answer for every combination (one spawned world, failures included)."""
    return world_once("FSDP1 hybrid", _hybrid_world, WORLD_SIZE, (COMBOS, WORLD_SIZE), WORLD_TIMEOUT_S)


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------


def check_fsdp1(
    tree: ModuleTree, spec: LayoutSpec, rank: int, got: dict[str, Any], where: dict[str, int] | None = None
) -> list[str]:
    """Differences between one rank's real FSDP1 metadata (and local values) and osdpipe's layout of ``spec``.

    The shard group and index come from :func:`~osdpipe.layout.ranges.shard_group`
    (the whole world, or ``shard_group_size`` ranks for hybrid sharding), so
    this holds any FSDP1 strategy.
    """
    if "error" in got:
        return [f"wrapping failed: {got['error']}"]
    flats = flat_param_layouts(tree, spec)
    tensors = rank_layout(tree, spec, rank)
    local = {t.key: t for t in tensors}
    size, index = shard_group(spec, rank)
    sharded = shards(spec)
    got_units = [u["unit"] for u in got["units"]]
    if got_units != [f.unit for f in flats]:
        return [f"FSDP units with parameters {got_units}, layout says {[f.unit for f in flats]}"]
    errors = []
    for flat, unit in zip(flats, got["units"]):
        label = f"unit {flat.unit or '<root>'!r}"
        full = tuple(f"{flat.unit}.{f}" if flat.unit else f for f in unit["fqns"])
        if full != flat.fqns:
            errors.append(f"{label}: flattened parameters {full}, layout {flat.fqns}")
        names = iter(full)
        entries = tuple(
            (None if pad else next(names, "?"), n)
            for n, pad in zip(unit["numels_with_padding"], unit["is_padding_mask"], strict=True)
        )
        if entries != flat.entries:
            errors.append(f"{label}: flat entries (fqn or None for padding, numel) {entries}, layout {flat.entries}")
        strategy = spec.sharding_strategy if sharded else "NO_SHARD"
        if (unit["sharded"], unit["strategy"]) != (sharded, strategy):
            errors.append(
                f"{label}: FSDP runs {unit['strategy']} (sharded={unit['sharded']}),"
                f" layout says {strategy} (sharded={sharded})"
            )
        if tuple(unit["shard_group"]) != (size, index):
            errors.append(
                f"{label}: FSDP shards over {unit['shard_group'][0]} ranks as index {unit['shard_group'][1]},"
                f" layout says {size} as {index}"
            )
        chunk = chunk_bounds(flat.total, size, index)[2] if sharded else flat.total
        if unit["local_numel"] != chunk:
            errors.append(
                f"{label}: local flat numel {unit['local_numel']},"
                f" layout's shard of {flat.total} over {size} is {chunk}"
            )
        infos = unit["shard_param_infos"]
        if len(infos) != len(full):
            errors.append(f"{label}: {len(infos)} shard infos for {len(full)} parameters")
            continue
        for (in_shard, _off, numel, lo, hi), fqn in zip(infos, full):
            if in_shard and numel != hi - lo + 1:  # how the fields read: inclusive end
                errors.append(f"{label}: {fqn}: numel_in_shard {numel} != intra [{lo}, {hi}]")
        held = [(fqn, lo, numel, off) for (in_shard, off, numel, lo, _hi), fqn in zip(infos, full) if in_shard]
        if spec.use_orig_params:
            for fqn in full:
                mine = [Segment(f, lo, numel, 0) for f, lo, numel, _off in held if f == fqn]
                t = local.get(fqn)
                if t is None or t.segments != tuple(mine) or t.flat != sharded:
                    errors.append(f"{label}: {fqn}: FSDP holds {mine}, layout {t}")
        else:
            t = local.get(flat_param_key(flat.unit))
            want = tuple(Segment(f, lo, numel, off) for f, lo, numel, off in held)
            if t is None or t.segments != want or t.fqns != flat.fqns or not t.flat:
                errors.append(f"{label}: FSDP holds {want}, layout {t}")
    real = [(p["fqn"], tuple(p["local_shape"])) for p in got["params"]]
    if real != [(t.key, t.shape) for t in tensors]:
        errors.append(
            f"(name, local shape) of the wrapped model's parameters {real},"
            f" layout {[(t.key, t.shape) for t in tensors]}"
        )
    elif where is not None:
        for p, t in zip(got["params"], tensors):
            if p["values"] is not None and list(p["values"]) != expected_values(t.numel, t.segments, where):
                errors.append(
                    f"{t.key}: local values {_short(p['values'])}, layout's segments {t.segments}"
                    f" give {_short(expected_values(t.numel, t.segments, where))}"
                )
    return errors


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 12 else f"{values[:6]} ... {values[-6:]} ({len(values)})"


@pytest.mark.parametrize("combo", COMBOS, ids=[c.label for c in COMBOS])
def test_layout_matches_hybrid_fsdp1(combo: Combo) -> None:
    results = _world()  # spawned once, timed out by WORLD_TIMEOUT_S
    i = COMBOS.index(combo)
    tree, spec = _tree(combo.model), combo.spec(WORLD_SIZE)
    errors = []
    for rank, per_rank in enumerate(results):
        errors += [
            f"rank {rank}/{WORLD_SIZE}: {e}" for e in check_fsdp1(tree, spec, rank, per_rank[i], tree_marks(tree))
        ]
    if errors:
        pytest.fail(f"{combo.label} (world size {WORLD_SIZE}):\n  " + "\n  ".join(errors), pytrace=False)


@pytest.mark.parametrize("combo", [c for c in COMBOS if c.shard_group_size < WORLD_SIZE], ids=lambda c: c.label)
def test_replica_groups_hold_the_same_shards(combo: Combo) -> None:
    """Ranks ``r`` and ``r + s`` hold the same shards: in osdpipe's layout,
    and in real FSDP1's metadata and local values."""
    results = _world()
    i = COMBOS.index(combo)
    tree, spec, size = _tree(combo.model), combo.spec(WORLD_SIZE), combo.shard_group_size
    for rank in range(WORLD_SIZE - size):
        assert rank_layout(tree, spec, rank) == rank_layout(tree, spec, rank + size), (
            f"layout: ranks {rank} and {rank + size} differ"
        )
        assert results[rank][i] == results[rank + size][i], (
            f"FSDP1: ranks {rank} and {rank + size} hold different shards"
        )


# ---------------------------------------------------------------------------
# Large worlds on the fake process group
# ---------------------------------------------------------------------------


def _fake_ranks(world_size: int) -> list[int]:
    """Rank 0, a middle one, the last, and one just past the few that hold any element of the tiny models (padding
    only)."""
    return [0, world_size // 2 + 1, world_size - 1, 30]


def _fake_combos(world_size: int) -> list[Combo]:
    out = [Combo("mlp3", (), "FULL_SHARD", orig, None) for orig in (False, True)]
    out += [
        Combo("mlp3", ("Linear",), "FULL_SHARD", True, None),
        Combo("nested", ("Block", "Leaf"), "FULL_SHARD", True, None),
    ]
    out += [Combo("lm2047", ("TransformerBlock",), "FULL_SHARD", orig, None) for orig in (False, True)]
    # the root: 2047 x 4, the last rank's chunk partial
    out.append(Combo("lm2047", ("TransformerBlock", "LayerNorm"), "FULL_SHARD", False, None))
    for size in (8, world_size // 16):  # (N/8, 8) and (16, N/16): (16, 64) at 1024 ranks
        out += [Combo("mlp3", ("Linear",), "HYBRID_SHARD", orig, size) for orig in (False, True)]
        out += [Combo("lm2047", (), "HYBRID_SHARD", orig, size) for orig in (False, True)]
    out.append(Combo("lm2047", ("TransformerBlock",), "_HYBRID_SHARD_ZERO2", True, 8))
    return out


@functools.cache
def _fake_world(world_size: int) -> dict[int, list[dict[str, Any]]]:
    """Every probed rank's answer for every fake combination (one subprocess for the world size, one rank after the
    other)."""
    cases = [
        dict(
            kind="fsdp1",
            factory=MODELS[c.model][0],
            kwargs=MODELS[c.model][1],
            wrap=list(c.wrap),
            strategy=c.strategy,
            use_orig_params=c.use_orig_params,
            shard_group_size=c.shard_group_size,
        )
        for c in _fake_combos(world_size)
    ]
    return run_fake_world(world_size, _fake_ranks(world_size), cases, FAKE_TIMEOUT_S)


@pytest.mark.parametrize("world_size", FAKE_WORLD_SIZES)
def test_large_worlds_match_fsdp1_on_a_fake_group(world_size: int) -> None:
    results = _fake_world(world_size)
    errors = []
    for i, combo in enumerate(_fake_combos(world_size)):
        tree, spec = _tree(combo.model), combo.spec(world_size)
        for rank in _fake_ranks(world_size):
            errors += [
                f"{combo.label} rank {rank}/{world_size}: {e}"
                for e in check_fsdp1(tree, spec, rank, results[rank][i], tree_marks(tree))
            ]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("world_size", FAKE_WORLD_SIZES)
def test_large_world_ranks_reach_padding_only_shards(world_size: int) -> None:
    """The probed ranks hold, between them, flat shards of parameters only, of parameters and padding, and of padding
    only, with and without hybrid sharding."""
    seen: set[tuple[bool, str]] = set()
    for combo in _fake_combos(world_size):
        tree, spec = _tree(combo.model), combo.spec(world_size)
        for flat in flat_param_layouts(tree, spec):
            for rank in _fake_ranks(world_size):
                start, _end, chunk = chunk_bounds(flat.total, *shard_group(spec, rank))
                held, offset = 0, 0  # elements of parameters (not padding) in [start, start + chunk)
                for fqn, numel in flat.entries:
                    held += max(0, min(offset + numel, start + chunk) - max(offset, start)) if fqn is not None else 0
                    offset += numel
                held_kind = "padding" if held == 0 else "full" if held == chunk else "partial"
                seen.add((spec.shard_group_size is not None, held_kind))
    assert seen == {(h, w) for h in (False, True) for w in ("padding", "full", "partial")}, sorted(seen)


# ---------------------------------------------------------------------------
# Pure math
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,want",
    [
        (LayoutSpec(world_size=8), [(8, r) for r in range(8)]),
        (LayoutSpec(world_size=8, sharding_strategy="NO_SHARD"), [(8, r) for r in range(8)]),
        (
            LayoutSpec(world_size=8, sharding_strategy="HYBRID_SHARD", shard_group_size=4),
            [(4, r % 4) for r in range(8)],
        ),
        (
            LayoutSpec(world_size=8, sharding_strategy="_HYBRID_SHARD_ZERO2", shard_group_size=2),
            [(2, r % 2) for r in range(8)],
        ),
        (LayoutSpec(world_size=8, sharding_strategy="HYBRID_SHARD", shard_group_size=8), [(8, r) for r in range(8)]),
        (LayoutSpec(world_size=8, sharding_strategy="HYBRID_SHARD", shard_group_size=1), [(1, 0)] * 8),
        (LayoutSpec(kind="fsdp2", world_size=6, shard_group_size=3), [(3, r % 3) for r in range(6)]),
        (LayoutSpec(kind="fsdp2", world_size=6), [(6, r) for r in range(6)]),
    ],
    ids=["full", "no_shard", "hybrid4", "zero2_2", "hybrid_whole", "hybrid1", "hsdp3", "fsdp2"],
)
def test_shard_group(spec: LayoutSpec, want: list[tuple[int, int]]) -> None:
    assert [shard_group(spec, r) for r in range(spec.world_size)] == want
    assert spec.replicas == (spec.world_size // spec.shard_group_size if spec.shard_group_size else 1)


@pytest.mark.parametrize("world_size,size", [(4, 1), (4, 2), (4, 4), (6, 3), (64, 8), (1024, 64)])
def test_hybrid_is_full_shard_of_one_shard_group(world_size: int, size: int) -> None:
    """Every rank's hybrid layout is the FULL_SHARD layout of a world of ``size`` ranks at index ``rank % size``."""
    ranks = sorted({0, 1, size - 1, size, world_size // 2 + 1, world_size - 1} & set(range(world_size)))
    for model, wraps in (
        ("nested", ((), ("Block", "Leaf"))),
        ("transformer", (("TransformerBlock",),)),
        ("mlp1", (("Linear",),)),
        ("lm2047", ((),)),
    ):
        tree = _tree(model)
        for wrap in wraps:
            for strategy in HYBRID_STRATEGIES:
                for orig in (False, True):
                    hybrid = LayoutSpec(
                        world_size=world_size,
                        sharding_strategy=strategy,
                        use_orig_params=orig,
                        wrap=wrap,
                        shard_group_size=size,
                    )
                    full = LayoutSpec(world_size=size, sharding_strategy="FULL_SHARD", use_orig_params=orig, wrap=wrap)
                    where = f"{model} wrap={wrap} {strategy} orig={orig} ws={world_size} s={size}"
                    assert flat_param_layouts(tree, hybrid) == flat_param_layouts(tree, full), where
                    for rank in ranks:
                        assert rank_layout(tree, hybrid, rank) == rank_layout(tree, full, rank % size), (
                            f"{where} rank {rank}"
                        )


@pytest.mark.parametrize(
    "settings,key",
    [
        (dict(kind="fsdp1", sharding_strategy="HYBRID_SHARD", world_size=4, shard_group_size=3), "shard_group_size"),
        (
            dict(kind="fsdp1", sharding_strategy="_HYBRID_SHARD_ZERO2", world_size=6, shard_group_size=4),
            "shard_group_size",
        ),
        (dict(kind="fsdp1", sharding_strategy="HYBRID_SHARD", world_size=4), "shard_group_size"),
        (dict(kind="fsdp1", sharding_strategy="_HYBRID_SHARD_ZERO2", world_size=4), "shard_group_size"),
        (dict(kind="fsdp1", sharding_strategy="FULL_SHARD", world_size=4, shard_group_size=2), "shard_group_size"),
        (dict(kind="fsdp1", sharding_strategy="NO_SHARD", world_size=4, shard_group_size=2), "shard_group_size"),
        (dict(kind="ddp", world_size=4, shard_group_size=2), "shard_group_size"),
        (dict(kind="none", world_size=1, shard_group_size=1), "shard_group_size"),
        (dict(kind="fsdp2", world_size=4, shard_group_size=3), "shard_group_size"),
        (dict(kind="fsdp1", sharding_strategy="HYBRID_SHARD", world_size=4, shard_group_size=0), "shard_group_size"),
    ],
    ids=[
        "not_dividing", "zero2_not_dividing", "hybrid_without", "zero2_without", "full_shard_with",
        "no_shard_with", "ddp_with", "none_with", "fsdp2_not_dividing", "zero",
    ],
)
def test_config_refuses_shard_groups_that_make_no_sense(settings: dict[str, Any], key: str) -> None:
    with pytest.raises(ValidationError) as info:
        LayoutConfig(**settings)
    assert key in str(info.value), f"{settings}: the error does not name {key}: {info.value}"


def test_config_accepts_hybrid_shard_groups() -> None:
    for strategy in HYBRID_STRATEGIES:
        for size in (1, 2, 4):
            spec = LayoutConfig(kind="fsdp1", sharding_strategy=strategy, world_size=4, shard_group_size=size).spec()
            assert (spec.shard_group_size, spec.replicas) == (size, 4 // size)
