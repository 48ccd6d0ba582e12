"""Pure layout math of Megatron-Core's GPT: where each element of each parameter sits on each (PP, TP, DP) rank.

Megatron saves its model by *sharded keys*: one global tensor per kind of weight, the decoder's layers stacked on a
leading layer axis (``decoder.layers.self_attention.linear_qkv.weight`` of shape ``(layers, rows, hidden)``). A
rank of the grid holds:

* **PP** stage ``p``: the layers ``[p L/P, (p+1) L/P)``; the embedding on the first stage, the final norm and the
  output layer on the last;
* **TP** rank ``t``: of a column-parallel weight (``linear_qkv``, ``linear_fc1``, the embedding and the output
  layer, whose vocabulary is padded to a multiple of ``make_vocab_size_divisible_by x TP``) the ``t``-th block of
  rows; of a row-parallel one (``linear_proj``, ``linear_fc2``) the ``t``-th block of columns; norms whole. SwiGLU's
  ``linear_fc1`` is ``[gate; up]`` globally and ``[gate_t; up_t]`` locally: two blocks of rows;
* **DP** (the distributed optimizer, ``dp_reshardable``): per gradient buffer, the stage's local parameters in
  *reverse* ``named_parameters()`` order, each start padded to a multiple of 64 elements and the end of the bucket
  to ``lcm(DP, 128)`` (megatron-core 0.16 ``distributed/param_and_grad_buffer.py``,
  ``_pad_start_of_param_if_needed`` and ``_pad_end_of_bucket_if_needed``); DP rank ``d`` owns the ``d``-th of
  ``DP`` equal parts. The saved tensor is the bucket cut at its unpadded size.

Everything here is a pure function of the model's dimensions (Megatron-LM's ``args``) and the parallelism; the
files are read in :mod:`osdpipe.io.formats.megatron`. What is laid out is Megatron's GPT with the local layer spec
(``--transformer-impl local``), dense, with or without linear biases (``add_bias_linear``: the column-parallel
layers' split as their rows, the row-parallel layers' held whole by every TP rank, as a norm; ``add_qkv_bias``:
``linear_qkv``'s alone); other models are refused where they are read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Parameters start on a multiple of this many elements in a bucket (128 bytes of a 16-bit dtype).
PARAM_ALIGNMENT = 64
#: A bucket's end is padded to a multiple of lcm(DP, this) (256 bytes of a 16-bit dtype).
BUCKET_ALIGNMENT = 128
#: The prefix of the stacked decoder layers' sharded keys.
LAYERS = "decoder.layers."


@dataclass(frozen=True)
class Gpt:
    """The dimensions of a Megatron GPT that its layout depends on (Megatron-LM's argument names)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    padded_vocab_size: int
    swiglu: bool
    #: ``add_bias_linear``: a bias on each of the four linear layers of a layer.
    linear_bias: bool = False
    #: ``add_qkv_bias`` (Qwen2's attention): a bias on ``linear_qkv`` alone; implied by ``linear_bias``.
    qkv_bias: bool = False

    @property
    def has_qkv_bias(self) -> bool:
        return self.linear_bias or self.qkv_bias

    @property
    def qkv_rows(self) -> int:
        """``linear_qkv``'s rows: per query group its query heads, then a key and a value head."""
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    @property
    def fc1_rows(self) -> int:
        return self.ffn_hidden_size * (2 if self.swiglu else 1)


@dataclass(frozen=True)
class Piece:
    """A block of a local parameter: its rows ``[local_start, local_stop)`` (axis 0 of the local tensor) are the global
    tensor ``key``'s box ``box`` (a ``(start, stop)`` per axis; the layer axis, for a decoder weight, is one layer)."""

    key: str
    box: tuple[tuple[int, int], ...]
    local_start: int
    local_stop: int


@dataclass(frozen=True)
class LocalParameter:
    """One parameter of one (PP, TP) rank, as ``named_parameters()`` of its model chunk names it."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def without_weight_decay(key: str, shape: tuple[int, ...]) -> bool:
    """Whether Megatron's default param groups put sharded key ``key`` (of global ``shape``) in the group without
    weight decay (``wd_mult`` 0): a 1-D parameter per layer (a norm), the decoder's layer axis not counted
    (megatron-core ``optimizer/__init__.py`` ``_get_param_groups``)."""
    return len(shape) - (1 if key.startswith(LAYERS) else 0) == 1


def query_groups(args: dict[str, Any]) -> int:
    """The key/value heads of the GPT ``args`` describe: ``num_query_groups`` only with ``group_query_attention``
    (Megatron-LM's ``core_transformer_config_from_args`` passes ``num_query_groups=None``, one group per head,
    otherwise; ``--num-query-groups`` defaults to 1 even then)."""
    heads = int(args["num_attention_heads"])
    if args.get("group_query_attention"):
        return int(args.get("num_query_groups") or heads)
    return heads


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """The vocabulary Megatron-LM builds the embedding and output layer for: ``vocab_size`` rounded up to a multiple
    of ``divisible_by x tp`` (Megatron-LM ``training/tokenizer``'s ``_vocab_size_with_padding``)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The global layers pipeline stage ``stage`` of ``pp`` holds (an even split, Megatron's default)."""
    if num_layers % pp:
        raise ValueError(f"{num_layers} layers do not split evenly over {pp} pipeline stages")
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def position_embedding_type(args: dict[str, Any]) -> str:
    """The position embedding of the GPT Megatron-LM's ``args`` describe: ``args.position_embedding_type``, whose
    default, ``learned_absolute``, is a learned table (``embedding.position_embeddings.weight``). Saves older than
    that argument record ``use_rotary_position_embeddings`` alone: RoPE where it is set, else the table."""
    kind = args.get("position_embedding_type")
    if kind is None:
        return "rope" if args.get("use_rotary_position_embeddings") else "learned_absolute"
    return kind


def global_shapes(gpt: Gpt) -> dict[str, tuple[int, ...]]:
    """Every sharded key of the model and its global shape (the decoder's layers stacked on axis 0)."""
    h, layers = gpt.hidden_size, gpt.num_layers
    biases = {
        f"{LAYERS}self_attention.linear_proj.bias": ((layers, h), gpt.linear_bias),
        f"{LAYERS}self_attention.linear_qkv.bias": ((layers, gpt.qkv_rows), gpt.has_qkv_bias),
        f"{LAYERS}mlp.linear_fc1.bias": ((layers, gpt.fc1_rows), gpt.linear_bias),
        f"{LAYERS}mlp.linear_fc2.bias": ((layers, h), gpt.linear_bias),
    }
    return {
        "embedding.word_embeddings.weight": (gpt.padded_vocab_size, h),
        f"{LAYERS}self_attention.linear_qkv.layer_norm_weight": (layers, h),
        f"{LAYERS}self_attention.linear_proj.weight": (layers, h, gpt.num_attention_heads * gpt.kv_channels),
        f"{LAYERS}self_attention.linear_qkv.weight": (layers, gpt.qkv_rows, h),
        f"{LAYERS}mlp.linear_fc1.layer_norm_weight": (layers, h),
        f"{LAYERS}mlp.linear_fc1.weight": (layers, gpt.fc1_rows, h),
        f"{LAYERS}mlp.linear_fc2.weight": (layers, h, gpt.ffn_hidden_size),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (gpt.padded_vocab_size, h),
        **{key: shape for key, (shape, held) in biases.items() if held},
    }


def _split(size: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if size % tp:
        raise ValueError(f"{what}: {size} does not split over {tp} tensor-parallel ranks")
    part = size // tp
    return rank * part, (rank + 1) * part


def local_parameters(gpt: Gpt, tp: int, pp: int, tp_rank: int, pp_rank: int) -> list[LocalParameter]:
    """The parameters of rank (``pp_rank``, ``tp_rank``), in ``named_parameters()`` order of Megatron's GPT with the
    local layer spec (embedding; per layer the input norm, ``linear_proj``, ``linear_qkv``, the pre-MLP norm,
    ``linear_fc1``, ``linear_fc2``, each linear layer's weight then its bias where it has one; the final norm; the
    output layer), each with the global boxes it holds."""
    h, shapes = gpt.hidden_size, global_shapes(gpt)
    out: list[LocalParameter] = []

    def column_parallel(name: str, key: str, at: tuple, blocks: list[tuple[int, int]],
                        cols: int | None) -> LocalParameter:
        """A column-parallel layer's weight (``cols`` columns) or, ``cols`` None, its bias: the global rows
        ``blocks`` (SwiGLU's gate and up blocks), one after another in the local tensor."""
        n, tail = blocks[0][1] - blocks[0][0], ((0, cols),) if cols is not None else ()
        pieces = tuple(Piece(key, (*at, block, *tail), i * n, (i + 1) * n) for i, block in enumerate(blocks))
        return LocalParameter(name, (n * len(blocks), *(() if cols is None else (cols,))), pieces)

    def whole(name: str, key: str, at: tuple, size: int) -> LocalParameter:
        """A norm's weight or a row-parallel layer's bias: every TP rank holds all of it."""
        return LocalParameter(name, (size,), (Piece(key, (*at, (0, size)), 0, size),))

    vocab = _split(gpt.padded_vocab_size, tp, tp_rank, "the padded vocabulary")
    if pp_rank == 0:
        name = "embedding.word_embeddings.weight"
        out.append(column_parallel(name, name, (), [vocab], h))
    for local, layer in enumerate(stage_layers(gpt.num_layers, pp, pp_rank)):
        prefix, at = f"decoder.layers.{local}.", ((layer, layer + 1),)
        attention = gpt.num_attention_heads * gpt.kv_channels
        cols = _split(attention, tp, tp_rank, "linear_proj's columns")
        rows = _split(gpt.qkv_rows, tp, tp_rank, "linear_qkv's rows")
        ffn = _split(gpt.ffn_hidden_size, tp, tp_rank, "linear_fc2's columns")
        fc1_blocks = [ffn] + ([(gpt.ffn_hidden_size + ffn[0], gpt.ffn_hidden_size + ffn[1])] if gpt.swiglu else [])
        attn, mlp = f"{prefix}self_attention.", f"{prefix}mlp."
        out.append(whole(f"{prefix}input_layernorm.weight", f"{LAYERS}self_attention.linear_qkv.layer_norm_weight",
                         at, h))
        proj = f"{LAYERS}self_attention.linear_proj.weight"
        out.append(LocalParameter(f"{attn}linear_proj.weight", (h, cols[1] - cols[0]),
                                  (Piece(proj, (*at, (0, h), cols), 0, h),)))
        if gpt.linear_bias:
            out.append(whole(f"{attn}linear_proj.bias", f"{LAYERS}self_attention.linear_proj.bias", at, h))
        qkv = f"{LAYERS}self_attention.linear_qkv."
        out.append(column_parallel(f"{attn}linear_qkv.weight", f"{qkv}weight", at, [rows], h))
        if gpt.has_qkv_bias:
            out.append(column_parallel(f"{attn}linear_qkv.bias", f"{qkv}bias", at, [rows], None))
        out.append(whole(f"{prefix}pre_mlp_layernorm.weight", f"{LAYERS}mlp.linear_fc1.layer_norm_weight", at, h))
        out.append(column_parallel(f"{mlp}linear_fc1.weight", f"{LAYERS}mlp.linear_fc1.weight", at, fc1_blocks, h))
        if gpt.linear_bias:
            out.append(column_parallel(f"{mlp}linear_fc1.bias", f"{LAYERS}mlp.linear_fc1.bias", at, fc1_blocks, None))
        fc2 = f"{LAYERS}mlp.linear_fc2.weight"
        out.append(LocalParameter(f"{mlp}linear_fc2.weight", (h, ffn[1] - ffn[0]),
                                  (Piece(fc2, (*at, (0, h), ffn), 0, h),)))
        if gpt.linear_bias:
            out.append(whole(f"{mlp}linear_fc2.bias", f"{LAYERS}mlp.linear_fc2.bias", at, h))
    if pp_rank == pp - 1:
        final = "decoder.final_layernorm.weight"
        out.append(whole(final, final, (), h))
        out.append(column_parallel("output_layer.weight", "output_layer.weight", (), [vocab], h))
    assert all(p.key in shapes for lp in out for p in lp.pieces)
    return out


@dataclass(frozen=True)
class BucketLayout:
    """A gradient bucket of the distributed optimizer: each parameter's ``(name, start, stop)`` in it, the end of
    the last parameter (``numel_unpadded``: what a ``dp_reshardable`` save holds) and the padded size."""

    entries: tuple[tuple[str, int, int], ...]
    numel_unpadded: int
    numel: int


def bucket_layout(params: Sequence[tuple[str, int]], dp: int) -> BucketLayout:
    """One bucket holding ``params`` (name and numel, in the bucket's order: reverse ``named_parameters()``), laid
    out as megatron-core pads it for ``dp`` data-parallel ranks."""
    entries, at = [], 0
    for name, numel in params:
        start = -(-at // PARAM_ALIGNMENT) * PARAM_ALIGNMENT
        entries.append((name, start, start + numel))
        at = start + numel
    divisor = math.lcm(dp, BUCKET_ALIGNMENT)
    return BucketLayout(tuple(entries), at, -(-at // divisor) * divisor)


def dp_group_index(tp: int, tp_rank: int, pp_rank: int) -> int:
    """The index Megatron gives the (PP, TP) rank's model-parallel domain in a ``dp_reshardable`` save's keys
    (``optimizer.distributed.dp_group_idx_<i>``): ``pp_rank x TP + tp_rank``."""
    return pp_rank * tp + tp_rank
