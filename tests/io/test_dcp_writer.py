"""osdpipe's own writer of DCP rank files (:func:`osdpipe.io.formats.dcp_writer.write_rank`):
DCP's layout, osdpipe's bytes.

In this process, no world: a small optimizer state cut along dim 0 for 3
ranks is written the way a conversion writes it (the global plan from
shapes, each rank's file, then ``.metadata``), and set against what
PyTorch's own ``FileSystemWriter`` writes for the same plan. PyTorch's
reader (``dcp.load``, no osdpipe code) must load both alike, every item's
bytes must be a ``torch.save`` archive that ``torch.load(weights_only=True)``
reads on its own, the digests must be the bytes' on disk, and a failure
while writing must leave no file behind.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import struct
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import digest_by_hand
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from osdpipe.core.compare import diff
from osdpipe.io import torchfile
from osdpipe.io.formats import dcp_writer

WORLD = 3
# 2 rows on 3 ranks: one rank holds none
SHAPES = {"embed.weight": (7, 5), "blocks.0.weight": (4, 4), "blocks.0.bias": (2,)}


def _full() -> dict:
    gen = torch.Generator().manual_seed(0)
    state = {
        fqn: {
            "step": torch.tensor(3.0),
            "exp_avg": torch.randn(shape, generator=gen),
            "exp_avg_sq": torch.rand(shape, generator=gen).to(torch.bfloat16),
        }
        for fqn, shape in SHAPES.items()
    }
    return {"state": state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(SHAPES)}]}


def _rank_state(full: dict, rank: int, local: bool) -> dict:
    """Rank ``rank``'s dim-0 rows as a conversion hands them to the writer
    (``local``: the rows themselves; else only their plan)."""
    state = {}
    for fqn, entries in full["state"].items():
        state[fqn] = {}
        for name, value in entries.items():
            if value.dim() == 0:
                state[fqn][name] = value
                continue
            piece = dcp_writer.row_shard(tuple(value.shape), value.dtype, WORLD, rank, None)
            ((first, count),) = piece.blocks
            rows = (value[first : first + count],) if local else None  # a view: its storage is the whole tensor's
            state[fqn][name] = dcp_writer.RowShard(piece.shape, piece.blocks, piece.dtype, rows)
    return {"optim": {"state": state, "param_groups": full["param_groups"]}}


def _write_ours(directory: Path, full: dict) -> tuple[dict[str, str], str]:
    plan = dcp_writer.plan(lambda r: _rank_state(full, r, False), WORLD)
    results, digests = [], {}
    for rank in range(WORLD):
        written, files, _ = dcp_writer.write_rank(directory, _rank_state(full, rank, True), rank, plan)
        results.append(written)
        digests.update(files)
    return digests, dcp_writer.finish(directory, plan, results)


def _write_pytorchs(directory: Path, full: dict) -> None:
    """The same plan, each rank's items written by PyTorch's own ``FileSystemWriter``."""
    plan = dcp_writer.plan(lambda r: _rank_state(full, r, False), WORLD)
    directory.mkdir()
    results = []
    for rank in range(WORLD):
        planner = dcp_writer._RowShardPlanner()
        planner.set_up_planner(_rank_state(full, rank, True), None, rank == 0)
        writer = FileSystemWriter(directory, single_file_per_rank=True, thread_count=1)
        writer.set_up_storage_writer(rank == 0, rank=rank)
        future = writer.write_data(planner.finish_plan(plan.plans[rank]), planner)
        future.wait()
        results.append(future.value())
    FileSystemWriter(directory).finish(plan.metadata, results)


def _load(directory: Path) -> dict:
    """The whole state back, by PyTorch's reader alone: every tensor into a full-size tensor of its own."""
    full = _full()
    target = {
        "optim": {
            "state": {
                fqn: {k: torch.zeros_like(v) for k, v in entries.items()} for fqn, entries in full["state"].items()
            }
        }
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        dcp.load(target, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    return target["optim"]


def test_pytorchs_reader_loads_what_osdpipe_writes_as_it_loads_what_dcp_writes(tmp_path: Path) -> None:
    full = _full()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _write_ours(ours, full)
    _write_pytorchs(theirs, full)
    assert diff(_load(ours)["state"], full["state"]) == []
    assert diff(_load(theirs)["state"], full["state"]) == []
    mine, pytorchs = FileSystemReader(str(ours)).read_metadata(), FileSystemReader(str(theirs)).read_metadata()
    assert mine.state_dict_metadata == pytorchs.state_dict_metadata, (
        "the same items, shapes and chunks as DCP's own writer records"
    )
    assert set(mine.storage_data) == set(pytorchs.storage_data)
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"
    ]


def test_every_item_is_a_torch_archive_of_its_own_rows_where_metadata_says(tmp_path: Path) -> None:
    full = _full()
    digests, metadata_digest = _write_ours(tmp_path, full)
    metadata = FileSystemReader(str(tmp_path)).read_metadata()
    assert metadata_digest == hashlib.sha256((tmp_path / ".metadata").read_bytes()).hexdigest()
    for name, digest in digests.items():
        assert digest == digest_by_hand(tmp_path / name, list(digest.pieces)), name
    covered: dict[str, list[tuple[int, int]]] = {}
    for index, info in metadata.storage_data.items():
        data = (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        covered.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
        if not isinstance(metadata.state_dict_metadata[index.fqn], dcp.metadata.TensorStorageMetadata):
            continue
        value = torch.load(io.BytesIO(data), weights_only=True)
        fqn, name = index.fqn.removeprefix("optim.state.").rsplit(".", 1)
        want = full["state"][fqn][name]
        if want.dim():  # a rank's rows; a step counter is kept whole, by one rank
            want = want[index.offset[0] : index.offset[0] + value.shape[0]]
        assert diff(value, want) == [] and value.untyped_storage().nbytes() == want.nbytes, index
        with zipfile.ZipFile(io.BytesIO(data)) as archive:  # offsets and alignment count from the item's own start
            for info_ in archive.infolist():
                # a storage record: its data 64-byte aligned, as torch aligns it
                if info_.filename.endswith(tuple("0123456789")):
                    name_length, extra_length = struct.unpack_from("<HH", data, info_.header_offset + 26)
                    assert (info_.header_offset + 30 + name_length + extra_length) % torchfile.ALIGNMENT == 0, (
                        index, info_.filename
                    )
    for name, spans in covered.items():  # the items tile each file, nothing between or after them
        spans.sort()
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), name
        assert spans[-1][1] == (tmp_path / name).stat().st_size, name


def test_online_and_offline_write_the_same_bytes_whatever_the_order(tmp_path: Path) -> None:
    """Each rank's file depends on that rank's rows and the plan only: written in another order, the same bytes."""
    full = _full()
    first, _ = _write_ours(tmp_path / "a", full)
    plan = dcp_writer.plan(lambda r: _rank_state(full, r, False), WORLD)
    results: dict[int, list] = {}
    for rank in reversed(range(WORLD)):
        results[rank], _, _ = dcp_writer.write_rank(tmp_path / "b", _rank_state(full, rank, True), rank, plan)
    dcp_writer.finish(tmp_path / "b", plan, [results[r] for r in range(WORLD)])
    for name in first:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / ".metadata").read_bytes() == (tmp_path / "b" / ".metadata").read_bytes()


def test_a_failure_while_writing_an_item_leaves_no_rank_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = _full()
    plan = dcp_writer.plan(lambda r: _rank_state(full, r, False), WORLD)
    calls = {"n": 0}
    real = torchfile.write_archive

    def failing(obj, out, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(obj, out, **kwargs)

    monkeypatch.setattr(torchfile, "write_archive", failing)
    with pytest.raises(OSError, match="No space left"):
        dcp_writer.write_rank(tmp_path, _rank_state(full, 1, True), 1, plan)
    assert list(tmp_path.iterdir()) == [], "a partly written rank file claims to be whole"


def test_the_write_results_survive_a_process_groups_pickling(tmp_path: Path) -> None:
    """Online, every rank's results reach rank 0 pickled; the offsets and lengths come back as written."""
    full = _full()
    plan = dcp_writer.plan(lambda r: _rank_state(full, r, False), WORLD)
    written, _, _ = dcp_writer.write_rank(tmp_path, _rank_state(full, 0, True), 0, plan)
    again = pickle.loads(pickle.dumps(written))
    assert [(r.index, r.storage_data.offset, r.storage_data.length) for r in again] == [
        (r.index, r.storage_data.offset, r.storage_data.length) for r in written
    ]


def test_no_tensor_made_after_the_write_takes_a_written_storages_digest(tmp_path: Path) -> None:
    """A view's rows are written from a copy of their own, which the write frees; the digests are keyed by a storage's
    address (``UntypedStorage._cdata``), which the next storage made may get. Tensors made after the write (as the
    model's pieces are made again for their digests) are never given a written copy's digest: the digests hold the
    storages they name."""
    from osdpipe.io.digest import tensor_sha256

    full = _full()
    plan = dcp_writer.plan(lambda r: _rank_state(full, r, False), WORLD)
    _, _, storages = dcp_writer.write_rank(tmp_path, _rank_state(full, 1, True), 1, plan)
    assert len(storages) >= len(SHAPES)
    made = [torch.full((n,), float(n)) for n in range(1, 400)]
    wrong = [t.numel() for t in made if tensor_sha256(t, storages) != hashlib.sha256(t.numpy().tobytes()).hexdigest()]
    assert wrong == []
