"""Megatron's layout rules, without Megatron: padding, buckets, a vocabulary that changes size.

The command's conversions are held against the test oracle (tests/support/megatron_oracle*.py: a save read and
written whole in memory), and the oracle's writer against the layout rules.

Real megatron-core saves and loads are in tests/frameworks/test_megatron.py; these are the cases its test model never
meets: a parameter whose size is not a multiple of 64 (a gap before the next one), and a target TP whose padded
vocabulary differs from the source's (the rows it adds must be zero, and the read-back check must see them).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from helpers import run_cli_cases, user_env
from megatron_oracle import read_save
from megatron_oracle_check import read_back_problems, roundtrip_problems
from megatron_oracle_writer import Target, write_save
from synthetic_megatron import synthetic_save, write_with_the_tied_copy_changed

from osdpipe.io.formats.base import InputError
from osdpipe.layout import megatron as layout


def test_megatron_pads_the_vocabulary_to_a_multiple_of_its_divisor_times_tp() -> None:
    assert layout.padded_vocab_size(1000, 128, 1) == 1024
    assert layout.padded_vocab_size(1000, 128, 4) == 1024
    assert layout.padded_vocab_size(1000, 96, 1) == 1056
    assert layout.padded_vocab_size(1000, 96, 2) == 1152
    assert layout.padded_vocab_size(50257, 128, 8) == 51200


def _param(name: str, numel: int, own: bool = False) -> layout.LocalParameter:
    """A parameter of ``numel`` elements as :func:`layout.buckets` sees it (``own``: a tied embedding's, alone)."""
    return layout.LocalParameter(name, (numel,), (), own_bucket=own)


def test_a_bucket_starts_each_parameter_on_a_multiple_of_64_and_pads_its_end_to_lcm_dp_128() -> None:
    (laid,) = layout.buckets([_param("c", 3), _param("b", 64), _param("a", 100)], dp=3)  # laid out in reverse
    assert laid.entries == (("a", 0, 100), ("b", 128, 192), ("c", 192, 195))
    assert (laid.data_end, laid.numel) == (195, 384)  # lcm(3, 128) = 384


def test_a_stage_holds_its_layers_and_tp_cuts_rows_or_columns() -> None:
    gpt = layout.Gpt(4, 32, 64, 4, 2, 8, 1024, True)
    params = {p.name: p for p in layout.local_parameters(gpt, tp=2, pp=2, tp_rank=1, pp_rank=1)}
    assert "embedding.word_embeddings.weight" not in params and "output_layer.weight" in params
    fc1 = params["decoder.layers.0.mlp.linear_fc1.weight"]  # local layer 0 of stage 1: global layer 2
    assert fc1.shape == (64, 32)
    assert [(p.box, p.local_start, p.local_stop) for p in fc1.pieces] == [
        (((2, 3), (32, 64), (0, 32)), 0, 32),  # gate rows of TP rank 1
        (((2, 3), (96, 128), (0, 32)), 32, 64),  # up rows of TP rank 1
    ]
    proj = params["decoder.layers.1.self_attention.linear_proj.weight"]
    assert proj.shape == (32, 16) and proj.pieces[0].box == ((3, 4), (0, 32), (16, 32))
    with pytest.raises(ValueError, match="do not split evenly over 3 pipeline stages"):
        layout.local_parameters(gpt, tp=1, pp=3, tp_rank=0, pp_rank=0)


def test_virtual_stages_deal_the_pipelines_chunks_round_the_stages_in_layer_order() -> None:
    """PP2 with 2 chunks per stage over 8 layers: the 4 chunks of 2 layers go stage 0, stage 1, stage 0, stage 1
    (megatron-core's ``get_transformer_layer_offset``); each layer is held once; the embedding is chunk 0's of the
    first stage, the final norm and the output layer chunk 1's of the last; each chunk names its layers from 0."""
    assert [list(layout.stage_layers(8, 2, stage, 2, chunk)) for chunk in (0, 1) for stage in (0, 1)] == [
        [0, 1], [2, 3], [4, 5], [6, 7]]
    gpt = layout.Gpt(8, 32, 64, 4, 2, 8, 1024, True)
    chunks = {(stage, chunk): {p.name: p for p in layout.local_parameters(gpt, 1, 2, 0, stage, 2, chunk)}
              for stage in (0, 1) for chunk in (0, 1)}
    for name, where in (("embedding.word_embeddings.weight", (0, 0)), ("output_layer.weight", (1, 1)),
                        ("decoder.final_layernorm.weight", (1, 1))):
        assert [at for at, params in chunks.items() if name in params] == [where], name
    fc2 = "decoder.layers.mlp.linear_fc2.weight"
    layers = {at: [piece.box[0][0] for p in params.values() for piece in p.pieces if piece.key == fc2]
              for at, params in chunks.items()}
    assert layers == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}  # each layer once, in order
    with pytest.raises(ValueError, match="do not split evenly over 2 pipeline stages x 3 virtual stages"):
        layout.stage_layers(8, 2, 0, 3, 0)


def test_a_grid_of_virtual_stages_that_cannot_be_is_one_line_naming_the_key() -> None:
    assert layout.virtual_stages_problem(8, 2, 2) is None and layout.virtual_stages_problem(8, 1, 1) is None
    assert "target.vpp_size=2: virtual pipeline stages interleave several pipeline stages" in \
        layout.virtual_stages_problem(8, 1, 2)
    assert layout.virtual_stages_problem(8, 2, 3) == (
        "target.pp_size=2 x target.vpp_size=3 does not divide the model's 8 layers; choose a PP that does")
    args = layout.virtual_stage_args(8, 2, 2)
    assert (args["virtual_pipeline_model_parallel_size"], args["num_layers_per_virtual_pipeline_stage"]) == (2, 2)
    assert layout.virtual_stages(args) == 2 and layout.virtual_stages(layout.virtual_stage_args(8, 2, 1)) == 1


def test_a_tp_that_does_not_split_the_heads_or_the_ffn_is_one_line_naming_the_tps_that_do() -> None:
    """16 heads in 4 key/value groups of 4 channels (linear_qkv's 96 rows), an FFN of 96: TP 1, 2, 4, 8 and 16 split
    them, the key/value heads replicated over 2 or 4 ranks at 8 and 16, as megatron-core runs them; 3 splits no head
    evenly. 12 heads in 6 key/value groups at TP 4: 4 neither divides 6 nor is a multiple of it, which megatron-core
    refuses. Without replication (a Hugging Face model's grid) 8 and 16 do not fit."""
    sizes = layout.tp_sizes(layout.Gpt(2, 64, 96, 16, 4, 4, 1024, True))
    assert [tp for tp in range(1, 33) if layout.tp_problem(sizes, tp, replicated=True) is None] == [1, 2, 4, 8, 16]
    assert layout.tp_problem(sizes, 3, replicated=True) == (
        "target.tp_size=3 does not divide the model's 16 attention heads; choose a TP that does: 1, 2, 4, 8, 16")
    assert layout.tp_problem(layout.tp_sizes(layout.Gpt(2, 48, 96, 12, 6, 4, 1024, True)), 4, replicated=True) == (
        "target.tp_size=4 neither divides nor is a multiple of the model's 6 key/value heads (query groups); "
        "choose a TP that does: 1, 2, 3, 6, 12")
    assert [tp for tp in range(1, 33) if layout.tp_problem(sizes, tp) is None] == [1, 2, 4]
    assert "does not divide the model's 96 ffn_hidden_size (the FFN)" in layout.tp_problem(
        layout.tp_sizes(layout.Gpt(2, 64, 96, 64, 64, 1, 1024, True)), 64, replicated=True)


def test_a_save_written_with_virtual_stages_reads_back_bitwise_and_a_grid_that_cannot_be_is_refused(
    tmp_path: Path,
) -> None:
    """Each chunk's bucket is a ``gbuf_idx`` of its own, its sizes listed per chunk; read back, it is the source."""
    from torch.distributed.checkpoint import FileSystemReader

    source = read_save(synthetic_save(tmp_path, tp=1, layers=4, tied=True))
    write_save(source, tmp_path / "vpp", Target(1, 2, 1, "dp_reshardable", vpp=2))
    back = read_save(tmp_path / "vpp")
    assert back.vpp == 2 and roundtrip_problems(source, back) == []
    stored = FileSystemReader(back.folder).read_metadata().state_dict_metadata
    assert {k.split(".gbuf_idx_")[1].split(".")[0] for k in stored if ".gbuf_idx_" in k} == {"0", "1"}
    back.optim["decoder.layers.mlp.linear_fc2.weight"]["exp_avg"][3, 0, 1] += 1  # chunk 1 of stage 1: the last layer
    assert roundtrip_problems(source, back) == ["exp_avg decoder.layers.mlp.linear_fc2.weight: differs from the "
                                                "source's"]
    with pytest.raises(InputError, match="target.pp_size=2 x target.vpp_size=3 does not divide"):
        write_save(source, tmp_path / "bad", Target(1, 2, 1, "dp_reshardable", vpp=3))
    assert not (tmp_path / "bad").exists()


def test_a_column_parallel_bias_is_cut_as_its_rows_and_a_row_parallel_one_is_whole_on_every_tp_rank() -> None:
    biased = layout.Gpt(4, 32, 64, 4, 2, 8, 1024, True, linear_bias=True)
    params = layout.local_parameters(biased, tp=2, pp=2, tp_rank=1, pp_rank=1)
    by_name = {p.name: p for p in params}
    layer = [p.name.removeprefix("decoder.layers.0.") for p in params if p.name.startswith("decoder.layers.0.")]
    assert layer == ["input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                     "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "pre_mlp_layernorm.weight",
                     "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]
    fc1 = by_name["decoder.layers.0.mlp.linear_fc1.bias"]  # global layer 2, TP rank 1: its gate and up elements
    assert fc1.shape == (64,) and [(p.box, p.local_start, p.local_stop) for p in fc1.pieces] == [
        (((2, 3), (32, 64)), 0, 32), (((2, 3), (96, 128)), 32, 64)]
    qkv = by_name["decoder.layers.1.self_attention.linear_qkv.bias"]  # qkv rows: (4 + 2 x 2) x 8 = 64, half of them
    assert qkv.shape == (32,) and qkv.pieces[0].box == ((3, 4), (32, 64))
    for whole in ("decoder.layers.1.self_attention.linear_proj.bias", "decoder.layers.1.mlp.linear_fc2.bias"):
        assert by_name[whole].shape == (32,) and by_name[whole].pieces[0].box == ((3, 4), (0, 32))
    shapes = layout.global_shapes(biased)
    assert shapes["decoder.layers.mlp.linear_fc1.bias"] == (4, 128)
    assert all(layout.without_weight_decay(k, shapes[k]) for k in shapes if k.endswith(".bias"))
    qkv_only = layout.Gpt(4, 32, 64, 4, 2, 8, 1024, True, qkv_bias=True)  # Qwen2's attention
    assert sorted(k for k in layout.global_shapes(qkv_only) if k.endswith("bias")) == [
        "decoder.layers.self_attention.linear_qkv.bias"]
    assert not any(k.endswith("bias") for k in layout.global_shapes(layout.Gpt(4, 32, 64, 4, 2, 8, 1024, True)))


def test_megatron_lms_default_gpt_has_norm_biases_a_position_table_and_a_tied_embedding_copied_over_pp() -> None:
    gpt = layout.Gpt(4, 32, 64, 4, 2, 8, 1024, False, norm_bias=True, position_table=16, tied=True)
    shapes = layout.global_shapes(gpt)
    assert "output_layer.weight" not in shapes and shapes["embedding.position_embeddings.weight"] == (16, 32)
    assert shapes["decoder.layers.self_attention.linear_qkv.layer_norm_bias"] == (4, 32)
    assert shapes["decoder.final_layernorm.bias"] == (32,)
    first = layout.local_parameters(gpt, tp=2, pp=2, tp_rank=1, pp_rank=0)
    assert [p.name for p in first[:4]] == ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                                           "decoder.layers.0.input_layernorm.weight",
                                           "decoder.layers.0.input_layernorm.bias"]
    table = first[1]  # whole on every TP rank
    assert table.shape == (16, 32) and table.pieces[0].box == ((0, 16), (0, 32))
    last = layout.local_parameters(gpt, tp=2, pp=2, tp_rank=1, pp_rank=1)
    assert [p.name for p in last[-3:]] == ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
                                          "output_layer.weight"]
    copy = last[-1]  # the embedding's rows of TP rank 1, under the embedding's key
    assert copy.tied_copy and copy.own_bucket and copy.pieces[0].key == "embedding.word_embeddings.weight"
    assert copy.pieces[0].box == ((512, 1024), (0, 32))
    # each tied parameter a bucket of its own: the embedding last in the first stage's order, the copy first
    assert [[e[0] for e in b.entries][-1:] for b in layout.buckets(first, dp=1)] == [
        ["embedding.position_embeddings.weight"], ["embedding.word_embeddings.weight"]]
    assert [len(b.entries) for b in layout.buckets(last, dp=1)] == [1, len(last) - 1]
    assert all(b.numel % 128 == 0 for b in layout.buckets(last, dp=1))
    one_stage = layout.local_parameters(gpt, tp=1, pp=1, tp_rank=0, pp_rank=0)  # the output layer has no weight
    assert "output_layer.weight" not in {p.name for p in one_stage} and len(layout.buckets(one_stage, dp=2)) == 1


def test_a_larger_padded_vocabulary_gets_zero_rows_and_the_read_back_check_sees_a_nonzero_one(tmp_path: Path) -> None:
    source = read_save(synthetic_save(tmp_path, tp=1))  # 1000 rows padded to 1056
    write_save(source, tmp_path / "tp2", Target(2, 1, 1, "fully_reshardable"))  # padded to 1152
    back = read_save(tmp_path / "tp2")
    assert back.args["padded_vocab_size"] == 1152 and back.tp == 2
    assert back.model["output_layer.weight"].shape == (1152, 32)
    assert roundtrip_problems(source, back) == []
    back.optim["embedding.word_embeddings.weight"]["exp_avg"][1100, 0] = 1.0
    assert roundtrip_problems(source, back) == [
        "exp_avg embedding.word_embeddings.weight: the padding rows [1056, 1152) it adds are not zero"
    ]


def test_a_tied_copy_whose_state_differs_from_the_first_stages_is_named_in_every_conversions_report(
    tmp_path: Path,
) -> None:
    """Megatron keeps the last stage's copy of a tied embedding equal to the first stage's, and a ``dp_reshardable``
    save holds both. The first stage's is the one read (as Megatron's own model-space save keeps it); a copy that
    differs in one element is named in the report of a conversion by Megatron's stages and by the range pipeline, not
    left out without a word; in a conversion's read-back, it fails the conversion. (tests/frameworks/test_megatron.py
    holds a real save's copy equal.)"""
    pytest.importorskip("transformers")  # the Llama a PyTorch job's output is of (the frameworks extra)
    source = synthetic_save(tmp_path, tp=1, pp=2, tied=True)
    write_with_the_tied_copy_changed(read_save(source), tmp_path / "wrong")
    right, wrong = read_save(source), read_save(tmp_path / "wrong")
    note = (f"{wrong.folder}: the last pipeline stage's copy of the tied word embedding holds optimizer state unequal "
            "to the first stage's (1 element of exp_avg), which Megatron keeps equal: the first stage's is "
            "converted, the copy's left out")
    assert right.notes == () and wrong.notes == (note,)
    # as the read-back of a conversion's output, one wrong element of the copy fails it (the rest, the first stage's
    # state, is the source's)
    assert roundtrip_problems(right, wrong) == [f"the written save: {note}"]
    assert read_back_problems(right, tmp_path / "wrong") == [f"the written save: {note}"]  # as it is read

    targets = {"megatron": ["target.tp_size=1", "target.pp_size=1", "target.world_size=1"],
               "pytorch": ["output.checkpoint=pytorch", "target.kind=fsdp2", "target.world_size=2",
                           "runtime.mode=offline"]}
    cases = [["checkpoint=megatron", f"input.path={folder}", *args, f"output.path={tmp_path / f'{name}-{kind}'}"]
             for name, folder in (("right", source), ("wrong", tmp_path / "wrong")) for kind, args in targets.items()]
    results = run_cli_cases(cases, cwd=tmp_path, per_case_s=240, env=user_env())
    assert [r["code"] for r in results] == [0] * len(cases), [r["stderr"][-2000:] for r in results]
    for name in ("right", "wrong"):
        for kind in targets:
            warnings = json.loads((tmp_path / f"{name}-{kind}" / "report.json").read_text())["warnings"]
            assert (note in warnings) == (name == "wrong"), (name, kind, warnings)


def test_a_smaller_padded_vocabulary_keeps_the_rows_it_has(tmp_path: Path) -> None:
    source = read_save(synthetic_save(tmp_path, tp=2))  # padded to 1152
    write_save(source, tmp_path / "tp1", Target(1, 1, 2, "dp_reshardable"))  # padded to 1056
    back = read_save(tmp_path / "tp1")
    assert back.model["embedding.word_embeddings.weight"].shape == (1056, 32) and back.dp == 2
    assert roundtrip_problems(source, back) == []


def test_a_weight_the_layout_has_no_place_for_is_named_not_dropped(tmp_path: Path) -> None:
    """What the reader does with a save holding a weight its args' layout lacks (a LayerNorm's bias, a position
    table, ...): it names it. Here the layout is the save's own less the final norm, whose weight the save holds."""
    from osdpipe.io.formats.dcp_reader import DcpCheckpoint
    from osdpipe.io.formats.megatron import _refuse_unknown_tensors, gpt_of, iteration_folder, read_common

    folder = iteration_folder(synthetic_save(tmp_path, tp=1))
    shapes = layout.global_shapes(gpt_of(read_common(folder)["args"]))
    checkpoint = DcpCheckpoint(str(folder), None)
    _refuse_unknown_tensors(checkpoint, shapes)  # the save's own layout: nothing unknown
    del shapes["decoder.final_layernorm.weight"]
    with pytest.raises(InputError, match=r"holds decoder\.final_layernorm\.weight, which the GPT its common\.pt's "
                                         "args describe has no place for: not supported yet"):
        _refuse_unknown_tensors(checkpoint, shapes)


@pytest.mark.parametrize("reader", ["product", "oracle"])
def test_damaged_and_missing_files_are_named_in_one_line(tmp_path: Path, reader: str) -> None:
    """By the product's reader (:class:`~osdpipe.io.formats.megatron_reader.MegatronFiles`) and the test oracle's."""
    from osdpipe.io.formats.megatron_reader import MegatronFiles

    read = MegatronFiles if reader == "product" else read_save
    folder = synthetic_save(tmp_path, tp=1) / "iter_0000007"
    (folder / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(InputError, match=r"\.metadata"):
        read(folder)
    (folder / "common.pt").unlink()
    with pytest.raises(InputError, match="holds no common.pt"):
        read(folder)
    (folder / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    with pytest.raises(InputError, match="sharded_backend 'zarr'"):
        read(folder)


def test_a_missing_data_file_fails_the_command_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    from helpers import run_osdpipe

    save = synthetic_save(tmp_path, tp=1)
    (save / "iter_0000007" / "__0_0.distcp").unlink()
    done = run_osdpipe("checkpoint=megatron", f"input.path={save}", "target.world_size=2",
                       f"output.path={tmp_path / 'out'}", cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr  # before anything runs
    assert "__0_0.distcp is missing" in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_api_refuses_to_replace_an_output_unless_asked_and_then_replaces_it_whole(tmp_path: Path) -> None:
    import json

    import osdpipe
    from osdpipe.spec.config import ConfigError

    source = synthetic_save(tmp_path, tp=1)
    out = tmp_path / "out"
    done = osdpipe.reshard_megatron(source, out, tp=2)
    assert done["target"] == {"tp": 2, "pp": 1, "vpp": 1, "dp": 1, "sharding": "dp_reshardable"}
    assert done["rng_from"] == {}  # the synthetic save has no RNG states to carry
    with pytest.raises(ConfigError, match="output.overwrite=true"):
        osdpipe.reshard_megatron(source, out, tp=1, dp=2)
    osdpipe.reshard_megatron(source, out, tp=1, dp=2, overwrite=True)
    assert read_save(out).dp == 2 and sorted(p.name for p in out.iterdir()) == [
        "iter_0000007", "latest_checkpointed_iteration.txt", "manifest.json", "osdpipe.log", "report.json"
    ]
    assert set(json.loads((out / "manifest.json").read_text())["files"]) == {  # the run's record aside
        str(p.relative_to(out)) for p in out.rglob("*")
        if p.is_file() and p.name not in ("manifest.json", "report.json", "osdpipe.log")
    }
    from helpers import run_osdpipe

    checked = run_osdpipe("check", str(out), cwd=tmp_path)  # the API's manifest holds its own, smaller config
    assert checked.returncode == 0 and "check roundtrip  pass" in checked.stdout, checked.stdout + checked.stderr


def _printed_command(stdout: str, filled: dict[str, str]) -> list[str]:
    """The arguments of the command ``osdpipe inspect`` printed, each placeholder (``T``, ``OUT_DIR``...) filled."""
    printed = stdout[stdout.index("convert with osdpipe ") + len("convert with osdpipe "):].strip()
    return [w.split("=")[0] + "=" + filled.get(w.split("=", 1)[1], w.split("=", 1)[1]) for w in shlex.split(printed)]


def test_inspect_of_a_save_with_virtual_pipeline_stages_names_the_key_that_keeps_them(tmp_path: Path) -> None:
    """The printed command's target has no virtual stages unless ``target.vpp_size`` is added: inspect says so for a
    save that has them, and the command with the key added keeps them."""
    from helpers import run_osdpipe

    source = read_save(synthetic_save(tmp_path, tp=1, layers=4))
    write_save(source, tmp_path / "vpp", Target(1, 2, 1, "dp_reshardable", vpp=2))
    inspected = run_osdpipe("inspect", str(tmp_path / "vpp"), cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    assert "TP1 PP2 DP1 (world 2), EP1, virtual pipeline stages 2" in inspected.stdout
    assert "to keep 2 virtual pipeline stages per pipeline stage, add target.vpp_size=2" in inspected.stdout
    words = _printed_command(inspected.stdout, {"T": "2", "P": "2", "M": "4", "OUT_DIR": str(tmp_path / "out")})
    done = run_osdpipe(*words, "target.vpp_size=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    back = read_save(tmp_path / "out")
    assert (back.tp, back.pp, back.vpp, back.dp) == (2, 2, 2, 1) and roundtrip_problems(source, back) == []
    plain = run_osdpipe("inspect", str(synthetic_save(tmp_path, tp=2)), cwd=tmp_path)
    assert "target.vpp_size" not in plain.stdout  # a save without virtual stages: nothing to keep


def test_inspect_names_a_saves_buckets_and_a_save_of_counted_buckets_converts_bitwise(tmp_path: Path) -> None:
    """``--overlap-grad-reduce`` with ``--ddp-bucket-size`` or ``--ddp-num-buckets`` is described; buckets counted
    (their size the rank's parameters over the count) are laid out at the source's TP and again at the target's."""
    from helpers import run_osdpipe

    bucketed = synthetic_save(tmp_path / "sized", tp=1, ddp=BUCKETED)
    inspected = run_osdpipe("inspect", str(bucketed), cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    assert "DDP with --overlap-grad-reduce: the first stage's gradient buffer in buckets of 3000 elements" in \
        inspected.stdout
    counted = synthetic_save(tmp_path / "counted", tp=2, ddp={"overlap_grad_reduce": True, "ddp_num_buckets": 3})
    assert _bucket_counts(counted)[0] > 1  # the sizes: held against megatron-core in tests/frameworks
    assert "in about 3 buckets (--ddp-num-buckets)" in run_osdpipe("inspect", str(counted), cwd=tmp_path).stdout
    source = read_save(counted)
    write_save(source, tmp_path / "tp1", Target(1, 1, 2, "dp_reshardable"))
    assert _bucket_counts(tmp_path / "tp1")[0] > 1
    assert roundtrip_problems(source, read_save(tmp_path / "tp1")) == []


def test_inspect_describes_a_megatron_save_and_the_command_it_prints_converts_it_and_check_proves_it(
    tmp_path: Path,
) -> None:
    """inspect names the parallelism, sharding type, dtypes, iteration and the model's dimensions; its printed command,
    placeholders filled, converts the save (two writers), and ``osdpipe check`` proves the output against the source and
    fails against another save."""
    import json

    from helpers import run_osdpipe

    save = synthetic_save(tmp_path, tp=2)
    inspected = run_osdpipe("inspect", str(save), cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    for said in ("layout       megatron", "TP2 PP1 DP1 (world 2), EP1, virtual pipeline stages none",
                 "distributed optimizer dp_reshardable; weights float32", "of iteration 7",
                 "2 layers, hidden 32, ffn 64, 4 heads in 2 query groups, vocabulary padded to 1152, SwiGLU"):
        assert said in inspected.stdout, inspected.stdout
    words = _printed_command(inspected.stdout, {"T": "1", "P": "2", "M": "4", "OUT_DIR": str(tmp_path / "out")})
    done = run_osdpipe(*words, "runtime.workers=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    back = read_save(tmp_path / "out")
    assert (back.tp, back.pp, back.dp) == (1, 2, 2)
    assert len(list((tmp_path / "out" / "iter_0000007").glob("*.distcp"))) == 4  # one file per target rank
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["ok"] and [s["name"] for s in report["stages"]] == [  # the stages of every conversion
        "load", "broadcast", "flatten", "shard", "rekey", "verify", "save"]
    assert {e["part"] for e in report["entries"]} == {"model", "optimizer", "other"}
    checked = run_osdpipe("check", str(tmp_path / "out"), cwd=tmp_path)
    assert checked.returncode == 0 and "check roundtrip  pass" in checked.stdout, checked.stdout + checked.stderr
    other = synthetic_save(tmp_path / "other", tp=2, seed=1)
    against = run_osdpipe("check", str(tmp_path / "out"), f"input.path={other}", cwd=tmp_path)
    assert against.returncode == 1 and "roundtrip  FAIL" in against.stdout
    assert "differs from the source's" in against.stdout


def test_bad_megatron_configs_are_refused_in_one_line_and_write_nothing(tmp_path: Path) -> None:
    from helpers import run_cli_cases

    save = synthetic_save(tmp_path, tp=2)
    out = tmp_path / "out"
    grid = ["checkpoint=megatron", f"input.path={save}", f"output.path={out}"]
    cases = {
        "checkpoint=megatron with target.kind=fsdp2": [*grid, "target.kind=fsdp2"],
        "target.pp_size=2: pipeline stages are Megatron's": ["target.pp_size=2", f"output.path={out}"],
        "target.vpp_size=2: pipeline stages are Megatron's": ["target.vpp_size=2", f"output.path={out}"],
        "target.vpp_size=2: virtual pipeline stages interleave several pipeline stages": [*grid, "target.vpp_size=2"],
        "target.pp_size=2 x target.vpp_size=2 does not divide the model's 2 layers": [
            *grid, "target.pp_size=2", "target.vpp_size=2", "target.world_size=2"],
        "output.megatron_optim_format=fully_reshardable is how a Megatron-LM output": [
            "output.megatron_optim_format=fully_reshardable", f"output.path={out}"],
        "target.kind=megatron writes a Megatron-LM save from one": ["target.kind=megatron", f"output.path={out}"],
        "tp_size=2 x pp_size=2 does not divide world_size=2": [*grid, "target.tp_size=2", "target.pp_size=2",
                                                               "target.world_size=2"],
        "source.tp_size=4, but": [*grid, "source.tp_size=4", "target.world_size=2"],
        "runtime.mode=online: a Megatron-LM save converts offline": [*grid, "runtime.mode=online"],
        "target.tp_size=3 does not divide the model's 4 attention heads; choose a TP that does: 1, 2": [
            *grid, "target.tp_size=3", "target.world_size=3"],
        "set checkpoint=megatron and the target's grid": [f"input.path={save}", f"output.path={out}"],
        "checkpoint=megatron converts a Megatron-LM save: give input.path": ["checkpoint=megatron",
                                                                             f"output.path={out}"],
    }
    results = run_cli_cases(list(cases.values()), cwd=tmp_path)
    for said, result in zip(cases, results):
        assert result["code"] == 2, (said, result)
        assert said in result["stderr"] and len(result["stderr"].strip().splitlines()) == 1, (said, result["stderr"])
        assert not out.exists(), said
    (out / "iter_0000007").mkdir(parents=True)  # a conversion already there stays unless output.overwrite=true
    (out / "latest_checkpointed_iteration.txt").write_text("7")
    again = run_cli_cases([[*grid, "target.world_size=2"]], cwd=tmp_path)[0]
    assert again["code"] == 2 and f"osdpipe: error: config: output.path='{out}' already holds a conversion (" in (
        again["stderr"]
    ), again["stderr"]
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000007", "latest_checkpointed_iteration.txt"]


def test_a_save_whose_model_cannot_be_its_hugging_face_models_is_one_line_naming_why(tmp_path: Path) -> None:
    """A save whose args lack what config.json needs (``seq_length``, without ``max_position_embeddings``: not
    Megatron-LM's own), or hold what the Hugging Face family cannot express (interleaved RoPE): a Hugging Face folder,
    or a framework's checkpoint of the Hugging Face model, is refused in one line naming it, and nothing is written
    (not a run that builds another model and says that model is wrong)."""
    changes = {"common.pt's args hold no seq_length, which config.json needs": lambda args: delattr(args, "seq_length"),
               "interleaved RoPE (rotary_interleaved): not supported yet": lambda args: setattr(
                   args, "rotary_interleaved", True)}
    cases, said = [], []
    for i, (why, change) in enumerate(changes.items()):
        save = synthetic_save(tmp_path / f"save{i}", tp=1)
        common = save / "iter_0000007" / "common.pt"
        held = torch.load(common, weights_only=False)
        change(held["args"])
        torch.save(held, common)
        given = ["checkpoint=megatron", f"input.path={save}", f"output.path={tmp_path / 'out'}"]
        cases += [[*given, "output.checkpoint=hf"],
                  [*given, "output.checkpoint=accelerate", "target.kind=fsdp2", "target.world_size=1"]]
        said += [why, why]
    for why, result in zip(said, run_cli_cases(cases, cwd=tmp_path)):
        line = result["stderr"].strip()
        assert result["code"] in (1, 2) and len(line.splitlines()) == 1, (why, line)
        assert why in line and "internal" not in line, (why, line)
        out = tmp_path / "out"
        assert not out.exists() or sorted(p.name for p in out.iterdir()) == ["osdpipe.log", "report.json"], why


def test_output_checkpoint_hf_writes_the_fp32_masters_as_a_hugging_face_folder_that_maps_back_bitwise(
    tmp_path: Path,
) -> None:
    """No target grid: the folder is the whole model. Its weights are the masters (not the model's weights), mapped to
    Llama's names, the vocabulary's padding dropped; sharded past output.max_shard_size with an index."""
    import json

    from helpers import run_osdpipe

    from osdpipe.io.hf_folder import read_weights
    from osdpipe.layout.megatron_hf import from_hf

    save = synthetic_save(tmp_path, tp=2)
    out = tmp_path / "hf"
    done = run_osdpipe("checkpoint=megatron", f"input.path={save}", "output.checkpoint=hf",
                       "output.max_shard_size=200KB", f"output.path={out}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["num_key_value_heads"], config["num_hidden_layers"]) == (1000, 2, 2)
    assert (out / "model.safetensors.index.json").is_file()
    source = read_save(save)
    back = from_hf(layout.Gpt(2, 32, 64, 4, 2, 8, 1152, True), read_weights(out), 1152)
    for key, states in source.optim.items():
        rows = 1000 if key in ("embedding.word_embeddings.weight", "output_layer.weight") else None
        assert torch.equal(back[key][:rows], states["param"][:rows]), key
    assert not torch.equal(source.model["output_layer.weight"], source.optim["output_layer.weight"]["param"])
    report = json.loads((out / "report.json").read_text())
    detail = report["checks"][0]["detail"]
    assert report["ok"] and report["checks"][0]["name"] == "roundtrip" and "bitwise" in detail
    checked = run_osdpipe("check", str(out), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


class _FlattenedItem:
    """One ``fully_sharded_model_space`` item as megatron-core 0.13 stores it, without files: its DCP metadata and the
    stored tensor read flat, as :class:`osdpipe.io.formats.dcp_reader.DcpCheckpoint` gives them."""

    def __init__(self, key: str, stored: torch.Tensor, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

        self.path, self.stored = "iter_0000003", stored
        item = TensorStorageMetadata(TensorProperties(dtype=stored.dtype), stored.shape,
                                     [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
        self.metadata = type("Metadata", (), {"state_dict_metadata": {key: item}})()

    def read_range(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self.stored.reshape(-1)[start:stop]


def test_a_fully_sharded_model_space_item_is_put_back_from_its_flattened_chunks() -> None:
    """A stacked weight (2 layers of 6 x 4, TP2 over rows, stored (2, 2, 1, 12)), one chunk cut between two DP ranks:
    every element lands where the global tensor has it; an item of another shape or with a missing part is refused."""
    from megatron_oracle import _unflattened

    key, full = "optimizer.state.exp_avg.w", torch.arange(48, dtype=torch.float32).reshape(2, 6, 4)
    stored = torch.stack([torch.stack([full[layer, 3 * t : 3 * (t + 1)].reshape(1, 12) for t in range(2)])
                          for layer in range(2)])
    chunks = [((0, 0, 0, 0), (1, 1, 1, 5)), ((0, 0, 0, 5), (1, 1, 1, 7)), ((0, 1, 0, 0), (1, 1, 1, 12)),
              ((1, 0, 0, 0), (1, 1, 1, 12)), ((1, 1, 0, 0), (1, 1, 1, 12))]
    assert torch.equal(_unflattened(_FlattenedItem(key, stored, chunks), key, (2, 6, 4)), full)
    with pytest.raises(InputError, match=r"not the flattened chunks of a \(2, 8, 4\) tensor"):
        _unflattened(_FlattenedItem(key, stored, chunks), key, (2, 8, 4))
    with pytest.raises(InputError, match="do not cover it; re-copy the save folder"):
        _unflattened(_FlattenedItem(key, stored, chunks[1:]), key, (2, 6, 4))


def _bucket_counts(folder: Path) -> dict[int, int]:
    """How many buckets each model-parallel domain of a ``dp_reshardable`` save holds, from its stored keys."""
    from torch.distributed.checkpoint import FileSystemReader

    (iteration,) = folder.glob("iter_*")
    stored = FileSystemReader(iteration).read_metadata().state_dict_metadata
    held: dict[int, set[int]] = {}
    for key in stored:
        if ".bucket_idx_" in key and key.endswith(".exp_avg"):
            domain = int(key.split("dp_group_idx_")[1].split(".")[0])
            held.setdefault(domain, set()).add(int(key.split(".bucket_idx_")[1].split(".")[0]))
    return {domain: len(b) for domain, b in sorted(held.items())}


BUCKETED = {"overlap_grad_reduce": True, "ddp_bucket_size": 3000}


def test_a_bucket_size_cuts_the_first_stages_buffer_and_converts_to_another_grid_bitwise(tmp_path: Path) -> None:
    """With ``--overlap-grad-reduce --ddp-bucket-size``, the first stage's buffer is several buckets, the later
    stage's one; read, converted to PP1 (all of it bucketed) and back, every state is the source's."""
    folder = synthetic_save(tmp_path, tp=1, pp=2, layers=4, ddp=BUCKETED)
    counts = _bucket_counts(folder)
    assert counts[0] > 2 and counts[1] == 1, counts
    source = read_save(folder)
    write_save(source, tmp_path / "pp1", Target(1, 1, 2, "dp_reshardable"))
    assert _bucket_counts(tmp_path / "pp1")[0] > counts[0]
    back = read_save(tmp_path / "pp1")
    assert roundtrip_problems(source, back) == []
    back.optim["decoder.layers.mlp.linear_fc1.weight"]["exp_avg_sq"][0, 5, 2] += 1
    assert roundtrip_problems(source, back) == ["exp_avg_sq decoder.layers.mlp.linear_fc1.weight: differs from the "
                                                "source's"]


def test_buckets_close_at_the_bucket_size_and_around_a_tied_embedding_as_megatron_core_closes_them() -> None:
    """The rules of megatron-core 0.16's ``_ParamAndGradBuffer`` (reverse order, a start aligned to 64, a bucket
    closed once its span reaches the size, a tied embedding's parameter a bucket alone whose bucket before ends at
    its aligned start), on sizes whose alignment shows."""
    params = [_param("embed", 300, own=True), _param("a", 100), _param("b", 70), _param("c", 30)]  # reversed: c, b, a
    laid = layout.buckets(params, dp=2, how=layout.Bucketing(size=130))
    assert [b.entries for b in laid] == [(("c", 0, 30), ("b", 64, 134)), (("a", 0, 100),), (("embed", 0, 300),)]
    assert [(b.data_end, b.numel) for b in laid] == [(134, 256), (128, 128), (300, 384)]
    # no size: one bucket before the embedding, closed at the embedding's aligned start (292 -> 320)
    laid = layout.buckets(params, dp=2)
    assert [b.data_end for b in laid] == [320, 300] and laid[0].entries[-1] == ("a", 192, 292)
    assert layout.buckets(params[1:], dp=3, how=layout.Bucketing(high_busbw=True))[0].numel == 3 * 2**16


def test_only_the_first_stages_first_chunk_is_bucketed_and_only_with_overlap_grad_reduce() -> None:
    on = {"overlap_grad_reduce": True, "ddp_bucket_size": 5000}
    assert layout.bucketing(on, 2, 0, 0, 10**6) == layout.Bucketing(5000)
    assert layout.bucketing(on, 2, 1, 0, 10**6).size is None and layout.bucketing(on, 2, 0, 1, 10**6).size is None
    assert layout.bucketing({**on, "overlap_param_gather_with_optimizer_step": True}, 2, 0, 0, 10**6).size is None
    assert layout.bucketing({**on, "overlap_grad_reduce": False}, 2, 0, 0, 10**6).size is None
    default = {"overlap_grad_reduce": True, "ddp_bucket_size": None}
    assert layout.bucketing(default, 8, 0, 0, 10**6).size == 40_000_000
    assert layout.bucketing(default, 64, 0, 0, 10**6).size == 64_000_000
    counted = {"overlap_grad_reduce": True, "ddp_bucket_size": None, "ddp_num_buckets": 8}
    assert layout.bucketing(counted, 2, 0, 0, 1_000_007).size == 125_000  # the rank's parameters over 8, rounded down
    gpt = layout.Gpt(4, 32, 64, 4, 2, 8, 1024, True)  # every chunk of the rank counts, the bucketed one or not
    assert layout.rank_numel(gpt, 2, 2, 1, 0, vpp=2) == sum(
        p.numel for c in (0, 1) for p in layout.local_parameters(gpt, 2, 2, 1, 0, 2, c))


def test_a_save_in_other_buckets_than_its_args_lay_out_is_refused_in_one_line(tmp_path: Path, monkeypatch) -> None:
    """A save whose buckets its args do not describe (a bucket size they do not name) is refused rather than
    misread; one whose domain lacks a bucket its layout has is damaged: named, to re-copy. By the test oracle's reader
    and the product's."""
    from osdpipe.io.formats.megatron_reader import MegatronFiles

    folder = synthetic_save(tmp_path, tp=1, ddp=BUCKETED)
    common = folder / "iter_0000007" / "common.pt"
    held = torch.load(common, weights_only=False)
    held["args"].overlap_grad_reduce = False  # the save's buckets, args that lay out one
    torch.save(held, common)
    with pytest.raises(InputError, match=r"cut into \d+ buckets where its args lay out 1 \(one bucket: overlap_grad_"
                                         r"reduce, ddp_bucket_size, ddp_num_buckets\); it is not the job its args"):
        read_save(folder)
    with pytest.raises(InputError, match=r"cut into \d+ buckets where its args lay out 1 \(overlap_grad_reduce, "
                                         r"ddp_bucket_size, ddp_num_buckets\); it is not the job its args"):
        MegatronFiles(folder).pieces("output_layer.weight", "exp_avg", 0, 1)  # the product's reader
    one = synthetic_save(tmp_path / "one", tp=1)
    real = layout.buckets
    monkeypatch.setattr(layout, "buckets", lambda params, dp, how: [*real(params, dp, how), *real(params, dp, how)])
    with pytest.raises(InputError, match=r"domain 0 is missing buckets \(it holds \[0\] of 2\); re-copy"):
        read_save(one)
    with pytest.raises(InputError, match=r"domain 0 is missing buckets \(it holds \[0\] of 2\); re-copy"):
        MegatronFiles(one).pieces("output_layer.weight", "exp_avg", 0, 1)


@pytest.mark.parametrize(("change", "said"), [
    ({}, "a Hugging Face LlamaForCausalLM (output.checkpoint=hf: its weights; accelerate|pytorch: a job's, the "
         "optimizer included); torchtitan's llama3 too (output.checkpoint=torchtitan)"),
    ({"qk_layernorm": True}, "a Hugging Face Qwen3ForCausalLM (output.checkpoint=hf: its weights; accelerate|pytorch: "
                             "a job's, the optimizer included); torchtitan's qwen3 too (output.checkpoint=torchtitan)"),
    ({"untie_embeddings_and_output_weights": False}, "LlamaForCausalLM (output.checkpoint=hf: its weights; "
     "accelerate|pytorch: a job's, the optimizer included); torchtitan's llama3 too (output.checkpoint=torchtitan)"),
    ({"add_bias_linear": True}, "torchtitan's llama3 cannot hold it (linear biases"),
    ({"normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "swiglu": False,
      "add_bias_linear": True, "num_query_groups": 4, "group_query_attention": False},
     "a Hugging Face GPT2LMHeadModel"),
    ({"num_experts": 8}, "outside Megatron: no Hugging Face model yet (a mixture of experts (num_experts)); convert it "
                         "within Megatron"),
])
def test_inspect_says_which_outputs_take_a_save(change: dict, said: str) -> None:
    """The Hugging Face model a save becomes, and whether torchtitan's llama3 holds it, from its ``args`` alone."""
    from synthetic_megatron import ARGS

    from osdpipe.io.checkpoints.megatron import elsewhere

    line = elsewhere({**ARGS, **change})
    assert said in line and "\n" not in line, line


def test_inspect_of_a_save_says_which_outputs_take_it(tmp_path: Path) -> None:
    from helpers import run_osdpipe

    inspected = run_osdpipe("inspect", str(synthetic_save(tmp_path, tp=2, tied=True)), cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    assert "outside Megatron: a Hugging Face LlamaForCausalLM" in inspected.stdout
    assert "torchtitan's llama3 too (output.checkpoint=torchtitan)" in inspected.stdout  # tied, as torchtitan ties
