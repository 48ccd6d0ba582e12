"""A test oracle: a Megatron-LM ``torch_dist`` save read whole into memory, every tensor global, without Megatron.

The product reads a save by ranges through the stage loop (:mod:`osdpipe.io.formats.megatron_reader`); this reader is
an independent one, kept for the tests and benchmarks to hold the product's output against: it gathers every weight,
fp32 master and moment of a small save into global tensors (a ``dp_reshardable`` save's buckets put back piece by
piece by :mod:`osdpipe.layout.megatron`'s rules), with its param groups, iteration, scheduler, RNG states and
``_extra_state``. It holds the whole save in memory and checks nothing of the machine's: for small saves only. The
save's names and ``common.pt`` are the product's (:mod:`osdpipe.io.formats.megatron`); the format is described there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from osdpipe.core.compare import differing_bits
from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.dcp_reader import DcpCheckpoint
from osdpipe.io.formats.megatron import (
    _BUCKET,
    FS_STATES,
    RELEASE,
    RNG,
    STATES,
    _check_backend,
    _groups_with_keys,
    _refuse_unknown_tensors,
    _saved_groups,
    gpt_of,
    iteration_folder,
    optimizer_sharding,
    read_common,
    refused_model,
)
from osdpipe.layout import megatron as layout


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
    #: What reading found that a reader should say (a tied copy unequal to the first stage's): a line each.
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
    or a caller's own (:class:`megatron_oracle_check.Compared`: held against a source, and let go)."""

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

    def states(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's states by sharded key, in the order of ``shapes`` and :data:`STATES`."""
        return {key: {s: self._optim[(key, s)] for s in STATES} for key in shapes}


def read_save(path: str | Path, *, placed: Placement | None = None) -> MegatronSave:
    """Read the Megatron-LM save at ``path`` (a save folder or one ``iter_<N>`` folder) whole.

    ``placed``: where each tensor goes as it is read (:class:`Placement`); by default (:class:`Gathered`) into the
    global tensors the save returned holds. A comparison's own (:class:`megatron_oracle_check.Compared`) takes them
    instead, and the save returned holds no tensors: its ``model`` and ``optim`` are empty.

    Raises:
        InputError: one line naming the file: a missing or damaged file, a model or sharding this reader (as the
            product's) does not read.
    """
    folder = iteration_folder(path)
    _check_backend(folder)
    common = read_common(folder)
    args = common["args"]
    if (why := refused_model(args, folder)) is not None:
        raise InputError(why)
    sharding = optimizer_sharding(common, folder)
    checkpoint = DcpCheckpoint(str(folder), None)
    gpt = gpt_of(args)
    shapes = layout.global_shapes(gpt)
    _refuse_unknown_tensors(checkpoint, shapes)
    placement = placed if placed is not None else Gathered()
    placement.expect(shapes)
    _expect(checkpoint, list(shapes))
    for key, shape in shapes.items():
        placement.whole(key, None, _whole(checkpoint, key, shape))
    notes: tuple[str, ...] = ()
    if sharding is None:
        pass  # the weights alone (args.no_save_optim): no optimizer state to read
    elif sharding == "fully_reshardable":
        _expect(checkpoint, [f"optimizer.state.{s}.{key}" for key in shapes for s in STATES])
        for key, shape in shapes.items():
            for s in STATES:
                placement.whole(key, s, _whole(checkpoint, f"optimizer.state.{s}.{key}", shape))
    elif sharding == "fully_sharded_model_space":
        _expect(checkpoint, [f"optimizer.state.{FS_STATES[s]}.{key}" for key in shapes for s in STATES])
        for key, shape in shapes.items():
            for s in STATES:
                placement.whole(key, s, _unflattened(checkpoint, f"optimizer.state.{FS_STATES[s]}.{key}", shape))
    else:
        notes = _from_buckets(checkpoint, gpt, args, folder, placement)
    checkpoint.expect([])  # what was fetched ahead and not read is let go
    rng, extra = {}, {}
    for flat in checkpoint.metadata.state_dict_metadata:
        if (m := RNG.fullmatch(flat)) is not None:
            rng[(int(m[1]), int(m[2]))] = _stored(checkpoint, flat)
        elif "._extra_state/shard_" in flat:
            extra[flat] = _stored(checkpoint, flat)
    gathered = isinstance(placement, Gathered)
    return _assembled(folder, common, sharding, checkpoint, shapes, model=placement.model if gathered else {},
                      optim=placement.states(shapes) if gathered and sharding is not None else {},
                      rng=rng, extra_state=extra, notes=notes)


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


def _gbuf_dtypes(checkpoint: DcpCheckpoint) -> str | None:
    """A ``dp_reshardable`` save's gradient buffer's dtypes as its bucket keys spell them; ``None``: it has none."""
    return next((m[4] for f in checkpoint.metadata.state_dict_metadata if (m := _BUCKET.fullmatch(f))), None)


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
    """Tensor item ``key`` of a ``fully_sharded_model_space`` save, stored as flattened chunks
    (:mod:`osdpipe.io.formats.megatron`'s notes), put back in the global ``shape`` the model's args give it."""
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


def _stored(checkpoint: DcpCheckpoint, flat: str) -> bytes:
    raw = checkpoint.stored(flat)
    if raw is None:
        raise InputError(f"{checkpoint.path}: {flat} is stored transformed (compressed): not supported yet")
    return raw


def _from_buckets(
    checkpoint: DcpCheckpoint, gpt: layout.Gpt, args: dict[str, Any], folder: Path, placement: Placement
) -> tuple[str, ...]:
    """A ``dp_reshardable`` optimizer's states, each bucket's parameters handed to ``placement`` piece by
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
            if m[1] is not None:
                raise InputError(f"{folder}: an expert-parallel job's two optimizers: the oracle reads one")
            buckets.setdefault((int(m[2]), int(m[3]), int(m[5])), {})[m[6]] = flat
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
