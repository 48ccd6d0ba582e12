"""Megatron's grid as segments (osdpipe.layout.megatron_grid): what every rank writes covers every item of a save
exactly once, and holds what Megatron's own bucket and box layout (osdpipe.layout.megatron, held against real
megatron-core in tests/frameworks/test_megatron.py) puts there."""

from __future__ import annotations

import math

import pytest
import torch

from osdpipe.layout import megatron as gpt_layout
from osdpipe.layout.megatron_grid import (
    OPTIMIZER_STATES,
    grid_of,
    item_chunks,
    model_tensors,
    state_item,
    written_tensors,
)
from osdpipe.layout.ranges import WEIGHTS

ARGS = {"num_layers": 4, "hidden_size": 16, "ffn_hidden_size": 24, "num_attention_heads": 4,
        "group_query_attention": True, "num_query_groups": 2, "padded_vocab_size": 256, "vocab_size": 100,
        "make_vocab_size_divisible_by": 128, "swiglu": True, "normalization": "RMSNorm",
        "position_embedding_type": "rope", "untie_embeddings_and_output_weights": True}
#: Megatron-LM's default GPT: LayerNorm, a learned position table, tied embeddings, biases.
GPT_ARGS = {**{k: v for k, v in ARGS.items() if k not in ("normalization", "position_embedding_type", "swiglu",
                                                          "untie_embeddings_and_output_weights")},
            "max_position_embeddings": 32, "add_bias_linear": True}


def _globals(args: dict, tree_vocab: int) -> dict[str, dict[str, torch.Tensor]]:
    """Random global tensors of every sharded key and state, the vocabulary ``tree_vocab`` rows (the source's)."""
    gpt = gpt_layout.gpt_of({**args, "padded_vocab_size": tree_vocab})
    g = torch.Generator().manual_seed(0)
    return {key: {s: torch.randn(shape, generator=g) for s in (WEIGHTS, *OPTIMIZER_STATES)}
            for key, shape in gpt_layout.global_shapes(gpt).items()}


def _filled(tensor, state: torch.Tensor | None, source: dict[str, dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    out = torch.zeros(math.prod(tensor.shape))
    for s in tensor.segments:
        out[s.dest: s.dest + s.length] = source[s.fqn][name].reshape(-1)[s.start: s.start + s.length]
    return out.reshape(tensor.shape)


def _box_of(full: torch.Tensor, box, rows: int) -> torch.Tensor:
    """``box`` of a global tensor whose rows past ``rows`` are zero (a vocabulary padded further)."""
    padded = torch.zeros((max(rows, box[0][1]), *full.shape[1:]))
    padded[: min(rows, full.shape[0])] = full[:rows]
    return padded[tuple(slice(a, b) for a, b in box)]


#: The first stage's first chunk's gradient buffer cut into buckets of a size (``--overlap-grad-reduce``).
BUCKETED = {**ARGS, "overlap_grad_reduce": True, "ddp_bucket_size": 700}


@pytest.mark.parametrize("args", [ARGS, GPT_ARGS, BUCKETED], ids=["llama", "gpt", "bucketed"])
@pytest.mark.parametrize("grid", [(1, 1, 2, 1), (2, 1, 2, 1), (2, 2, 1, 1), (1, 2, 2, 2), (4, 1, 1, 1), (1, 2, 3, 1)])
@pytest.mark.parametrize("sharding", ["dp_reshardable", "fully_reshardable"])
def test_every_item_of_the_save_is_written_once_as_megatron_lays_it_out(args, grid, sharding) -> None:
    _check_items(args, (*grid, 1), sharding)


#: A mixture of experts in every layer: 4 experts, each of its own FFN size.
MOE = {**ARGS, "num_experts": 4, "moe_ffn_hidden_size": 12}


@pytest.mark.parametrize("grid", [(1, 1, 2, 1, 2), (1, 1, 4, 1, 2), (1, 1, 4, 1, 4), (2, 1, 2, 1, 2), (1, 2, 2, 2, 2),
                                  (1, 1, 2, 1, 1), (2, 2, 4, 1, 4)])
@pytest.mark.parametrize("sharding", ["dp_reshardable", "fully_reshardable"])
def test_a_mixture_of_experts_save_is_written_once_over_tp_pp_ep_dp(grid, sharding) -> None:
    """Every item of an MoE save (the experts' keys with their global expert axis, the router, the dense and the
    expert buffers) written exactly once, each holding what the layout puts there, at EP 1 (experts dense) and over
    EP (the experts' own buffers cut over the expert DP ranks)."""
    _check_items(MOE, grid, sharding)


def _check_items(args: dict, grid: tuple[int, ...], sharding: str) -> None:
    tp, pp, dp, vpp, ep = grid
    source_vocab = gpt_layout.padded_vocab_size(100, 128, 2)  # the tree is another TP's save: 256 rows
    target = grid_of(args, tp, pp, dp, vpp, sharding, ep)
    source = _globals(args, source_vocab)
    shapes = {key: states[WEIGHTS].shape for key, states in source.items()}
    items: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for rank in range(target.world_size):
        chunks = item_chunks(target, rank)
        tensors = {t.key: t for t in written_tensors(target, shapes, rank)}
        assert set(chunks) == set(tensors)
        for key, tensor in tensors.items():
            for state in tensor.states:
                if state == "step":
                    continue  # the save keeps it in the param groups
                local = _filled(tensor, None, source, state)
                c = chunks[key]
                item = state_item(c, state)
                items.setdefault(item, torch.zeros(c.shape))
                covered.setdefault(item, torch.zeros(c.shape, dtype=torch.int32))
                box = tuple(slice(a, b) for a, b in c.box)
                assert tensor.shape == items[item][box].shape
                items[item][box] = local
                covered[item][box] += 1
    assert all(bool((n == 1).all()) for n in covered.values()), [k for k, n in covered.items() if not (n == 1).all()]
    for key, shape in target.shapes.items():  # the model (and model-space states) as the target pads it
        states = (WEIGHTS, *OPTIMIZER_STATES) if sharding == "fully_reshardable" else (WEIGHTS,)
        for state in states:
            item = key if state == WEIGHTS else f"optimizer.state.{state}.{key}"
            assert torch.equal(items[item], _box_of(source[key][state], tuple((0, n) for n in shape), source_vocab))
    buckets = [i for i in items if ".distributed." in i]
    assert bool(buckets) == (sharding == "dp_reshardable")
    if ep > 1 and buckets:  # two optimizers: the dense one's items and the experts'
        assert {i.split(".")[0] for i in buckets} == {"chained_0", "chained_1"}
    expert_buffers = (False, True) if ep > 1 else (False,)
    for pp_rank, tp_rank, ep_rank, expert in ((a, b, c, d) for a in range(pp) for b in range(tp) for c in range(ep)
                                              for d in expert_buffers if sharding == "dp_reshardable"):
        for chunk in range(vpp):
            params = {p.name: p for p in target.params(pp_rank, tp_rank, chunk, ep_rank)}
            for b, bucket in enumerate(target.buckets(pp_rank, tp_rank, chunk, ep_rank, expert)):
                assert all(params[name].expert == expert for name, _, _ in bucket.entries) or ep == 1
                for state in OPTIMIZER_STATES:
                    want = torch.zeros(bucket.data_end)
                    for name, start, stop in bucket.entries:
                        local = torch.zeros(params[name].shape)
                        for piece in params[name].pieces:
                            rows = local[piece.local_start: piece.local_stop]
                            rows.copy_(_box_of(source[piece.key][state], piece.box, source_vocab).reshape(
                                rows.shape))
                        want[start:stop] = local.reshape(-1)
                    item = f"{target.bucket_item(pp_rank, tp_rank, chunk, b, ep_rank, expert)}.{state}"
                    assert torch.equal(items[item], want), item


def test_each_rank_holds_its_model_chunks_local_parameters_and_a_grid_is_ranked_tp_fastest() -> None:
    grid = grid_of(ARGS, 2, 2, 2)
    assert [grid.coordinates(r) for r in (0, 1, 2, 4, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (1, 1, 1)]
    source = _globals(ARGS, 256)
    shapes = {key: states[WEIGHTS].shape for key, states in source.items()}
    seen: dict[str, int] = {}
    for rank in range(grid.world_size):
        for tensor in model_tensors(grid, shapes, rank):
            for s in tensor.segments:
                seen[s.fqn] = seen.get(s.fqn, 0) + s.length
    # every element of every key once per DP replica (2), the vocabulary's 256 rows whole at TP2; a norm is whole on
    # each TP rank too
    assert seen == {key: (4 if "norm" in key else 2) * math.prod(shape) for key, shape in shapes.items()}


def test_the_experts_param_group_joins_the_dense_one_at_ep_1_and_is_made_of_it_over_ep() -> None:
    """What megatron-core builds: at EP 1 one optimizer, the experts in the dense group with weight decay; over EP a
    second optimizer whose one group is the experts' (``is_expert_parallel``). A save's experts' group whose
    hyperparameters differ from the dense one cannot become it: one line naming target.ep_size."""
    from osdpipe.io.formats.base import InputError
    from osdpipe.io.formats.megatron_items import optimizer_groups

    decay = {"lr": 1e-3, "wd_mult": 1.0, "is_expert_parallel": False, "step": 3.0}
    no_decay = {**decay, "wd_mult": 0.0}
    experts = {**decay, "is_expert_parallel": True}
    at_ep1, at_ep2 = grid_of(MOE, 1, 1, 2), grid_of(MOE, 1, 1, 2, ep=2)
    assert optimizer_groups(at_ep1, [decay, no_decay, experts]) == ([decay, no_decay], [])
    assert optimizer_groups(at_ep2, [decay, no_decay, experts]) == ([decay, no_decay], [experts])
    assert optimizer_groups(at_ep2, [decay, no_decay]) == ([decay, no_decay], [experts])  # from an EP 1 save
    with pytest.raises(InputError, match=r"^target\.ep_size=1 makes the experts dense .* keep target\.ep_size above 1"):
        optimizer_groups(at_ep1, [decay, no_decay, {**experts, "lr": 2e-3}])
