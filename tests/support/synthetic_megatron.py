"""A Megatron-LM save of random state, written by the test oracle's writer (:mod:`megatron_oracle_writer`): the tests
that need a Megatron save but not megatron-core's training (layout rules, the command's errors, object storage). Real
megatron-core saves are tests/frameworks/mcore_saves.py's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import megatron_oracle_writer
import torch
from megatron_oracle import MegatronSave
from megatron_oracle_writer import Target, target_args, write_save

from osdpipe.layout import megatron as layout

#: A small GPT's Megatron-LM args (the divisor 96 makes the padded vocabulary change with TP).
ARGS = {
    "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
    "kv_channels": 8, "vocab_size": 1000, "make_vocab_size_divisible_by": 96, "swiglu": True,
    "untie_embeddings_and_output_weights": True, "transformer_impl": "local", "add_bias_linear": False,
    "normalization": "RMSNorm", "position_embedding_type": "rope", "group_query_attention": True, "seq_length": 16,
}


def synthetic_save(tmp_path: Path, tp: int, seed: int = 0, *, pp: int = 1, tied: bool = False,
                   layers: int = 2, width: int = 32, vocab: int = 1000, ddp: dict | None = None,
                   bf16: bool = False) -> Path:
    """A Megatron-LM save of random state at TP ``tp`` and PP ``pp``, written by the oracle's writer into
    ``tmp_path / f"tp{tp}"``; ``tied``: the word embedding tied to the output layer (over PP the last stage holds a
    copy); ``layers``, ``width`` (the hidden size; the FFN's is twice it) and ``vocab``: the GPT's; ``ddp``:
    Megatron-LM's DDP args of the job (``overlap_grad_reduce``, ``ddp_bucket_size``: its buckets); ``bf16``: a bf16
    job's (``args.bf16``, the model's weights its masters rounded to bf16)."""
    grid = Target(tp, pp, 1, "dp_reshardable")
    dims = {"hidden_size": width, "ffn_hidden_size": 2 * width, "kv_channels": width // 4, "vocab_size": vocab}
    args = target_args({**ARGS, **dims, "iteration": 7, "untie_embeddings_and_output_weights": not tied,
                        "num_layers": layers, **(ddp or {}), **({"bf16": True} if bf16 else {})}, grid)
    gpt = layout.Gpt(layers, width, 2 * width, 4, 2, width // 4, args["padded_vocab_size"], True, tied=tied)
    generator = torch.Generator().manual_seed(seed)
    shapes = layout.global_shapes(gpt)
    model = {k: torch.randn(s, generator=generator).to(torch.bfloat16 if bf16 else torch.float32)
             for k, s in shapes.items()}
    optim = {k: {s: torch.randn(v, generator=generator) for s in ("param", "exp_avg", "exp_avg_sq")}
             for k, v in shapes.items()}
    one_dim = sorted(k for k in shapes if layout.without_weight_decay(k, shapes[k]))
    adamw = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False, "maximize": False, "foreach": None,
             "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True}
    # the hyperparameters of torch.optim.AdamW (Megatron's optimizer on CPU), which a PyTorch job's optimizer reads
    groups = [{**adamw, "wd_mult": 1.0, "weight_decay": 0.1, "step": 7.0, "params": sorted(set(shapes) - set(one_dim))},
              {**adamw, "wd_mult": 0.0, "weight_decay": 0.0, "step": 7.0, "params": one_dim}]
    save = MegatronSave(tmp_path, 7, args, "dp_reshardable", model, optim, groups, {"num_steps": 7},
                        gbuf_dtypes="torch.float32, torch.float32")
    write_save(save, tmp_path / f"tp{tp}", grid)
    return tmp_path / f"tp{tp}"


@contextmanager
def one_element_changed(chosen: Callable[[str], bool], index: int) -> Iterator[list[str]]:
    """Inside, the oracle's Megatron writer writes element ``index`` of the first item it makes as it writes (a
    bucket, a padded vocabulary tensor) whose key ``chosen`` picks one more than it should be; the list given names
    the item."""
    real, picked = megatron_oracle_writer._dcp_save, []

    def dcp_save(items, folder, made):
        key = next(k for k, v in items.items() if chosen(k) and isinstance(v, torch.Tensor)
                   and made.fills(v.untyped_storage()))
        wrong, dtype, real_windows = items[key].untyped_storage()._cdata, items[key].dtype, made.windows

        def windows(storage):
            if storage._cdata != wrong:
                return real_windows(storage)
            data = torch.frombuffer(bytearray(b"".join(bytes(w) for w in real_windows(storage))), dtype=dtype)
            data[index] += 1
            return iter([memoryview(data.view(torch.uint8).numpy())])

        made.windows = windows
        picked.append(key)
        return real(items, folder, made)

    megatron_oracle_writer._dcp_save = dcp_save
    try:
        yield picked
    finally:
        megatron_oracle_writer._dcp_save = real


def write_with_the_tied_copy_changed(save: MegatronSave, folder: Path) -> None:
    """``save`` written by the oracle's writer at TP1 PP2 ``dp_reshardable``, but one element of the last stage's copy
    of the tied embedding (domain 1, bucket 0: the copy alone) wrong in its ``exp_avg``: a save whose two copies of
    the tied embedding differ, which Megatron never writes."""
    with one_element_changed(lambda key: key.startswith("optimizer.distributed.dp_group_idx_1.")
                             and key.endswith("bucket_idx_0.exp_avg"), 3):
        write_save(save, folder, Target(1, 2, 1, "dp_reshardable"))
