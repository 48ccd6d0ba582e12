"""osdpipe reads real Megatron-Core saves without Megatron: every tensor bitwise what the saving job held.

Real megatron-core 0.16.1 trains the test's own GPT (GQA, SwiGLU, RoPE, RMSNorm, untied, vocabulary 1000 padded to
1024 x TP) 3 steps on 4 CPU ranks with its DistributedOptimizer and saves the folder Megatron-LM writes
(:mod:`frameworks.mcore`), beside the state gathered from the live job (the truth). osdpipe's reader
(:func:`osdpipe.io.formats.megatron.read_save`) must give back every weight, fp32 master and moment, the step and the
param groups, for both sharding types Megatron-LM writes (``dp_reshardable``, its default, whose buckets are laid
out by :mod:`osdpipe.layout.megatron`, and ``fully_reshardable``), at TP, PP, DP and in bf16; and each bucket's
layout must be the one megatron-core built (the truth carries it, measured from the live buffers). Bad inputs are
refused in one line.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from frameworks import mcore

from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.megatron import read_save
from osdpipe.layout import megatron as layout

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

#: name -> (TP, PP, DP, sharding type, bf16): each saved once by real megatron-core on 4 ranks.
SAVES = {
    "tp2_dp2": (2, 1, 2, "dp_reshardable", False),
    "tp1_pp2_dp2": (1, 2, 2, "dp_reshardable", False),
    "tp4_bf16": (4, 1, 1, "dp_reshardable", True),
    "tp2_pp2_fully": (2, 2, 1, "fully_reshardable", False),
}


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron")
    out = {}
    for name, (tp, pp, dp, sharding, bf16) in SAVES.items():
        out[name] = mcore.save(root, root / name, tp=tp, pp=pp, dp=dp, sharding=sharding, bf16=bf16, timeout=400)
    return out


def differences(truth: dict, save) -> list[str]:
    """Every tensor, step and param group where osdpipe's reading differs from the truth, bit for bit."""
    found = []
    for key, weight in truth["model"].items():
        got = save.model.get(key)
        if got is None or got.dtype != weight.dtype or not torch.equal(got.view(-1).view(torch.uint8),
                                                                       weight.contiguous().view(-1).view(torch.uint8)):
            found.append(f"model {key}")
    for key, states in truth["optim"].items():
        for state in ("param", "exp_avg", "exp_avg_sq"):
            if not torch.equal(save.optim[key][state], states[state]):
                found.append(f"{state} {key}")
    steps = {float(s["step"]) for s in truth["optim"].values()}
    if {float(g["step"]) for g in save.param_groups} != steps:
        found.append(f"step: {[g['step'] for g in save.param_groups]}, the job's {steps}")
    expected = {tuple(g["params"]): g["weight_decay"] for g in truth["param_groups"]}
    if {tuple(g["params"]): g["weight_decay"] for g in save.param_groups} != expected:
        found.append("param groups")
    if save.iteration != truth["iteration"]:
        found.append(f"iteration {save.iteration}")
    return found


@pytest.mark.parametrize("name", sorted(SAVES))
def test_every_tensor_is_read_bitwise_as_the_job_held_it(saves: dict[str, Path], name: str) -> None:
    truth = torch.load(mcore.truth_path(saves[name]), weights_only=False)
    save = read_save(saves[name])
    assert save.sharding == SAVES[name][3] and (save.tp, save.pp, save.dp) == SAVES[name][:3]
    assert differences(truth, save) == []
    key = "decoder.layers.mlp.linear_fc1.weight"
    truth["optim"][key]["exp_avg"].view(-1)[7] += 1  # one element wrong: the comparison must see it
    assert differences(truth, save) == [f"exp_avg {key}"]


@pytest.mark.parametrize("name", ["tp2_dp2", "tp1_pp2_dp2", "tp4_bf16"])
def test_each_bucket_is_laid_out_as_megatron_core_built_it(saves: dict[str, Path], name: str) -> None:
    truth = torch.load(mcore.truth_path(saves[name]), weights_only=False)
    args = truth["args"]
    gpt = layout.Gpt(args["num_layers"], args["hidden_size"], args["ffn_hidden_size"], args["num_attention_heads"],
                     args["num_query_groups"], args["kv_channels"], args["padded_vocab_size"], args["swiglu"])
    tp, pp, dp = SAVES[name][:3]
    for domain in truth["buckets"]:
        params = layout.local_parameters(gpt, tp, pp, domain["tp_rank"], domain["pp_rank"])
        assert layout.dp_group_index(tp, domain["tp_rank"], domain["pp_rank"]) == domain["dp_group_idx"]
        [gbuf] = domain["gbufs"]
        [bucket] = gbuf["buckets"]
        laid = layout.bucket_layout([(p.name, p.numel) for p in reversed(params)], dp)
        assert list(laid.entries) == [(p["name"], p["start"], p["end"]) for p in bucket["params"]]
        assert (laid.numel_unpadded, laid.numel) == (bucket["numel_unpadded"], bucket["numel"])
        by_name = {p.name: p for p in params}
        for p in bucket["params"]:
            mine = sorted(list(piece.box) for piece in by_name[p["name"]].pieces)
            theirs = sorted([(x, x + 1) if isinstance(x, int) else tuple(x) for x in piece] for piece in p["global"])
            assert tuple(by_name[p["name"]].shape) == tuple(p["shape"]) and mine == theirs, p["name"]


def test_bad_inputs_are_refused_in_one_line(saves: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(saves["tp2_dp2"], tmp_path / "copy")
    (folder / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(InputError, match="names iteration 7, but .*iter_0000007 is not there"):
        read_save(folder)
    (folder / "latest_checkpointed_iteration.txt").write_text("3")
    data = sorted((folder / "iter_0000003").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(InputError, match="truncated"):
        read_save(folder)
    with pytest.raises(InputError, match="holds no latest_checkpointed_iteration.txt"):
        read_save(tmp_path)


def test_a_model_osdpipe_cannot_lay_out_yet_is_refused_naming_the_feature() -> None:
    from osdpipe.io.formats.megatron import refused_model

    moe = {"num_experts": 8, "untie_embeddings_and_output_weights": True, "transformer_impl": "local"}
    assert "a mixture of experts (num_experts): not supported yet" in refused_model(moe, Path("iter_0000003"))
    biased = {"add_bias_linear": True, "untie_embeddings_and_output_weights": True}
    assert "linear biases" in refused_model(biased, Path("x"))
    assert refused_model({"untie_embeddings_and_output_weights": True}, Path("x")) is None
