"""Built-in models, and user models by import path.

A model is built by a *factory*: any callable returning an ``nn.Module``. The
built-in ones are registered by short name; a user's own model is named as
``package.module:function`` and receives ``model.kwargs``. No model needs an
input: generate and verify step the optimizer on synthetic gradients
(:func:`osdpipe.run.live_jobs.train_step`), so any model trains, whatever it eats.

Every built-in model is deterministic for a given seed and can be built on the
``meta`` device, which is how layouts are computed without memory.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

ModelFactory = Callable[..., nn.Module]


class Leaf(nn.Module):
    """A linear layer plus a parameter of its own, so a unit holds both."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))
        self.lin = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.lin(x * self.scale)))


class Block(nn.Module):
    """Holds a parameter directly *and* children with parameters, so FSDP units nest."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        # In place: the same bits, and on the meta device (validation)
        # it does not import torch._dynamo as the operator does (~1 s).
        self.gate = nn.Parameter(torch.randn(dim, dim).div_(dim))
        self.leaf1 = Leaf(dim, hidden)
        self.leaf2 = Leaf(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.leaf2(self.leaf1(x @ self.gate))


class NestedModel(nn.Module):
    """A module tree for nested wrapping.

    ``wrap=[Block]`` gives units ``block1``, ``block2`` and the root;
    ``wrap=[Leaf]`` is a second, different wrapping; both together nest three
    levels deep. Several parameters share a shape (``dim x dim`` gates, the
    ``scale`` vectors), which is what makes order-based rekeying dangerous.
    """

    fsdp_units = ("Block",)  # the natural units: the default of source.wrap and target.wrap

    def __init__(self, dim: int = 8, hidden: int = 12, blocks: int = 2) -> None:
        super().__init__()
        self.dim = dim
        self.embed = nn.Linear(dim, dim)
        for i in range(blocks):
            self.add_module(f"block{i + 1}", Block(dim, hidden))
        self.head = nn.Linear(dim, 3)
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for i in range(self.blocks):
            x = getattr(self, f"block{i + 1}")(x)
        return self.head(x)


class TransformerBlock(nn.Module):
    """A pre-norm transformer block (single-head attention keeps it small)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(attn @ v)
        return x + self.fc2(torch.relu(self.fc1(self.norm2(x))))


class TransformerModel(nn.Module):
    """A small language model whose output head is tied to the embedding."""

    fsdp_units = ("TransformerBlock",)

    def __init__(self, vocab: int = 32, dim: int = 16, hidden: int = 24, layers: int = 2, seq: int = 6) -> None:
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.tok_embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok_embed.weight  # tied: one parameter, two FQNs

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class MLP(nn.Module):
    """A plain multilayer perceptron; width and depth set its size, for benchmarks."""

    fsdp_units = ("Linear",)

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.width = width
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class Attention(nn.Module):
    """Llama's attention projections
    (no rotary embedding, one head: only the parameters' names and shapes matter here)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.wq(x) @ self.wk(x).transpose(-1, -2) / x.shape[-1] ** 0.5, dim=-1)
        return self.wo(scores @ self.wv(x))


class FeedForward(nn.Module):
    """Llama's SwiGLU feed-forward."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """A small model named as torchtitan's Llama is
    (``tok_embeddings``, ``layers.<i>.attention.wq``, ``feed_forward.w1``, ...), for its TP plan.

    The hidden size (44 by default) is not a multiple of the usual
    tensor-parallel sizes, so its pieces are uneven, as a real 8B's are not.
    """

    fsdp_units = ("LlamaBlock",)

    def __init__(self, vocab: int = 64, dim: int = 16, hidden: int = 44, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def torchtitan_model(name: str = "llama3", flavor: str = "debugmodel") -> nn.Module:
    """A model from torchtitan's own registry, as its trainer builds it:
    ``torchtitan.models.<name>.model_registry(flavor)``.

    What a torchtitan job's checkpoint was saved from, named as torchtitan
    names it (``--module llama3``, flavour ``debugmodel``), so its state-dict
    hooks (llama3's fused ``wqkv`` saved as ``wq``, ``wk``, ``wv``) are the
    job's own. Its FSDP units are its transformer blocks, as torchtitan's
    ``parallelize`` wraps them. Needs torchtitan installed (``pip install torchtitan``).
    """
    model = torchtitan_config(name, flavor).build()
    layers = getattr(model, "layers", None)
    blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers or [])
    model.fsdp_units = (type(blocks[0]).__name__,) if blocks else ()
    return model


def torchtitan_config(name: str, flavor: str) -> Any:
    """The config of torchtitan's registry model ``name``/``flavor`` (what :func:`torchtitan_model` builds), read
    without building it: an 8B's dimensions without 32 GB of weights.

    Raises:
        ValueError: torchtitan, the model or the flavor is not there; the message says which.
    """
    try:
        registry = importlib.import_module(f"torchtitan.models.{name}").model_registry
    except ImportError as exc:
        raise ValueError(
            f"model.factory=torchtitan with name={name!r}: cannot import torchtitan.models.{name} ({exc}); "
            "is torchtitan installed?"
        ) from None
    except AttributeError:
        raise ValueError(
            f"model.factory=torchtitan: torchtitan.models.{name} has no model_registry; "
            "name one of torchtitan's models"
        ) from None
    try:
        return registry(flavor).model
    except KeyError:
        raise ValueError(f"model.factory=torchtitan: torchtitan's {name} has no flavor {flavor!r}") from None


def hf_llama(**config: Any) -> nn.Module:
    """Hugging Face's ``LlamaForCausalLM`` of a ``config.json``'s keys (``model.kwargs``), or its ``Qwen2ForCausalLM``
    or ``Qwen3ForCausalLM`` where ``model_type`` is ``qwen2`` or ``qwen3``: the model a Megatron GPT becomes
    (:func:`osdpipe.layout.megatron_hf.hf_config`; a Qwen2 is a Llama with biases on q, k and v, a Qwen3 one with a
    norm on each head's query and key). Its FSDP units are its decoder layers, the modules transformers never splits
    (``_no_split_modules``). Needs transformers (``pip install transformers``)."""
    try:
        import transformers
    except ImportError as exc:
        raise ValueError(f"model.factory=hf_llama: cannot import transformers ({exc}); pip install transformers") \
            from None
    classes = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
    config_name, model_name = classes.get(config.get("model_type"), ("LlamaConfig", "LlamaForCausalLM"))
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**config))
    model.fsdp_units = tuple(model._no_split_modules or ())
    return model


def hf_gpt2(**config: Any) -> nn.Module:
    """Hugging Face's ``GPT2LMHeadModel`` of a ``config.json``'s keys (``model.kwargs``): what Megatron-LM's default
    GPT (LayerNorm, a learned position table, GeLU) becomes (:func:`osdpipe.layout.megatron_hf.hf_config`). Its FSDP
    units are its blocks, the modules transformers never splits. Needs transformers (``pip install transformers``)."""
    try:
        import transformers
    except ImportError as exc:
        raise ValueError(f"model.factory=hf_gpt2: cannot import transformers ({exc}); pip install transformers") \
            from None
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
    model.fsdp_units = tuple(model._no_split_modules or ())
    return model


def torchtitan_llama3(*, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, hidden_dim: int, vocab_size: int,
                      norm_eps: float = 1e-5, rope_theta: float = 10000.0, max_seq_len: int = 4096,
                      rope_scaling: dict[str, float] | None = None, tie_embeddings: bool = False,
                      attn_backend: str = "flex") -> nn.Module:
    """torchtitan's llama3 (fused ``wqkv``, complex RoPE; ``rope_scaling``: Llama 3.1's, as torchtitan's ``llama``
    scaling takes it: ``scaling_factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``; ``None``: unscaled; ``tie_embeddings``: its output layer the embedding, as
    torchtitan's ``enable_weight_tying``) of any dimensions: what a Megatron GPT becomes
    for a torchtitan job (:func:`osdpipe.layout.llama_titan.to_titan` maps its tensors). Built by torchtitan's own
    config classes, its ``debugmodel`` flavor's with these dimensions, and its own layer builder; its FSDP units are its
    transformer blocks, as torchtitan's ``parallelize`` wraps them. A job builds the same model with these keywords
    (``model_args.json`` beside the converted step folder). Needs torchtitan (``pip install torchtitan``)."""
    llama3, rope = _titan_modules("torchtitan_llama3", "llama3", "ComplexRoPE")
    layers = llama3._build_llama3_layers(
        fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, hidden_dim=hidden_dim,
        rope=rope.Config(dim=dim // n_heads, max_seq_len=max_seq_len, theta=rope_theta,
                         **({"scaling": "llama", **rope_scaling} if rope_scaling else {"scaling": "none"})),
        attn_backend=attn_backend,
    )
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = norm_eps
    return _titan_decoder(llama3, layers, dim=dim, vocab_size=vocab_size, norm_eps=norm_eps,
                          tie_embeddings=tie_embeddings)


def torchtitan_qwen3(*, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, hidden_dim: int,
                     vocab_size: int, norm_eps: float = 1e-6, rope_theta: float = 1000000.0, max_seq_len: int = 4096,
                     tie_embeddings: bool = False, attn_backend: str = "flex") -> nn.Module:
    """torchtitan's qwen3 (fused ``wqkv``, rotate-half RoPE, a norm of each head's query and key, a head dimension of
    its own; dense; ``tie_embeddings``: its output layer the embedding, as its 0.6B to 4B) of any dimensions: what a
    Megatron GPT with ``--qk-layernorm`` becomes for a torchtitan job (:func:`osdpipe.layout.llama_titan.to_titan`
    maps its tensors). Built by torchtitan's own config classes, its ``debugmodel`` flavor's with these dimensions,
    and its own layer builder, every norm's epsilon ``norm_eps``; its FSDP units are its transformer blocks, as
    torchtitan's ``parallelize`` wraps them. A job builds the same model with these keywords (``model_args.json``
    beside the converted step folder). Needs torchtitan (``pip install torchtitan``)."""
    qwen3, rope = _titan_modules("torchtitan_qwen3", "qwen3", "CosSinRoPE")
    layers = qwen3._build_qwen3_layers(
        fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        hidden_dim=hidden_dim, rope=rope.Config(dim=head_dim, max_seq_len=max_seq_len, theta=rope_theta),
        attn_backend=attn_backend,
    )
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = layer.attention.qk_norm.eps = norm_eps
    return _titan_decoder(qwen3, layers, dim=dim, vocab_size=vocab_size, norm_eps=norm_eps,
                          tie_embeddings=tie_embeddings)


def _titan_modules(factory: str, name: str, rope: str) -> tuple[Any, Any]:
    """torchtitan's module of the model ``name`` and its RoPE config class ``rope``, for ``model.factory=factory``.

    Raises:
        ValueError: torchtitan is not installed (one line naming the factory).
    """
    try:
        return (importlib.import_module(f"torchtitan.models.{name}"),
                getattr(importlib.import_module("torchtitan.models.common"), rope))
    except ImportError as exc:
        raise ValueError(f"model.factory={factory}: cannot import torchtitan ({exc}); pip install torchtitan") from None


def _titan_decoder(module: Any, layers: list[Any], *, dim: int, vocab_size: int, norm_eps: float,
                   tie_embeddings: bool) -> nn.Module:
    """The decoder of torchtitan's ``module`` (its ``debugmodel`` flavor's config) with ``layers`` and these
    dimensions, built; its FSDP units are its transformer blocks, as torchtitan's ``parallelize`` wraps them."""
    import dataclasses

    base = module.model_registry("debugmodel").model
    config = dataclasses.replace(
        base, dim=dim, vocab_size=vocab_size, layers=layers, enable_weight_tying=tie_embeddings,
        tok_embeddings=dataclasses.replace(base.tok_embeddings, num_embeddings=vocab_size, embedding_dim=dim),
        norm=dataclasses.replace(base.norm, normalized_shape=dim, eps=norm_eps),
        lm_head=dataclasses.replace(base.lm_head, in_features=dim, out_features=vocab_size),
    )
    model = config.build()
    model.fsdp_units = (type(next(iter(model.layers.values()))).__name__,)
    return model


#: torchtitan's RoPE config fields of Llama 3.1's scaling (``models/common/rope.py``, ``RoPE.Config``).
LLAMA_ROPE_SCALING = ("scaling_factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def torchtitan_flavor_args(name: str = "llama3", flavor: str = "debugmodel") -> dict[str, Any]:
    """The keywords of the factory of torchtitan's model ``name`` (:data:`osdpipe.layout.llama_titan.FAMILIES`:
    :func:`torchtitan_llama3`, :func:`torchtitan_qwen3`) that build the model of torchtitan's own registry
    ``name``/``flavor`` (``model=torchtitan``): its dimensions, norms, RoPE and tying read from torchtitan's config of
    it, which is not built.

    Raises:
        ValueError: a model osdpipe does not map (another family, an MoE, a RoPE scaling its factory does not take:
            Llama 3.1's for llama3, none for qwen3).
    """
    from osdpipe.layout.llama_titan import FAMILIES

    family = next((f for f in FAMILIES.values() if f.name == name), None)
    config = torchtitan_config(name, flavor)
    attention, block = config.layers[0].attention, config.layers[0]
    rope = attention.rope
    why = [what for bad, what in (
        (family is None, f"not one of {', '.join(f.name for f in FAMILIES.values())}"),
        (getattr(block, "feed_forward", None) is None, "a mixture of experts"),
        (family is not None and rope.scaling not in family.rope_scalings, f"RoPE scaling {rope.scaling!r}"),
        (not hasattr(attention, "n_kv_heads"), "attention other than grouped-query"),
    ) if bad]
    if why:
        raise ValueError(f"model=torchtitan {name} {flavor}: {', '.join(why)}; not supported yet")
    heads = int(attention.n_heads)
    args = {
        "dim": int(config.dim), "n_layers": len(config.layers), "n_heads": heads,
        "n_kv_heads": int(attention.n_kv_heads or heads), "hidden_dim": int(block.feed_forward.w1.out_features),
        "vocab_size": int(config.vocab_size), "norm_eps": float(block.attention_norm.eps),
        "rope_theta": float(rope.theta), "max_seq_len": int(rope.max_seq_len),
        **({"tie_embeddings": True} if config.enable_weight_tying else {}),
    }
    if family.own_head_dim:
        args["head_dim"] = int(attention.head_dim)
    if "llama" in family.rope_scalings:
        args["rope_scaling"] = {k: float(getattr(rope, k)) for k in LLAMA_ROPE_SCALING} if rope.scaling == "llama" \
            else None
    return args


def hf_adapter(
    factory: str, kwargs: dict[str, Any]
) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
    """The model's own conversion of its state dict to Hugging Face's names and layout,
    where it has one (``None``: it has none).

    torchtitan's models have one (their train spec's ``state_dict_adapter``:
    ``to_hf`` renames, permutes q/k for HF's RoPE and leaves out a tied
    head), which is what torchtitan's own HF export writes. It takes any
    part of the state dict, a key at a time.
    """
    if factory != "torchtitan":
        return None
    name, flavor = kwargs.get("name", "llama3"), kwargs.get("flavor", "debugmodel")
    spec = importlib.import_module(f"torchtitan.models.{name}").model_registry(flavor)
    if spec.state_dict_adapter is None:
        return None
    return spec.state_dict_adapter(spec.model, None).to_hf


def torchtitan_model_of(shapes: dict[str, tuple[int, ...]]) -> tuple[str, str, frozenset[str]] | None:
    """The torchtitan model (name, flavor, its parameters' names) whose own ``state_dict()`` holds exactly these names
    and shapes; ``None`` for none, or without torchtitan.

    How ``osdpipe inspect`` names the model of a torchtitan checkpoint so that
    its command runs as printed. A flavor is built (on ``meta``) only where its
    config's ``vocab_size`` and ``dim`` fit the checkpoint's embedding.
    """
    import pkgutil

    try:
        import torchtitan.models as package
    except ImportError:
        return None
    embedding = next(
        (shape for name, shape in shapes.items() if name.endswith("embeddings.weight") and len(shape) == 2), None
    )
    names = sorted(
        (m.name for m in pkgutil.iter_modules(package.__path__)), key=lambda n: (n not in COMMON_TORCHTITAN_MODELS, n)
    )
    # the language models users train most first: each other module's import costs seconds (flux's many)
    for name in names:
        try:
            module = importlib.import_module(f"torchtitan.models.{name}")
        except Exception:  # noqa: BLE001 - a model whose imports this machine lacks is not the one
            continue
        configs = next((v for k, v in vars(module).items() if k.endswith("_configs") and isinstance(v, dict)), None)
        if configs is None or not hasattr(module, "model_registry"):
            continue
        for flavor in configs:
            try:
                config = module.model_registry(flavor).model
                size = (getattr(config, "vocab_size", None), getattr(config, "dim", None))
                if embedding is not None and size not in ((embedding[0], embedding[1]), (None, None)):
                    continue
                with torch.device("meta"):
                    model = module.model_registry(flavor).model.build()
                held = model.state_dict()
            except Exception:  # noqa: BLE001 - a flavor that cannot be built here is not the one
                continue
            if {n: tuple(t.shape) for n, t in held.items()} == shapes:
                return name, flavor, frozenset(n for n, _ in model.named_parameters())
    return None


#: The torchtitan models :func:`torchtitan_model_of` tries first.
COMMON_TORCHTITAN_MODELS = ("llama3", "qwen3", "deepseek_v3", "gpt_oss")


def megatron_gpt(args: dict[str, Any]) -> nn.Module:
    """A Megatron GPT as its save keys it: a module whose parameters are the sharded keys, each of its global shape
    over TP and PP (the decoder's layers stacked on a leading axis) and in the job's ``params_dtype``, from
    Megatron-LM's ``args`` (:func:`osdpipe.layout.megatron.layout_args`). No ``forward``: what a conversion of a
    Megatron save lays out (:mod:`osdpipe.layout.megatron_grid`), and no megatron-core needed."""
    from osdpipe.layout import megatron  # pure; imported where a Megatron model is built

    dtype = getattr(torch, megatron.params_dtype(args))
    root = nn.Module()
    for key, shape in megatron.global_shapes(megatron.gpt_of(args)).items():
        *path, leaf = key.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dtype)))
    return root


BUILTIN_MODELS: dict[str, ModelFactory] = {
    "megatron_gpt": megatron_gpt,
    "nested": NestedModel,
    "transformer": TransformerModel,
    "mlp": MLP,
    "llama": Llama,
    "torchtitan": torchtitan_model,
    "hf_llama": hf_llama,
    "hf_gpt2": hf_gpt2,
    "torchtitan_llama3": torchtitan_llama3,
    "torchtitan_qwen3": torchtitan_qwen3,
}


def resolve_factory(factory: str) -> ModelFactory:
    """Return the model factory named by a built-in name or ``package.module:function``.

    Raises:
        ValueError: if the name is neither a built-in model nor an importable
            ``module:attribute`` path.
    """
    if factory in BUILTIN_MODELS:
        return BUILTIN_MODELS[factory]
    if ":" not in factory:
        raise ValueError(
            f"model.factory={factory!r} is not a built-in model ({', '.join(BUILTIN_MODELS)}); "
            "name your own as package.module:function"
        )
    module_name, _, attr = factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"model.factory={factory!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"model.factory={factory!r}: module {module_name!r} has no attribute {attr!r}") from None


def model_units(factory: str, kwargs: dict[str, Any]) -> list[str]:
    """The model's natural FSDP units:
    its ``fsdp_units`` attribute (read on the meta model), else none (the root only)."""
    return list(getattr(meta_model(factory, kwargs), "fsdp_units", ()))


#: The last meta model built, by factory and kwargs: the config's default units and the plan's tree read the same one.
_last_meta: tuple[str, nn.Module] | None = None


def meta_model(factory: str, kwargs: dict[str, Any]) -> nn.Module:
    """The model built on the ``meta`` device (no memory),
    built once for a run however many ask (read it, never change it)."""
    global _last_meta
    key = json.dumps([factory, kwargs], sort_keys=True, default=repr)
    if _last_meta is None or _last_meta[0] != key:
        _last_meta = (key, build_model(factory, kwargs, device="meta"))
    return _last_meta[1]


def build_model(factory: str, kwargs: dict[str, Any], seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """Build the model deterministically: the same seed gives the same weights.

    On ``device="meta"`` no memory is allocated; only the module tree, shapes and
    dtypes exist, which is all layout math needs.
    """
    make = resolve_factory(factory)
    torch.manual_seed(seed)
    with torch.device(device):
        model = make(**kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model.factory={factory!r} returned {type(model).__name__}, not an nn.Module")
    return model
