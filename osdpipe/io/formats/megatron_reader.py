"""A Megatron-LM ``torch_dist`` save read by ranges: every state of every sharded key, where its save keeps it.

The save's model and optimizer are DCP items (:mod:`osdpipe.io.formats.megatron` names them), read here as any DCP
checkpoint is read: by ranges of its memory-mapped chunks (:meth:`~osdpipe.io.formats.dcp_reader.DcpCheckpoint.
read_parts`), never whole. What a range of a sharded key's state is depends on how the distributed optimizer saved it:

* the weights (:data:`~osdpipe.layout.ranges.WEIGHTS`) and ``fully_reshardable``'s states are global items of the
  key's own shape: a range of the key is the same range of its item;
* ``fully_sharded_model_space`` stores each of its key's TP/PP chunks flattened on an axis of its own: a range of the
  key is a run of each chunk it crosses;
* ``dp_reshardable`` keeps the states in gradient buckets, each a flat buffer of its (PP, TP) rank's local
  parameters (:mod:`osdpipe.layout.megatron_grid`): where every element of every key is is the buckets' segments met
  the other way (:func:`osdpipe.layout.flat_buffer.held_by`). The last stage's copy of a tied embedding is a replica:
  the first stage's state is read, as Megatron's own model-space save keeps it.

So a conversion holds the ranges it copies, whatever the save's size (``runtime.memory_budget``). The reader is a
:class:`~osdpipe.io.formats.base.SourceReader` keyed by the sharded keys, the names the model's tree gives the
parameters (:func:`osdpipe.layout.models.megatron_gpt`), with the fp32 master as state ``param``, Adam's moments, and
each param group's ``step`` as every parameter's; the weights are the model part
(:class:`osdpipe.io.checkpoints.megatron.SavedWeights`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import cached_property
from itertools import product
from pathlib import Path
from typing import Any

import torch

from osdpipe.core.compare import differing_bits
from osdpipe.io.formats.base import InputError, SourceMeta, TensorRef
from osdpipe.io.formats.dcp_reader import DcpCheckpoint
from osdpipe.io.formats.megatron import (
    _BUCKET,
    FS_STATES,
    RELEASE,
    RNG,
    _check_backend,
    _groups_with_keys,
    _refuse_unknown_tensors,
    _saved_groups,
    iteration_folder,
    optimizer_sharding,
    read_common,
    refused_model,
)
from osdpipe.layout import megatron as gpt_layout
from osdpipe.layout.boxes import BoxSpans, flat_overlap, intersect, range_boxes, relative
from osdpipe.layout.flat_buffer import Held, held_by, held_in, segments
from osdpipe.layout.megatron_grid import OPTIMIZER_STATES, Grid, param_segments
from osdpipe.layout.ranges import WEIGHTS, Segment


class MegatronFiles:
    """A Megatron-LM save opened: ``common.pt`` read (inertly), its ``.metadata`` and structure checked, and where
    each sharded key's states are in its items worked out; no tensor read.

    Raises:
        InputError: one line naming the file: a missing or damaged file, a model or sharding osdpipe does not read
            yet, an item the GPT its args describe has no place for, a bucket that is not its args' layout.
    """

    def __init__(self, path: str | Path) -> None:
        self.folder = folder = iteration_folder(path)
        _check_backend(folder)
        self.common = read_common(folder)
        self.args: dict[str, Any] = self.common["args"]
        if (why := refused_model(self.args, folder)) is not None:
            raise InputError(why)
        #: How the distributed optimizer saved its state; ``None``: the save holds the weights alone.
        self.sharding = optimizer_sharding(self.common, folder)
        self.checkpoint = DcpCheckpoint(str(folder), None)
        self.gpt = gpt_layout.gpt_of(self.args)
        self.shapes = gpt_layout.global_shapes(self.gpt)
        _refuse_unknown_tensors(self.checkpoint, self.shapes)
        self.iteration = int(self.common.get("iteration", self.args.get("iteration", 0)))
        self.release = folder.name == RELEASE
        self._tied_copies: dict[str, list[Held]] = {}  # a tied embedding's copy on the last stage (dp_reshardable)

    @property
    def has_rng(self) -> bool:
        """Whether the save holds its (PP, TP) ranks' RNG states (Megatron-LM's ``--no-save-rng`` leaves them out)."""
        return any(RNG.fullmatch(flat) for flat in self.checkpoint.metadata.state_dict_metadata)

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
    def ep(self) -> int:
        return int(self.args.get("expert_model_parallel_size") or 1)

    @property
    def vpp(self) -> int:
        return gpt_layout.virtual_stages(self.args)

    @cached_property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups (hyperparameters and ``step``), each with the sharded keys it holds."""
        if self.sharding is None:
            return []
        return _groups_with_keys(_saved_groups(self.checkpoint, self.common, self.sharding), self.shapes, self.folder)

    def item(self, key: str, state: str) -> str:
        """The DCP item that holds ``state`` of sharded key ``key`` (a model-space save's; the weights' own)."""
        if state == WEIGHTS:
            return key
        stored = FS_STATES[state] if self.sharding == "fully_sharded_model_space" else state
        return f"optimizer.state.{stored}.{key}"

    def pieces(self, key: str, state: str, start: int, stop: int) -> list[tuple[str, int, int]]:
        """Elements ``[start, stop)`` of ``state`` of sharded key ``key``, where the save keeps them, in order:
        ``(item, start in its flattened view, length)`` each."""
        if state == WEIGHTS or self.sharding == "fully_reshardable":
            return [(self.item(key, state), start, stop - start)]
        if self.sharding == "fully_sharded_model_space":
            return self._chunk_runs(key, state, start, stop)
        return [(f"{p.where}.{state}", p.offset, p.length) for p in held_in(self._buckets[key], start, stop)]

    @cached_property
    def _buckets(self) -> dict[str, list[Held]]:
        """Where every element of every sharded key is in a ``dp_reshardable`` save's buckets (by bucket item); each
        bucket checked against the layout its args give (:mod:`osdpipe.layout.megatron_grid`)."""
        grid = Grid(self.gpt, self.tp, self.pp, self.dp, self.vpp, "dp_reshardable",
                    tuple((k, self.args[k]) for k in gpt_layout.DDP_ARGS if k in self.args), ep=self.ep)
        stored: dict[tuple[int, int, int], set[int]] = {}  # (chained optimizer, dp_group_idx, gbuf) -> buckets
        items: dict[tuple[int, int, int, int], str] = {}
        for flat in self.checkpoint.metadata.state_dict_metadata:
            if (m := _BUCKET.fullmatch(flat)) is not None:
                where = (int(m[1] or 0), int(m[2]), int(m[3]))
                stored.setdefault(where, set()).add(int(m[5]))
                items[(*where, int(m[5]))] = flat.rsplit(".", 1)[0]
        if any(gbuf >= self.vpp for _, _, gbuf in stored):  # one gradient buffer per model chunk
            raise InputError(f"{self.folder}: the optimizer has several gradient buffers per model chunk: "
                             "not supported yet")
        containers, tied_copies = [], []
        boxes: dict[str, list[tuple[str, int, tuple[tuple[int, int], ...]]]] = {}
        for pp_rank, tp_rank, ep_rank, expert, chunk in product(
                range(self.pp), range(self.tp), range(self.ep), grid.buffers(), range(self.vpp)):
            if ep_rank and not expert:
                continue  # the dense buffers are every expert-parallel rank's alike
            index, chain = grid.optimizer_index(pp_rank, tp_rank, ep_rank, expert), grid.chain_index(expert) or 0
            where = (f"model-parallel domain {index}" + (" of the experts' optimizer" if expert else "")
                     + (f", model chunk {chunk}" if self.vpp > 1 else ""))
            laid = grid.buckets(pp_rank, tp_rank, chunk, ep_rank, expert)
            held = sorted(stored.get((chain, index, chunk), ()))
            if len(held) > len(laid):
                raise InputError(f"{self.folder}: the optimizer's gradient buffer of {where} is cut into {len(held)} "
                                 f"buckets where its args lay out {len(laid)} (overlap_grad_reduce, ddp_bucket_size, "
                                 "ddp_num_buckets); it is not the job its args describe")
            if held != list(range(len(laid))):
                raise InputError(f"{self.folder}: the optimizer state of {where} is missing buckets (it holds "
                                 f"{held} of {len(laid)}); re-copy the save folder")
            params = {p.name: p for p in grid.params(pp_rank, tp_rank, chunk, ep_rank)}
            first = {p.name: p.pieces for p in grid.params(pp_rank, 0, chunk, ep_rank)}
            # a replica is read from one place: TP rank 0's copy of what every TP rank holds whole (a norm), the
            # first stage's of a tied embedding
            replica = {name for name, p in params.items() if p.tied_copy or (tp_rank and first.get(name) == p.pieces)}
            copies = {name for name, p in params.items() if p.tied_copy}
            for b, bucket in enumerate(laid):
                base = items[(chain, index, chunk, b)]
                for state in OPTIMIZER_STATES:
                    flat = f"{base}.{state}"
                    if flat not in self.checkpoint.metadata.state_dict_metadata:
                        raise InputError(f"{self.folder}: the optimizer state of {where}, bucket {b}, holds no "
                                         f"{state}; re-copy the save folder")
                    if (held_numel := math.prod(self.checkpoint.ref(flat).shape)) != bucket.data_end:
                        raise InputError(f"{self.folder}: {flat} holds {held_numel} elements, the bucket of its "
                                         f"parameters {bucket.data_end}; it is not the GPT its args describe")
                for part in segments(bucket, 0, bucket.data_end):
                    param = params[part.fqn]
                    if part.fqn in replica or part.start or part.length != param.numel:
                        continue  # a part of a parameter is read by its runs (no bucket cuts one in megatron-core)
                    row = math.prod(param.shape[1:])
                    for piece in param.pieces:
                        box = tuple(_clipped_rows(piece.box, self.shapes[piece.key]))
                        if all(lo < hi for lo, hi in box):
                            boxes.setdefault(piece.key, []).append((base, part.dest + piece.local_start * row, box))
                containers.append((base, [
                    Segment(s.fqn, s.start, s.length, s.dest + part.dest)
                    for part in segments(bucket, 0, bucket.data_end) if part.fqn not in replica
                    for s in param_segments(params[part.fqn], self.shapes, part.start, part.start + part.length)]))
                tied_copies.append((base, [
                    Segment(s.fqn, s.start, s.length, s.dest + part.dest)
                    for part in segments(bucket, 0, bucket.data_end) if part.fqn in copies
                    for s in param_segments(params[part.fqn], self.shapes, part.start, part.start + part.length)]))
        self._tied_copies = held_by(tied_copies)
        self._stored_boxes = boxes
        where_is = held_by(containers)
        for key, shape in self.shapes.items():
            covered = sum(p.length for p in where_is.get(key, ()))
            if covered != math.prod(shape):
                raise InputError(f"{self.folder}: no optimizer state for parts of {key}; re-copy the save folder")
        return where_is

    @cached_property
    def column_blocks(self) -> dict[str, BoxSpans]:
        """Each key a ``dp_reshardable`` save's buckets store as column blocks (a weight split over TP along its last
        axis), whole, every element of it: its blocks by the flat ranges they reach, each standing for ``(bucket item,
        offset in it)``. A range of such a key is copied block by block (:meth:`SavedState._assembled`): read as
        runs, it is a run per row. None for another sharding (its items are the keys' own)."""
        if self.sharding != "dp_reshardable":
            return {}
        self._buckets  # noqa: B018 - lays out the buckets, and the blocks beside them
        out = {}
        for key, blocks in self._stored_boxes.items():
            shape = self.shapes[key]
            whole = sum(math.prod(hi - lo for lo, hi in box) for _, _, box in blocks) == math.prod(shape)
            if whole and any(box[-1] != (0, shape[-1]) for _, _, box in blocks):
                out[key] = BoxSpans(shape, ((box, (base, offset)) for base, offset, box in blocks))
        return out

    @cached_property
    def notes(self) -> tuple[str, ...]:
        """What reading found that a conversion's report should say: where the last pipeline stage's copy of a tied
        embedding (a ``dp_reshardable`` save keeps it in that stage's bucket) holds state unequal to the first
        stage's. Megatron keeps the two equal (their gradients are summed before either steps), so they differ only
        in a save that something else wrote or changed; the first stage's is the one converted, as Megatron's own
        model-space save keeps it, and the note says the copy's was not, so that the loss is not silent."""
        if self.sharding != "dp_reshardable":
            return ()
        self._buckets  # noqa: B018 - lays out the buckets, and the copies beside them
        unequal: dict[str, int] = {}
        for key, pieces in self._tied_copies.items():
            for state in OPTIMIZER_STATES:
                for p in pieces:
                    for lo in range(0, p.length, _COMPARED):  # a window at a time: the vocabulary may be large
                        n = min(_COMPARED, p.length - lo)
                        copy = self.checkpoint.read_range(f"{p.where}.{state}", p.offset + lo, p.offset + lo + n)
                        first = torch.cat(read_pieces(self, key, state, p.start + lo, p.start + lo + n))
                        if differ := differing_bits(copy, first):
                            unequal[state] = unequal.get(state, 0) + differ
        if not unequal:
            return ()
        counted = ", ".join(f"{n} element{'s' * (n > 1)} of {state}" for state, n in unequal.items())
        return (f"{self.folder}: the last pipeline stage's copy of the tied word embedding holds optimizer state "
                f"unequal to the first stage's ({counted}), which Megatron keeps equal: the first stage's is "
                "converted, the copy's left out",)

    def _chunk_runs(self, key: str, state: str, start: int, stop: int) -> list[tuple[str, int, int]]:
        """A ``fully_sharded_model_space`` state's range: the item stores each TP/PP chunk of the key flattened on
        its last axis (``(f_0, .., f_n, chunk)``), so the range is a run of each chunk box it crosses."""
        item = self.item(key, state)
        shape = self.shapes[key]
        if item not in self.checkpoint.metadata.state_dict_metadata:
            raise InputError(f"{self.folder} has no item {item}; it is not the GPT its common.pt's args describe")
        size = tuple(self.checkpoint.metadata.state_dict_metadata[item].size)
        cuts = size[:-1]
        if len(cuts) != len(shape) or any(c <= 0 or g % c for g, c in zip(shape, cuts)) or \
                math.prod(g // c for g, c in zip(shape, cuts)) != (size[-1] if size else 0):
            raise InputError(f"{self.folder}: {item} is {size}, not the flattened chunks of a {tuple(shape)} tensor; "
                             "it is not the GPT its args describe")
        edge = tuple(g // c for g, c in zip(shape, cuts))
        numel = math.prod(edge)
        runs = []
        for linear, index in enumerate(product(*(range(c) for c in cuts))):
            box = tuple((i * e, (i + 1) * e) for i, e in zip(index, edge))
            for lo, hi in flat_overlap(shape, box, start, stop):
                runs.append((lo, (item, linear * numel + _box_index(shape, box, lo), hi - lo)))
        return [run for _, run in sorted(runs)]


def _box_index(shape: tuple[int, ...], box: tuple[tuple[int, int], ...], flat: int) -> int:
    """Where element ``flat`` of a tensor of ``shape`` (inside ``box``) is in the box's own row-major order."""
    coords = []
    for n in reversed(shape):
        flat, index = divmod(flat, n)
        coords.append(index)
    local = 0
    for c, (lo, hi) in zip(reversed(coords), box):
        local = local * (hi - lo) + c - lo
    return local


#: How many elements of a tied embedding's copy :attr:`MegatronFiles.notes` compares at a time.
_COMPARED = 1 << 22


class SavedState:
    """A Megatron-LM save's optimizer as a :class:`~osdpipe.io.formats.base.SourceReader` keyed by the sharded keys:
    per key its fp32 master (``param``), ``exp_avg`` and ``exp_avg_sq`` (fp32, global shape) and its group's
    ``step``; the param groups as saved, each listing its keys. ``compared``: its metadata says where a tied
    embedding's copy holds state unequal to the first stage's (:attr:`MegatronFiles.notes`, which reads both); else it
    reads no tensor (a description of the save: the config's look at it)."""

    def __init__(self, files: MegatronFiles, *, compared: bool = True) -> None:
        self.files, self.compared = files, compared

    def meta(self) -> SourceMeta:
        files = self.files
        state: dict[str, dict[str, Any]] = {}
        groups = []
        for group in files.param_groups:
            if "step" not in group:
                raise InputError(f"{files.folder}: a param group of the optimizer holds no step; re-copy the save")
            groups.append(group)
            for key in group["params"]:
                state[key] = {"step": torch.tensor(float(group["step"]), dtype=torch.float32)}
                state[key].update({s: TensorRef(files.shapes[key], "float32") for s in OPTIMIZER_STATES})
        notes = list(files.notes) if self.compared else []
        return SourceMeta(state=state, param_groups=groups, state_dtype="float32", notes=notes)

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        return {(key, name): self.read_range(key, name, 0, math.prod(self.files.shapes[key])).reshape(
            self.files.shapes[key]) for key, name in items}

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        parts = self.read_parts(fqn, name, start, stop)
        return parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.empty(0)

    def read_parts(self, fqn: str, name: str, start: int, stop: int) -> list[torch.Tensor]:
        if self._across_rows(fqn, start, stop):
            return [self._assembled(fqn, name, start, stop)]
        return read_pieces(self.files, fqn, name, start, stop)

    def _across_rows(self, key: str, start: int, stop: int) -> bool:
        """Whether the range crosses rows of a key stored as column blocks (:attr:`MegatronFiles.column_blocks`)."""
        return key in self.files.column_blocks and stop - start > self.files.shapes[key][-1]

    def _assembled(self, key: str, state: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``state`` of ``key`` as one tensor, copied block by block from the buckets
        (against :func:`~osdpipe.layout.boxes.range_boxes`): a range of a column-split weight crosses each TP rank's
        block once a row, which read as runs is a view per row."""
        shape, blocks = self.files.shapes[key], self.files.column_blocks[key]
        out = torch.empty(stop - start, dtype=torch.float32)
        at = 0
        for box in range_boxes(shape, start, stop):
            count = math.prod(hi - lo for lo, hi in box)
            held = out[at : at + count].view(tuple(hi - lo for lo, hi in box))
            for stored, (base, offset) in blocks.reaching(start + at, start + at + count):
                both = intersect(box, stored)
                if both is not None:
                    size = tuple(hi - lo for lo, hi in stored)
                    block = self.files.checkpoint.read_range(f"{base}.{state}", offset, offset + math.prod(size))
                    held[relative(both, box)] = block.view(size)[relative(both, stored)]
            at += count
        return out

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        """The pages under the range let go: each item's from the first element read to the last, at once (a column
        block's whole, where the range crosses its rows)."""
        if self._across_rows(fqn, start, stop):
            for stored, (base, offset) in self.files.column_blocks[fqn].reaching(start, stop):
                numel = math.prod(hi - lo for lo, hi in stored)
                self.files.checkpoint.release(f"{base}.{name}", offset, offset + numel)
            return
        reach: dict[str, tuple[int, int]] = {}
        for item, at, length in self.files.pieces(fqn, name, start, stop):
            first, last = reach.get(item, (at, at + length))
            reach[item] = (min(first, at), max(last, at + length))
        for item, (first, last) in reach.items():
            self.files.checkpoint.release(item, first, last)

    def expect(self, reads: Iterable[tuple[str, str, int, int]]) -> None:
        self.files.checkpoint.expect(
            (item, at, at + length) for fqn, name, start, stop in reads
            for item, at, length in self.files.pieces(fqn, name, start, stop))


def _clipped_rows(box: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``box`` with its rows cut to the tensor's (a vocabulary padded further than the model's)."""
    (a, b), rest = box[0], box[1:]
    return ((min(a, shape[0]), min(b, shape[0])), *rest)


def read_pieces(files: MegatronFiles, key: str, state: str, start: int, stop: int) -> list[torch.Tensor]:
    """Elements ``[start, stop)`` of ``state`` of sharded key ``key`` as the save's chunks hold them, in order."""
    return [part for item, at, length in files.pieces(key, state, start, stop)
            for part in files.checkpoint.read_parts(item, at, at + length)]
