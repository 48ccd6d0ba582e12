"""Boxes (osdpipe.layout.boxes): torch.chunk at each level, nested cuts that tile a tensor exactly once,
boxes met with flat ranges.

The properties run on random shapes, meshes and uneven sizes (seeded); the
last test holds the nested cuts against a real FSDP2 x TP job (dp 2 x tp 2,
gloo, 4 processes) whose parameters are numbered, so each rank's local tensor
says which elements it holds.
"""

from __future__ import annotations

import random

import pytest
import torch

from osdpipe.layout.boxes import (
    Cut,
    chunk,
    flat_overlap,
    flat_runs,
    intersect,
    local_box,
    mesh_coordinates,
    placement_cuts,
    volume,
    whole,
)
from osdpipe.run.launch import run_local_world

CASES = 300


def numbered(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(max(1, torch.Size(shape).numel()))[: torch.Size(shape).numel()].reshape(shape)


def held(shape: tuple[int, ...], box) -> torch.Tensor:
    """The flat indices of the elements in ``box``, by indexing a numbered tensor (the oracle)."""
    return numbered(shape)[tuple(slice(a, b) for a, b in box)].reshape(-1)


def random_shape(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3)))


def test_chunk_is_torch_chunk() -> None:
    for size in range(0, 23):
        for parts in range(1, 9):
            pieces = torch.arange(size).chunk(parts)
            for index in range(parts):
                start, stop = chunk(size, parts, index)
                got = torch.arange(size)[start:stop]
                expected = pieces[index] if index < len(pieces) else torch.arange(0)
                assert torch.equal(got, expected), (size, parts, index)


def fsdp_over_tp(tp_dim: int | None, tp: int) -> tuple[str, str]:
    """The placements FSDP2 over TP gives a parameter TP shards on ``tp_dim``
    (``None``: TP leaves it whole), as PyTorch prints them."""
    if tp_dim is None:
        return ("S(0)", "R")
    return (f"_S(0, {tp})" if tp_dim == 0 else "S(0)", f"S({tp_dim})")


def test_nested_cuts_cover_every_element_exactly_once() -> None:
    """FSDP2 x TP on any mesh: over all dp x tp ranks, each element is held once
    (TP's chunk of a dim, then dp's of dim 0)."""
    rng = random.Random(0)
    for _ in range(CASES):
        shape = random_shape(rng)
        dp, tp = rng.randint(1, 5), rng.randint(1, 4)
        tp_dim = rng.choice([None, *range(len(shape))])
        count = torch.zeros(torch.Size(shape).numel(), dtype=torch.int64)
        for rank in range(dp * tp):
            cuts = placement_cuts(fsdp_over_tp(tp_dim, tp), (dp, tp), mesh_coordinates(rank, (dp, tp)))
            count[held(shape, local_box(shape, cuts))] += 1
        replicas = tp if tp_dim is None else 1  # a tensor TP leaves whole is held by every tp rank
        assert bool((count == replicas).all()), (shape, dp, tp, tp_dim, count)


def test_a_colwise_weight_is_the_dp_chunk_of_the_tp_chunk() -> None:
    """33 rows over tp=2 are 17 + 16, each chunked over dp=2: not the (dp*tp+tp)-th quarter of the rows."""
    boxes = [
        local_box((33, 5), placement_cuts(("_S(0, 2)", "S(0)"), (2, 2), mesh_coordinates(r, (2, 2)))) for r in range(4)
    ]
    assert [b[0] for b in boxes] == [(0, 9), (17, 25), (9, 17), (25, 33)]
    hsdp = [
        local_box((33,), placement_cuts(("R", "_S(0, 2)", "S(0)"), (2, 1, 2), mesh_coordinates(r, (2, 1, 2))))
        for r in range(4)
    ]
    assert hsdp == [((0, 17),), ((17, 33),)] * 2, "HSDP x TP: each replica holds the same TP pieces"


def test_placements_that_hold_no_box_are_refused() -> None:
    with pytest.raises(ValueError, match="holds no box"):
        placement_cuts(("S(0)", "P(sum)"), (2, 2), (0, 0))
    with pytest.raises(ValueError, match="cut dim 0 into 1 piece"):
        placement_cuts(("_S(0, 2)", "S(1)"), (2, 2), (0, 0))


def test_flat_runs_are_the_boxes_elements_in_order() -> None:
    rng = random.Random(1)
    for _ in range(CASES):
        shape = random_shape(rng)
        box = tuple((a, rng.randint(a, n)) for n in shape for a in [rng.randint(0, n)])
        runs = flat_runs(shape, box)
        flat = [i for start, stop in runs for i in range(start, stop)]
        assert flat == held(shape, box).tolist(), (shape, box, runs)
        assert all(a[1] < b[0] for a, b in zip(runs, runs[1:])), f"runs that touch are merged: {runs}"


def test_intersect_and_flat_overlap_agree_with_the_oracle() -> None:
    rng = random.Random(2)
    for _ in range(CASES):
        shape = random_shape(rng)
        a, b = (tuple((s, rng.randint(s, n)) for n in shape for s in [rng.randint(0, n)]) for _ in range(2))
        both = set(held(shape, a).tolist()) & set(held(shape, b).tolist())
        meet = intersect(a, b)
        assert (set() if meet is None else set(held(shape, meet).tolist())) == both
        assert meet is None or volume(meet) == len(both)
        numel = torch.Size(shape).numel()
        start = rng.randint(0, numel)
        stop = rng.randint(start, numel)
        overlap = [i for lo, hi in flat_overlap(shape, a, start, stop) for i in range(lo, hi)]
        assert overlap == [i for i in held(shape, a).tolist() if start <= i < stop]


def test_local_box_of_no_cut_is_the_whole_tensor() -> None:
    assert local_box((4, 3), ()) == whole((4, 3)) == ((0, 4), (0, 3))
    assert local_box((4, 3), (Cut(1, 2, 1),)) == ((0, 4), (2, 3))


def _fsdp_tp_job() -> list[tuple[str, list[int], tuple[int, ...], tuple[tuple[int, int], ...]]]:
    """One rank of dp 2 x tp 2: numbered parameters, TP then FSDP2; per parameter, the global indices its local tensor
    holds and the box osdpipe reads from its placements."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(5, 33)  # 33 rows: uneven over tp, and again over dp
            self.down = nn.Linear(33, 5)
            self.other = nn.Linear(5, 3)  # outside the TP plan

    model = Model()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(numbered(tuple(p.shape)).float())
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    out = []
    for name, p in model.named_parameters():
        mesh = tuple(p.device_mesh.shape)  # (2, 2) for what TP shards, (2,) for what it leaves alone
        coords = mesh_coordinates(dist.get_rank(), (2, 2))[: len(mesh)]
        box = local_box(tuple(p.shape), placement_cuts([str(x) for x in p.placements], mesh, coords))
        out.append((name, p.to_local().reshape(-1).long().tolist(), tuple(p.shape), box))
    return out


def test_nested_cuts_are_what_real_fsdp2_over_tp_holds() -> None:
    for rank, params in enumerate(run_local_world(_fsdp_tp_job, 4, timeout_s=120)):
        for name, got, shape, box in params:
            assert got == held(shape, box).tolist(), (
                f"rank {rank} {name}: PyTorch holds {got[:6]}..., the box {box} says otherwise"
            )


def _random_tp_job(rng: random.Random):
    """A random model (2-D and 1-D parameters, uneven sizes) on a random (dp, tp) or (replicate, shard, tp) mesh, each
    parameter given a style's placements."""
    from torch import nn

    from osdpipe.layout.ranges import LayoutSpec, Placement
    from osdpipe.layout.tree import describe

    tp, shard, replicas = rng.randint(2, 4), rng.randint(1, 5), rng.choice([None, 2])
    dp = shard * (replicas or 1)
    model = nn.Module()
    for i in range(6):
        shape = (rng.randint(0, 23), rng.randint(1, 9)) if rng.random() < 0.7 else (rng.randint(1, 23),)
        model.register_parameter(f"p{i}", nn.Parameter(torch.empty(shape, device="meta")))
    tree = describe(model)
    outer, outer_names = ((replicas, shard), ("dp_replicate", "dp_shard")) if replicas else ((dp,), ("dp",))
    prefix = ("R",) if replicas else ()
    table = []
    for p in tree.params:
        style = rng.choice(["colwise", "replicated", "untouched"] + ["rowwise"] * (len(p.shape) == 2))
        if style == "untouched":
            table.append((p.fqn, Placement(outer, (*prefix, "S(0)"), outer_names)))
            continue
        inner = {"colwise": (f"_S(0, {tp})", "S(0)"), "rowwise": ("S(0)", "S(1)"), "replicated": ("S(0)", "R")}[style]
        table.append((p.fqn, Placement((*outer, tp), (*prefix, *inner), (*outer_names, "tp"))))
    spec = LayoutSpec(kind="fsdp2", world_size=dp * tp, shard_group_size=shard if replicas else None, tp_size=tp,
                      tp_plan=(("*", "colwise"),), tp_placements=tuple(table))
    return tree, spec, dict(table)


def test_fsdp2_over_tp_layouts_hold_every_element_once_per_copy() -> None:
    """On random 2-D and 3-D meshes, every element of every parameter lies on exactly as many ranks as its placements
    replicate it (R dims, and tp for what TP leaves alone), and each local tensor is its segments packed in order."""
    from osdpipe.layout.kinds import rank_layout

    rng = random.Random(18)
    for _ in range(60):
        tree, spec, table = _random_tp_job(rng)
        counts = {p.fqn: torch.zeros(p.numel, dtype=torch.long) for p in tree.params}
        for rank in range(spec.world_size):
            for tensor in rank_layout(tree, spec, rank):
                dest = 0
                for seg in tensor.segments:
                    assert seg.dest == dest and seg.fqn == tensor.key
                    counts[seg.fqn][seg.start : seg.start + seg.length] += 1
                    dest += seg.length
                assert dest == tensor.numel, (spec, tensor)
        for fqn, seen in counts.items():
            where = table[fqn]
            copies = 1
            for text, size in zip(where.placements, where.mesh):
                copies *= size if text == "R" else 1
            # the mesh dimensions the parameter does not lie on (tp, for what TP leaves alone)
            copies *= spec.world_size // torch.Size(where.mesh).numel()
            assert bool((seen == copies).all()), (fqn, where, spec.world_size, seen.tolist())
