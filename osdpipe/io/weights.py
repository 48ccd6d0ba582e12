"""A model's weights as state: how a whole checkpoint's model travels through the same stages as its optimizer.

Every per-parameter layout osdpipe writes places a parameter's weights where
it places that parameter's optimizer state: FSDP2's dim-0 pieces and
tensor-parallel boxes, DCP's dim-0 chunks, whole on DDP and on one process.
So the model needs no stages of its own. Reading a whole checkpoint, each
parameter's state gains one more tensor, :data:`WEIGHTS`, read from the
checkpoint's model part (:class:`WholeReader`); flatten, shard, the transfers
and ``roundtrip`` carry it like ``exp_avg``; rekey takes it back out into the
model's own state dict (:func:`split_weights`), under every name the model
gives the parameter (a tied weight's too), next to the buffers, which no
layout cuts and every rank holds whole.

FSDP1's flat layouts are the exception: a flat parameter's shard is not
``model.state_dict()`` in any state-dict type a job loads without FSDP's own
machinery, so a whole checkpoint for an FSDP1 target is written as DCP (its
SHARDED_STATE_DICT: dim-0 chunks), never as rank files.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from osdpipe.io.formats.base import WEIGHTS, InputError, SourceMeta, SourceReader, TensorRef, expect, read_parts
from osdpipe.layout.model_keys import gather, key_ranges
from osdpipe.layout.tree import ModuleTree, ParamInfo

if TYPE_CHECKING:  # annotations only: the mapped reader imports this module's readers' base
    from osdpipe.io.formats.mapped import MappedReader


@dataclass
class ModelMeta:
    """What a checkpoint's model part holds: each parameter's weights (described) and each buffer (read whole).

    Attributes:
        weights: canonical parameter FQN -> its weights, described: stored under a name of its own, or
            as rows of the keys the model's state-dict hooks make (:attr:`osdpipe.layout.tree.ModuleTree.key_maps`).
        buffers: canonical buffer name -> the buffer, read whole: no layout cuts buffers.
    """

    weights: dict[str, TensorRef] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


class WeightsReader(Protocol):
    """A checkpoint's model part, read lazily: what :class:`WholeReader` asks of each layout's model reader."""

    def model_meta(self) -> ModelMeta:
        """The model part's metadata (its buffers read whole)."""
        ...

    def stored_name(self, name: str) -> str | None:
        """The name the model part stores canonical parameter FQN or hook-made key ``name`` under
        (``None``: it stores none such), known without reading any data."""
        ...

    def read_weights(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor stored under ``name``,
        as a 1-D tensor not to be written to."""
        ...


def model_meta_of(
    stored: dict[str, TensorRef], buffers: dict[str, torch.Tensor], tree: ModuleTree, where: str
) -> ModelMeta:
    """A model part's stored names sorted into parameters' weights (checked against the model) and buffers.

    ``stored`` holds each name the model has as a parameter or as a key its
    state-dict hooks make (:meth:`~osdpipe.layout.tree.ModuleTree.holds_weights`);
    ``buffers`` maps every other stored name to its value. A tied weight is
    stored under each of its names (``model.state_dict()`` and
    ``get_model_state_dict`` keep both): the first is read, and the rest must
    describe the same tensor. A parameter a hook splits (torchtitan's
    ``wqkv`` saved as ``wq``, ``wk``, ``wv``) is read from the rows of its keys.

    Raises:
        InputError: for a name the model has as neither a parameter nor a
            persistent buffer, or a shape or dtype that differs from the model's.
    """
    hint = "is model.factory / model.kwargs the model that saved it?"
    meta = ModelMeta()
    keyed: dict[str, TensorRef] = {}
    for name, ref in stored.items():
        param, key = tree.resolve(name), tree.key_map(name)
        want = (
            (param.shape, param.dtype, "parameter")
            if param is not None
            else (key.shape, key.dtype, "state-dict key")
            if key is not None
            else None
        )
        if want is None:
            raise InputError(
                f"{where}: the model part holds {name!r}, "
                f"which the model has as neither a parameter nor a buffer; {hint}"
            )
        if tuple(ref.shape) != want[0] or ref.dtype != want[1]:
            raise InputError(
                f"{where}: the checkpoint's {name} is {ref.dtype} {list(ref.shape)}, "
                f"but the model's {want[2]} is {want[1]} {list(want[0])}; {hint}"
            )
        if param is not None:
            meta.weights.setdefault(param.fqn, ref)
        else:
            keyed[key.name] = ref
    for param in tree.params:
        keys = tree.keys_of(param.fqn)
        if param.fqn not in meta.weights and keys and all(k.name in keyed for k in keys):
            meta.weights[param.fqn] = TensorRef(param.shape, keyed[keys[0].name].dtype)
    for name, value in buffers.items():
        buffer = tree.resolve_buffer(name)
        if buffer is None:
            raise InputError(
                f"{where}: the model part holds {name!r}, "
                f"which the model has as neither a parameter nor a buffer; {hint}"
            )
        if tuple(value.shape) != buffer.shape or str(value.dtype).removeprefix("torch.") != buffer.dtype:
            raise InputError(
                f"{where}: the checkpoint's buffer {name} is {value.dtype} {list(value.shape)}, "
                f"but the model's is {buffer.dtype} {list(buffer.shape)}; {hint}"
            )
        meta.buffers[buffer.fqn] = value
    missing = [p.fqn for p in tree.params if p.fqn not in meta.weights]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise InputError(f"{where}: the model part holds no weights for {shown}, which the model has; {hint}")
    return meta


@dataclass(frozen=True)
class WholeSource:
    """A whole checkpoint's entries besides the model and the optimizer:
    where each is (``carrying``) and its bytes (``carried``).

    Read once, by the first reading rank, and shared with every rank in the
    source's metadata (:attr:`SourceMeta.carried`), so each can write them.
    """

    layout: str
    carrying: Any  # osdpipe.io.checkpoints.base.Carrying
    carried: Any  # osdpipe.io.checkpoints.base.CarriedData


def stored_names(stored: Iterable[str], tree: ModuleTree) -> dict[str, str]:
    """Canonical parameter FQN, or hook-made key,
    -> the first of ``stored`` names that is it (a tied weight is stored under each of its names)."""
    names: dict[str, str] = {}
    for name in stored:
        param = tree.resolve(name)
        key = tree.key_map(name) if param is None else None
        if param is not None or key is not None:
            names.setdefault(param.fqn if param is not None else key.name, name)
    return names


class WholeReader:
    """The optimizer's state and the model's weights as one source: every parameter's state gains :data:`WEIGHTS`.

    Its metadata is keyed by canonical FQN, with the names the optimizer part
    stores them under (:attr:`SourceMeta.names`), so the broadcast stage
    wraps it in a :class:`~osdpipe.io.formats.base.RenamedReader` as any input,
    and every rank asks it by those names; the model part may name a
    parameter otherwise (``module.x``, a tied alias), which the model reader
    resolves itself. The metadata also holds what the checkpoint carries
    besides (:class:`WholeSource`).
    """

    def __init__(
        self,
        optimizer: SourceReader,
        model: WeightsReader,
        tree: ModuleTree,
        where: str,
        layout: Any = None,
        carrying: Any = None,
    ) -> None:
        self.optimizer, self.model, self.tree, self.where = optimizer, model, tree, where
        self.layout, self.carrying = layout, carrying

    def meta(self) -> SourceMeta:
        optimizer = self.optimizer.meta()
        model = self.model.model_meta()
        state: dict[str, dict[str, Any]] = {}
        names: dict[str, str] = {}
        for name, entries in optimizer.state.items():
            param = self.tree.resolve(name) if isinstance(name, str) else None
            if param is None:  # canonical_meta names the unknown parameter, with the model's hint
                state[name] = entries
                continue
            if WEIGHTS in entries:
                raise InputError(
                    f"{self.where}: the optimizer state of {name} holds a state named {WEIGHTS!r}, "
                    "the name osdpipe carries the model's weights under in a whole checkpoint; "
                    "convert the optimizer alone (checkpoint=optimizer)"
                )
            state[param.fqn] = dict(entries)
            stored = optimizer.names.get(name, name)
            if stored != param.fqn:
                names[param.fqn] = stored
        for fqn, ref in model.weights.items():
            state.setdefault(fqn, {})[WEIGHTS] = ref
        carried = (
            None
            if self.layout is None
            else WholeSource(self.layout.name, self.carrying, self.layout.read_carried(self.carrying))
        )
        return SourceMeta(
            state=state,
            param_groups=optimizer.param_groups,
            extra=optimizer.extra,
            names=names,
            buffers=model.buffers,
            carried=carried,
            notes=optimizer.notes,
            state_dtype=optimizer.state_dtype,
        )

    def _weights(self, param: ParamInfo, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``param``'s flattened weights:
        a range of its own stored tensor, or pieces of the keys a hook makes of its rows."""
        own = self.model.stored_name(param.fqn)
        if own is not None:
            return self.model.read_weights(own, start, stop)
        pieces = sorted(
            (at, k0, k1, key.name)
            for key in self.tree.keys_of(param.fqn)
            for k0, k1, at in key_ranges(key, param.fqn, start, stop)
        )
        read = [self.model.read_weights(self.model.stored_name(name), k0, k1) for _, k0, k1, name in pieces]
        if not read:
            return torch.empty(0, dtype=getattr(torch, param.dtype))
        return torch.cat(read) if len(read) != 1 else read[0]

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        theirs = [(f, n) for f, n in items if n != WEIGHTS]
        out = self.optimizer.read(theirs) if theirs else {}
        for fqn, name in items:
            if name == WEIGHTS:
                param = self.tree.resolve(fqn)
                out[(fqn, name)] = self._weights(param, 0, param.numel).reshape(param.shape)
        return out

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        if name == WEIGHTS:
            return self._weights(self.tree.resolve(fqn), start, stop)
        return self.optimizer.read_range(fqn, name, start, stop)

    def read_parts(self, fqn: str, name: str, start: int, stop: int) -> list[torch.Tensor]:
        if name == WEIGHTS:
            own = self.model.stored_name(fqn)
            if own is not None and hasattr(self.model, "read_parts"):  # as its files hold them: no join first
                return self.model.read_parts(own, start, stop)
            return [self._weights(self.tree.resolve(fqn), start, stop)]
        return read_parts(self.optimizer, fqn, name, start, stop)

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        """Done with the range: the optimizer's reader lets its pages go; so does a model part that reads its own
        name's weights by ranges of mapped files (a Megatron save's items), where it can."""
        if name != WEIGHTS:
            self.optimizer.release(fqn, name, start, stop)
            return
        own = self.model.stored_name(fqn)
        if own is not None and hasattr(self.model, "release"):
            self.model.release(own, start, stop)

    def expect(self, reads: Iterable[tuple[str, str, int, int]]) -> None:
        """The optimizer's ranges about to be read, told to its reader where it fetches ahead
        (:func:`osdpipe.io.formats.base.expect`); the weights are read as they are asked for."""
        expect(self.optimizer, [r for r in reads if r[1] != WEIGHTS])


class NoOptimizer:
    """The optimizer part of a model-only checkpoint
    (torchtitan's last save by default, its seed checkpoint): no state, no param groups.

    The model's weights are then the only state each parameter has, and the
    output holds no optimizer either.
    """

    def meta(self) -> SourceMeta:
        return SourceMeta(state={}, param_groups=None)

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        assert not items, f"a model-only checkpoint holds no optimizer state, yet {items[:2]} were asked for"
        return {}

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        raise KeyError(f"a model-only checkpoint holds no optimizer state: {fqn} {name}")

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        pass


def split_weights(state: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, torch.Tensor]]:
    """A rank's converted state (layout key -> state name -> value)
    as the optimizer's state and the weights by layout key.

    A key whose only state was its weights (a parameter the optimizer holds
    no state for: frozen, or never stepped) leaves the optimizer's state.
    """
    optimizer: dict[str, dict[str, Any]] = {}
    weights: dict[str, torch.Tensor] = {}
    for key, entries in state.items():
        if WEIGHTS in entries:
            weights[key] = entries[WEIGHTS]
        rest = {n: v for n, v in entries.items() if n != WEIGHTS}
        if rest:
            optimizer[key] = rest
    return optimizer, weights


def model_state_dict(
    weights: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], tree: ModuleTree
) -> dict[str, torch.Tensor]:
    """This rank's ``model.state_dict()`` as local tensors, in the model's own order of names.

    ``weights`` are keyed by canonical FQN; a tied weight appears under each
    of its names (one tensor, as ``model.state_dict()`` gives it), a key the
    model's state-dict hooks make is made of its parameters' rows (which must
    be whole here), each buffer whole. Names without a value here (a
    parameter this rank's layout leaves out) are left out.
    """
    out: dict[str, torch.Tensor] = {}
    for name in tree.state_names:
        param, key = tree.resolve(name), tree.key_map(name)
        if param is not None:
            if param.fqn in weights:
                out[name] = weights[param.fqn]
        elif key is not None:
            made_of = {r.param for r in key.runs}
            if made_of <= set(weights):
                assert all(
                    tuple(weights[f].shape) == tree.param(f).shape for f in made_of
                ), f"{name} is made of parameters this rank holds only pieces of"
                out[name] = gather(key, weights)
        elif name in buffers:
            out[name] = buffers[name]
    return out


def open_whole(
    layout: Any, path: str, input_format: str, *, tree: ModuleTree, source: Any, written_in: Any = None,
    described: bool = False, dtype: str | None = None, named: Any = None,
) -> WholeReader | MappedReader:
    """A reader of the whole checkpoint at ``path`` laid out as ``layout``
    (:class:`osdpipe.io.checkpoints.base.CheckpointLayout`) says, for an output in the layout ``written_in`` (its
    optimizer part is read for that layout's job: :meth:`~osdpipe.io.checkpoints.base.CheckpointLayout.optimizer_part`);
    ``described``: for its metadata alone (:meth:`osdpipe.io.formats.base.Format.describe`); ``dtype``: the weights'
    in the output (``output.dtype``), where another framework's model is read through a map that casts them;
    ``named``: the checkpoint's model as the command names it
    (:meth:`~osdpipe.io.checkpoints.base.CheckpointLayout.named_by`).

    Raises:
        InputError: naming the part of the checkpoint that is missing or damaged.
    """
    from osdpipe.io.formats import open_source  # the formats package imports this module's base: imported where used

    mapping = layout.model_map(path, written_in, dtype, named)
    own = tree if mapping is None else _tree_of(*mapping.model)
    part = layout.optimizer_part(path, input_format, written_in)
    optimizer = (
        NoOptimizer()
        if part is None
        else open_source(part.format, part.path, part.key, tree=own, source=source, id_groups=None,
                         described=described)
    )
    model = layout.open_model(path, input_format, own, optimizer)
    carrying = layout.carried(path, input_format, own, written_in)
    if mapping is None:
        return WholeReader(optimizer, model, own, path, layout, carrying)
    from dataclasses import replace

    from osdpipe.io.formats.mapped import MappedReader

    carrying = replace(carrying, gpt_config=layout.gpt_config(path, named))
    whole = WholeReader(optimizer, model, own, path, layout, carrying)
    return MappedReader(whole, mapping, {p.fqn: p.shape for p in tree.params})


def _tree_of(factory: str, kwargs: dict[str, Any]) -> ModuleTree:
    """The parameters of the model ``factory`` builds of ``kwargs``, on the meta device."""
    from osdpipe.layout.models import meta_model
    from osdpipe.layout.tree import describe

    return describe(meta_model(factory, kwargs))
