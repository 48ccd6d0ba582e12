"""Read a Megatron-LM ``torch_dist`` checkpoint without Megatron: the model, the distributed optimizer, the rest.

A Megatron-LM save folder holds ``latest_checkpointed_iteration.txt`` and ``iter_<7 digits>/``; the iteration
folder is one DCP checkpoint (``.metadata``, ``__<rank>_<k>.distcp``) beside ``common.pt`` (a ``torch.save`` of
``args``, an ``argparse.Namespace``, the iteration, the scheduler's state and, for a ``fully_reshardable``
optimizer, its param groups) and ``metadata.json`` (``sharded_backend: torch_dist``). What is in the DCP items:

* the model, one tensor per sharded key, global over TP and PP (:mod:`osdpipe.layout.megatron`);
* the distributed optimizer in the sharding type ``common.pt``'s ``content_metadata`` names:

  - ``dp_reshardable`` (Megatron-LM's default): per model-parallel domain ``i``, gradient buffer, dtype and bucket,
    one 1-D tensor per state, ``optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_(<param>, <grad>)
    .bucket_idx_<b>.<param|exp_avg|exp_avg_sq>``: each bucket as :func:`osdpipe.layout.megatron.buckets` lays it
    out (one; two on a stage that holds a tied embedding over PP), ``g`` the model chunk (0 but with virtual
    pipeline stages), cut at its unpadded size; the param groups (with
    ``step``) in the byte item ``optimizer.distributed.dp_group_idx_<i>.optimizer``;
  - ``fully_reshardable``: ``optimizer.state.<param|exp_avg|exp_avg_sq>.<sharded key>``, global like the model;
    the param groups (with ``step``) in ``common.pt``;
  - ``fully_sharded_model_space`` (megatron-core's default until 0.14, which dropped it): per sharded key
    ``optimizer.state.<fp32_param|exp_avg|exp_avg_sq>.<sharded key>``, each DP rank's part of each TP/PP-local
    chunk stored flattened: for a key of global shape ``(s_0, .., s_n)`` cut into ``f_i`` chunks along axis ``i``
    (the decoder's layer axis into single layers), the item's shape is ``(f_0, .., f_n, prod(s_i / f_i))``, the last
    axis the chunk in row-major order (megatron-core 0.13 ``dist_checkpointing/strategies/torch.py``, its
    N-D flattened tensors); the param groups (with ``step``) in ``common.pt`` as for ``fully_reshardable``;

* byte items (``rng_state``, a linear's ``_extra_state``, the bucket sizes): each a ``torch.save`` of a one-element
  list.

A save of the weights alone (Megatron-LM's ``--no-save-optim``, recorded in ``args.no_save_optim``; what a converted
model is, as Megatron-LM's ``release`` folder) holds the model's items and no optimizer: Megatron-LM's
``load_checkpoint`` then starts its optimizer fresh (it loads one only where ``args.no_save_optim`` is unset and the
folder is no ``release``), and so does osdpipe's reader (:attr:`MegatronSave.weights_only`).

Every pickle (``common.pt``, the byte items) is read by :func:`osdpipe.io.formats.inert_load.load_inert`: names of
``argparse`` and ``megatron`` become inert records, nothing runs, and Megatron need not be installed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from osdpipe.core import memory
from osdpipe.core.compare import differing_bits
from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.dcp_reader import DcpCheckpoint
from osdpipe.io.formats.inert_load import load_inert, load_inert_bytes
from osdpipe.io.remote_input import RemotePath, as_path
from osdpipe.layout import megatron as layout
from osdpipe.layout.megatron import gpt_of

LATEST = "latest_checkpointed_iteration.txt"
#: What ``latest_checkpointed_iteration.txt`` says of a ``release`` save (Megatron-LM's converted weights): its folder
#: is ``release/``, and Megatron-LM loads it at iteration 0 with a fresh optimizer, scheduler and RNG.
RELEASE = "release"
COMMON = "common.pt"
#: The packages whose objects a Megatron pickle may name: kept as inert records, never imported.
DESCRIBED = ("argparse", "megatron")
WHAT = "a Megatron-LM checkpoint's common.pt"
#: The optimizer's per-parameter states, as Megatron's sharded keys name them (``param``: the fp32 master weight).
STATES = ("param", "exp_avg", "exp_avg_sq")
#: The fp32 master weights alone (:func:`read_save`'s ``states``): what a Hugging Face folder of a save holds.
MASTERS = ("param",)
#: What every optimizer item's key starts with (its states, a ``dp_reshardable`` save's buckets); the model's weights'
#: keys are the weights' own.
OPTIMIZER = "optimizer."
#: The distributed optimizer's sharding types osdpipe reads.
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space")
#: Those it writes (megatron-core 0.14 and later no longer save nor load ``fully_sharded_model_space``).
WRITTEN_TYPES = ("dp_reshardable", "fully_reshardable")
#: The type a save of each type is written in where ``output.megatron_optim_format`` is unset: its own, or for
#: ``fully_sharded_model_space`` the other model-space type, ``fully_reshardable``, which megatron-core, like the
#: source, loads at any TP and PP (a ``dp_reshardable`` save only at its own).
DEFAULT_OUTPUT = {"dp_reshardable": "dp_reshardable", "fully_reshardable": "fully_reshardable",
                  "fully_sharded_model_space": "fully_reshardable"}
#: How a ``fully_sharded_model_space`` save names each of :data:`STATES` in its keys.
FS_STATES = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
_BUCKET = re.compile(
    r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\((.+)\)\.bucket_idx_(\d+)\.(\w+)"
)
#: A model-space optimizer state's key (``fully_reshardable``, ``fully_sharded_model_space``): the state's name as
#: stored, then the weight's key.
_MODEL_SPACE_STATE = re.compile(rf"optimizer\.state\.({'|'.join(sorted({*STATES, *FS_STATES.values()}))})\.(.+)")
#: Each of :data:`STATES` by the names a save stores it under.
_STATE_NAMED = {**{s: s for s in STATES}, **{stored: s for s, stored in FS_STATES.items()}}
_ITERATION = re.compile(r"iter_(\d{7})")
RNG = re.compile(r"rng_state/shard_(\d+)\.(\d+)_\d+\.\d+")

#: The states a PyTorch Adam keeps per parameter, in the order its ``state_dict()`` lists them.
MOMENTS = ("exp_avg", "exp_avg_sq")
#: What megatron-core adds to each param group for its ``OptimizerParamScheduler`` (megatron-core 0.16.1
#: ``optimizer/__init__.py`` ``_get_param_groups``, l. 208-225), which no torch optimizer reads.
SCHEDULERS_KEYS = ("is_expert_parallel", "default_config", "wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr")


@dataclass
class MegatronSave:
    """What a Megatron-LM save holds, read whole: every tensor global (over TP, PP and DP), as Megatron keys it."""

    folder: Path
    iteration: int
    args: dict[str, Any]
    #: The distributed optimizer's sharding type; ``None``: the save holds the weights alone (:attr:`weights_only`).
    sharding: str | None
    #: sharded key -> the model's weight (its ``params_dtype``; the vocabulary padded as Megatron holds it)
    model: dict[str, torch.Tensor]
    #: sharded key -> ``{"param": fp32 master, "exp_avg": ..., "exp_avg_sq": ...}``
    optim: dict[str, dict[str, torch.Tensor]]
    #: Each param group's hyperparameters (``step`` among them) and its parameters' sharded keys.
    param_groups: list[dict[str, Any]]
    scheduler: dict[str, Any] | None
    common: dict[str, Any] = field(repr=False, default_factory=dict)
    #: Each (PP, TP) rank's RNG states (Megatron-LM's ``get_rng_state``), the stored bytes, never unpickled: they
    #: hold numpy's state, and are carried as they are.
    rng: dict[tuple[int, int], bytes] = field(repr=False, default_factory=dict)
    #: The linears' ``_extra_state`` items by their stored keys (one per global layer), the stored bytes.
    extra_state: dict[str, bytes] = field(repr=False, default_factory=dict)
    #: A ``dp_reshardable`` gradient buffer's ``(param dtype, grad dtype)`` as its keys spell it.
    gbuf_dtypes: str | None = None
    #: The save is Megatron-LM's ``release`` folder (iteration 0), not an ``iter_<N>`` one.
    release: bool = False
    #: What reading found that a conversion's report should say (a warning each).
    notes: tuple[str, ...] = ()

    @property
    def weights_only(self) -> bool:
        """The save holds the model's weights and no optimizer state (``optim`` and ``param_groups`` are empty)."""
        return self.sharding is None

    @property
    def tp(self) -> int:
        return int(self.args["tensor_model_parallel_size"])

    @property
    def pp(self) -> int:
        return int(self.args["pipeline_model_parallel_size"])

    @property
    def dp(self) -> int:
        return int(self.args["data_parallel_size"])

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank (virtual pipeline stages); 1: none."""
        return layout.virtual_stages(self.args)


#: A box of a global tensor: a slice per axis.
Box = tuple[slice, ...]


class Placement(Protocol):
    """Where :func:`read_save` puts each tensor as it reads it: :class:`Gathered` (into global tensors, the default),
    or a caller's own (:class:`osdpipe.verify.megatron.Compared`: held against a source, and let go)."""

    def expect(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """The save's global tensors, by sharded key, as its ``args`` shape them: told before any is read."""

    def whole(self, key: str, state: str | None, tensor: torch.Tensor) -> None:
        """A global tensor read whole: the model's weight ``key`` (``state`` ``None``) or one of its optimizer
        :data:`STATES`."""

    def block(self, key: str, state: str, box: Box, block: torch.Tensor) -> None:
        """A block of ``key``'s optimizer ``state`` at ``box`` of its global tensor (a ``dp_reshardable`` bucket's
        piece): each element of every global tensor comes once."""

    def tied_copy(self, key: str, state: str, box: Box, block: torch.Tensor) -> int:
        """The last stage's copy of the tied embedding's ``state`` at ``box``, which Megatron keeps equal to the
        first stage's (placed before it): how many of its elements differ from that."""
        ...


class Gathered:
    """The default :class:`Placement`: every tensor into the global tensors a :class:`MegatronSave` holds."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.model: dict[str, torch.Tensor] = {}
        self._optim: dict[tuple[str, str], torch.Tensor] = {}

    def expect(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = dict(shapes)

    def whole(self, key: str, state: str | None, tensor: torch.Tensor) -> None:
        if state is None:
            self.model[key] = tensor
        else:
            self._optim[(key, state)] = tensor

    def _global(self, key: str, state: str) -> torch.Tensor:
        if (key, state) not in self._optim:
            self._optim[(key, state)] = torch.empty(self.shapes[key], dtype=torch.float32)
        return self._optim[(key, state)]

    def block(self, key: str, state: str, box: Box, block: torch.Tensor) -> None:
        self._global(key, state)[box] = block

    def tied_copy(self, key: str, state: str, box: Box, block: torch.Tensor) -> int:
        return differing_bits(block, self._global(key, state)[box])

    def states(
        self, shapes: dict[str, tuple[int, ...]], states: tuple[str, ...] = STATES
    ) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's ``states`` (those read) by sharded key, in the order of ``shapes`` and :data:`STATES`."""
        return {key: {s: self._optim[(key, s)] for s in states} for key in shapes}


def iteration_folder(path: str | Path | RemotePath) -> Path | RemotePath:
    """The ``iter_<N>`` (or ``release``) folder of a save: ``path`` itself, or the one its
    ``latest_checkpointed_iteration.txt`` names (in object storage: a :class:`RemotePath`, read by range).

    Raises:
        InputError: neither, or a ``latest`` file that names a missing folder.
    """
    p = as_path(path)
    if (_ITERATION.fullmatch(p.name) or p.name == RELEASE) and p.is_dir() and not (p / LATEST).is_file():
        return p
    latest = p / LATEST
    if not latest.is_file():
        raise InputError(
            f"{p} holds no {LATEST} and is no iter_<7 digits> folder; point input.path at a Megatron-LM save"
        )
    said = latest.read_text().strip()
    if said == RELEASE:
        folder = p / RELEASE
    elif said.isdigit():
        folder = p / f"iter_{int(said):07d}"
    else:
        raise InputError(f"{latest} says {said!r}, not an iteration; re-copy the save folder")
    if not folder.is_dir():
        raise InputError(f"{latest} names iteration {said}, but {folder} is not there; re-copy the save folder")
    return folder


def megatron_folder(path: Path) -> Path | None:
    """The iteration folder of the Megatron-LM save at ``path`` (a save folder or an ``iter_`` folder of a torch_dist
    save); ``None`` where ``path`` is none."""
    if (path / LATEST).is_file():
        return path
    if (path / COMMON).is_file() and (path / "metadata.json").is_file() and (path / ".metadata").is_file():
        return path
    return None


def what_to_do_with(path: Path) -> str:
    """One line for a Megatron-LM save given where an optimizer checkpoint is asked for: what it is (from
    ``common.pt``, read inertly) and the keys that convert it."""
    try:
        save_args = read_common(iteration_folder(path))["args"]
        shape = (f"TP{save_args.get('tensor_model_parallel_size')} PP{save_args.get('pipeline_model_parallel_size')} "
                 f"DP{save_args.get('data_parallel_size')}, iteration {save_args.get('iteration')}")
    except InputError as exc:
        return str(exc)
    return (
        f"{path} is a Megatron-LM torch_dist save ({shape}); set checkpoint=megatron and the target's grid: "
        "target.tp_size=T target.pp_size=P target.world_size=W (docs/frameworks.md, From and to Megatron-Core)"
    )


def read_common(folder: Path) -> dict[str, Any]:
    """``common.pt``, read inertly, with ``args`` as a plain dict."""
    if not (folder / COMMON).is_file():
        raise InputError(f"{folder} holds no {COMMON}; a Megatron-LM torch_dist save has one beside .metadata")
    common = load_inert(folder / COMMON, DESCRIBED, what=WHAT)
    if not isinstance(common, dict) or "args" not in common:
        raise InputError(f"{folder / COMMON} holds no args; it is not a Megatron-LM checkpoint's common.pt")
    args = common["args"]
    common["args"] = dict(args.state) if hasattr(args, "state") and isinstance(args.state, dict) else vars(args)
    return common


def refused_model(args: dict[str, Any], where: Path) -> str | None:
    """Why osdpipe cannot lay out the model ``args`` describe yet (``None``: it can), naming the feature. Absent args
    take Megatron-LM's defaults (LayerNorm, a learned position table, tied embeddings: all laid out)."""
    norm, positions = args.get("normalization", "LayerNorm"), layout.position_embedding_type(args)
    checks = [
        (norm not in ("RMSNorm", "LayerNorm"), f"{norm} normalization"),
        (positions not in ("rope", "learned_absolute"), f"{positions} position embeddings"),
        ((args.get("num_experts") or 0) > 0, "a mixture of experts (num_experts)"),
        ((args.get("expert_model_parallel_size") or 1) > 1, "expert parallelism (expert_model_parallel_size)"),
        ((args.get("context_parallel_size") or 1) > 1, "context parallelism"),
        ((args.get("num_distributed_optimizer_instances") or 1) > 1,
         "several distributed optimizer instances (num_distributed_optimizer_instances)"),
        (args.get("transformer_impl", "local") != "local", f"the {args.get('transformer_impl')} layer spec"),
        (bool(args.get("use_megatron_fsdp")) or args.get("ckpt_format") == "fsdp_dtensor", "Megatron-FSDP"),
    ]
    refused = [what for bad, what in checks if bad]
    if refused:
        return f"{where}: a Megatron GPT with {', '.join(refused)}: not supported yet"
    return None


def read_save(
    path: str | Path, *, within_memory: bool = False, on_read: Callable[[int, int], None] | None = None,
    placed: Placement | None = None, weights: bool = True, states: tuple[str, ...] = STATES, tensors: bool = True,
) -> MegatronSave:
    """Read the Megatron-LM save at ``path`` (a save folder or one ``iter_<N>`` folder) whole.

    ``within_memory``: first refuse a save whose tensors need more memory than this machine has available
    (:func:`refuse_unless_it_fits`), so that the run says so at once rather than being killed hours into the read.
    Unset, as a read-back of an output the same run made asks: no check.

    ``on_read``: told ``(bytes read, bytes in all)`` as each stored tensor is read (:func:`stored_bytes`: the total),
    so that a save that takes minutes to read shows how far it is.

    ``placed``: where each tensor goes as it is read (:class:`Placement`); by default (:class:`Gathered`) into the
    global tensors the save returned holds. One of the caller's (the verify stage's comparison,
    :class:`osdpipe.verify.megatron.Compared`) takes them instead, and the save returned holds no tensors: its
    ``model`` and ``optim`` are empty.

    ``weights``: read the model's weights (the module's copy, in the training dtype). ``False`` for a reader that
    serves the fp32 master weights in their place (a PyTorch job's state, :class:`~osdpipe.io.formats.megatron_source.
    MegatronReader`): that copy is then neither read, nor held (``model`` is empty), nor counted against the memory
    available. A save without optimizer state has nothing else, and its weights are read whatever this says.

    ``states``: the optimizer's states read (of :data:`STATES`, in that order), the rest neither read, held nor
    counted; ``("param",)``: the fp32 masters alone, what a Hugging Face folder of the save holds.

    ``tensors=False``: the save described, not read: its tensors are the global shapes on the meta device, and what
    is read is ``common.pt``, ``.metadata`` and the param groups (a few small items): what working out a conversion's
    config asks of a save it reads whole once the run starts. The checks that need the tensors' bytes (a bucket's
    layout, a tied copy's state) are the run's; RNG states and extra state are left out.

    Raises:
        InputError: one line naming the file and what to do: a missing or damaged file, a model or sharding
            osdpipe does not read yet, a save larger than the memory available.
    """
    folder = iteration_folder(path)
    _check_backend(folder)
    common = read_common(folder)
    args = common["args"]
    if (why := refused_model(args, folder)) is not None:
        raise InputError(why)
    sharding = optimizer_sharding(common, folder)
    weights = weights or sharding is None
    checkpoint = DcpCheckpoint(str(folder), None)
    states = tuple(s for s in STATES if s in states)
    if within_memory:
        refuse_unless_it_fits(checkpoint, folder, weights=weights, states=states)
    if on_read is not None:
        checkpoint.on_read = _counted(on_read, stored_bytes(checkpoint, weights=weights, states=states))
    gpt = gpt_of(args)
    shapes = layout.global_shapes(gpt)
    _refuse_unknown_tensors(checkpoint, shapes)
    if not tensors:
        return _described(folder, common, sharding, checkpoint, shapes, weights, states)
    placement = placed if placed is not None else Gathered()
    placement.expect(shapes)
    if weights:
        _expect(checkpoint, list(shapes))
        for key, shape in shapes.items():
            placement.whole(key, None, _whole(checkpoint, key, shape))
    notes: tuple[str, ...] = ()
    if sharding is None:
        pass  # the weights alone (args.no_save_optim): no optimizer state to read
    elif sharding == "fully_reshardable":
        _expect(checkpoint, [f"optimizer.state.{s}.{key}" for key in shapes for s in states])
        for key, shape in shapes.items():
            for s in states:
                placement.whole(key, s, _whole(checkpoint, f"optimizer.state.{s}.{key}", shape))
    elif sharding == "fully_sharded_model_space":
        _expect(checkpoint, [f"optimizer.state.{FS_STATES[s]}.{key}" for key in shapes for s in states])
        for key, shape in shapes.items():
            for s in states:
                placement.whole(key, s, _unflattened(checkpoint, f"optimizer.state.{FS_STATES[s]}.{key}", shape))
    else:
        notes = _from_buckets(checkpoint, gpt, args, folder, placement, states)
    checkpoint.expect([])  # what was fetched ahead and not read is let go
    rng, extra = {}, {}
    for flat in checkpoint.metadata.state_dict_metadata:
        if (m := RNG.fullmatch(flat)) is not None:
            rng[(int(m[1]), int(m[2]))] = _stored(checkpoint, flat)
        elif "._extra_state/shard_" in flat:
            extra[flat] = _stored(checkpoint, flat)
    gathered = isinstance(placement, Gathered)
    return _assembled(folder, common, sharding, checkpoint, shapes, model=placement.model if gathered else {},
                      optim=placement.states(shapes, states) if gathered and sharding is not None else {},
                      rng=rng, extra_state=extra, notes=notes)


def _described(
    folder: Path, common: dict[str, Any], sharding: str | None, checkpoint: DcpCheckpoint,
    shapes: dict[str, tuple[int, ...]], weights: bool, states: tuple[str, ...],
) -> MegatronSave:
    """:func:`read_save`'s save with ``tensors=False``: every tensor of its global shape on the meta device."""
    def meta(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    model = {k: meta(shape, checkpoint.ref(k).torch_dtype) for k, shape in shapes.items()} if weights else {}
    optim = {k: {s: meta(shape) for s in states} for k, shape in shapes.items()} if sharding is not None else {}
    return _assembled(folder, common, sharding, checkpoint, shapes, model=model, optim=optim)


def _assembled(
    folder: Path, common: dict[str, Any], sharding: str | None, checkpoint: DcpCheckpoint,
    shapes: dict[str, tuple[int, ...]], **tensors: Any,
) -> MegatronSave:
    """The :class:`MegatronSave` of the save in ``folder`` around what was read of it (``tensors``: its ``model``,
    ``optim`` and the rest of its fields as read); its param groups, the few small items they are, read here."""
    args = common["args"]
    return MegatronSave(
        folder=folder,
        iteration=int(common.get("iteration", args.get("iteration", 0))),
        args=args,
        sharding=sharding,
        param_groups=_groups_with_keys(_saved_groups(checkpoint, common, sharding), shapes, folder)
        if sharding is not None else [],
        scheduler=common.get("opt_param_scheduler"),
        common=common,
        gbuf_dtypes=_gbuf_dtypes(checkpoint),
        release=folder.name == RELEASE,
        **tensors,
    )


def _saved_groups(checkpoint: DcpCheckpoint, common: dict[str, Any], sharding: str | None) -> list[dict] | None:
    """The optimizer's param groups as saved (their hyperparameters and ``step``; no parameters listed): in common.pt
    for a model-space save, else in the first model-parallel domain's optimizer item that holds them."""
    if sharding != "dp_reshardable":
        return (common.get("optimizer") or {}).get("optimizer", {}).get("param_groups")
    args = common["args"]
    tp, pp = int(args["tensor_model_parallel_size"]), int(args["pipeline_model_parallel_size"])
    for pp_rank, tp_rank in ((p, t) for p in range(pp) for t in range(tp)):
        index = layout.dp_group_index(tp, tp_rank, pp_rank)
        groups = (_byte_item(checkpoint, f"optimizer.distributed.dp_group_idx_{index}.optimizer") or {})
        if groups.get("param_groups") is not None:
            return groups["param_groups"]
    return None


def _gbuf_dtypes(checkpoint: DcpCheckpoint) -> str | None:
    """A ``dp_reshardable`` save's gradient buffer's dtypes as its bucket keys spell them; ``None``: it has none."""
    return next((m[3] for f in checkpoint.metadata.state_dict_metadata if (m := _BUCKET.fullmatch(f))), None)


def _counted(on_read: Callable[[int, int], None], total: int) -> Callable[[int], None]:
    """What a :class:`DcpCheckpoint` tells of each tensor it reads, summed and passed on with the ``total``."""
    done = 0

    def read(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        on_read(done, total)

    return read


def _refuse_unknown_tensors(checkpoint: DcpCheckpoint, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse a save holding a weight (or a model-space optimizer state of one) that the layout of its ``args`` does
    not have, naming it: read without it, the output would lack a weight its job needs while every check, comparing
    what was read, passed. :func:`refused_model` names the features it knows; this catches the rest."""
    unknown = []
    for flat, item in checkpoint.metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata) or _BUCKET.fullmatch(flat):
            continue
        state = _MODEL_SPACE_STATE.fullmatch(flat)
        if (state[2] if state else flat) not in shapes:
            unknown.append(flat)
    if unknown:
        shown = ", ".join(sorted(unknown)[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        raise InputError(
            f"{checkpoint.path}: holds {shown}, which the GPT its common.pt's args describe has no place for: "
            "not supported yet"
        )


def _check_backend(folder: Path) -> None:
    meta = folder / "metadata.json"
    if not meta.is_file():
        raise InputError(f"{folder} holds no metadata.json; it is not a Megatron dist_checkpointing save")
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except ValueError:
        raise InputError(f"{meta} is damaged (not JSON); re-copy the save folder") from None
    if backend != "torch_dist":
        raise InputError(f"{meta}: sharded_backend {backend!r}; osdpipe reads torch_dist saves, not yet this one")


def sharding_type(common: dict[str, Any], folder: Path) -> str:
    """How the save's distributed optimizer is sharded, as ``common.pt`` says it.

    Raises:
        InputError: a sharding type (or a non-distributed optimizer) osdpipe does not read yet.
    """
    said = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    said = said or (common.get("optimizer") or {}).get("param_state_sharding_type")
    if said is None:
        raise InputError(f"{folder}: no distributed optimizer state (a non-distributed optimizer): not supported yet")
    if said not in SHARDING_TYPES:
        raise InputError(f"{folder}: the optimizer is saved {said!r}: not supported yet (osdpipe reads "
                         f"{' and '.join(SHARDING_TYPES)})")
    return said


def optimizer_sharding(common: dict[str, Any], folder: Path) -> str | None:
    """How the save's distributed optimizer is sharded (:func:`sharding_type`); ``None``: the save holds the weights
    alone (``args.no_save_optim``: Megatron-LM's ``--no-save-optim``, and every ``release`` save osdpipe writes), and
    a job that loads it starts its optimizer fresh.

    Raises:
        InputError: a sharding type (or a non-distributed optimizer) osdpipe does not read yet.
    """
    return None if common["args"].get("no_save_optim") else sharding_type(common, folder)


def stored_bytes(checkpoint: DcpCheckpoint, *, weights: bool = True, states: tuple[str, ...] = STATES) -> int:
    """The bytes of every tensor the save's ``.metadata`` lists (the model's, the optimizer's, a ``dp_reshardable``
    save's buckets with the few elements of padding between their parameters): what reading it whole holds.
    ``weights`` and ``states``: those :func:`read_save` reads (without the model's weights, some states)."""
    return sum(math.prod(item.size) * item.properties.dtype.itemsize
               for flat, item in checkpoint.metadata.state_dict_metadata.items()
               if isinstance(item, TensorStorageMetadata)
               and (_state_of(flat) in states if flat.startswith(OPTIMIZER) else weights))


def _state_of(flat: str) -> str | None:
    """Which of :data:`STATES` optimizer item ``flat`` stores (a model-space state, a bucket's); ``None``: neither."""
    if (bucket := _BUCKET.fullmatch(flat)) is not None:
        return bucket[5]
    if (state := _MODEL_SPACE_STATE.fullmatch(flat)) is not None:
        return _STATE_NAMED[state[1]]
    return None


def refuse_unless_it_fits(
    checkpoint: DcpCheckpoint, folder: Path | RemotePath, *, weights: bool = True, states: tuple[str, ...] = STATES
) -> None:
    """Refuse, in one line, a save whose tensors (:func:`stored_bytes`) need more memory than this machine has
    available (:func:`osdpipe.core.memory.available_bytes`): a Megatron conversion holds the save whole, and such a run
    can only end killed for memory, after reading for as long as the save is large. The figure is less than the run
    holds (the output's largest parameter or bucket being written or read back, the reader's buffers and Python's own
    come on top): a save that passes may still not fit, one that fails never does. ``weights`` and ``states``: what
    :func:`read_save` reads of it."""
    need, free = stored_bytes(checkpoint, weights=weights, states=states), memory.available_bytes()
    if free is None or need <= free:
        return
    if weights and states == STATES:
        what = "this save whole"
    else:
        what = f"this save's {'weights and ' if weights else ''}optimizer states ({', '.join(states)})"
    raise InputError(f"{folder}: reading {what} takes {need / 1e9:.1f} GB of memory, and this machine has "
                     f"{free / 1e9:.1f} GB available (MemAvailable and SwapFree, or its cgroup's limit); a Megatron "
                     "conversion holds the save in memory, not streamed yet: run it on a machine with more memory")


def _expect(checkpoint: DcpCheckpoint, keys: list[str]) -> None:
    """Tell ``checkpoint`` the tensor items about to be read whole, in order: in object storage their items are
    fetched ahead, each file's neighbours as one request (:meth:`DcpCheckpoint.expect`); locally nothing happens. A
    key the save lacks is left to the read, which names it."""
    stored = checkpoint.metadata.state_dict_metadata
    checkpoint.expect(
        (key, 0, math.prod(checkpoint.ref(key).shape)) for key in keys if key in stored and checkpoint.is_tensor(key)
    )


def _whole(checkpoint: DcpCheckpoint, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor item ``key`` read whole, in the global ``shape`` the model's args give it."""
    if key not in checkpoint.metadata.state_dict_metadata:
        raise InputError(f"{checkpoint.path} has no item {key}; it is not the GPT its common.pt's args describe")
    ref = checkpoint.ref(key)
    if tuple(ref.shape) != tuple(shape):
        raise InputError(f"{checkpoint.path}: {key} is {tuple(ref.shape)}, its args make it {tuple(shape)}")
    return checkpoint.read_range(key, 0, math.prod(ref.shape)).reshape(shape).clone()


def _unflattened(checkpoint: DcpCheckpoint, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor item ``key`` of a ``fully_sharded_model_space`` save, stored as flattened chunks (the module's notes),
    put back in the global ``shape`` the model's args give it."""
    if key not in checkpoint.metadata.state_dict_metadata:
        raise InputError(f"{checkpoint.path} has no item {key}; it is not the GPT its common.pt's args describe")
    md = checkpoint.metadata.state_dict_metadata[key]
    size = tuple(md.size)
    cuts, flat = size[:-1], size[-1] if size else 0
    if len(cuts) != len(shape) or any(c <= 0 or g % c for g, c in zip(shape, cuts)) or \
            math.prod(g // c for g, c in zip(shape, cuts)) != flat:
        raise InputError(f"{checkpoint.path}: {key} is {size}, not the flattened chunks of a {tuple(shape)} tensor; "
                         "it is not the GPT its args describe")
    if sum(math.prod(c.sizes) for c in md.chunks) != math.prod(size):
        raise InputError(f"{checkpoint.path}: the stored parts of {key} do not cover it; re-copy the save folder")
    chunk = tuple(g // c for g, c in zip(shape, cuts))
    data = checkpoint.read_range(key, 0, math.prod(size)).reshape(*cuts, *chunk)
    axes = len(shape)
    return data.permute(*(i + k * axes for i in range(axes) for k in (0, 1))).reshape(shape).clone()


def _byte_item(checkpoint: DcpCheckpoint, name: str, flat: str | None = None) -> Any:
    """The object Megatron saved as ShardedObject ``name`` (stored as ``<name>/shard_<offset>_<shape>``; ``flat``:
    that stored key, where a name has several shards), or ``None``."""
    if flat is None:
        flat = next((f for f in checkpoint.metadata.state_dict_metadata if f.startswith(f"{name}/shard_")), None)
    if flat is None:
        return None
    raw = checkpoint.stored(flat)
    if raw is None:
        raise InputError(f"{checkpoint.path}: {flat} is stored transformed (compressed): not supported yet")
    value = load_inert_bytes(raw, DESCRIBED, what=f"{checkpoint.path}'s item {flat}")
    return value[0] if isinstance(value, list) and len(value) == 1 else value  # a ShardedObject's one-element list


def _stored(checkpoint: DcpCheckpoint, flat: str) -> bytes:
    raw = checkpoint.stored(flat)
    if raw is None:
        raise InputError(f"{checkpoint.path}: {flat} is stored transformed (compressed): not supported yet")
    return raw


def _from_buckets(
    checkpoint: DcpCheckpoint, gpt: layout.Gpt, args: dict[str, Any], folder: Path, placement: Placement,
    wanted: tuple[str, ...],
) -> tuple[str, ...]:
    """A ``dp_reshardable`` optimizer's ``wanted`` states, each bucket's parameters handed to ``placement`` piece by
    piece (each element of every global tensor once); and a note where the last stage's copy of a tied embedding
    holds state unequal to the first stage's.

    Megatron keeps the two copies equal (their gradients are summed before either steps), so they differ only in a save
    that something else wrote or changed. The first stage's is the one converted, as Megatron's own model-space save
    keeps it; the note says the copy's was not, so that the loss is not silent."""
    tp, pp, dp = (int(args[k]) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                         "data_parallel_size"))
    vpp = layout.virtual_stages(args)
    shapes = layout.global_shapes(gpt)
    filled = {key: torch.zeros(shape, dtype=torch.bool) for key, shape in shapes.items()}
    buckets: dict[tuple[int, int, int], dict[str, str]] = {}
    for flat in checkpoint.metadata.state_dict_metadata:
        if (m := _BUCKET.fullmatch(flat)) is not None:
            buckets.setdefault((int(m[1]), int(m[2]), int(m[4])), {})[m[5]] = flat
    if any(gbuf >= vpp for _, gbuf, _ in buckets):  # one gradient buffer per model chunk
        raise InputError(f"{folder}: the optimizer has several gradient buffers per model chunk: not supported yet")
    unequal: dict[str, int] = {}  # state -> elements of the tied copy that differ from the first stage's
    numels = {(p, t): layout.rank_numel(gpt, tp, pp, t, p, vpp) for p in range(pp) for t in range(tp)}  # once a rank
    # the first stage's embedding is placed before the last stage's copy is compared with it
    for pp_rank, tp_rank, chunk in ((p, t, c) for p in range(pp) for t in range(tp) for c in range(vpp)):
        index = layout.dp_group_index(tp, tp_rank, pp_rank)
        where = f"model-parallel domain {index}" + (f", model chunk {chunk}" if vpp > 1 else "")
        params = layout.local_parameters(gpt, tp, pp, tp_rank, pp_rank, vpp, chunk)
        how = layout.bucketing(args, dp, pp_rank, chunk, numels[pp_rank, tp_rank])
        laid = layout.buckets(params, dp, how)
        held_buckets = sorted(b for i, g, b in buckets if (i, g) == (index, chunk))
        if len(held_buckets) > len(laid):
            said = f"buckets of {how.size} elements" if how.size is not None else "one bucket"
            raise InputError(f"{folder}: the optimizer's gradient buffer of {where} is cut into "
                             f"{len(held_buckets)} buckets where its args lay out {len(laid)} ({said}: "
                             "overlap_grad_reduce, ddp_bucket_size, ddp_num_buckets); it is not the job its args "
                             "describe")
        if held_buckets != list(range(len(laid))):
            raise InputError(f"{folder}: the optimizer state of {where} is missing "
                             f"buckets (it holds {held_buckets} of {len(laid)}); re-copy the save folder")
        by_name = {p.name: p for p in params}
        for b, bucket in enumerate(laid):
            states = buckets[(index, chunk, b)]
            if set(states) != set(STATES):
                raise InputError(f"{folder}: the optimizer state of {where}, bucket {b} "
                                 "is missing; re-copy the save folder")
            for state, flat in states.items():
                if state not in wanted:
                    continue
                held = math.prod(checkpoint.ref(flat).shape)
                if held != bucket.data_end:
                    raise InputError(f"{folder}: {flat} holds {held} elements, the bucket of its parameters "
                                     f"{bucket.data_end}; it is not the GPT its args describe")
                data = checkpoint.read_range(flat, 0, bucket.data_end)
                for name, start, stop in bucket.entries:
                    local = by_name[name]
                    for key, box, block in _blocks(data[start:stop].view(local.shape), local):
                        if local.tied_copy:  # the tied embedding's state is the first stage's
                            if differ := placement.tied_copy(key, state, box, block):
                                unequal[state] = unequal.get(state, 0) + differ
                        else:
                            placement.block(key, state, box, block)
                            filled[key][box] = True
    missing = [key for key, done in filled.items() if not bool(done.all())]
    if missing:
        raise InputError(f"{folder}: no optimizer state for parts of {', '.join(missing[:3])}; re-copy the save")
    counted = ", ".join(f"{n} element{'s' * (n > 1)} of {state}" for state, n in unequal.items())
    notes = () if not unequal else (
        f"{folder}: the last pipeline stage's copy of the tied word embedding holds optimizer state unequal to the "
        f"first stage's ({counted}), which Megatron keeps equal: the first stage's is converted, the copy's left out",
    )
    return notes


def _blocks(local: torch.Tensor, param: layout.LocalParameter) -> Iterator[tuple[str, Box, torch.Tensor]]:
    """Each piece of a local parameter's state ``local``: its key, its box in the global tensor and its block of
    ``local`` shaped as that box."""
    for piece in param.pieces:
        box = tuple(slice(a, b) for a, b in piece.box)
        yield piece.key, box, local[piece.local_start : piece.local_stop].reshape([b - a for a, b in piece.box])


def _groups_with_keys(
    groups: list[dict[str, Any]] | None, shapes: dict[str, tuple[int, ...]], folder: Path
) -> list[dict[str, Any]]:
    """The param groups with the sharded keys each holds: Megatron's default rule puts 1-D parameters (norms,
    biases) in the group without weight decay (``wd_mult`` 0) and the rest in the other; the saved groups do not list
    their parameters."""
    if not groups:
        raise InputError(f"{folder}: the optimizer's param groups are missing; re-copy the save folder")
    decays = [g for g in groups if float(g.get("wd_mult", 1.0)) != 0.0]
    no_decay = [g for g in groups if float(g.get("wd_mult", 1.0)) == 0.0]
    if len(decays) != 1 or len(no_decay) > 1:
        raise InputError(f"{folder}: {len(groups)} param groups beyond Megatron's default two (weight decay and "
                         "none): not supported yet")
    out = []
    for group in groups:
        one_dim = float(group.get("wd_mult", 1.0)) == 0.0
        keys = sorted(k for k, shape in shapes.items() if layout.without_weight_decay(k, tuple(shape)) == one_dim)
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": keys})
    return out

