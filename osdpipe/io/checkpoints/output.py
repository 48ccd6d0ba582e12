"""Writing a whole checkpoint: each target rank's model,
optimizer and the entries carried over, as its layout lays them out.

A layout (:mod:`osdpipe.io.checkpoints.torchtitan`, :mod:`osdpipe.io.checkpoints.accelerate`)
says *where* each part goes; this module does the writing they share:

* ``rank_local``: one file per target rank, ``{"model": model.state_dict()
  as local tensors, "optim": the optimizer state as today, ...every other
  entry}``, loadable with ``torch.load(weights_only=True)``
  (:func:`write_rank_file`; :func:`osdpipe.load_rank_local` loads both parts);
* ``dcp``: DCP checkpoints as the framework saves them, every model and
  optimizer tensor cut in the dim-0 pieces the target world writes
  (:func:`write_dcp`): the model's weights as ``RowShard`` pieces under every
  name ``model.state_dict()`` gives them, its buffers whole, the optimizer
  nested or flattened (``flatten_optimizer_state_dict``, torchtitan's), and
  each carried item as it is stored in the source, its bytes copied;
* files beside the checkpoint's DCP directories, copied byte for byte (:func:`copy_files`).

What a conversion carries over is read once, on the first reading rank, and
travels with the source's metadata (:class:`CarriedData`), so every rank can
write it without the input at hand.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass, replace
from math import prod
from pathlib import Path
from typing import Any

import torch

from osdpipe.core.compare import diff
from osdpipe.core.state_paths import put_at
from osdpipe.io import torchfile
from osdpipe.io.checkpoints.base import CarriedData, Carrying
from osdpipe.io.digest import tensor_digests, tensor_sha256
from osdpipe.io.formats import dcp_writer
from osdpipe.io.formats.base import WEIGHTS, InputError, RankFiles, load_written, write_torch_file
from osdpipe.io.formats.rank_local import rank_file_name
from osdpipe.io.remote_input import as_path
from osdpipe.io.safetensors_out import TensorSpec, write_safetensors
from osdpipe.io.weights import model_state_dict
from osdpipe.io.whole_rank_file import MODEL_PART, OPTIMIZER_PART
from osdpipe.layout.model_keys import KeyMap, gather, key_rows_within, rows_of
from osdpipe.layout.ranges import chunk_bounds
from osdpipe.layout.tree import ModuleTree


def read_carried(checkpoint: Any, carrying: Carrying) -> CarriedData:
    """Read what ``carrying`` names from the DCP checkpoint ``checkpoint``
    (:class:`~osdpipe.io.formats.dcp_reader.DcpCheckpoint`), unpickling nothing it can copy."""
    data = CarriedData()
    for flat in carrying.items:
        if flat in carrying.item_tensors:
            data.tensors[flat] = checkpoint.read_item(flat)
        elif (raw := checkpoint.stored(flat)) is not None:
            data.raw[flat] = raw
        else:  # stored transformed (compressed): its bytes mean nothing without DCP's transform
            data.values[flat] = checkpoint.read_item(flat)
    return data


@dataclass(frozen=True)
class RankParts:
    """What one target rank writes of a whole checkpoint.

    Attributes:
        optimizer: the optimizer's state dict as rekey keyed it (param IDs for ``rank_local``, FQNs for ``dcp``).
        weights: this rank's pieces of each parameter's weights, by canonical FQN (dim-0 rows for ``dcp``).
        buffers: the model's buffers, whole.
        carrying: what the source holds besides, and where.
        carried: its bytes and values.
    """

    optimizer: dict[str, Any]
    weights: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    carrying: Carrying
    carried: CarriedData


# ---------------------------------------------------------------------------- rank_local


def carried_values(carrying: Carrying, data: CarriedData) -> dict[str, Any]:
    """Every carried item as its value, nested as the checkpoint saved it:
    what a ``rank_local`` file holds besides the model and the optimizer.

    Raises:
        InputError: an item holds objects ``torch.load(weights_only=True)`` refuses (a rank file must load so); its
            bytes can only be carried as they are, which a ``dcp`` output does.
    """
    out: dict[str, Any] = {}
    for flat, path in zip(carrying.items, carrying.item_paths):
        if flat in data.tensors:
            value = data.tensors[flat]
        elif flat in data.values:
            value = data.values[flat]
        else:
            try:
                value = torch.load(io.BytesIO(data.raw[flat]), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - said in one line below
                raise InputError(
                    f"{carrying.source}: the entry {flat} holds objects torch.load(weights_only=True) refuses "
                    f"({str(exc).strip().splitlines()[0][:120]}); "
                    "a rank file must load so: set output.format=dcp, which carries it as stored"
                ) from None
        put_at(out, carrying.written_path(path), value)
    return out


def rank_parts(keyed: Any, writer: Any) -> RankParts:
    """What one target rank writes of a whole checkpoint laid out as ``writer``
    (:class:`~osdpipe.io.checkpoints.base.CheckpointLayout`) lays it out, from its keyed product
    (:class:`osdpipe.run.products.Keyed`)."""
    meta = keyed.source.meta
    return RankParts(
        keyed.state_dict, keyed.weights or {}, meta.buffers, writer.adopt(meta.carried.carrying), meta.carried.carried
    )


def rank_file_content(parts: RankParts, tree: ModuleTree) -> dict[str, Any]:
    """What a whole checkpoint's ``rank_<r>.pt`` holds:
    model (``model.state_dict()`` as local tensors), optimizer and every carried entry."""
    whole = {MODEL_PART: model_state_dict(parts.weights, parts.buffers, tree), OPTIMIZER_PART: parts.optimizer}
    for name, value in carried_values(parts.carrying, parts.carried).items():
        if name in whole:
            raise InputError(
                f"{parts.carrying.source}: an entry of its own is called {name!r}, "
                f"which a rank file keeps the {name} in; rename it"
            )
        whole[name] = value
    return whole


def carried_file_name(carrying: Carrying) -> str | None:
    """The file a layout with no place for another framework's entries keeps them in (``<framework>.pt``,
    beside the output's own files), where the carried items are another framework's (:attr:`Carrying.under`);
    ``None``: they are not."""
    return None if carrying.under is None or not carrying.items else f"{carrying.under}.pt"


def carried_file_content(parts: RankParts) -> dict[str, Any]:
    """What :func:`carried_file_name` holds: every carried item as its value, nested as the source saved it."""
    return carried_values(replace(parts.carrying, under=None), parts.carried)


def write_rank_file(parts: RankParts, staging: Path, rank: int, tree: ModuleTree) -> RankFiles:
    """Target rank ``rank``'s ``rank_<r>.pt`` of a whole checkpoint (:func:`rank_file_content`)."""
    # its digests: osdpipe.io.digest.tensor_digests
    return write_torch_file(rank_file_content(parts, tree), staging / rank_file_name(rank))


def rank_file_differences(directory: Path, parts: RankParts, rank: int, tree: ModuleTree) -> list[str]:
    """Where rank ``rank``'s file under ``directory`` differs from what it should hold, bitwise."""
    return full_file_differences(directory, {rank_file_name(rank): rank_file_content(parts, tree)})


def full_file_differences(directory: Path, wanted: dict[str, Any]) -> list[str]:
    """Where each file under ``directory`` differs from what it should hold
    (``wanted``: file name -> content), bitwise."""
    problems = []
    for name, content in wanted.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        problems += [f"{path}: {p.removeprefix('state_dict')}" for p in diff(load_written(path), content, limit=3)]
    return problems


def model_digests(pieces: dict[str, Any], where: str, known: dict[int, str] | None = None) -> dict[str, str]:
    """sha256 of every model tensor this rank wrote (:func:`model_pieces`), keyed ``<file>:model.<name>``: for partial
    checks, beside the optimizer's (``known``: see :func:`osdpipe.io.digest.tensor_sha256`). A key written as several
    blocks of rows has one per block, ``<name>@<first row>``."""
    out = {}
    for name, value in pieces.items():
        if isinstance(value, dcp_writer.RowShard):
            assert value.local is not None
            for (first, _), block in zip(value.blocks, value.local):
                label = f"{where}:model.{name}" if len(value.blocks) == 1 else f"{where}:model.{name}@{first}"
                out[label] = tensor_sha256(block, known)
        else:
            out[f"{where}:model.{name}"] = tensor_sha256(value, known)
    return out


# ---------------------------------------------------------------------------- dcp


def model_pieces(parts: RankParts | None, tree: ModuleTree, world_size: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s ``model.state_dict()`` as DCP is to save it: each parameter's weights as its dim-0 rows (every
    name of a tied weight), each key a state-dict hook makes of parameters' rows as the blocks of it that are this
    rank's rows, each buffer whole. ``parts`` are this rank's own (``None``: only the plan is needed)."""
    out: dict[str, Any] = {}
    for name in tree.state_names:
        param, key = tree.resolve(name), tree.key_map(name)
        if param is not None:
            local = None if parts is None else parts.weights[param.fqn]
            if param.shape:
                out[name] = dcp_writer.row_shard(param.shape, getattr(torch, param.dtype), world_size, rank, local)
            else:  # a 0-dim parameter: whole on every rank, kept by one
                out[name] = (
                    local if local is not None else torch.empty((), dtype=getattr(torch, param.dtype), device="meta")
                )
        elif key is not None:
            out[name] = _key_blocks(key, None if parts is None else parts.weights, tree, world_size, rank)
        else:
            buffer = tree.resolve_buffer(name)
            assert buffer is not None, f"{name} is neither a parameter nor a buffer of the model's tree"
            out[name] = (
                parts.buffers[buffer.fqn]
                if parts is not None
                else torch.empty(buffer.shape, dtype=getattr(torch, buffer.dtype), device="meta")
            )
    return out


def _key_blocks(
    key: KeyMap, weights: dict[str, torch.Tensor] | None, tree: ModuleTree, world_size: int, rank: int
) -> dcp_writer.RowShard:
    """The blocks of ``key``'s rows that are rank ``rank``'s dim-0 rows of the parameters it is made of
    (``weights``: the rank's, ``None`` for the plan)."""
    blocks: list[tuple[int, int, torch.Tensor | None]] = []
    for fqn in dict.fromkeys(run.param for run in key.runs):
        first, last, _ = chunk_bounds(rows_of(tree.param(fqn).shape), world_size, rank)
        for key_row, rows, offset in key_rows_within(key, fqn, first, last):
            blocks.append((key_row, rows, None if weights is None else _rows(weights[fqn], offset, rows)))
    blocks.sort(key=lambda b: b[0])
    local = None if weights is None else tuple(b[2] for b in blocks)
    return dcp_writer.RowShard(key.shape, tuple((b[0], b[1]) for b in blocks), getattr(torch, key.dtype), local)


def _rows(weights: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Rows ``[first, first + count)`` of a rank's weights, as a tensor of their own: made as it is written where the
    weights are (:func:`osdpipe.io.torchfile.part_of`)."""
    row = prod(weights.shape[1:])
    flat = torchfile.part_of(weights.reshape(-1), first * row, (first + count) * row)
    return flat.view(count, *weights.shape[1:])


def flattened(optimizer: dict[str, Any]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict as
    ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` gives it.

    ``state.<fqn>.<name>`` for each state, ``param_groups.<fqn>.<hyperparameter>``
    for each parameter of each group (the ``params`` list itself is not kept).
    """
    out: dict[str, Any] = {}
    for fqn, entries in optimizer["state"].items():
        for name, value in entries.items():
            out[f"state.{fqn}.{name}"] = value
    for group in optimizer.get("param_groups", []):
        for fqn in group["params"]:
            for name, value in group.items():
                if name != "params":
                    out[f"param_groups.{fqn}.{name}"] = value
    return out


def carried_state(carrying: Carrying, data: CarriedData | None) -> dict[str, Any]:
    """The carried items nested as the source saved them,
    each as it is stored there (``data`` ``None``: only the plan is needed)."""
    out: dict[str, Any] = {}
    for flat, path in zip(carrying.items, carrying.item_paths):
        if flat in carrying.item_tensors:
            shape, dtype = carrying.item_tensors[flat]
            value = (
                data.tensors[flat]
                if data is not None
                else torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            )
        elif data is not None and flat in data.values:
            value = data.values[flat]
        else:
            value = dcp_writer.Stored(None if data is None else data.raw[flat])
        put_at(out, carrying.written_path(path), value)
    return out


def write_dcp(
    directory: Path,
    name: str,
    state_of: Callable[[int, bool], dict[str, Any]],
    rank: int,
    world_size: int,
    shared: dict[str, Any],
) -> tuple[list[Any], dict[str, str], dict[int, str]]:
    """Write rank ``rank``'s items of the DCP checkpoint ``directory / name``,
    whose rank ``r`` saves ``state_of(r, local)``.

    The global plan is made once per process (``shared``), from every rank's
    plan (``local=False``: shapes, no bytes). Returns this rank's write
    results (for :func:`finish_dcp`), the sha256 of each file it wrote, by
    its path under ``directory``, and of each tensor storage it wrote (by
    ``UntypedStorage._cdata``: the tensors' digests, taken on the way).
    """
    key = ("dcp plan", name)
    if key not in shared:
        shared[key] = dcp_writer.plan(lambda r: state_of(r, False), world_size)
    results, digests, storages = dcp_writer.write_rank(directory / name, state_of(rank, True), rank, shared[key])
    return results, {f"{name}/{file}": digest for file, digest in sorted(digests.items())}, storages


def finish_dcp(directory: Path, name: str, shared: dict[str, Any], results: list[list[Any]]) -> dict[str, str]:
    """Write ``directory / name``'s ``.metadata`` once every rank has written
    (``results``: each rank's, in rank order)."""
    return {f"{name}/.metadata": dcp_writer.finish(directory / name, shared[("dcp plan", name)], results)}


def model_differences(
    checkpoint: Any, key: str | None, parts: RankParts, tree: ModuleTree, world_size: int, rank: int
) -> list[str]:
    """Where rank ``rank``'s rows of the model items of a DCP checkpoint
    (at the top level, or under ``key``) differ from its pieces, bitwise.

    Parameters and hook-made keys by the blocks of rows the rank wrote;
    buffers (and 0-dim parameters), which one rank keeps, on rank 0.
    """
    problems = []
    for name, want in model_pieces(parts, tree, world_size, rank).items():
        flat = name if key is None else f"{key}.{name}"
        if flat not in checkpoint.metadata.state_dict_metadata:
            problems.append(f"{checkpoint.path}: {flat} is missing")
            continue
        if isinstance(want, dcp_writer.RowShard):
            assert want.local is not None
            width = prod(want.shape[1:])
            for (first, rows), block in zip(want.blocks, want.local):
                if rows:
                    got = checkpoint.read_range(flat, first * width, (first + rows) * width)
                    problems += [
                        f"{checkpoint.path}: {p}"
                        for p in diff(got, block.reshape(-1), path=f"{flat} (rows from {first})", limit=1)
                    ]
        elif rank == 0:
            problems += [f"{checkpoint.path}: {p}" for p in diff(checkpoint.read_item(flat), want, path=flat, limit=1)]
    return problems


def one_dcp_differences(
    directory: Path,
    parts: RankParts,
    rank: int,
    world_size: int,
    tree: ModuleTree,
    opened: dict[str, Any],
    optimizer_key: str,
) -> list[str]:
    """Where target rank ``rank``'s part of a whole checkpoint laid out as one DCP directory (``parts.carrying.folder``:
    the model under ``parts.carrying.model_key``, the optimizer under ``optimizer_key``, the carried items beside)
    differs from ``parts``, bitwise.

    torchtitan's step folder and PyTorch's ``{"model", "optim"}`` are both such a directory. ``opened`` keeps the
    checkpoint (metadata read, structure checked) across ranks.
    """
    from osdpipe.io.formats.dcp import optimizer_differences
    from osdpipe.io.formats.dcp_reader import DcpCheckpoint, DcpReader

    if "checkpoint" not in opened:
        opened["checkpoint"] = checkpoint = DcpCheckpoint(str(directory / parts.carrying.folder), None)
        if parts.carrying.optimizer:
            opened["optimizer"] = reader = DcpReader(checkpoint.path, optimizer_key, checkpoint)
            opened["optimizer meta"] = reader.meta()
    checkpoint = opened["checkpoint"]
    problems = model_differences(checkpoint, parts.carrying.model_key, parts, tree, world_size, rank)
    if parts.carrying.optimizer:
        problems += optimizer_differences(
            opened["optimizer"], opened["optimizer meta"], parts.optimizer, tree=tree, world_size=world_size, rank=rank
        )
    elif any(p[0] == optimizer_key for p in checkpoint.paths.values()):
        problems.append(f"{checkpoint.path}: holds optimizer state, but the model-only source has none")
    if rank == 0:
        problems += carried_differences(checkpoint, parts.carrying, parts.carried)
    return problems


def carried_differences(checkpoint: Any, carrying: Carrying, data: CarriedData) -> list[str]:
    """Where a DCP checkpoint's carried items differ from the source's:
    the same stored bytes, or the same value (tensors)."""
    problems = []
    for flat in carrying.items:
        written = carrying.written_flat(flat)
        if written not in checkpoint.metadata.state_dict_metadata:
            problems.append(f"{checkpoint.path}: the carried entry {written} is missing")
        elif flat in data.raw:
            if checkpoint.stored(written) != data.raw[flat]:
                problems.append(f"{checkpoint.path}: the carried entry {written} is not stored as the source stores it")
        else:
            want = data.tensors.get(flat, data.values.get(flat))
            problems += [
                f"{checkpoint.path}: {p}" for p in diff(checkpoint.read_item(written), want, path=written, limit=1)
            ]
    return problems


def file_differences(directory: Path, carrying: Carrying) -> list[str]:
    """The carried files under ``directory`` that are missing or not byte for byte the source's."""
    problems = []
    for rel in carrying.files:
        got = directory / rel
        if not got.is_file():
            problems.append(f"{got} is missing")
        elif got.read_bytes() != (as_path(carrying.source) / rel).read_bytes():
            problems.append(f"{got} is not byte for byte {as_path(carrying.source) / rel}")
    for rel, data in carrying.made.items():
        got = directory / rel
        if not got.is_file():
            problems.append(f"{got} is missing")
        elif got.read_bytes() != data:
            problems.append(f"{got} is not what osdpipe made of {carrying.source}")
    return problems


def optimizer_digests(optimizer: dict[str, Any], where: str, known: dict[int, str] | None = None) -> dict[str, str]:
    """sha256 of every optimizer state tensor's bytes, keyed ``<file>:<param key>.<state name>``:
    for partial checks, beside the model's."""
    return {f"{where}:{k}": v for k, v in tensor_digests(optimizer, known).items()}


# ---------------------------------------------------------------------------- files


def copy_files(carrying: Carrying, staging: Path, under: str = "") -> dict[str, str]:
    """Copy every carried file into ``staging / under`` byte for byte, and write every file the source's layout made
    (:attr:`Carrying.made`); their sha256 by path under ``staging``, taken as they are written."""
    out = {}
    for rel, data in carrying.made.items():
        target = staging / under / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "xb") as dst:
            dst.write(data)
        out[str(Path(under) / rel) if under else rel] = hashlib.sha256(data).hexdigest()
    for rel in carrying.files:
        out[str(Path(under) / rel) if under else rel] = copy_file(as_path(carrying.source) / rel, staging / under / rel)
    return out


def copy_file(source: Any, target: Path) -> str:
    """Copy ``source`` (a local or :class:`~osdpipe.io.remote_input.RemotePath`) to the new file ``target`` byte for
    byte; its sha256, taken as it is written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with source.open("rb") as src, open(target, "xb") as dst:
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            dst.write(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------- safetensors


def export_safetensors(
    reader: Any,
    meta: Any,
    tree: ModuleTree,
    directory: Path,
    max_shard_size: int | None,
    to_hf: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> dict[str, str]:
    """The model's full weights as safetensors files (:mod:`osdpipe.io.safetensors_out`), into ``directory``.

    Keyed as the model's own ``state_dict()`` keys them: each parameter once,
    under its first name (a tied weight's other names are left out, as
    ``save_pretrained`` leaves them), each key a state-dict hook makes of
    parameters' rows, then each buffer, in the order of ``model.state_dict()``.
    ``to_hf``: the model's own conversion to Hugging Face's names and layout
    (:func:`osdpipe.layout.models.hf_adapter`), applied a key at a time; its names
    and shapes are learned on the ``meta`` device first. Each tensor is read
    whole from the source when the writer asks for it and dropped once
    written: one tensor in memory at a time.

    Returns:
        Every file written, with its sha256.
    """
    specs: list[TensorSpec] = []
    read: dict[str, Callable[[], torch.Tensor]] = {}

    def add(name: str, shape: tuple[int, ...], dtype: torch.dtype, value: Callable[[], torch.Tensor]) -> None:
        if to_hf is None:
            specs.append(TensorSpec(name, shape, dtype))
            read[name] = value
            return
        for hf_name, hf_value in to_hf({name: torch.empty(shape, dtype=dtype, device="meta")}).items():
            specs.append(TensorSpec(hf_name, tuple(hf_value.shape), hf_value.dtype))
            read[hf_name] = lambda n=name, h=hf_name, v=value: to_hf({n: v()})[h].contiguous()

    for name in tree.state_names:
        param, key = tree.resolve(name), tree.key_map(name)
        if param is not None:
            if name != param.fqn:
                continue  # a tied weight is stored once, under its first name
            add(
                name,
                param.shape,
                getattr(torch, param.dtype),
                lambda p=param: reader.read_range(p.fqn, WEIGHTS, 0, p.numel).reshape(p.shape),
            )
        elif key is not None:  # rows of parameters, as the model's own state_dict() makes the key
            made_of = {r.param for r in key.runs}
            add(
                name,
                key.shape,
                getattr(torch, key.dtype),
                lambda k=key, m=made_of: gather(
                    k,
                    {f: reader.read_range(f, WEIGHTS, 0, tree.param(f).numel).reshape(tree.param(f).shape) for f in m},
                ),
            )
        elif name in meta.buffers:
            buffer = meta.buffers[name]
            add(name, tuple(buffer.shape), buffer.dtype, lambda b=buffer: b)
    return write_safetensors(directory, specs, lambda spec: read[spec.name](), max_shard_size=max_shard_size)
