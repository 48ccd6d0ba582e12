"""Pure layout math of Megatron-Core's GPT: where each element of each parameter sits on each (PP, TP, DP) rank.

Megatron saves its model by *sharded keys*: one global tensor per kind of weight, the decoder's layers stacked on a
leading layer axis (``decoder.layers.self_attention.linear_qkv.weight`` of shape ``(layers, rows, hidden)``). A
rank of the grid holds:

* **PP** stage ``p``: the layers ``[p L/P, (p+1) L/P)``; the embedding on the first stage, the final norm and the
  output layer on the last. With ``V`` virtual stages per pipeline rank (Megatron-LM's interleaved schedule,
  ``virtual_pipeline_model_parallel_size``) a stage holds ``V`` model chunks instead, chunk ``v`` the layers
  ``[(v P + p) L/(P V), (v P + p + 1) L/(P V))``: the pipeline's ``P V`` chunks in layer order, dealt round the
  stages (megatron-core 0.16 ``transformer/transformer_layer.py`` ``get_transformer_layer_offset``); the embedding
  is chunk 0's of the first stage, the final norm and the output layer chunk ``V - 1``'s of the last. Each chunk is a
  model of its own (its layers named from ``decoder.layers.0``) with its own gradient buffer;
* **TP** rank ``t``: of a column-parallel weight (``linear_qkv``, ``linear_fc1``, the embedding and the output
  layer, whose vocabulary is padded to a multiple of ``make_vocab_size_divisible_by x TP``) the ``t``-th block of
  rows; of a row-parallel one (``linear_proj``, ``linear_fc2``) the ``t``-th block of columns; norms whole. SwiGLU's
  ``linear_fc1`` is ``[gate; up]`` globally and ``[gate_t; up_t]`` locally: two blocks of rows;
* **DP** (the distributed optimizer, ``dp_reshardable``): per gradient buffer (one per model chunk: ``gbuf_idx``
  is the chunk's index), the chunk's local parameters in
  *reverse* ``named_parameters()`` order, each start padded to a multiple of 64 elements and the end of the bucket
  to ``lcm(DP, 128)`` (megatron-core 0.16 ``distributed/param_and_grad_buffer.py``,
  ``_pad_start_of_param_if_needed`` and ``_pad_end_of_bucket_if_needed``); DP rank ``d`` owns the ``d``-th of
  ``DP`` equal parts. The saved tensor is the bucket cut at its unpadded size. With ``--overlap-grad-reduce`` the
  buffer of the first stage's first model chunk is cut into buckets of about ``--ddp-bucket-size`` elements
  (:class:`Bucketing`, :func:`bucketing`); the other buffers are not cut by size.

Embeddings tied to the output layer (Megatron-LM's default, ``untie_embeddings_and_output_weights`` unset) have
one sharded key, ``embedding.word_embeddings.weight``. At PP 1 the output layer has no weight of its own; over PP the
last stage holds a copy (``output_layer.weight``, which Megatron keeps equal to the first stage's by summing both
gradients), saved under the embedding's key as a replica: in a ``dp_reshardable`` save the copy's state is in its
stage's bucket, and where the two are read, the first stage's is the one kept (:attr:`LocalParameter.tied_copy`), as
Megatron's own model-space save keeps it (the report says so where the copy's differs). With the distributed
optimizer each of the two tied parameters is a bucket of its own (``param_and_grad_buffer.py``'s
``_does_param_require_new_bucket``: :func:`buckets`).

Everything here is a pure function of the model's dimensions (Megatron-LM's ``args``) and the parallelism; the
files are read in :mod:`osdpipe.io.formats.megatron`. What is laid out is Megatron's GPT with the local layer spec
(``--transformer-impl local``), dense, with RMSNorm or LayerNorm (a bias beside each norm's weight), RoPE or a learned
position table (``embedding.position_embeddings.weight``, on the first stage, whole on every TP rank), tied or untied
embeddings, with or without linear biases (``add_bias_linear``: the column-parallel layers' split as their rows, the
row-parallel layers' held whole by every TP rank, as a norm; ``add_qkv_bias``: ``linear_qkv``'s alone), with or without
a norm on each head's query and key (``qk_layernorm``); other models are refused where they are read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from osdpipe.layout.flat_buffer import FlatBuffer, pack, round_up

#: Parameters start on a multiple of this many elements in a bucket (128 bytes of a 16-bit dtype).
PARAM_ALIGNMENT = 64
#: A bucket's end is padded to a multiple of lcm(DP, this) (256 bytes of a 16-bit dtype).
BUCKET_ALIGNMENT = 128
#: The prefix of the stacked decoder layers' sharded keys.
LAYERS = "decoder.layers."
#: The model keys whose first axis is the padded vocabulary.
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
#: A mixture of experts' sharded keys: the router (``[layers, experts, hidden]``) and the experts' two linear layers,
#: each with a global expert axis after the layer axis (SequentialMLP's ``experts.experts.``).
ROUTER = f"{LAYERS}mlp.router.weight"
EXPERT_FC1 = f"{LAYERS}mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = f"{LAYERS}mlp.experts.experts.linear_fc2.weight"
#: The experts' sharded keys: with expert parallelism, the experts' optimizer's parameters.
EXPERT_KEYS = (EXPERT_FC1, EXPERT_FC2)
#: What the key/value heads are called in :func:`tp_problem`'s line.
GROUPS = "key/value heads (query groups)"


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
    #: ``normalization=LayerNorm``: each norm has a bias beside its weight (RMSNorm has none).
    norm_bias: bool = False
    #: The rows of the learned position table (``max_position_embeddings``) where ``position_embedding_type`` is
    #: ``learned_absolute``; 0: none (RoPE).
    position_table: int = 0
    #: The output layer is the word embedding (``untie_embeddings_and_output_weights`` unset).
    tied: bool = False
    #: ``qk_layernorm`` (Qwen3's, OLMo2's attention): a norm of ``kv_channels`` on each head's query and key, after
    #: ``linear_qkv`` (``self_attention.q_layernorm`` and ``k_layernorm``; a bias beside each with LayerNorm).
    qk_layernorm: bool = False
    #: ``num_experts``: every layer's MLP a mixture of this many experts (0: dense), routed by ``mlp.router``.
    num_experts: int = 0
    #: ``moe_ffn_hidden_size``: each expert's FFN (SwiGLU's ``linear_fc1`` twice its rows, as a dense layer's).
    moe_ffn_hidden_size: int = 0

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

    @property
    def expert_fc1_rows(self) -> int:
        return self.moe_ffn_hidden_size * (2 if self.swiglu else 1)


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
    #: The last stage's copy of the tied word embedding (PP > 1): written from the embedding's state, never read
    #: into it (the first stage's is the main replica), only compared with it.
    tied_copy: bool = False
    #: A tied embedding's parameter over PP (the word embedding on the first stage, its copy on the last): with the
    #: distributed optimizer, a bucket of its own.
    own_bucket: bool = False
    #: One expert's weight (a mixture of experts): held by the ranks of its expert-parallel rank, its gradients in the
    #: expert gradient buffer, cut over the expert data-parallel ranks.
    expert: bool = False

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


def tied_embeddings(args: dict[str, Any]) -> bool:
    """Whether the GPT Megatron-LM's ``args`` describe ties its output layer to the word embedding: Megatron-LM's
    default, unless ``--untie-embeddings-and-output-weights``."""
    return not args.get("untie_embeddings_and_output_weights", False)


def tied_word_embeddings(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face ``config.json`` ties ``lm_head`` to the embedding: ``tie_word_embeddings``, whose
    default in transformers' ``PretrainedConfig`` is true. What a converted-in model's args say of it (either family
    writes ``untie_embeddings_and_output_weights`` as its negation)."""
    return config.get("tie_word_embeddings", True) is not False


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """The vocabulary Megatron-LM builds the embedding and output layer for: ``vocab_size`` rounded up to a multiple
    of ``divisible_by x tp`` (Megatron-LM ``training/tokenizer``'s ``_vocab_size_with_padding``)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def stage_layers(num_layers: int, pp: int, stage: int, vpp: int = 1, chunk: int = 0) -> range:
    """The global layers model chunk ``chunk`` of pipeline stage ``stage`` of ``pp`` holds, with ``vpp`` virtual
    stages (chunks) per pipeline rank: an even split into ``pp x vpp`` runs of layers, dealt round the stages chunk
    by chunk (Megatron's default split; ``vpp`` 1: the stage's one run)."""
    if num_layers % (pp * vpp):
        stages = f"{pp} pipeline stages" + (f" x {vpp} virtual stages" if vpp > 1 else "")
        raise ValueError(f"{num_layers} layers do not split evenly over {stages}")
    per = num_layers // (pp * vpp)
    first = (chunk * pp + stage) * per
    return range(first, first + per)


def virtual_stages(args: dict[str, Any]) -> int:
    """The model chunks per pipeline rank of the job Megatron-LM's ``args`` describe: its
    ``virtual_pipeline_model_parallel_size`` (derived from ``--num-layers-per-virtual-pipeline-stage`` or
    ``--num-virtual-stages-per-pipeline-rank``), 1 where unset (no interleaved schedule)."""
    return int(args.get("virtual_pipeline_model_parallel_size") or 1)


def virtual_stage_args(num_layers: int, pp: int, vpp: int) -> dict[str, Any]:
    """Megatron-LM's ``args`` of ``vpp`` virtual stages per pipeline rank (``vpp`` 1: none), as its ``arguments.py``
    records a job launched with ``--num-layers-per-virtual-pipeline-stage``: the size it derives, the layers per
    virtual stage, and ``num_virtual_stages_per_pipeline_rank`` unset (its other flag for the same; Megatron-LM refuses
    both at once)."""
    if vpp == 1:
        return {"virtual_pipeline_model_parallel_size": None, "num_layers_per_virtual_pipeline_stage": None,
                "num_virtual_stages_per_pipeline_rank": None}
    return {"virtual_pipeline_model_parallel_size": vpp,
            "num_layers_per_virtual_pipeline_stage": num_layers // (pp * vpp),
            "num_virtual_stages_per_pipeline_rank": None}


def position_embedding_type(args: dict[str, Any]) -> str:
    """The position embedding of the GPT Megatron-LM's ``args`` describe: ``args.position_embedding_type``, whose
    default, ``learned_absolute``, is a learned table (``embedding.position_embeddings.weight``). Saves older than
    that argument record ``use_rotary_position_embeddings`` alone: RoPE where it is set, else the table."""
    kind = args.get("position_embedding_type")
    if kind is None:
        return "rope" if args.get("use_rotary_position_embeddings") else "learned_absolute"
    return kind


def gpt_of(args: dict[str, Any]) -> Gpt:
    """The layout's dimensions of the GPT Megatron-LM's ``args`` describe."""
    heads = int(args["num_attention_heads"])
    return Gpt(
        num_layers=int(args["num_layers"]),
        hidden_size=int(args["hidden_size"]),
        ffn_hidden_size=int(args["ffn_hidden_size"]),
        num_attention_heads=heads,
        num_query_groups=query_groups(args),
        kv_channels=int(args.get("kv_channels") or int(args["hidden_size"]) // heads),
        padded_vocab_size=int(args["padded_vocab_size"]),
        swiglu=bool(args.get("swiglu")),
        linear_bias=bool(args.get("add_bias_linear")),
        qkv_bias=bool(args.get("add_qkv_bias")),
        norm_bias=args.get("normalization", "LayerNorm") == "LayerNorm",
        position_table=int(args["max_position_embeddings"])
        if position_embedding_type(args) == "learned_absolute" else 0,
        tied=tied_embeddings(args),
        qk_layernorm=bool(args.get("qk_layernorm")),
        num_experts=int(args.get("num_experts") or 0),
        moe_ffn_hidden_size=int(args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"])
        if args.get("num_experts") else 0,
    )


#: Megatron-LM's ``args`` of the gradient buffers' buckets (:func:`bucketing` reads them): a job's DDP options, which
#: move elements of a ``dp_reshardable`` save, and which a converted save keeps.
DDP_ARGS = ("overlap_grad_reduce", "ddp_bucket_size", "ddp_num_buckets", "ddp_pad_buckets_for_high_nccl_busbw",
            "overlap_param_gather_with_optimizer_step")
#: Megatron-LM's ``args`` of a mixture of experts that place its elements (the expert parallelism is the grid's).
MOE_ARGS = ("num_experts", "moe_ffn_hidden_size")
#: Megatron-LM's ``args`` that say where every element of a GPT and of its distributed optimizer lies: the model's
#: dimensions (:func:`gpt_of`), its vocabulary before padding, its precision and its buckets.
LAYOUT_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
               "num_query_groups", "kv_channels", "padded_vocab_size", "vocab_size", "make_vocab_size_divisible_by",
               "swiglu", "add_bias_linear", "add_qkv_bias", "normalization", "position_embedding_type",
               "use_rotary_position_embeddings", "max_position_embeddings", "untie_embeddings_and_output_weights",
               "qk_layernorm", "bf16", "fp16", "accumulate_allreduce_grads_in_fp32", *DDP_ARGS, *MOE_ARGS)


def layout_args(args: dict[str, Any]) -> dict[str, Any]:
    """The part of Megatron-LM's ``args`` that lays a GPT and its optimizer out (:data:`LAYOUT_ARGS`): what the model's
    tree is built from (``model.kwargs``), small and plain."""
    return {k: args[k] for k in LAYOUT_ARGS if k in args}


def params_dtype(args: dict[str, Any]) -> str:
    """The dtype of the model's weights in the job ``args`` describe (its ``params_dtype``)."""
    return "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32"


def dtype_args(dtype: str) -> dict[str, bool]:
    """The ``args`` flags of a job whose weights are ``dtype`` (:func:`params_dtype`'s inverse)."""
    return {"bf16": dtype == "bfloat16", "fp16": dtype == "float16"}


def gbuf_dtypes(args: dict[str, Any]) -> str:
    """A gradient buffer's ``(param dtype, grad dtype)`` as a ``dp_reshardable`` save's keys spell it: the weights'
    dtype, and fp32 gradients unless a 16-bit job reduces them in its own dtype (Megatron-LM sets
    ``accumulate_allreduce_grads_in_fp32`` for bf16)."""
    weights = params_dtype(args)
    in_fp32 = weights == "float32" or args.get("accumulate_allreduce_grads_in_fp32", weights == "bfloat16")
    return f"torch.{weights}, torch.{'float32' if in_fp32 else weights}"


def target_vocab(args: dict[str, Any], tp: int) -> int:
    """The padded vocabulary of the GPT ``args`` describe on TP ``tp`` (:func:`padded_vocab_size`); a save that does
    not record its vocabulary before padding (a tokenizer's, not ``--vocab-size``) keeps its padded size."""
    if not args.get("vocab_size"):
        return int(args["padded_vocab_size"])
    return padded_vocab_size(int(args["vocab_size"]), int(args.get("make_vocab_size_divisible_by") or 128), tp)


def global_shapes(gpt: Gpt) -> dict[str, tuple[int, ...]]:
    """Every sharded key of the model and its global shape (the decoder's layers stacked on axis 0)."""
    h, layers = gpt.hidden_size, gpt.num_layers
    biases = {
        f"{LAYERS}self_attention.linear_proj.bias": ((layers, h), gpt.linear_bias),
        f"{LAYERS}self_attention.linear_qkv.bias": ((layers, gpt.qkv_rows), gpt.has_qkv_bias),
        f"{LAYERS}mlp.linear_fc1.bias": ((layers, gpt.fc1_rows), gpt.linear_bias and not gpt.num_experts),
        f"{LAYERS}mlp.linear_fc2.bias": ((layers, h), gpt.linear_bias and not gpt.num_experts),
    }
    norm_biases = {
        f"{LAYERS}self_attention.linear_qkv.layer_norm_bias": (layers, h),
        f"{LAYERS}mlp.linear_fc1.layer_norm_bias": (layers, h),
        "decoder.final_layernorm.bias": (h,),
    }
    head_norms = [f"{LAYERS}self_attention.{which}_layernorm.{part}" for which in ("q", "k")
                  for part in ("weight", "bias") if part == "weight" or gpt.norm_bias] if gpt.qk_layernorm else []
    mlp = ({f"{LAYERS}mlp.linear_fc1.weight": (layers, gpt.fc1_rows, h),
            f"{LAYERS}mlp.linear_fc2.weight": (layers, h, gpt.ffn_hidden_size)} if not gpt.num_experts else
           {ROUTER: (layers, gpt.num_experts, h),
            EXPERT_FC1: (layers, gpt.num_experts, gpt.expert_fc1_rows, h),
            EXPERT_FC2: (layers, gpt.num_experts, h, gpt.moe_ffn_hidden_size)})
    return {
        "embedding.word_embeddings.weight": (gpt.padded_vocab_size, h),
        **({"embedding.position_embeddings.weight": (gpt.position_table, h)} if gpt.position_table else {}),
        f"{LAYERS}self_attention.linear_qkv.layer_norm_weight": (layers, h),
        f"{LAYERS}self_attention.linear_proj.weight": (layers, h, gpt.num_attention_heads * gpt.kv_channels),
        f"{LAYERS}self_attention.linear_qkv.weight": (layers, gpt.qkv_rows, h),
        f"{LAYERS}mlp.linear_fc1.layer_norm_weight": (layers, h),
        **mlp,
        "decoder.final_layernorm.weight": (h,),
        **({} if gpt.tied else {"output_layer.weight": (gpt.padded_vocab_size, h)}),
        **{key: shape for key, (shape, held) in biases.items() if held},
        **(norm_biases if gpt.norm_bias else {}),
        **{key: (layers, gpt.kv_channels) for key in head_norms},
    }


def check_shapes(tensors: dict[str, Any], shapes: dict[str, tuple[int, ...]], what: str) -> None:
    """``tensors`` holds exactly the names of ``shapes``, each of its shape; else a ``ValueError`` naming the first
    few missing, unexpected or misshapen (``what``: whose tensors, for the message)."""
    missing, extra = sorted(shapes.keys() - tensors.keys()), sorted(tensors.keys() - shapes.keys())
    if missing or extra:
        raise ValueError(f"{what}: missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
                         f"unexpected {extra[:4]}{'...' if len(extra) > 4 else ''}")
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != shape:
            raise ValueError(f"{what}: {key} has shape {tuple(tensors[key].shape)}, expected {shape}")


def block_refusals(args: dict[str, Any]) -> list[str]:
    """What of the decoder block Megatron-LM's ``args`` describe neither Hugging Face map (a Llama's, a GPT-2's) nor
    its model expresses: features of the norms, the activation, the attention and the layers both families lack."""
    checks = [
        (bool(args.get("apply_layernorm_1p")) or bool(args.get("layernorm_zero_centered_gamma")),
         "zero-centred norm weights (apply_layernorm_1p)"),
        (bool(args.get("squared_relu")), "squared ReLU"),
        (args.get("activation_func_clamp_value") is not None, "a clamped activation (activation_func_clamp_value)"),
        ((args.get("num_experts") or 0) > 0, "a mixture of experts (num_experts)"),
        (bool(args.get("multi_latent_attention")), "multi-latent attention"),
        (bool(args.get("attention_output_gate")), "a gated attention output (attention_output_gate)"),
        (args.get("window_size") is not None, "sliding-window attention (window_size)"),
        (bool(args.get("apply_residual_connection_post_layernorm")), "residuals after the norm"),
        ((args.get("mtp_num_layers") or 0) > 0, "multi-token prediction layers (mtp_num_layers)"),
    ]
    return [what for bad, what in checks if bad]


def grid_args(
    sizes: Sequence[tuple[int, str]], layers: int, tp: int, pp: int, world: int, vpp: int = 1
) -> dict[str, Any]:
    """Megatron-LM's ``args`` of the parallelism, for a GPT converted in from another framework's model: TP ``tp`` x
    PP ``pp`` on ``world`` ranks, ``vpp`` virtual stages per pipeline rank, the distributed optimizer.

    The TP rule is megatron-core's (:func:`tp_problem` with ``replicated``): the key/value heads may divide the TP,
    each then held by ``tp / groups`` ranks, as the other direction (a Megatron save to another TP) takes it.

    Raises:
        ValueError: one line: a TP that does not divide one of ``sizes`` (``(size, what it is)``: the heads, the FFN;
            the key/value heads neither divided by it nor dividing it), a PP (times the virtual stages) that does not
            divide the ``layers``, a world that is no multiple of TP x PP.
    """
    if why := tp_problem(sizes, tp, replicated=True):
        raise ValueError(why)
    if why := virtual_stages_problem(layers, pp, vpp):
        raise ValueError(why)
    if world % (tp * pp):
        raise ValueError(f"target.world_size={world} is no multiple of TP {tp} x PP {pp}")
    return {
        "world_size": world, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "data_parallel_size": world // (tp * pp), "context_parallel_size": 1, "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": tp, "sequence_parallel": False, "use_distributed_optimizer": True,
        **virtual_stage_args(layers, pp, vpp),
    }  # fmt: skip


def tp_sizes(gpt: Gpt) -> tuple[tuple[int, str], ...]:
    """What tensor parallelism splits of ``gpt``, as ``(size, what it is)``: the attention heads, the key/value heads
    (:data:`GROUPS`), ``linear_qkv``'s rows and the FFN (the vocabulary is padded for each TP instead:
    :func:`padded_vocab_size`)."""
    return ((gpt.num_attention_heads, "attention heads"), (gpt.num_query_groups, GROUPS),
            (gpt.qkv_rows, "linear_qkv's rows"), (gpt.ffn_hidden_size, "ffn_hidden_size (the FFN)"))


def tp_problem(sizes: Sequence[tuple[int, str]], tp: int, replicated: bool = False) -> str | None:
    """Why TP ``tp`` cannot split a GPT of ``sizes`` (``(size, what it is)``, :func:`tp_sizes`), in one line naming
    ``target.tp_size`` and the TPs that can (``None``: it can). Each size must be a multiple of ``tp``; with
    ``replicated``, the key/value heads may instead divide ``tp``, each then held by ``tp / groups`` ranks, as
    megatron-core runs them (its ``TransformerConfig``'s rule; a save of 2 at TP 4 converts both ways,
    tests/frameworks/test_megatron.py)."""

    def failed(t: int) -> tuple[int, str] | None:
        return next(((s, n) for s, n in sizes if s % t and not (replicated and n == GROUPS and t % s == 0)), None)

    if (first := failed(tp)) is None:
        return None
    size, name = first
    bound = min(s for s, n in sizes if not (replicated and n == GROUPS))  # every TP that fits divides these
    fits = ", ".join(str(d) for d in range(1, bound + 1) if failed(d) is None)
    how = "neither divides nor is a multiple of" if replicated and name == GROUPS else "does not divide"
    return f"target.tp_size={tp} {how} the model's {size} {name}; choose a TP that does: {fits}"


def interleaving_problem(pp: int, vpp: int) -> str | None:
    """Why ``vpp`` virtual stages per pipeline rank cannot interleave PP ``pp`` (``None``: they can), in one line
    naming the key: Megatron's interleaved schedule needs more than one pipeline stage. Needs no model: the schema
    pass asks it (:func:`osdpipe.spec.megatron.megatron_problem`)."""
    if vpp > 1 and pp < 2:
        return (f"target.vpp_size={vpp}: virtual pipeline stages interleave several pipeline stages (megatron-core "
                "refuses them at PP 1); set target.pp_size to 2 or more, or leave target.vpp_size out")
    return None


def virtual_stages_problem(layers: int, pp: int, vpp: int) -> str | None:
    """Why a target of PP ``pp`` with ``vpp`` virtual stages per pipeline rank cannot hold a GPT of ``layers``
    layers (``None``: it can), in one line naming the key: :func:`interleaving_problem`, or chunks that do not split
    the layers evenly."""
    if why := interleaving_problem(pp, vpp):
        return why
    if layers % (pp * vpp):
        what = f"target.pp_size={pp}" + (f" x target.vpp_size={vpp}" if vpp > 1 else "")
        return f"{what} does not divide the model's {layers} layers; choose a PP that does"
    return None


def save_args(vocab: int, divisible_by: int, tp: int, iteration: int, sharding: str) -> dict[str, Any]:
    """Megatron-LM's ``args`` of the vocabulary (the NullTokenizer's ``vocab_size``, as Megatron-LM records it for
    ``--vocab-size``, padded for ``tp``: :func:`padded_vocab_size`), the precision (the weights written as an fp32
    job's masters) and the checkpoint (``torch_dist``, ``sharding``), for a GPT converted in from another framework."""
    return {
        "vocab_size": vocab, "padded_vocab_size": padded_vocab_size(vocab, divisible_by, tp),
        "make_vocab_size_divisible_by": divisible_by, "tokenizer_type": "NullTokenizer",
        "bf16": False, "fp16": False,
        "iteration": iteration, "consumed_train_samples": 0, "ckpt_format": "torch_dist", "use_dist_ckpt": True,
        "dist_ckpt_optim_fully_reshardable": sharding == "fully_reshardable",
    }  # fmt: skip


def _split(size: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if size % tp:
        raise ValueError(f"{what}: {size} does not split over {tp} tensor-parallel ranks")
    part = size // tp
    return rank * part, (rank + 1) * part


def local_parameters(
    gpt: Gpt, tp: int, pp: int, tp_rank: int, pp_rank: int, vpp: int = 1, chunk: int = 0, ep: int = 1,
    ep_rank: int = 0,
) -> list[LocalParameter]:
    """The parameters of model chunk ``chunk`` (of ``vpp`` per pipeline rank; 1: the rank's one model) of rank
    (``pp_rank``, ``tp_rank``, expert-parallel rank ``ep_rank`` of ``ep``), in ``named_parameters()`` order of
    Megatron's GPT with the local layer spec (the word embedding, the position table; per layer the input norm,
    ``linear_proj``, ``linear_qkv``, with ``qk_layernorm`` the query's and the key's norm, the pre-MLP norm,
    ``linear_fc1``, ``linear_fc2`` (a mixture of experts: the router, whole on every rank, then each local expert's
    ``linear_fc1`` and ``linear_fc2``, split over TP as a dense layer's: :func:`expert_parameters`), each norm's and
    linear layer's weight then its bias where it has one; the final norm; the output layer, or over PP the tied
    embedding's copy), each with the global boxes it holds."""
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
        """A norm's weight or bias, or a row-parallel layer's bias: every TP rank holds all of it."""
        return LocalParameter(name, (size,), (Piece(key, (*at, (0, size)), 0, size),))

    def norm(name: str, key: str, at: tuple, size: int = h) -> list[LocalParameter]:
        """A norm's weight (``<key>weight``), and its bias with LayerNorm (``<key>bias``), of ``size``."""
        held = [whole(f"{name}weight", f"{key}weight", at, size)]
        return held + ([whole(f"{name}bias", f"{key}bias", at, size)] if gpt.norm_bias else [])

    vocab = _split(gpt.padded_vocab_size, tp, tp_rank, "the padded vocabulary")
    tied_over_pp = gpt.tied and pp > 1
    embedding = "embedding.word_embeddings.weight"
    if pp_rank == 0 and chunk == 0:
        out.append(replace(column_parallel(embedding, embedding, (), [vocab], h), own_bucket=tied_over_pp))
        if gpt.position_table:
            table = "embedding.position_embeddings.weight"
            out.append(LocalParameter(table, (gpt.position_table, h),
                                      (Piece(table, ((0, gpt.position_table), (0, h)), 0, gpt.position_table),)))
    for local, layer in enumerate(stage_layers(gpt.num_layers, pp, pp_rank, vpp, chunk)):
        prefix, at = f"decoder.layers.{local}.", ((layer, layer + 1),)
        attention = gpt.num_attention_heads * gpt.kv_channels
        cols = _split(attention, tp, tp_rank, "linear_proj's columns")
        rows = _split(gpt.qkv_rows, tp, tp_rank, "linear_qkv's rows")
        ffn = _split(gpt.ffn_hidden_size, tp, tp_rank, "linear_fc2's columns")
        fc1_blocks = [ffn] + ([(gpt.ffn_hidden_size + ffn[0], gpt.ffn_hidden_size + ffn[1])] if gpt.swiglu else [])
        attn, mlp = f"{prefix}self_attention.", f"{prefix}mlp."
        out += norm(f"{prefix}input_layernorm.", f"{LAYERS}self_attention.linear_qkv.layer_norm_", at)
        proj = f"{LAYERS}self_attention.linear_proj.weight"
        out.append(LocalParameter(f"{attn}linear_proj.weight", (h, cols[1] - cols[0]),
                                  (Piece(proj, (*at, (0, h), cols), 0, h),)))
        if gpt.linear_bias:
            out.append(whole(f"{attn}linear_proj.bias", f"{LAYERS}self_attention.linear_proj.bias", at, h))
        qkv = f"{LAYERS}self_attention.linear_qkv."
        out.append(column_parallel(f"{attn}linear_qkv.weight", f"{qkv}weight", at, [rows], h))
        if gpt.has_qkv_bias:
            out.append(column_parallel(f"{attn}linear_qkv.bias", f"{qkv}bias", at, [rows], None))
        if gpt.qk_layernorm:  # a head's norm: whole on every TP rank, as the other norms
            for which in ("q", "k"):
                key = f"{which}_layernorm."
                out += norm(f"{attn}{key}", f"{LAYERS}self_attention.{key}", at, gpt.kv_channels)
        out += norm(f"{prefix}pre_mlp_layernorm.", f"{LAYERS}mlp.linear_fc1.layer_norm_", at)
        if gpt.num_experts:
            out += expert_parameters(gpt, mlp, layer, tp, tp_rank, ep, ep_rank)
            continue
        out.append(column_parallel(f"{mlp}linear_fc1.weight", f"{LAYERS}mlp.linear_fc1.weight", at, fc1_blocks, h))
        if gpt.linear_bias:
            out.append(column_parallel(f"{mlp}linear_fc1.bias", f"{LAYERS}mlp.linear_fc1.bias", at, fc1_blocks, None))
        fc2 = f"{LAYERS}mlp.linear_fc2.weight"
        out.append(LocalParameter(f"{mlp}linear_fc2.weight", (h, ffn[1] - ffn[0]),
                                  (Piece(fc2, (*at, (0, h), ffn), 0, h),)))
        if gpt.linear_bias:
            out.append(whole(f"{mlp}linear_fc2.bias", f"{LAYERS}mlp.linear_fc2.bias", at, h))
    if pp_rank == pp - 1 and chunk == vpp - 1:
        out += norm("decoder.final_layernorm.", "decoder.final_layernorm.", ())
        if not gpt.tied:
            out.append(column_parallel("output_layer.weight", "output_layer.weight", (), [vocab], h))
        elif tied_over_pp:  # the copy of the first stage's embedding (at PP 1 the output layer has no weight)
            out.append(replace(column_parallel("output_layer.weight", embedding, (), [vocab], h), tied_copy=True,
                               own_bucket=True))
    assert all(p.key in shapes for lp in out for p in lp.pieces)
    return out


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """The global indices of the experts expert-parallel rank ``ep_rank`` of ``ep`` holds: the ``ep_rank``-th of
    ``ep`` equal runs (megatron-core's ``local_expert_indices``)."""
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split over {ep} expert-parallel ranks")
    per = num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def ep_problem(num_experts: int, ep: int, dp: int) -> str | None:
    """Why EP ``ep`` cannot split a model of ``num_experts`` experts (0: dense) on DP ``dp`` ranks of each
    (PP, TP) rank (``None``: it can), in one line naming ``target.ep_size``: megatron-core's rules (the experts split
    evenly; the expert-parallel ranks are DP ranks)."""
    if ep == 1:
        return None
    if not num_experts:
        return f"target.ep_size={ep}: the model has no experts (num_experts); leave target.ep_size out"
    if num_experts % ep:
        fits = ", ".join(str(d) for d in range(1, num_experts + 1) if num_experts % d == 0 and dp % d == 0)
        return f"target.ep_size={ep} does not divide the model's {num_experts} experts; choose one that does: {fits}"
    if dp % ep:
        return (f"target.ep_size={ep} does not divide DP {dp} (target.world_size / (TP x PP)): the expert-parallel "
                "ranks are data-parallel ranks; choose an EP that divides DP")
    return None


def expert_parameters(
    gpt: Gpt, mlp: str, layer: int, tp: int, tp_rank: int, ep: int, ep_rank: int
) -> list[LocalParameter]:
    """The mixture of experts of global layer ``layer`` on one rank (``mlp``: its local name's prefix): the router
    (``[experts, hidden]``, whole on every rank, a dense parameter), then each local expert (SequentialMLP's
    ``experts.local_experts.<i>``) ``linear_fc1`` (column-parallel: SwiGLU's gate and up blocks of rows) and
    ``linear_fc2`` (row-parallel), their boxes in the sharded keys' global expert axis; expert tensor parallelism is
    the TP (megatron-core's default)."""
    h, at = gpt.hidden_size, (layer, layer + 1)
    e, ffn = gpt.num_experts, gpt.moe_ffn_hidden_size
    out = [LocalParameter(f"{mlp}router.weight", (e, h), (Piece(ROUTER, (at, (0, e), (0, h)), 0, e),))]
    rows = _split(ffn, tp, tp_rank, "an expert's linear_fc2 columns")
    blocks = [rows] + ([(ffn + rows[0], ffn + rows[1])] if gpt.swiglu else [])
    n = rows[1] - rows[0]
    for local, g in enumerate(local_experts(e, ep, ep_rank)):
        name, expert = f"{mlp}experts.local_experts.{local}.", (g, g + 1)
        fc1 = tuple(Piece(EXPERT_FC1, (at, expert, block, (0, h)), i * n, (i + 1) * n)
                    for i, block in enumerate(blocks))
        out.append(LocalParameter(f"{name}linear_fc1.weight", (n * len(blocks), h), fc1, expert=True))
        out.append(LocalParameter(f"{name}linear_fc2.weight", (h, n),
                                  (Piece(EXPERT_FC2, (at, expert, (0, h), rows), 0, h),), expert=True))
    return out


@dataclass(frozen=True)
class Bucketing:
    """How megatron-core's ``DistributedDataParallel`` cuts one model chunk's gradient buffer into buckets.

    ``size``: a bucket is closed once it spans this many elements (``None``: one bucket, as without
    ``--overlap-grad-reduce``). ``high_busbw``: each bucket's end is padded to a multiple of ``2**16`` as well
    (``--ddp-pad-buckets-for-high-nccl-busbw``), which changes only the padded sizes a save records."""

    size: int | None = None
    high_busbw: bool = False


#: megatron-core's bucket size where ``--ddp-bucket-size`` is unset: ``max(BUCKET_FLOOR, BUCKET_PER_DP x DP)``
#: (0.16 ``distributed/distributed_data_parallel.py``: large DP worlds get larger buckets).
BUCKET_FLOOR, BUCKET_PER_DP = 40_000_000, 1_000_000


def bucketing(args: dict[str, Any], dp: int, pp_rank: int, chunk: int, rank_numel: int) -> Bucketing:
    """The bucketing of model chunk ``chunk`` on pipeline stage ``pp_rank`` of a job of ``dp`` data-parallel ranks
    run with Megatron-LM's ``args``; ``rank_numel``: the elements of every parameter of the rank's model chunks
    (:func:`rank_numel`), of which ``--ddp-num-buckets`` makes its size.

    Buckets of a size exist only with ``overlap_grad_reduce`` (megatron-core drops the size otherwise), and only on
    the first stage's first model chunk: megatron-core's DDP drops the size on a later pipeline stage, and Megatron-LM
    builds every later chunk, and every chunk under ``overlap_param_gather_with_optimizer_step``, with
    ``disable_bucketing`` (their reduction is overlapped with compute anyway). The size is ``--ddp-bucket-size``, or
    with ``--ddp-num-buckets N`` the rank's parameters over ``N`` (Megatron-LM's ``get_model``, rounded down), else
    megatron-core's default for ``dp``.
    """
    high_busbw = bool(args.get("ddp_pad_buckets_for_high_nccl_busbw"))
    bucketed = (bool(args.get("overlap_grad_reduce")) and pp_rank == 0 and chunk == 0
                and not args.get("overlap_param_gather_with_optimizer_step"))
    if not bucketed:
        return Bucketing(None, high_busbw)
    if (count := args.get("ddp_num_buckets")) is not None:
        return Bucketing(rank_numel // int(count), high_busbw)
    size = args.get("ddp_bucket_size")
    return Bucketing(int(size) if size is not None else max(BUCKET_FLOOR, BUCKET_PER_DP * dp), high_busbw)


def rank_numel(gpt: Gpt, tp: int, pp: int, tp_rank: int, pp_rank: int, vpp: int = 1, ep: int = 1,
               ep_rank: int = 0) -> int:
    """The elements of every parameter of rank (``pp_rank``, ``tp_rank``, ``ep_rank``)'s model chunks: what
    Megatron-LM's ``get_model`` counts (and prints) before it builds the DDP."""
    return sum(p.numel for chunk in range(vpp)
               for p in local_parameters(gpt, tp, pp, tp_rank, pp_rank, vpp, chunk, ep, ep_rank))


def bucket_multiple(dp: int, high_busbw: bool = False) -> int:
    """What a bucket's end is padded to a multiple of: ``lcm(DP, 128)`` (and ``2**16`` with ``high_busbw``)."""
    return math.lcm(dp, BUCKET_ALIGNMENT, 2**16) if high_busbw else math.lcm(dp, BUCKET_ALIGNMENT)


def buckets(params: Sequence[LocalParameter], dp: int, how: Bucketing = Bucketing()) -> list[FlatBuffer]:
    """The buckets of one model chunk's parameters (``named_parameters()`` order, :func:`local_parameters`), as
    megatron-core's distributed optimizer makes them (0.16 ``param_and_grad_buffer.py``), each a flat buffer
    (:mod:`osdpipe.layout.flat_buffer`) cut into DP equal slices: in reverse order, each parameter starting on a
    multiple of 64 elements, a bucket closed once it spans ``how.size`` elements, and a tied embedding's parameter over
    PP (:attr:`LocalParameter.own_bucket`) a bucket alone; each bucket's end padded for ``dp`` ranks. Each bucket
    starts at the padded end of the one before (a multiple of 128), so its parameters' offsets in it start from 0.

    A bucket closed for such a parameter ends where that parameter would have started: its data (what a
    ``dp_reshardable`` save holds of it, :attr:`FlatBuffer.data_end`) counts the alignment after its last parameter
    (megatron-core aligns the start first, then closes the bucket there)."""
    laid: list[FlatBuffer] = []
    held: list[tuple[str, int]] = []  # the open bucket's parameters
    multiple = bucket_multiple(dp, how.high_busbw)

    def close(data_end: int) -> None:
        laid.append(pack(held, align=PARAM_ALIGNMENT, data_end=data_end, multiple=multiple))
        held.clear()

    at = 0  # where the open bucket's last parameter ends
    for param in reversed(params):
        start = round_up(at, PARAM_ALIGNMENT) if held else 0
        if param.own_bucket and held:
            close(start)
            start = 0
        held.append((param.name, param.numel))
        at = start + param.numel
        if param.own_bucket or (how.size is not None and at >= how.size):
            close(at)
    if held:
        close(at)
    return laid


def dp_group_index(tp: int, tp_rank: int, pp_rank: int) -> int:
    """The index Megatron gives the (PP, TP) rank's model-parallel domain in a ``dp_reshardable`` save's keys
    (``optimizer.distributed.dp_group_idx_<i>``): ``pp_rank x TP + tp_rank``."""
    return pp_rank * tp + tp_rank
