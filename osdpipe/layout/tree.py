"""The module tree: what layout math needs to know about a model, and nothing more.

It is read from a model built on the ``meta`` device, so describing a model of
any size costs no memory and needs no process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
from torch import nn

from osdpipe.layout.model_keys import KeyMap, probe


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the unwrapped model.

    Attributes:
        fqn: the canonical name: the first one ``named_parameters()`` yields.
        shape: the parameter's shape.
        dtype: its dtype's name (``"float32"``).
        owner: FQN of the module that registers the parameter under ``fqn``.
        aliases: the other names of a tied parameter (``lm_head.weight`` for a
            weight shared with ``tok_embed.weight``).
        alias_owners: owner module of each alias, in the same order.
        requires_grad: whether the parameter trains.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    owner: str
    aliases: tuple[str, ...] = ()
    alias_owners: tuple[str, ...] = ()
    requires_grad: bool = True

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class BufferInfo:
    """One persistent buffer of the unwrapped model: what ``model.state_dict()`` holds besides parameters.

    No layout cuts a buffer: every rank of every kind holds it whole.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str


#: Module names that wrappers put into FQNs, never a user's: torch.compile's, activation
#: checkpointing's and FSDP1's. DDP's (and DataParallel's) ``module`` is a prefix, and may also be a user's name.
WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
WRAPPER_PREFIX = "module"


@dataclass(frozen=True)
class ModuleTree:
    """Modules (pre-order, as ``named_modules()``) and parameters (as ``named_parameters()``)."""

    modules: tuple[tuple[str, str], ...]
    params: tuple[ParamInfo, ...]
    #: The persistent buffers, as ``model.state_dict()`` holds them.
    buffers: tuple[BufferInfo, ...] = ()
    #: Every name ``model.state_dict()`` holds, in its order:
    #: parameters (a tied one under each name), keys its hooks make of parameters' rows (:attr:`key_maps`), and buffers.
    state_names: tuple[str, ...] = ()
    #: The keys of ``model.state_dict()`` that its hooks make of parameters' rows
    #: (torchtitan's ``wq``/``wk``/``wv`` of a fused ``wqkv``).
    key_maps: tuple[KeyMap, ...] = ()
    _by_fqn: dict[str, ParamInfo] = field(default_factory=dict, compare=False, repr=False)
    _buffers: dict[str, BufferInfo] = field(default_factory=dict, compare=False, repr=False)
    _keys: dict[str, KeyMap] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for p in self.params:
            for name in (p.fqn, *p.aliases):
                self._by_fqn[name] = p
        for b in self.buffers:
            self._buffers[b.fqn] = b
        for k in self.key_maps:
            self._keys[k.name] = k

    def key_map(self, name: str) -> KeyMap | None:
        """The rows of parameters that the state dict's key ``name`` is made of,
        where a hook makes it (the wrappers' names dropped, as :meth:`resolve` drops them)."""
        return _unwrapped(name, self._keys)

    def holds_weights(self, name: str) -> bool:
        """Whether a state-dict name holds weights:
        a parameter's own name, or a key the model's hooks make of parameters' rows."""
        return self.resolve(name) is not None or self.key_map(name) is not None

    def keys_of(self, fqn: str) -> tuple[KeyMap, ...]:
        """The hook-made keys that hold rows of parameter ``fqn`` (canonical);
        none where the state dict holds it under its own names."""
        return tuple(k for k in self.key_maps if any(r.param == fqn for r in k.runs))

    def param(self, fqn: str) -> ParamInfo:
        """The parameter named ``fqn`` (canonical name or alias)."""
        try:
            return self._by_fqn[fqn]
        except KeyError:
            raise KeyError(f"the model has no parameter {fqn!r}") from None

    def has_param(self, fqn: str) -> bool:
        return fqn in self._by_fqn

    def canonical(self, fqn: str) -> str:
        return self.param(fqn).fqn

    def resolve(self, name: str) -> ParamInfo | None:
        """The parameter a checkpoint's ``name`` refers to, or ``None``.

        The name itself (canonical or a tied alias) first; else the name
        without the module names wrappers insert (:data:`WRAPPER_PARTS`
        anywhere, DDP's ``module.`` as a prefix, as often as it was wrapped).
        Nothing else is tried: a name is never guessed from a similar one,
        and the caller checks the shape.
        """
        return _unwrapped(name, self._by_fqn)

    def resolve_buffer(self, name: str) -> BufferInfo | None:
        """The persistent buffer a checkpoint's ``name`` refers to,
        or ``None`` (the wrappers' names dropped, as :meth:`resolve` drops them)."""
        return _unwrapped(name, self._buffers)


def _unwrapped(name: str, known: dict[str, Any]) -> Any:
    """``known[name]``, else ``known`` of ``name`` without the module names wrappers insert;
    ``None`` where neither is known."""
    if name in known:
        return known[name]
    parts = [p for p in name.split(".") if p not in WRAPPER_PARTS]
    while parts and ".".join(parts) not in known and parts[0] == WRAPPER_PREFIX:
        parts = parts[1:]
    return known.get(".".join(parts))


def parent(fqn: str) -> str:
    """The FQN of the module that holds ``fqn`` (``""`` is the root)."""
    return fqn.rpartition(".")[0]


def describe(model: nn.Module) -> ModuleTree:
    """Read the module tree of ``model`` (best built on the ``meta`` device)."""
    modules = tuple((name, type(mod).__name__) for name, mod in model.named_modules())
    first: dict[int, list[str]] = {}
    order: list[nn.Parameter] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        names = first.setdefault(id(param), [])
        if not names:
            order.append(param)
        names.append(name)
    params = []
    for param in order:
        fqn, *aliases = first[id(param)]
        params.append(
            ParamInfo(
                fqn=fqn,
                shape=tuple(param.shape),
                dtype=str(param.dtype).removeprefix("torch."),
                owner=parent(fqn),
                aliases=tuple(aliases),
                alias_owners=tuple(parent(a) for a in aliases),
                requires_grad=param.requires_grad,
            )
        )
    # on meta, no memory: every persistent buffer, and each name of a tied parameter
    held = model.state_dict(keep_vars=True)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    # buffers, and keys hooks make
    made = {n for n, v in held.items() if torch.is_tensor(v) and not isinstance(v, nn.Parameter)}
    key_maps: tuple[KeyMap, ...] = ()
    # hooks rename or reshape: learn their keys from the model
    if made - {n for n, _ in model.named_buffers()} or names - set(held):
        key_maps = probe(model, [p.fqn for p in params], order)
    mapped = {k.name for k in key_maps}
    buffers = tuple(
        BufferInfo(n, tuple(b.shape), str(b.dtype).removeprefix("torch."))
        for n, b in held.items()
        if n not in names and n not in mapped and torch.is_tensor(b)
    )
    return ModuleTree(
        modules=modules, params=tuple(params), buffers=buffers, state_names=tuple(held), key_maps=key_maps
    )
