"""Hold osdpipe's pure layout math against the FlatParameter metadata of real FSDP1.

One local world (CPU, gloo) is spawned per world size; inside it every rank
wraps every (model, wrapping) combination of :data:`COMBOS` with real
``FullyShardedDataParallel`` and sends back plain metadata. Each combination is
then compared, in this process, with :func:`osdpipe.layout.kinds.fsdp1.flat_param_layouts`
and :func:`osdpipe.layout.kinds.rank_layout` computed on a ``meta`` model.

The pure helpers :func:`~osdpipe.layout.ranges.chunk_bounds` and
:func:`~osdpipe.layout.ranges.dim0_chunk_bounds` are held against ``torch.chunk``.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import torch
from oracle_probe import fsdp1_metadata, tree_of, world_once

from osdpipe.layout import kinds
from osdpipe.layout import ranges as layout
from osdpipe.layout.kinds.fsdp1 import FlatParamLayout, flat_param_key, flat_param_layouts, shards
from osdpipe.layout.models import build_model
from osdpipe.layout.ranges import LayoutSpec, LocalTensor, Segment

WORLD_SIZES = (1, 2, 3, 4)
#: Per world: 2-4 s to spawn, plus the wrapping of every combination on every rank.
WORLD_TIMEOUT_S = 120.0

#: label -> (built-in factory, kwargs)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "nested": ("nested", {}),
    "transformer": ("transformer", {}),  # tok_embed.weight is tied to lm_head.weight
    "mlp": ("mlp", {"width": 5, "depth": 3}),  # odd numels: 25 + 5 per layer
    "mlp1": ("mlp", {"width": 1, "depth": 2}),  # 2-element units: trailing ranks hold only padding
}
WRAPS: dict[str, tuple[tuple[str, ...], ...]] = {
    "nested": ((), ("Block",), ("Leaf",), ("Block", "Leaf"), ("block1", "block2.leaf1"), ("embed", "block2.leaf2.out")),
    "transformer": ((), ("TransformerBlock",), ("layers.1",)),
    "mlp": ((), ("Linear",), ("layers.0", "layers.2")),
    "mlp1": ((), ("Linear",)),
}
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def _combos() -> list[tuple[str, tuple[str, ...], bool, str, bool, str | None]]:
    """(model, wrap, wrap_root, sharding_strategy, use_orig_params, mixed-precision param_dtype) for every case in one
    world.

    Mixed precision changes the layout only through ``use_orig_params``'
    alignment (16 bytes of the bf16 forward dtype: 8 fp32 elements, not 4), so
    it is crossed with ``use_orig_params=True`` and the strategies that align.
    """
    out = []
    for model, wraps in WRAPS.items():
        for wrap in wraps:
            for wrap_root in (True, False) if wrap else (True,):
                for strategy in STRATEGIES:
                    for orig in (False, True):
                        out.append((model, wrap, wrap_root, strategy, orig, None))
            for strategy in ("FULL_SHARD", "NO_SHARD"):
                out.append((model, wrap, True, strategy, True, "bfloat16"))
    return out


COMBOS = _combos()


def _spec(combo: tuple, world_size: int) -> LayoutSpec:
    _model, wrap, wrap_root, strategy, orig, param_dtype = combo
    return LayoutSpec(
        kind="fsdp1",
        world_size=world_size,
        sharding_strategy=strategy,
        use_orig_params=orig,
        wrap=wrap,
        wrap_root=wrap_root,
        param_dtype=param_dtype,
    )


def _combo_id(combo: tuple) -> str:
    model, wrap, wrap_root, strategy, orig, param_dtype = combo
    mixed = f"-mp_{param_dtype}" if param_dtype else ""
    return (
        f"{model}-wrap[{','.join(wrap)}]-{'root' if wrap_root else 'noroot'}"
        f"-{strategy}-{'orig' if orig else 'flat'}{mixed}"
    )


# ---------------------------------------------------------------------------
# What real FSDP1 says (runs on every spawned rank)
# ---------------------------------------------------------------------------


def _fsdp_metadata(combos: list[tuple], world_size: int) -> list[dict[str, Any]]:
    """Wrap every combination with FSDP1 and return its units' FlatParameter metadata and
    (name, local shape) per parameter."""
    import warnings

    from osdpipe.layout import kinds

    warnings.simplefilter("ignore")  # FSDP1 deprecation, world-size-1 NO_SHARD switch
    torch.set_num_threads(1)
    out = []
    for combo in combos:
        factory, kwargs = MODELS[combo[0]]
        wrapped = kinds.get("fsdp1").wrap(build_model(factory, kwargs, seed=0), _spec(combo, world_size))
        found = fsdp1_metadata(wrapped, with_values=False)
        out.append(dict(units=found["units"], params=[(p["fqn"], p["local_shape"]) for p in found["params"]]))
    return out


def _world(world_size: int) -> list[list[dict[str, Any]]]:
    """Every rank's metadata for every combination (one spawned world per world size, failures included)."""
    return world_once("FSDP1", _fsdp_metadata, world_size, (COMBOS, world_size), WORLD_TIMEOUT_S)


def _tree(label: str):
    return tree_of(MODELS, label)


def _diff(got: Any, want: Any) -> str:
    """``got`` vs ``want`` (sequences), from the first difference on."""
    got, want = list(got), list(want)
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    lead = f"from index {i} of {len(got)} vs {len(want)}: " if i else ""
    return (
        f"{lead}FSDP {got[i:i + 4]}{' ...' if len(got) > i + 4 else ''},"
        f" layout {want[i:i + 4]}{' ...' if len(want) > i + 4 else ''}"
    )


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------


def _check_unit(
    flat: FlatParamLayout, got: dict[str, Any], spec: LayoutSpec, rank: int, local: dict[str, LocalTensor]
) -> list[str]:
    """Differences between one FSDP unit and the layout's view of it on ``rank``."""
    unit = flat.unit
    where = f"unit {unit or '<root>'!r}"
    errors = []
    full = tuple(f"{unit}.{f}" if unit else f for f in got["fqns"])
    if full != flat.fqns:
        errors.append(f"{where}: flattened parameters differ, {_diff(full, flat.fqns)}")
    names = iter(full)
    entries = tuple(
        (None if pad else next(names, "?"), n)
        for n, pad in zip(got["numels_with_padding"], got["is_padding_mask"], strict=True)
    )
    if entries != flat.entries:
        errors.append(f"{where}: flat entries (fqn or None for padding, numel) differ, {_diff(entries, flat.entries)}")
    if got["sharded"] != shards(spec):
        errors.append(f"{where}: FSDP shards={got['sharded']}, layout says shards={shards(spec)}")

    infos = got["shard_param_infos"]
    if len(infos) != len(full):
        return [*errors, f"{where}: {len(infos)} shard infos for {len(full)} parameters"]
    for (in_shard, _off, numel, lo, hi), fqn in zip(infos, full):
        if in_shard and numel != hi - lo + 1:  # how the fields read: inclusive end
            errors.append(f"{where}: {fqn}: numel_in_shard {numel} != intra [{lo}, {hi}]")

    if spec.use_orig_params:
        # one tensor per parameter; the flat parameter is FSDP's business, but its size is still the shard size
        size = layout.chunk_bounds(flat.total, spec.world_size, rank)[2] if shards(spec) else flat.total
        if got["local_numel"] != size:
            errors.append(
                f"{where}: FSDP local flat numel {got['local_numel']}, layout's shard of {flat.total} is {size}"
            )
        for (in_shard, _off, numel, lo, _hi), fqn in zip(infos, full):
            t = local.get(fqn)
            if t is None:
                errors.append(f"{where}: layout has no local tensor {fqn!r}")
                continue
            if not shards(spec):
                want_segs = (Segment(fqn, 0, numel, 0),)
            else:
                want_segs = (Segment(fqn, lo, numel, 0),) if in_shard else ()
                if t.shape != ((numel,) if in_shard else (0,)):
                    errors.append(
                        f"{where}: {fqn}: FSDP local numel {numel if in_shard else 0}, layout shape {t.shape}"
                    )
            if not in_shard and not shards(spec):
                errors.append(f"{where}: {fqn}: FSDP NO_SHARD reports it out of the shard")
            if t.segments != want_segs:
                errors.append(f"{where}: {fqn}: FSDP shard info gives {want_segs}, layout says {t.segments}")
            if not t.flat == shards(spec):
                errors.append(f"{where}: {fqn}: layout flat={t.flat}, expected {shards(spec)}")
        return errors

    key = flat_param_key(unit)
    t = local.get(key)
    if t is None:
        return [*errors, f"{where}: layout has no local tensor {key!r}"]
    if t.shape != (got["local_numel"],):
        errors.append(f"{where}: FSDP local flat numel {got['local_numel']}, layout shape {t.shape}")
    if t.fqns != flat.fqns or not t.flat:
        errors.append(f"{where}: layout local tensor {key} has fqns {t.fqns} flat={t.flat}")
    want_segs = tuple(
        Segment(fqn, lo, numel, off) for (in_shard, off, numel, lo, _hi), fqn in zip(infos, full) if in_shard
    )
    if t.segments != want_segs:
        errors.append(f"{where}: segments of {key} differ, {_diff(want_segs, t.segments)}")
    return errors


def _check(combo: tuple, world_size: int, rank: int, got: dict[str, Any]) -> list[str]:
    tree = _tree(combo[0])
    spec = _spec(combo, world_size)
    flats = flat_param_layouts(tree, spec)
    tensors = kinds.rank_layout(tree, spec, rank)
    local = {t.key: t for t in tensors}
    errors = []

    got_units = [u["unit"] for u in got["units"]]
    want_units = [f.unit for f in flats]
    if got_units != want_units:
        return [f"FSDP units with parameters {got_units}, layout says {want_units}"]
    for flat, unit in zip(flats, got["units"]):
        errors += _check_unit(flat, unit, spec, rank, local)

    want_params = [(t.key, t.shape) for t in tensors]
    if got["params"] != want_params:
        errors.append(
            "(name, local shape) of wrapped.named_parameters() vs layout's local tensors differ,"
            f" {_diff(got['params'], want_params)}"
        )
    if len(local) != len(tensors):
        errors.append(f"layout repeats a key: {[t.key for t in tensors]}")
    for t in tensors:
        covered = sum(s.length for s in t.segments)
        if covered > t.numel or any(s.dest + s.length > t.numel for s in t.segments):
            errors.append(f"{t.key}: segments {t.segments} overflow shape {t.shape}")
    return errors


@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layout_matches_fsdp1(world_size: int, combo: tuple) -> None:
    results = _world(world_size)  # spawned once per world size, timed out by WORLD_TIMEOUT_S
    i = COMBOS.index(combo)
    errors = []
    for rank, per_rank in enumerate(results):
        errors += [f"rank {rank}/{world_size}: {e}" for e in _check(combo, world_size, rank, per_rank[i])]
    if errors:
        pytest.fail(f"{_combo_id(combo)} (world size {world_size}):\n  " + "\n  ".join(errors), pytrace=False)


def test_every_parameter_element_is_held_exactly_once() -> None:
    """Across ranks, the sharded layouts cover each parameter exactly once (NO_SHARD: once per rank)."""
    for world_size in WORLD_SIZES:
        for combo in COMBOS:
            tree = _tree(combo[0])
            spec = _spec(combo, world_size)
            counts = {p.fqn: [0] * p.numel for p in tree.params}
            for rank in range(world_size):
                for t in kinds.rank_layout(tree, spec, rank):
                    for s in t.segments:
                        for k in range(s.start, s.start + s.length):
                            counts[s.fqn][k] += 1
            unit = layout.unit_of(tree, spec)
            for fqn, c in counts.items():
                want = 1 if shards(spec) and unit[fqn] is not None else world_size
                assert set(c) == {want}, f"{_combo_id(combo)} ws={world_size}: {fqn} held {sorted(set(c))} times"


# ---------------------------------------------------------------------------
# Pure helpers against torch.chunk
# ---------------------------------------------------------------------------


def _torch_chunks(total: int, world_size: int) -> list[int]:
    """Chunk sizes per rank as FSDP1 takes them from ``torch.chunk`` (missing chunks are empty)."""
    sizes = [c.numel() for c in torch.arange(total).chunk(world_size)]
    return sizes + [0] * (world_size - len(sizes))


def _sizes_cases() -> list[tuple[int, int]]:
    rng = random.Random(0)
    cases = [(0, 1), (0, 3), (1, 1), (1, 4), (2, 3), (3, 4), (5, 4), (6, 4), (7, 3), (8, 4), (9, 8), (10, 7)]
    cases += [(rng.randrange(0, 200), rng.randrange(1, 17)) for _ in range(200)]
    return cases


@pytest.mark.parametrize("total,world_size", _sizes_cases()[:12])
def test_chunk_bounds_edge_cases(total: int, world_size: int) -> None:
    _check_chunk_bounds(total, world_size)


def test_chunk_bounds_random_sizes() -> None:
    for total, world_size in _sizes_cases():
        _check_chunk_bounds(total, world_size)


def _check_chunk_bounds(total: int, world_size: int) -> None:
    flat = torch.arange(total)
    chunks = flat.chunk(world_size) if total else ()
    sizes = _torch_chunks(total, world_size)
    padded = max(sizes, default=0)
    end_prev = 0
    for rank in range(world_size):
        start, end, chunk = layout.chunk_bounds(total, world_size, rank)
        assert chunk == padded, (
            f"total={total} ws={world_size} rank={rank}: chunk size {chunk}, torch.chunk gives {padded}"
        )
        assert end - start == sizes[rank], (
            f"total={total} ws={world_size} rank={rank}: [{start}, {end}) vs {sizes[rank]} elements"
        )
        assert start == end_prev, (
            f"total={total} ws={world_size} rank={rank}: starts at {start}, previous ended at {end_prev}"
        )
        if rank < len(chunks):
            assert flat[start:end].tolist() == chunks[rank].tolist()
        # FSDP1's own view of the shard: [chunk * rank, chunk * (rank + 1)) clipped to the total
        assert (start, end) == (min(chunk * rank, total), min(chunk * (rank + 1), total))
        end_prev = end
    assert end_prev == total


def test_dim0_chunk_bounds() -> None:
    rng = random.Random(1)
    shapes = [(), (0,), (1,), (3,), (5, 2), (2, 3, 4), (7, 1), (0, 5), (4, 0)]
    shapes += [tuple(rng.randrange(0, 9) for _ in range(rng.randrange(1, 4))) for _ in range(100)]
    for shape in shapes:
        for world_size in range(1, 6):
            full = torch.arange(int(torch.Size(shape).numel())).reshape(shape)
            parts = full.chunk(world_size, dim=0) if shape and shape[0] else ()
            covered = 0
            for rank in range(world_size):
                start, end, rows = layout.dim0_chunk_bounds(shape, world_size, rank)
                where = f"shape={shape} ws={world_size} rank={rank}"
                if not shape:  # a scalar is held whole by rank 0
                    assert (start, end, rows) == ((0, 1, 1) if rank == 0 else (0, 0, 0)), where
                    covered += end - start
                    continue
                want = parts[rank] if rank < len(parts) else full[:0]
                assert rows == want.shape[0], f"{where}: {rows} rows, torch.chunk gives {want.shape[0]}"
                assert full.flatten()[start:end].tolist() == want.flatten().tolist(), f"{where}: [{start}, {end})"
                assert start == covered or end == start, f"{where}: starts at {start}, expected {covered}"
                covered = max(covered, end)
            assert covered == full.numel(), f"shape={shape} ws={world_size}: covers {covered} of {full.numel()}"


def test_layout_spec_ws1_never_shards() -> None:
    """FSDP1 switches to NO_SHARD in a world of one; the layout must agree (the oracle checks ws=1 too)."""
    for strategy in STRATEGIES:
        assert not shards(replace(LayoutSpec(), sharding_strategy=strategy, world_size=1))


def test_mixed_precision_changes_the_alignment() -> None:
    """bf16 forward dtype over fp32 parameters: 16 bytes are 8 elements, not 4
    (the oracle cases above hold it against FSDP1)."""
    tree = _tree("nested")
    spec = LayoutSpec(kind="fsdp1", world_size=2, use_orig_params=True, wrap=("Block",))
    fp32 = {f.unit: f.entries for f in flat_param_layouts(tree, spec)}
    bf16 = {f.unit: f.entries for f in flat_param_layouts(tree, replace(spec, param_dtype="bfloat16"))}
    assert fp32["block1"] != bf16["block1"]
    offsets, total = [], 0
    for fqn, numel in bf16["block1"]:
        if fqn is not None:
            offsets.append(total)
        total += numel
    assert all(o % 8 == 0 for o in offsets), offsets
