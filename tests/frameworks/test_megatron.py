"""osdpipe reads and writes real Megatron-Core saves without Megatron, at another TP, PP and DP, optimizer included.

Real megatron-core 0.16.1 trains the test's own GPT (GQA, SwiGLU, RoPE, RMSNorm, untied, vocabulary 1000 padded to
1024 x TP) 3 steps on 4 CPU ranks with its DistributedOptimizer and saves the folder Megatron-LM writes
(:mod:`frameworks.mcore`), beside the state gathered from the live job (the truth). osdpipe's range reader
(:mod:`osdpipe.io.formats.megatron_reader`) and the test oracle the other tests read saves with
(:func:`megatron_oracle.read_save`) must give back every weight, fp32 master and moment, the step and the param
groups, for both sharding types Megatron-LM writes (``dp_reshardable``, its default, whose buckets are laid out by
:mod:`osdpipe.layout.megatron`, and ``fully_reshardable``), at TP, PP, DP and in bf16; and each bucket's layout must
be the one megatron-core built (the truth carries it, measured from the live buffers), with Megatron-LM's
linear biases (``--add-bias-linear``, its default) and with ``linear_qkv``'s alone (``--add-qkv-bias``), and for
Megatron-LM's default GPT (LayerNorm, a learned position table, GeLU, the output layer tied to the word embedding: over
PP the last stage's copy of it, a bucket of its own on either stage). Bad inputs are refused in one line. The sharding
type megatron-core saved by default until 0.14, ``fully_sharded_model_space``, is saved by megatron-core 0.13.1
(installed apart: :func:`frameworks.mcore.legacy_megatron`) at TP2 DP2 and TP1 PP2 DP2.

Converted by the ``osdpipe`` command (``checkpoint=megatron``, in a subprocess) to two of TP1 PP1 DP2, TP2 PP1 DP1,
TP1 PP2 DP1 and TP4 PP1 DP1 (the last by two writers; :func:`targets_of`), each output is loaded by megatron-core itself
at that parallelism, as Megatron-LM's ``load_checkpoint`` does (the GPT with every linear bias among the sources): what
it holds must be bitwise the saving job's state, and 2 more steps on synthetic gradients (a function of the key, the
global index and the step: comparable across layouts, Adam being elementwise) bitwise what the saving job itself did
next. A ``dp_reshardable`` source, which Megatron refuses at another TP or PP, converts to both; a
``fully_sharded_model_space`` source is written ``fully_reshardable`` (megatron-core 0.16.1, which loads the outputs,
reads no ``fully_sharded_model_space``).
"""

from __future__ import annotations

import importlib.util
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from frameworks import mcore
from frameworks.mcore_saves import CONVERTED, SAVES, resumed_path, saved
from helpers import run_cli_cases
from megatron_oracle import read_save
from megatron_oracle_writer import Target, write_save
from synthetic_megatron import write_with_the_tied_copy_changed

import osdpipe
from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.megatron import DEFAULT_OUTPUT, gpt_of
from osdpipe.io.formats.megatron_reader import MegatronFiles, read_pieces
from osdpipe.layout import megatron as layout
from osdpipe.layout.megatron_grid import OPTIMIZER_STATES
from osdpipe.layout.ranges import WEIGHTS

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

#: The grids (TP, PP, DP) the converted sources are written for.
TARGETS = [(1, 1, 2), (2, 1, 1), (1, 2, 1), (4, 1, 1)]


def targets_of(name: str) -> list[tuple[int, int, int]]:
    """The two of :data:`TARGETS` source ``name`` is converted to: the ``i``-th of :data:`CONVERTED` to the ``i``-th
    and the ``i + 2``-th, round. Each source thus goes to two grids, and each grid takes five sources, every sharding
    type among them; a conversion and a load in one launch (:func:`converted`) cost about 7 s on 2 cores, so all
    four grids for all eleven sources would cost CI two and a half minutes more for pairs the layout math treats
    alike."""
    i = CONVERTED.index(name)
    return [TARGETS[i % len(TARGETS)], TARGETS[(i + 2) % len(TARGETS)]]


@pytest.fixture
def saves(megatron_saves: dict[str, Path]) -> dict[str, Path]:
    return megatron_saves


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
    truth = torch.load(mcore.truth_path(saved(saves, name)), weights_only=False)
    save = read_save(saves[name])
    assert save.sharding == SAVES[name].sharding and (save.tp, save.pp, save.dp) == SAVES[name][:3]
    assert save.vpp == SAVES[name].vpp
    assert differences(truth, save) == []
    assert save.notes == ()  # a tied embedding's copy (gpt_tp2_pp2, tied_tp2_pp2) holds the first stage's state
    key = "decoder.layers.mlp.linear_fc1.weight"
    truth["optim"][key]["exp_avg"].view(-1)[7] += 1  # one element wrong: the comparison must see it
    assert differences(truth, save) == [f"exp_avg {key}"]


@pytest.mark.parametrize("name", sorted(SAVES))
def test_every_tensor_read_by_ranges_is_the_jobs(saves: dict[str, Path], name: str) -> None:
    """The range reader conversions read a save by (:mod:`osdpipe.io.formats.megatron_reader`: memory-mapped chunks,
    a ``dp_reshardable`` save's buckets met the other way) gives the saving job's every weight, fp32 master and moment
    bitwise, whole and in ranges that cross chunks and buckets, with its step and param groups."""
    truth = torch.load(mcore.truth_path(saved(saves, name)), weights_only=False)
    files = MegatronFiles(saves[name])
    assert (files.sharding, files.tp, files.pp, files.dp, files.vpp) == (SAVES[name].sharding, *SAVES[name][:3],
                                                                          SAVES[name].vpp)

    def gathered(key: str, state: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = math.prod(files.shapes[key]) if stop is None else stop
        return torch.cat(read_pieces(files, key, state, start, stop))

    whole = SimpleNamespace(
        model={k: gathered(k, WEIGHTS).reshape(shape) for k, shape in files.shapes.items()},
        optim={k: {s: gathered(k, s).reshape(shape) for s in OPTIMIZER_STATES} for k, shape in files.shapes.items()},
        param_groups=files.param_groups, iteration=files.iteration)
    assert differences(truth, whole) == []
    for key, shape in files.shapes.items():  # a range from a third of the way in to a fifth from the end
        numel = math.prod(shape)
        for state, held in (("exp_avg", truth["optim"][key]["exp_avg"]), (WEIGHTS, truth["model"][key])):
            assert torch.equal(gathered(key, state, numel // 3, numel - numel // 5),
                               held.reshape(-1)[numel // 3: numel - numel // 5]), (key, state)
    key = "decoder.layers.mlp.linear_fc1.weight"
    truth["optim"][key]["exp_avg"].view(-1)[7] += 1  # one element wrong: the comparison must see it
    assert differences(truth, whole) == [f"exp_avg {key}"]


@pytest.mark.parametrize("name", ["tp2_dp2", "tp1_pp2_dp2", "tp2_pp2", "tp4_bf16", "tp2_dp2_bias", "tp2_pp2_qkv_bias",
                                  "gpt_tp2_pp2", "tp1_pp2_vpp2_dp2", "tp1_pp2_dp2_buckets",
                                  "gpt_qk_tp2_pp2", "tp2_dp2_counted", "qwen3_tp2_pp2"])
def test_each_bucket_is_laid_out_as_megatron_core_built_it(saves: dict[str, Path], name: str) -> None:
    truth = torch.load(mcore.truth_path(saves[name]), weights_only=False)
    gpt = gpt_of(truth["args"])
    assert (gpt.linear_bias, gpt.has_qkv_bias) == {"none": (False, False), "linear": (True, True),
                                                   "qkv": (False, True)}[SAVES[name].bias]
    megatron_defaults = SAVES[name].model == "gpt"
    assert (gpt.norm_bias, bool(gpt.position_table), gpt.tied, gpt.swiglu) == (megatron_defaults,) * 3 + (
        not megatron_defaults,)
    assert gpt.qk_layernorm == SAVES[name].qk
    tp, pp, dp = SAVES[name][:3]
    vpp = SAVES[name].vpp
    for domain, chunk in ((d, c) for d in truth["buckets"] for c in range(vpp)):
        params = layout.local_parameters(gpt, tp, pp, domain["tp_rank"], domain["pp_rank"], vpp, chunk)
        assert layout.dp_group_index(tp, domain["tp_rank"], domain["pp_rank"]) == domain["dp_group_idx"]
        assert len(domain["gbufs"]) == vpp  # a gradient buffer per model chunk, in the chunks' order
        gbuf = domain["gbufs"][chunk]
        held = layout.rank_numel(gpt, tp, pp, domain["tp_rank"], domain["pp_rank"], vpp)
        laid = layout.buckets(params, dp, layout.bucketing(truth["args"], dp, domain["pp_rank"], chunk, held))
        cut = domain["pp_rank"] == 0 and (SAVES[name].bucket or SAVES[name].num_buckets)
        assert len(laid) == len(gbuf["buckets"]) == ({"tp1_pp2_dp2_buckets": 4, "tp2_dp2_counted": 4}[name] if cut else
                                                     1 + (gpt.tied and pp > 1))
        for mine, bucket in zip(laid, gbuf["buckets"], strict=True):
            assert list(mine.entries) == [(p["name"], p["start"], p["end"]) for p in bucket["params"]]
            assert (mine.data_end, mine.numel) == (bucket["numel_unpadded"], bucket["numel"])
        by_name = {p.name: p for p in params}
        for p in (p for bucket in gbuf["buckets"] for p in bucket["params"]):
            mine = sorted(list(piece.box) for piece in by_name[p["name"]].pieces)
            theirs = sorted([(x, x + 1) if isinstance(x, int) else tuple(x) for x in piece] for piece in p["global"])
            assert tuple(by_name[p["name"]].shape) == tuple(p["shape"]) and mine == theirs, p["name"]
            assert {piece.key for piece in by_name[p["name"]].pieces} == {p["key"]}, p["name"]


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

    laid_out = {"untie_embeddings_and_output_weights": True, "normalization": "RMSNorm",
                "position_embedding_type": "rope"}
    moe = {**laid_out, "num_experts": 8, "transformer_impl": "local"}
    assert refused_model(moe, Path("iter_0000003")) is None  # SequentialMLP experts in every layer: laid out
    for change, feature in (({"moe_layer_freq": [1, 0]}, "dense layers among the MoE layers"),
                            ({"moe_shared_expert_intermediate_size": 64}, "shared experts"),
                            ({"moe_grouped_gemm": True}, "grouped-GEMM experts (moe_grouped_gemm)"),
                            ({"moe_router_enable_expert_bias": True}, "a router expert bias"),
                            ({"expert_tensor_parallel_size": 1, "tensor_model_parallel_size": 2},
                             "an expert tensor parallelism other than the TP")):  # fmt: skip
        assert f"{feature}" in refused_model({**moe, **change}, Path("x")), feature
    assert "expert parallelism without experts" in refused_model({**laid_out, "expert_model_parallel_size": 2},
                                                                 Path("x"))
    for biased in ({"add_bias_linear": True}, {"add_qkv_bias": True}):  # laid out (tp2_dp2_bias, tp2_pp2_qkv_bias)
        assert refused_model({**laid_out, **biased}, Path("x")) is None
    # Megatron-LM's defaults where the args are silent (LayerNorm, a learned position table, tied embeddings) are
    # laid out (gpt_tp2_pp2); other norms and position embeddings are named
    assert refused_model({}, Path("x")) is None
    assert refused_model({**laid_out, "qk_layernorm": True}, Path("x")) is None  # laid out (gpt_qk_tp2_pp2)
    # each instance shards the optimizer over a part of DP: a layout of its own
    assert "several distributed optimizer instances (num_distributed_optimizer_instances): not supported yet" in \
        refused_model({**laid_out, "num_distributed_optimizer_instances": 2}, Path("x"))
    assert "MixedFusedRMSNorm normalization" in refused_model({"normalization": "MixedFusedRMSNorm"}, Path("x"))
    assert "mrope position embeddings" in refused_model({**laid_out, "position_embedding_type": "mrope"}, Path("x"))
    older = {k: v for k, v in laid_out.items() if k != "position_embedding_type"}  # before --position-embedding-type
    assert gpt_of({**older, **DIMS, "use_rotary_position_embeddings": True}).position_table == 0
    assert gpt_of({**older, **DIMS}).position_table == DIMS["max_position_embeddings"]


#: A GPT's dimensions as Megatron-LM's args name them.
DIMS = {"num_layers": 2, "hidden_size": 8, "ffn_hidden_size": 16, "num_attention_heads": 2, "padded_vocab_size": 128,
        "max_position_embeddings": 32}


def test_a_weight_the_args_have_no_place_for_is_refused_not_dropped(saves: dict[str, Path], tmp_path: Path) -> None:
    """A save whose common.pt describes a model without a weight the save holds (here linear_qkv's bias, the args
    edited to deny it) is refused naming the weight: read without it, the output would lack it while every check of
    what was read passed."""
    folder = shutil.copytree(saves["tp2_pp2_qkv_bias"], tmp_path / "copy")
    common_pt = folder / "iter_0000003" / "common.pt"
    common = torch.load(common_pt, weights_only=False)
    common["args"].add_qkv_bias = False
    torch.save(common, common_pt)
    weight = r"decoder\.layers\.self_attention\.linear_qkv\.bias"
    with pytest.raises(InputError, match=rf"holds {weight}, optimizer\.state\.exp_avg\.{weight}, .* and 1 more, "
                                         "which the GPT its common.pt's args describe has no place for"):
        read_save(folder)


def _label(tp: int, pp: int, dp: int) -> str:
    return f"tp{tp}_pp{pp}_dp{dp}"


@pytest.fixture(scope="module")
def converted(megatron_saves: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict]]:
    """Each saved source of :data:`CONVERTED` converted by the ``osdpipe`` command to each grid of :func:`targets_of`
    (``<root>/<source>/<grid>``; the TP4 output by two writers: two DCP files), and each output megatron-core loaded
    at its grid and resumed 2 steps (``<grid>.pt``, ``<grid>.resumed.pt`` beside it): by source and grid, the
    command's ``code``, ``stderr`` and ``folder``.

    The 28 conversions run in one process (:func:`run_cli_cases`: the command's entry point, as the script calls it)
    and the loads in one megatron-core launch per world size (:func:`mcore.each`): started once each, not 28
    times, they take minutes less (a launch's start is most of a load's time)."""
    saves, root = megatron_saves, tmp_path_factory.mktemp("converted")
    cases, where = [], []
    for name in (n for n in CONVERTED if n in saves):
        for tp, pp, dp in targets_of(name):
            folder = root / name / _label(tp, pp, dp)
            workers = ["runtime.workers=2"] if tp == 4 else []
            cases.append(["checkpoint=megatron", f"input.path={saves[name]}", f"target.tp_size={tp}",
                          f"target.pp_size={pp}", f"target.world_size={tp * pp * dp}", f"output.path={folder}",
                          *workers])
            where.append((name, (tp, pp, dp), folder))
    (root / "work").mkdir()
    outcome: dict[str, dict[str, dict]] = {}
    loads: dict[int, list[list[str]]] = {}
    for (name, (tp, pp, dp), folder), done in zip(where, run_cli_cases(cases, cwd=root / "work", per_case_s=240),
                                                  strict=True):
        outcome.setdefault(name, {})[_label(tp, pp, dp)] = {**done, "folder": folder}
        if done["code"] == 0:
            loads.setdefault(tp * pp * dp, []).append(mcore.load_argv(
                folder, folder.with_suffix(".pt"), tp=tp, pp=pp, bf16=SAVES[name].bf16, resume=2,
                dump_after=folder.with_suffix(".resumed.pt"), bias=SAVES[name].bias, model=SAVES[name].model,
                bucket=SAVES[name].bucket, qk=SAVES[name].qk, num_buckets=SAVES[name].num_buckets))
    for world, jobs in sorted(loads.items()):
        mcore.each(root, world, jobs, label=f"load-each-{world}", timeout=900)
    return outcome


@pytest.mark.parametrize("name", CONVERTED)
def test_megatron_loads_every_conversion_bitwise_and_resumes_as_the_source_job(
    saves: dict[str, Path], converted: dict[str, dict[str, dict]], name: str
) -> None:
    truth = torch.load(mcore.truth_path(saved(saves, name)), weights_only=False)
    resumed = torch.load(resumed_path(saves[name]), weights_only=False)
    source = read_save(saves[name])
    failed = []
    for tp, pp, dp in targets_of(name):
        label = _label(tp, pp, dp)
        done = converted[name][label]
        assert done["code"] == 0, done["stderr"][-2000:]
        written = read_save(done["folder"])
        assert (written.tp, written.pp, written.dp, written.sharding) == (tp, pp, dp, DEFAULT_OUTPUT[source.sharding])
        got = torch.load(done["folder"].with_suffix(".pt"), weights_only=False)
        got_after = torch.load(done["folder"].with_suffix(".resumed.pt"), weights_only=False)
        failed += [f"{label} load: {d}" for d in mcore.dump_differences(truth, got)[:5]]
        failed += [f"{label} resume: {d}" for d in mcore.dump_differences(resumed, got_after)[:5]]
        assert got["layout"] == {"tp": tp, "pp": pp, "dp": dp, "vpp": 1}
        assert set(written.rng) == {(p, t) for p in range(pp) for t in range(tp)}
    assert failed == [], "\n".join(failed)


def test_virtual_pipeline_stages_are_written_as_megatron_cores_interleaved_schedule_loads_them(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """``target.vpp_size``: a save converts to model chunks per pipeline stage (virtual pipeline stages), each
    chunk's layers where megatron-core's interleaved schedule builds them and, ``dp_reshardable``, each chunk's
    gradient buffer a ``gbuf_idx`` of its own. A job without them (TP2 DP2) goes to PP2 x 2 chunks (DP2), and a job
    with them (PP2 x 2 chunks, DP2) to TP2 PP2 x 2 chunks (DP1); megatron-core builds each grid's chunks, loads the
    output, holds the saving job's state bitwise and resumes as the saving job did. A wrong grid is one line before
    anything is written."""
    wanted = {"tp2_dp2": (1, 2, 2, "dp_reshardable"), "tp1_pp2_vpp2_dp2_fully": (2, 2, 1, "fully_reshardable")}
    cases = [["checkpoint=megatron", f"input.path={saves[name]}", f"target.tp_size={tp}", f"target.pp_size={pp}",
              "target.vpp_size=2", f"target.world_size={tp * pp * dp}", f"output.path={tmp_path / name}"]
             for name, (tp, pp, dp, _) in wanted.items()]
    cases.append(["checkpoint=megatron", f"input.path={saves['tp2_dp2']}", "target.pp_size=1", "target.vpp_size=2",
                  f"output.path={tmp_path / 'refused'}"])
    (tmp_path / "work").mkdir()
    *done, refused = run_cli_cases(cases, cwd=tmp_path / "work", per_case_s=240)
    assert refused["code"] == 2 and "target.vpp_size=2: virtual pipeline stages interleave several pipeline " \
        "stages" in refused["stderr"] and not (tmp_path / "refused" / "latest_checkpointed_iteration.txt").exists()
    jobs = []
    for (name, (tp, pp, dp, sharding)), outcome in zip(wanted.items(), done, strict=True):
        assert outcome["code"] == 0, outcome["stderr"][-2000:]
        written = read_save(tmp_path / name)
        assert (written.tp, written.pp, written.vpp, written.dp, written.sharding) == (tp, pp, 2, dp, sharding)
        assert written.args["num_layers_per_virtual_pipeline_stage"] == mcore.LAYERS // (pp * 2)
        jobs.append(mcore.load_argv(tmp_path / name, tmp_path / f"{name}.pt", tp=tp, pp=pp, vpp=2, resume=2,
                                    dump_after=tmp_path / f"{name}.resumed.pt"))
    mcore.each(tmp_path, 4, jobs, label="load-virtual-stages", timeout=600)
    for name, (tp, pp, dp, _) in wanted.items():
        got = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        assert got["layout"] == {"tp": tp, "pp": pp, "dp": dp, "vpp": 2}
        truth = torch.load(mcore.truth_path(saves[name]), weights_only=False)
        assert mcore.dump_differences(truth, got) == []
        resumed = torch.load(resumed_path(saves[name]), weights_only=False)
        after = torch.load(tmp_path / f"{name}.resumed.pt", weights_only=False)
        assert mcore.dump_differences(resumed, after) == []


def test_a_dp_reshardable_source_becomes_fully_reshardable_at_a_tp_megatron_refuses_it_at(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """Megatron-LM refuses a dp_reshardable save at another TP or PP; written fully_reshardable, TP4 loads it."""
    name = "tp2_dp2"
    osdpipe.reshard_megatron(saves[name], tmp_path / "tp4", tp=4, optim_format="fully_reshardable")
    # one launch (a launch's start is most of a load's time): the conversion loads and resumes, then the source is
    # refused, by Megatron's own check as Megatron-LM's load_checkpoint makes it, which ends the launch
    with pytest.raises(RuntimeError, match=r"\(TP, PP\) mismatch after resume"):
        mcore.each(tmp_path, 4, [
            mcore.load_argv(tmp_path / "tp4", tmp_path / "tp4.pt", tp=4, pp=1, resume=2,
                            dump_after=tmp_path / "tp4.resumed.pt"),
            mcore.load_argv(saves[name], tmp_path / "refused.pt", tp=4, pp=1),
        ], label="load-tp4-then-refused", timeout=300)
    assert not (tmp_path / "refused.pt").exists()
    truth = torch.load(mcore.truth_path(saves[name]), weights_only=False)
    assert mcore.dump_differences(truth, torch.load(tmp_path / "tp4.pt", weights_only=False)) == []
    resumed = torch.load(resumed_path(saves[name]), weights_only=False)
    assert mcore.dump_differences(resumed, torch.load(tmp_path / "tp4.resumed.pt", weights_only=False)) == []


def test_a_roundtrip_through_the_writer_is_the_source_and_a_changed_element_is_seen(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    source = read_save(saves["tp1_pp2_dp2"])
    write_save(source, tmp_path / "back", Target(1, 2, 2, "dp_reshardable"))
    back = read_save(tmp_path / "back")
    assert all(torch.equal(source.model[k], back.model[k]) for k in source.model)
    assert all(torch.equal(source.optim[k][s], back.optim[k][s]) for k in source.optim for s in source.optim[k])
    assert back.rng == source.rng and back.extra_state == source.extra_state
    with pytest.raises(InputError, match="holds a Megatron save already"):
        write_save(source, tmp_path / "back", Target(1, 2, 2, "dp_reshardable"))


def test_a_layout_that_takes_one_element_from_the_wrong_place_fails_roundtrip_and_commits_nothing(
    saves: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verify is not a formality: a Megatron output whose layout reads one bucket's range one element off (one element
    twice, another never) fails ``roundtrip`` before anything is committed, converted in memory and made as it is
    written under a memory budget alike."""
    from dataclasses import replace

    from osdpipe.io.formats import megatron_source

    laid_out = megatron_source.written_tensors

    def one_off(grid, shapes, rank):  # noqa: ANN001, ANN202 - the patched function's own signature
        out = list(laid_out(grid, shapes, rank))
        i, j = next((i, j) for i, t in enumerate(out) if t.key.startswith("optimizer.distributed.")
                    for j, s in enumerate(t.segments) if s.start > 0)
        shifted = replace(out[i].segments[j], start=out[i].segments[j].start - 1)
        out[i] = replace(out[i], segments=(*out[i].segments[:j], shifted, *out[i].segments[j + 1:]))
        return tuple(out)

    monkeypatch.setattr(megatron_source, "written_tensors", one_off)
    for budget in (None, 1 << 20):
        out = tmp_path / f"refused-{budget}"
        with pytest.raises(RuntimeError, match="roundtrip"):
            osdpipe.reshard_megatron(saves["tp2_dp2"], out, tp=1, dp=2, checks=["roundtrip"], memory_budget=budget)
        assert not (out / "latest_checkpointed_iteration.txt").exists() and not (out / ".staging").exists()


def test_a_tied_embeddings_copy_on_the_last_stage_is_written_as_megatron_keeps_it_and_a_wrong_one_is_seen(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    """Over PP the last stage computes its logits with its own copy of the tied word embedding, whose state no
    model-space save holds: a ``dp_reshardable`` output carries it in the last stage's first bucket, filled from the
    embedding's. Megatron's loaded job must find it equal to the first stage's (the harness compares every replica
    with its main one); one element of its exp_avg changed, it must not."""
    source = read_save(saves["gpt_tp2_pp2"])
    write_save(source, tmp_path / "right", Target(1, 2, 1, "dp_reshardable"))
    write_with_the_tied_copy_changed(source, tmp_path / "wrong")
    truth = torch.load(mcore.truth_path(saves["gpt_tp2_pp2"]), weights_only=False)
    for name, expected in (("right", []), ("wrong", ["actual: replicas unequal to the main one: "
                                                       "exp_avg embedding.word_embeddings.weight"])):
        mcore.load(tmp_path, tmp_path / name, tmp_path / f"{name}.pt", tp=1, pp=2, dp=1, bias="linear", model="gpt",
                   timeout=300)
        assert mcore.dump_differences(truth, torch.load(tmp_path / f"{name}.pt", weights_only=False)) == expected
