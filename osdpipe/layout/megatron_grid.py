"""Where a Megatron GPT's elements lie on each rank of a TP x PP x DP grid, as the segments every layout is made of.

A rank of a Megatron-Core job holds, for each of its model chunks, its local parameters (boxes of the global sharded
keys: :func:`osdpipe.layout.megatron.local_parameters`) and its distributed optimizer's slice of each gradient bucket
(flat buffers cut over DP: :func:`osdpipe.layout.megatron.buckets`). The model's tree names its parameters by the
sharded keys, global over TP and PP (:func:`osdpipe.layout.models.megatron_gpt`), so both are
:class:`~osdpipe.layout.ranges.LocalTensor` of that tree, which is all the stages need:

* :func:`model_tensors`: every local parameter of the rank, parameter-shaped: what its model holds, and what its
  optimizer's param groups follow;
* :func:`written_tensors`: what the rank writes of a save: its share of its (PP, TP) rank's model boxes (the DP ranks
  share the writing, as Megatron writes one copy of a replicated box) holding the weights and, ``fully_reshardable``,
  the optimizer's states in model space; and ``dp_reshardable``, its DP slice of each bucket, holding the optimizer's
  states (the padding between parameters zero);
* :func:`item_chunks`: where each such tensor goes in the save: the DCP item, its global shape and its box.

Ranks are numbered as megatron-core numbers them by default (``tp-cp-ep-dp-pp``): TP fastest, then DP, then PP. The
vocabulary is padded for the grid's TP (:func:`osdpipe.layout.megatron.padded_vocab_size`); where that is more rows
than the model's tree holds, the rows past them are padding (zero), and where fewer, the tree's last rows are not
read. Pure functions of the dimensions: no torch, no files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from osdpipe.layout import megatron as gpt_layout
from osdpipe.layout.boxes import Box, box_range_runs
from osdpipe.layout.flat_buffer import rank_slice, segments
from osdpipe.layout.megatron import Gpt, LocalParameter, Piece
from osdpipe.layout.ranges import WEIGHTS, LocalTensor, Segment

#: The distributed optimizer's states of each parameter, as its sharded keys name them (``param``: the fp32 master).
OPTIMIZER_STATES = ("param", "exp_avg", "exp_avg_sq")
#: The state name of a PyTorch optimizer's step counter, which Megatron keeps per param group.
STEP = "step"
#: The sharding types of the distributed optimizer a grid lays out (``None``: the weights alone, no optimizer).
SHARDINGS = ("dp_reshardable", "fully_reshardable")


@dataclass(frozen=True)
class Grid:
    """A Megatron GPT laid out on TP x PP x DP ranks, ``vpp`` model chunks per pipeline rank, its experts (a mixture
    of experts) over ``ep`` expert-parallel ranks.

    ``gpt``'s vocabulary is the one this grid's TP pads to. ``ddp`` holds Megatron-LM's ``args`` that cut a gradient
    buffer into buckets (:func:`osdpipe.layout.megatron.bucketing` reads them), ``sharding`` how the distributed
    optimizer saves its state (``None``: a save of the weights alone) and ``dtypes`` the gradient buffers'
    ``(param dtype, grad dtype)`` as a ``dp_reshardable`` save's keys spell it.

    Expert parallelism splits the DP ranks of each (PP, TP) rank (megatron-core's expert rank order, ``tp-ep-dp-pp``,
    with expert TP the TP): DP rank ``d`` holds the experts of expert-parallel rank ``d mod ep``, and is expert
    data-parallel rank ``d // ep`` of ``dp / ep``. With ``ep`` > 1 the experts are a second optimizer's (a
    ``ChainedOptimizer`` of the dense one and the experts'), their gradient buffer cut over the expert DP ranks; at
    ``ep`` 1 they are dense parameters like any other."""

    gpt: Gpt
    tp: int
    pp: int
    dp: int
    vpp: int = 1
    sharding: str | None = "dp_reshardable"
    ddp: tuple[tuple[str, Any], ...] = ()
    dtypes: str = "torch.float32, torch.float32"
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_parallel(self) -> bool:
        """Whether the experts are a second optimizer's, over the expert DP ranks (megatron-core: EP > 1)."""
        return self.ep > 1

    def ep_rank(self, dp_rank: int) -> int:
        """The expert-parallel rank of DP rank ``dp_rank``: whose experts it holds."""
        return dp_rank % self.ep

    def expert_dp(self) -> int:
        """The expert data-parallel ranks of each (PP, TP, EP) rank: what an expert buffer is cut over."""
        return self.dp // self.ep

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every sharded key's global shape on this grid (its padded vocabulary)."""
        return gpt_layout.global_shapes(self.gpt)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of global rank ``rank``: TP fastest, then DP, then PP."""
        rest, tp_rank = divmod(rank, self.tp)
        pp_rank, dp_rank = divmod(rest, self.dp)
        return pp_rank, dp_rank, tp_rank

    def params(self, pp_rank: int, tp_rank: int, chunk: int, ep_rank: int = 0) -> list[LocalParameter]:
        """Model chunk ``chunk``'s local parameters on (``pp_rank``, ``tp_rank``, ``ep_rank``), in
        ``named_parameters()`` order."""
        return gpt_layout.local_parameters(self.gpt, self.tp, self.pp, tp_rank, pp_rank, self.vpp, chunk, self.ep,
                                           ep_rank)  # fmt: skip

    def buffers(self) -> tuple[bool, ...]:
        """The gradient buffers of each model chunk, as whether each is the experts': the dense one, and with
        expert parallelism the experts' (megatron-core's ``expert_parallel_buffers``)."""
        return (False, True) if self.expert_parallel else (False,)

    def buckets(self, pp_rank: int, tp_rank: int, chunk: int, ep_rank: int = 0, expert: bool = False) -> list[Any]:
        """Model chunk ``chunk``'s gradient buckets on (``pp_rank``, ``tp_rank``, ``ep_rank``), as its job's DDP makes
        them: of its dense parameters over DP, or (``expert``) of its experts over the expert DP ranks."""
        held = gpt_layout.rank_numel(self.gpt, self.tp, self.pp, tp_rank, pp_rank, self.vpp, self.ep, ep_rank)
        how = gpt_layout.bucketing(dict(self.ddp), self.dp, pp_rank, chunk, held)
        mine = [p for p in self.params(pp_rank, tp_rank, chunk, ep_rank)
                if (p.expert and self.expert_parallel) == expert]  # fmt: skip
        return gpt_layout.buckets(mine, self.expert_dp() if expert else self.dp, how)

    def optimizer_index(self, pp_rank: int, tp_rank: int, ep_rank: int = 0, expert: bool = False) -> int:
        """The index of a model-parallel rank in the model-parallel group of its dense optimizer, or (``expert``) of
        its experts' optimizer, whose group is TP x EP x PP (megatron-core ``optimizer/__init__.py``): what a
        ``dp_reshardable`` save's ``dp_group_idx_<i>`` says."""
        if expert:
            return gpt_layout.dp_group_index(self.tp * self.ep, ep_rank * self.tp + tp_rank, pp_rank)
        return gpt_layout.dp_group_index(self.tp, tp_rank, pp_rank)

    def chain_index(self, expert: bool) -> int | None:
        """The place of the dense optimizer (or the experts') in the job's ``ChainedOptimizer``, which prefixes its
        ``dp_reshardable`` items (``chained_<i>.``); ``None``: one optimizer, no prefix (no expert parallelism)."""
        return int(expert) if self.expert_parallel else None

    def optimizer_prefix(self, pp_rank: int, tp_rank: int, ep_rank: int = 0, expert: bool = False) -> str:
        """What a ``dp_reshardable`` save's items of one distributed optimizer of one model-parallel rank begin with:
        the optimizer's place in the chain (:meth:`chain_index`) and the rank's index in its group
        (:meth:`optimizer_index`)."""
        chain = self.chain_index(expert)
        chained = "" if chain is None else f"chained_{chain}."
        return f"{chained}optimizer.distributed.dp_group_idx_{self.optimizer_index(pp_rank, tp_rank, ep_rank, expert)}"

    def bucket_item(self, pp_rank: int, tp_rank: int, chunk: int, bucket: int, ep_rank: int = 0,
                    expert: bool = False) -> str:
        """A ``dp_reshardable`` bucket's item, as the save keys it (each state's item is this, a dot and the state)."""
        return (f"{self.optimizer_prefix(pp_rank, tp_rank, ep_rank, expert)}.gbuf_idx_{chunk}.dtype_({self.dtypes})"
                f".bucket_idx_{bucket}")

    def bucket_dp(self, dp_rank: int, expert: bool) -> tuple[int, int]:
        """``(ranks, rank)`` a bucket of the dense or the experts' buffer is cut over, for DP rank ``dp_rank``."""
        return (self.expert_dp(), dp_rank // self.ep) if expert else (self.dp, dp_rank)


def grid_of(args: Mapping[str, Any], tp: int, pp: int, dp: int, vpp: int = 1, sharding: str | None = None,
            ep: int = 1) -> Grid:
    """The grid a job of Megatron-LM's ``args`` (its GPT, vocabulary, precision and buckets:
    :func:`osdpipe.layout.megatron.layout_args`) has on TP ``tp`` x PP ``pp`` x DP ``dp``, ``vpp`` model chunks per
    pipeline stage, EP ``ep``, its optimizer saved ``sharding`` (``None``: ``dp_reshardable``, Megatron-LM's
    default).

    Raises:
        ValueError: an EP that does not divide DP or the experts, in one line naming ``target.ep_size``.
    """
    args = dict(args)
    gpt = replace(gpt_layout.gpt_of(args), padded_vocab_size=gpt_layout.target_vocab(args, tp))
    if why := gpt_layout.ep_problem(gpt.num_experts, ep, dp):
        raise ValueError(why)
    ddp = tuple((k, args[k]) for k in gpt_layout.DDP_ARGS if k in args)
    return Grid(gpt, tp, pp, dp, vpp, sharding or "dp_reshardable", ddp, gpt_layout.gbuf_dtypes(args), ep)


def model_key(chunk: int, param: LocalParameter) -> str:
    """A local parameter's layout key: its model chunk and its name in it (each chunk numbers its layers from 0)."""
    return f"model{chunk}.{param.name}"


def param_segments(
    param: LocalParameter, shapes: Mapping[str, tuple[int, ...]], start: int = 0, stop: int | None = None
) -> list[Segment]:
    """Elements ``[start, stop)`` of a local parameter's flattened view as segments of the global keys it holds
    (``shapes``: each key's global shape in the model's tree), at their offset from ``start``.

    A piece's box past the rows the tree holds (a vocabulary padded further than the tree's) has no segment there:
    padding."""
    stop = param.numel if stop is None else stop
    row = math.prod(param.shape[1:])
    out: list[Segment] = []
    for piece in param.pieces:
        box = _clipped(piece.box, shapes[piece.key], piece.key)
        first = piece.local_start * row  # the piece's first element in the local parameter
        lo, hi = max(start, first), min(stop, first + math.prod(b - a for a, b in box))
        for at, length, offset in box_range_runs(shapes[piece.key], box, lo - first, hi - first) if lo < hi else ():
            out.append(Segment(piece.key, at, length, offset + lo - start))
    return out


def _clipped(box: Box, shape: tuple[int, ...], key: str) -> Box:
    """``box`` within a tensor of ``shape``: only its rows may reach past the tensor's (a vocabulary padded further)."""
    if len(box) != len(shape) or any(b > s for (_, b), s in zip(box[1:], shape[1:], strict=True)):
        raise ValueError(f"{key}: the grid's box {box} does not lie in the model's {shape}")
    (a, b), rest = box[0], box[1:]
    return ((min(a, shape[0]), min(b, shape[0])), *rest)


def model_tensors(grid: Grid, shapes: Mapping[str, tuple[int, ...]], rank: int) -> tuple[LocalTensor, ...]:
    """Every local parameter of rank ``rank``'s model chunks, in order, parameter-shaped (``shapes``: the tree's)."""
    pp_rank, dp_rank, tp_rank = grid.coordinates(rank)
    out = []
    for chunk in range(grid.vpp):
        for param in grid.params(pp_rank, tp_rank, chunk, grid.ep_rank(dp_rank)):
            out.append(_tensor(model_key(chunk, param), param, shapes, None))
    return tuple(out)


def _tensor(
    key: str, param: LocalParameter, shapes: Mapping[str, tuple[int, ...]], states: tuple[str, ...] | None
) -> LocalTensor:
    fqns = tuple(dict.fromkeys(p.key for p in param.pieces))
    return LocalTensor(key, fqns, param.shape, tuple(param_segments(param, shapes)), flat=False, states=states)


def writers(grid: Grid, pp_rank: int, tp_rank: int, ep_rank: int = 0) -> dict[str, int]:
    """Which DP rank of (``pp_rank``, ``tp_rank``) writes each model box of expert-parallel rank ``ep_rank`` (by
    layout key): the largest first, each to the DP rank that writes least so far, so that the DP ranks write about as
    much; the dense boxes first, over every DP rank (the same for every ``ep_rank``), then the experts', over the DP
    ranks that hold them. A save holds a box once: what another TP rank holds too (a norm, a row-parallel layer's
    bias, a router: whole on every TP rank) is TP rank 0's to write, and the last stage's copy of a tied embedding is
    none's (the first stage's is kept)."""
    first = {(c, p.name): p.pieces for c in range(grid.vpp) for p in grid.params(pp_rank, 0, c, ep_rank)}
    held = [(model_key(c, p), p.numel, p.expert) for c in range(grid.vpp)
            for p in grid.params(pp_rank, tp_rank, c, ep_rank)
            if not p.tied_copy and (tp_rank == 0 or first.get((c, p.name)) != p.pieces)]  # fmt: skip
    loads, out = [0] * grid.dp, {}
    for expert in (False, True):
        ranks = [d for d in range(grid.dp) if not expert or grid.ep_rank(d) == ep_rank]
        for key, numel, _ in sorted((h for h in held if h[2] == expert), key=lambda h: -h[1]):
            least = min(ranks, key=lambda d: loads[d])
            out[key] = least
            loads[least] += numel
    return out


def written_tensors(grid: Grid, shapes: Mapping[str, tuple[int, ...]], rank: int) -> tuple[LocalTensor, ...]:
    """What rank ``rank`` writes of a save laid out on ``grid`` (``shapes``: the tree's), each tensor one chunk of an
    item of the save (:func:`item_chunks`): its share of the model's boxes (:func:`writers`; a local parameter of
    several boxes, SwiGLU's gate and up, one each), holding the weights and, ``fully_reshardable``, the optimizer's
    states; ``dp_reshardable``, its slice of each bucket, holding the optimizer's states. Each holds its group's
    ``step`` too, as every optimizer's tensor does; the save keeps it in the param groups."""
    pp_rank, dp_rank, tp_rank = grid.coordinates(rank)
    ep_rank = grid.ep_rank(dp_rank)
    mine = writers(grid, pp_rank, tp_rank, ep_rank)
    optimizer = (*OPTIMIZER_STATES, STEP)
    boxed = (WEIGHTS, *optimizer) if grid.sharding == "fully_reshardable" else (WEIGHTS,)
    out = []
    for chunk in range(grid.vpp):
        params = grid.params(pp_rank, tp_rank, chunk, ep_rank)
        for param in params:
            if mine.get(model_key(chunk, param)) == dp_rank:
                for key, piece in _boxes(chunk, param):
                    held = _piece_segments(piece, shapes)
                    out.append(LocalTensor(key, (piece.key,), _extents(piece.box), tuple(held), flat=False,
                                           states=boxed))
        if grid.sharding != "dp_reshardable":
            continue
        by_name = {p.name: p for p in params}
        for expert, b, bucket, lo, hi in _bucket_slices(grid, pp_rank, tp_rank, chunk, dp_rank):
            held = [Segment(s.fqn, s.start, s.length, s.dest + part.dest)
                    for part in segments(bucket, lo, hi)
                    for s in param_segments(by_name[part.fqn], shapes, part.start, part.start + part.length)]
            fqns = tuple(dict.fromkeys(s.fqn for s in held))
            if not fqns:  # a slice of padding alone still has its item's range: zeros (it holds no parameter)
                fqns = tuple(dict.fromkeys(p.key for p in by_name[bucket.entries[0][0]].pieces))
            item = grid.bucket_item(pp_rank, tp_rank, chunk, b, ep_rank, expert)
            out.append(LocalTensor(item, fqns, (hi - lo,), tuple(held), flat=True, states=optimizer))
    return tuple(out)


def _bucket_slices(grid: Grid, pp_rank: int, tp_rank: int, chunk: int, dp_rank: int) -> list[tuple]:
    """DP rank ``dp_rank``'s slice of each gradient bucket of model chunk ``chunk`` that holds data, as
    ``(expert, index, bucket, start, stop)``: of the dense buffer's buckets, then (expert parallelism) of the
    experts', each cut over the ranks its buffer is (:meth:`Grid.bucket_dp`), at the bucket's data (the save holds
    the bucket cut there)."""
    out = []
    for expert in grid.buffers():
        ranks, rank = grid.bucket_dp(dp_rank, expert)
        for b, bucket in enumerate(grid.buckets(pp_rank, tp_rank, chunk, grid.ep_rank(dp_rank), expert)):
            lo, hi, _ = rank_slice(bucket, ranks, rank)
            hi = min(hi, bucket.data_end)
            if hi > lo:
                out.append((expert, b, bucket, lo, hi))
    return out


def _boxes(chunk: int, param: LocalParameter) -> list[tuple[str, Piece]]:
    """A local parameter's boxes, each with its layout key: the parameter's own where it is one box, else numbered."""
    key = model_key(chunk, param)
    if len(param.pieces) == 1:
        return [(key, param.pieces[0])]
    return [(f"{key}#{i}", piece) for i, piece in enumerate(param.pieces)]


def _extents(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def _piece_segments(piece: Piece, shapes: Mapping[str, tuple[int, ...]]) -> list[Segment]:
    """A box's elements, in its own row-major order, as segments of its key (past the tree's rows: padding)."""
    box = _clipped(piece.box, shapes[piece.key], piece.key)
    return [Segment(piece.key, at, length, offset)
            for at, length, offset in box_range_runs(shapes[piece.key], box, 0, math.prod(_extents(box)))]


@dataclass(frozen=True)
class Chunk:
    """A written tensor is box ``box`` of item ``item`` (global ``shape``) of the save."""

    item: str
    shape: tuple[int, ...]
    box: Box


def item_chunks(grid: Grid, rank: int) -> dict[str, Chunk]:
    """Where each of rank ``rank``'s :func:`written_tensors` goes in the save, by layout key: a model box, a box of its
    sharded key (the weights' item; a model-space state's is ``optimizer.state.<state>.<key>``); a bucket's slice, its
    range of the bucket's item (each state's is ``<item>.<state>``)."""
    pp_rank, dp_rank, tp_rank = grid.coordinates(rank)
    ep_rank = grid.ep_rank(dp_rank)
    shapes, mine = grid.shapes, writers(grid, pp_rank, tp_rank, ep_rank)
    out: dict[str, Chunk] = {}
    for chunk in range(grid.vpp):
        for param in grid.params(pp_rank, tp_rank, chunk, ep_rank):
            if mine.get(model_key(chunk, param)) == dp_rank:
                out.update({key: Chunk(p.key, shapes[p.key], p.box) for key, p in _boxes(chunk, param)})
        if grid.sharding != "dp_reshardable":
            continue
        for expert, b, bucket, lo, hi in _bucket_slices(grid, pp_rank, tp_rank, chunk, dp_rank):
            item = grid.bucket_item(pp_rank, tp_rank, chunk, b, ep_rank, expert)
            out[item] = Chunk(item, (bucket.data_end,), ((lo, hi),))
    return out


def is_bucket(chunk: Chunk) -> bool:
    """Whether ``chunk`` is a ``dp_reshardable`` bucket's range (else a box of a sharded key)."""
    return chunk.item.startswith(("optimizer.distributed.", "chained_"))


def chunk_extents(chunk: Chunk) -> tuple[int, ...]:
    """The shape of a chunk's box: the shape of the written tensor that fills it."""
    return _extents(chunk.box)


def chunk_states(grid: Grid, chunk: Chunk, weights_only: bool) -> tuple[str, ...]:
    """The states a chunk is written in, each an item of the save (:func:`state_item`): a model box's weights and,
    ``fully_reshardable``, the optimizer's states in model space; a bucket's optimizer states; the weights alone for
    a save without optimizer state."""
    optimizer = () if weights_only else OPTIMIZER_STATES
    if is_bucket(chunk):
        return optimizer
    return (WEIGHTS, *optimizer) if grid.sharding == "fully_reshardable" else (WEIGHTS,)


def state_item(chunk: Chunk, state: str) -> str:
    """The save's item that holds ``state`` of a :class:`Chunk`: the weights under the sharded key itself, a
    model-space optimizer state under ``optimizer.state.<state>.<key>``, a bucket's state under ``<item>.<state>``."""
    if is_bucket(chunk):
        return f"{chunk.item}.{state}"
    return chunk.item if state == WEIGHTS else f"optimizer.state.{state}.{chunk.item}"
