"""Every input is read safely, and every damaged or wrong one is refused in one line that names the file.

Real inputs of all four formats are built once per module: ``fsdp_full``,
``dcp`` and ``rank_local`` by real FSDP1 on two gloo ranks (osdpipe's own
generate), ``plain`` with plain PyTorch. :func:`damaged_variants` then damages
copies of them in a few hundred ways (truncated at random offsets, zip headers,
index and end record overwritten, DCP metadata and data files overwritten,
truncated or removed, hostile pickles that would ``touch`` a marker file,
files of the wrong kind, state that does not fit the model), and each must be
refused by :func:`osdpipe.io.formats.inspect_source` with an
:class:`~osdpipe.io.formats.InputError`: one line, naming the file, quickly, and
without running the hostile code.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import struct
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import clean_env, run_cli_cases
from testmodels import make_model

from osdpipe.io.formats import InputError, inspect_source
from osdpipe.io.formats.safe_load import DcpMetadataUnpickler, read_dcp_metadata
from osdpipe.layout.models import build_model
from osdpipe.layout.tree import describe
from osdpipe.run.launch import run_local_world
from osdpipe.spec.config import LayoutConfig
from osdpipe.spec.reconcile import settle_and_validate

MODEL = "testmodels:make_model"
SOURCE = LayoutConfig(world_size=2, wrap=["Linear"]).spec()
SEED = 1234
#: Seconds one refusal may take: metadata only, never the whole checkpoint.
QUICK_S = 5.0


class Hostile:
    """Unpickled without care, it runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------- real inputs


def _generate(specs: list[Any]) -> list[str]:
    """On each rank of the world: save every spec's source checkpoint (osdpipe's generate: real FSDP1, two steps)."""
    from osdpipe.run.generate import generate_rank
    from osdpipe.spec.plan import plan_run

    return [generate_rank(plan_run(spec)) for spec in specs]


def _save_plain(path: Path) -> None:
    """An unwrapped model's own ``optim.state_dict()``, two Adam steps, plain PyTorch."""
    torch.manual_seed(0)
    model = make_model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randint(0, 11, (4, 3))).square().mean().backward()
        optim.step()
    torch.save(optim.state_dict(), path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    specs = [
        settle_and_validate(
            {
                "model": {"factory": MODEL},
                "source": {"world_size": 2, "wrap": ["Linear"], "state_dict_type": kind},
                "target": {"world_size": 2, "wrap": ["Linear"]},
                "output": {"path": str(root / kind)},
                "generate": {"steps": 2},
            }
        )
        for kind in ("full", "sharded", "local")
    ]
    full, dcp_dir, local = run_local_world(_generate, 2, (specs,), timeout_s=120)[0]
    _save_plain(root / "plain.pt")
    return {"fsdp_full": Path(full), "dcp": Path(dcp_dir), "rank_local": Path(local), "plain": root / "plain.pt"}


def inspect(fmt: str, path: Path) -> Any:
    """What the launcher runs before any process starts."""
    tree = describe(build_model(MODEL, {}, device="meta"))
    return inspect_source(
        fmt, str(path), "optim", tree=tree, source=SOURCE, id_groups=[["*"]] if fmt == "plain" else None
    )


# ---------------------------------------------------------------- damage


def _flip(data: bytes, pos: int, n: int, rng: random.Random) -> bytes:
    """``data`` with ``n`` bytes from ``pos`` changed (each XORed with a nonzero byte, so each one surely differs)."""
    out = bytearray(data)
    for i in range(pos, min(pos + n, len(out))):
        out[i] ^= rng.randrange(1, 256)
    return bytes(out)


def _smear(data: bytes, pos: int, n: int) -> bytes:
    """``data`` with ``n`` bytes from ``pos`` set to 0xFF (0xFE where one already was): bytes no UTF-8 text holds,
    so an overwritten name is never silently another valid name, and no pickle opcode."""
    out = bytearray(data)
    for i in range(pos, min(pos + n, len(out))):
        out[i] = 0xFE if out[i] == 0xFF else 0xFF
    return bytes(out)


def _zip_regions(data: bytes) -> dict[str, list[tuple[str, int, int]]]:
    """Where a torch.save archive keeps its structure: (label, start, length) per kind of region."""
    archive = zipfile.ZipFile(io.BytesIO(data))
    infos = sorted(archive.infolist(), key=lambda i: i.header_offset)
    regions: dict[str, list[tuple[str, int, int]]] = {
        "header": [], "descriptor": [], "pickle": [], "index": [], "end": []
    }
    for info in infos:
        name = info.filename
        regions["header"].append((name, info.header_offset, 30 + len(name.encode())))
        nlen, elen = struct.unpack_from("<2H", data, info.header_offset + 26)
        start = info.header_offset + 30 + nlen + elen
        if info.flag_bits & 0x08:
            regions["descriptor"].append((name, start + info.compress_size, 16))
        if name.endswith("/data.pkl"):
            regions["pickle"].append((name, start, info.compress_size))
    # The index: per entry, the fields a reader depends on (flags .. sizes, name length, header offset, name).
    pos = archive.start_dir
    for info in infos:
        name_len = len(info.filename.encode())
        fields = {
            "flags": (8, 2), "method": (10, 2), "time": (12, 4), "crc": (16, 4),
            "sizes": (20, 8), "namelen": (28, 2), "offset": (42, 4),
        }
        for field, (off, size) in {**fields, "name": (46, name_len)}.items():
            regions["index"].append((f"{info.filename}:{field}", pos + off, size))
        pos += 46 + name_len + len(info.extra) + len(info.comment)
    end = len(data) - 22
    end_fields = {
        "signature": (0, 4), "disks": (4, 4), "counts": (8, 4), "size": (12, 4), "offset": (16, 4), "comment": (20, 2)
    }
    for field, (off, size) in end_fields.items():
        regions["end"].append((field, end + off, size))
    locator = end - 20
    if data[locator : locator + 4] == b"PK\x06\x07":  # torch writes zip64 end records too
        for field, (off, size) in {"signature": (0, 4), "disk": (4, 4), "offset": (8, 8), "disks": (16, 4)}.items():
            regions["end"].append((f"locator:{field}", locator + off, size))
        end64 = int.from_bytes(data[locator + 8 : locator + 16], "little")
        fields64 = {
            "signature": (0, 4), "size": (4, 8), "disks": (16, 8), "counts": (24, 16),
            "index_size": (40, 8), "index_offset": (48, 8),
        }
        for field, (off, size) in fields64.items():
            regions["end"].append((f"zip64:{field}", end64 + off, size))
    return regions


def _torch_file_damage(
    prefix: str, data: bytes, rng: random.Random, *, truncations: int, per_region: dict[str, int]
) -> list[tuple[str, bytes]]:
    """Damaged copies of a torch.save file: truncated at random offsets, and each kind of structure overwritten."""
    out = [(f"{prefix}truncated@{k}", data[:k]) for k in sorted(rng.sample(range(1, len(data)), truncations))]
    if truncations:
        out.append((f"{prefix}truncated@{len(data) - 1}", data[:-1]))
    for kind, regions in _zip_regions(data).items():
        chosen = regions if per_region.get(kind, 0) >= len(regions) else rng.sample(regions, per_region.get(kind, 0))
        for label, start, length in chosen:
            n = min(length, rng.randrange(1, 9))
            pos = start + rng.randrange(0, length - n + 1)
            out.append((f"{prefix}{kind}@{label}+{pos - start}", _flip(data, pos, n, rng)))
    return out


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _torch_bytes(obj: Any, **kwargs: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, **kwargs)
    return buffer.getvalue()


def _not_torch_files(rng: random.Random) -> list[tuple[str, bytes]]:
    """Files that are no torch.save file at all, or one of another kind."""
    plain_zip = io.BytesIO()
    with zipfile.ZipFile(plain_zip, "w") as z:
        z.writestr("notes/readme.txt", "not a checkpoint")
    return [
        ("foreign@empty", b""),
        ("foreign@random", rng.randbytes(4096)),
        ("foreign@text", b"step,loss\n1,0.5\n" * 64),
        ("foreign@zip", plain_zip.getvalue()),
        ("foreign@legacy", _torch_bytes({"state": {}, "param_groups": []}, _use_new_zipfile_serialization=False)),
        ("wrong@tensor", _torch_bytes(torch.zeros(3))),
        ("wrong@list", _torch_bytes([1, 2, 3])),
        ("wrong@model_state_dict", _torch_bytes(make_model().state_dict())),
        ("wrong@state_list", _torch_bytes({"state": [1], "param_groups": []})),
    ]


def _changed(osd: dict[str, Any], change: str) -> dict[str, Any]:
    """A copy of an optimizer state dict with one thing changed that makes it not fit the model."""
    state = {k: dict(v) if isinstance(v, dict) else v for k, v in osd["state"].items()}
    groups = [dict(g) for g in osd["param_groups"]]
    key = next(
        k
        for k, v in state.items()
        if isinstance(v, dict) and torch.is_tensor(v.get("exp_avg")) and v["exp_avg"].dim() == 2
    )
    if change == "dtype":
        state[key]["exp_avg"] = state[key]["exp_avg"].double()
    elif change == "shape":
        state[key]["exp_avg"] = torch.zeros(3, 3)
    elif change == "rename":
        state["embedding.weight"] = state.pop(key)
        groups[0]["params"] = ["embedding.weight" if p == key else p for p in groups[0]["params"]]
    elif change == "group_fqn":
        groups[0]["params"] = [*groups[0]["params"], "head.weight"]
    elif change == "group_id":
        groups[0]["params"] = [*groups[0]["params"], 99]
    return {"state": state, "param_groups": groups}


def _as_double(osd: dict[str, Any]) -> dict[str, Any]:
    """A copy of a param-ID keyed state dict with every state tensor in float64."""
    state = {
        pid: {k: v.double() if torch.is_tensor(v) and v.dim() else v for k, v in s.items()}
        for pid, s in osd["state"].items()
    }
    return {**osd, "state": state}


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edited_copy(src: Path, dst: Path, edit: dict[str, bytes | None]) -> Path:
    """A copy of directory ``src`` with the files ``edit`` names replaced (``None``: removed)."""
    _copy_dir(src, dst)
    for name, blob in edit.items():
        if blob is None:
            (dst / name).unlink()
        else:
            (dst / name).write_bytes(blob)
    return dst


def _dcp_save(state: dict[str, Any], directory: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(directory))
    return directory


def damaged_variants(inputs: dict[str, Path], out_dir: Path) -> list[tuple[str, str, Path]]:
    """Damaged and wrong copies of intact inputs, each of which osdpipe must refuse.

    Args:
        inputs: an intact input per format: ``fsdp_full`` and ``plain`` files,
            ``rank_local`` and ``dcp`` directories (two ranks, ``optim`` key)
            of :func:`make_model`'s optimizer state.
        out_dir: an empty directory; every variant is written under it.

    Returns:
        ``(case, format, path)`` per variant: the case says what was done, as
        ``<format>/<kind>@<detail>``; ``path`` is what ``input.path`` names.
        A hostile variant, loaded carelessly, creates ``out_dir/MARKER``.
    """
    rng = random.Random(SEED)
    marker = out_dir / "MARKER"
    out: list[tuple[str, str, Path]] = []

    def add(fmt: str, case: str, path: Path) -> None:
        out.append((f"{fmt}/{case}", fmt, path))

    # ---- single files: fsdp_full and plain
    for fmt in ("fsdp_full", "plain"):
        data = inputs[fmt].read_bytes()
        osd = torch.load(inputs[fmt], weights_only=True)
        per_region = {"header": 12, "descriptor": 4, "pickle": 4, "index": 14, "end": 16}
        cases = _torch_file_damage("", data, rng, truncations=20, per_region=per_region)
        cases += _not_torch_files(rng)
        hostile_state = {next(iter(osd["state"])): {"exp_avg": Hostile(marker)}}
        cases.append(("hostile@state", _torch_bytes({"state": hostile_state, "param_groups": osd["param_groups"]})))
        for change in ("dtype", "shape", "rename" if fmt == "fsdp_full" else "group_id"):
            cases.append((f"model@{change}", _torch_bytes(_changed(osd, change))))
        if fmt == "fsdp_full":
            cases.append(("model@group_fqn", _torch_bytes(_changed(osd, "group_fqn"))))
        other = inputs["plain" if fmt == "fsdp_full" else "fsdp_full"].read_bytes()
        cases.append(("format@other", other))
        for i, (case, blob) in enumerate(cases):
            add(fmt, case, _write(out_dir / fmt / f"{i:03d}.pt", blob))

    # ---- rank_local: a directory of rank_<r>.pt
    src = inputs["rank_local"]
    layout = sorted(p.name for p in src.glob("rank_*.pt"))
    assert layout == ["rank_0.pt", "rank_1.pt"], layout
    def local_variant(case: str, edit: dict[str, bytes | None]) -> None:
        add("rank_local", case, _edited_copy(src, out_dir / "rank_local" / f"{len(out):03d}", edit))

    rank_data = {r: (src / f"rank_{r}.pt").read_bytes() for r in range(2)}
    local_variant("files@missing_rank_1", {"rank_1.pt": None})
    local_variant("files@missing_rank_0", {"rank_0.pt": None})
    local_variant("files@none", {"rank_0.pt": None, "rank_1.pt": None})
    local_variant("files@extra_rank_2", {"rank_2.pt": rank_data[1]})
    local_variant("files@extra_rank_5", {"rank_5.pt": rank_data[1]})
    for r in range(2):
        per_region = {"header": 5, "descriptor": 2, "pickle": 2, "index": 5, "end": 2}
        for case, blob in _torch_file_damage(f"rank_{r}:", rank_data[r], rng, truncations=8, per_region=per_region):
            local_variant(case, {f"rank_{r}.pt": blob})
    for case, blob in _not_torch_files(rng):
        local_variant(f"rank_1:{case}", {"rank_1.pt": blob})
    rank1 = torch.load(src / "rank_1.pt", weights_only=True)
    first = next(iter(rank1["state"]))
    local_variant(
        "rank_1:hostile@state", {"rank_1.pt": _torch_bytes({**rank1, "state": {first: {"exp_avg": Hostile(marker)}}})}
    )
    local_variant("rank_1:model@dtype", {"rank_1.pt": _torch_bytes(_as_double(rank1))})
    shape = {
        pid: {k: torch.zeros(5) if torch.is_tensor(v) and v.dim() else v for k, v in s.items()}
        for pid, s in rank1["state"].items()
    }
    local_variant("rank_1:model@shape", {"rank_1.pt": _torch_bytes({**rank1, "state": shape})})
    local_variant("rank_1:format@plain", {"rank_1.pt": inputs["plain"].read_bytes()})
    both = {
        f"rank_{r}.pt": _torch_bytes(_as_double(torch.load(src / f"rank_{r}.pt", weights_only=True))) for r in range(2)
    }
    local_variant("model@dtype_both", both)

    # ---- dcp: a directory of .metadata and __<rank>_0.distcp
    src = inputs["dcp"]

    def dcp_variant(case: str, edit: dict[str, bytes | None]) -> None:
        add("dcp", case, _edited_copy(src, out_dir / "dcp" / f"{len(out):03d}", edit))

    meta_bytes = (src / ".metadata").read_bytes()
    dcp_variant("metadata@missing", {".metadata": None})
    dcp_variant("metadata@empty", {".metadata": b""})
    for k in sorted(rng.sample(range(1, len(meta_bytes)), 15)):
        dcp_variant(f"metadata@truncated{k}", {".metadata": meta_bytes[:k]})
    for pos in sorted(rng.sample(range(0, len(meta_bytes) - 8), 15)):
        dcp_variant(f"metadata@overwritten{pos}", {".metadata": _smear(meta_bytes, pos, 8)})
    dcp_variant("hostile@metadata", {".metadata": pickle.dumps(Hostile(marker))})
    metadata = read_dcp_metadata(src / ".metadata")
    metadata.planner_data = {**metadata.planner_data, "optim.extra": Hostile(marker)}
    dcp_variant("hostile@metadata_inside", {".metadata": pickle.dumps(metadata)})
    metadata = read_dcp_metadata(src / ".metadata")
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../" + info.relative_path
    dcp_variant("metadata@path_outside", {".metadata": pickle.dumps(metadata)})

    metadata = read_dcp_metadata(src / ".metadata")
    files = sorted({i.relative_path for i in metadata.storage_data.values()})
    for rel in files:
        data = (src / rel).read_bytes()
        dcp_variant(f"distcp@missing_{rel}", {rel: None})
        for k in sorted(rng.sample(range(0, len(data)), 4)):
            dcp_variant(f"distcp@truncated_{rel}@{k}", {rel: data[:k]})
        items = sorted(
            (i for i in metadata.storage_data.items() if i[1].relative_path == rel), key=lambda i: i[1].offset
        )
        small = [(idx, i) for idx, i in items if not idx.offset]  # bytes items and 0-dim tensors (step)
        for idx, item in rng.sample(items, 3):
            dcp_variant(f"distcp@item_start_{rel}@{idx.fqn}", {rel: _flip(data, item.offset, 4, rng)})
            dcp_variant(f"distcp@item_end_{rel}@{idx.fqn}", {rel: _flip(data, item.offset + item.length - 22, 4, rng)})
        # Inside the items that opening the checkpoint reads (param groups, step): their headers, index and pickle.
        for idx, item in rng.sample(small, min(3, len(small))):
            blob = data[item.offset : item.offset + item.length]
            per_region = {"header": 1, "pickle": 1, "index": 1}
            for case, damaged in _torch_file_damage("", blob, rng, truncations=0, per_region=per_region):
                dcp_variant(
                    f"distcp@{rel}@{idx.fqn}@{case}",
                    {rel: data[: item.offset] + damaged + data[item.offset + item.length :]},
                )

    full = torch.load(inputs["fsdp_full"], weights_only=True)
    made = out_dir / "dcp_made"
    hostile_groups = [{**g, "lr": Hostile(marker)} for g in full["param_groups"]]
    add(
        "dcp",
        "hostile@param_group_item",
        _dcp_save({"optim": {"state": full["state"], "param_groups": hostile_groups}}, made / "hostile"),
    )
    add("dcp", "wrong@key", _dcp_save({"model_optim": full}, made / "key"))
    add("dcp", "wrong@model_state_dict", _dcp_save({"optim": make_model().state_dict()}, made / "model"))
    for change in ("dtype", "rename", "group_fqn"):
        add("dcp", f"model@{change}", _dcp_save({"optim": _changed(full, change)}, made / change))
    return out


#: What each kind of damage must be called; a case's kind is the part of its name before ``@``, less any ``rank_<r>:``.
EXPECTED = {
    "truncated": r"is damaged or not a torch\.save file \(.*(truncated|overwritten|missing|disagrees|empty|past)",
    "header": r"is damaged or not a torch\.save file \(.*(header|record|index|zip)",
    "descriptor": r"is damaged or not a torch\.save file \(.*(descriptor|record|overlaps|past)",
    "pickle": r"is damaged or not a torch\.save file \(record .*data\.pkl is overwritten: its CRC-32 does not match",
    "index": r"is damaged or not a torch\.save file \(.*(index|header|record|overlaps|past)",
    "end": r"is damaged or not a torch\.save file \(.*(index|end record|locator)",
    "foreign": r"is damaged or not a torch\.save file|legacy format",
    "wrong": (
        r"not an optimizer state dict|holds a \w+, not an optimizer state dict|has no top-level key"
        r"|holds no optimizer state"
    ),
    "hostile": r"(refusing to run code from a checkpoint|which a DCP checkpoint never holds; refusing to load it)",
    "model": (
        r"which model has no parameter|but the parameter (is|has shape)|dtypes? .*on different ranks"
        r"|source layout says|param ID|input\.param_groups"
    ),
    "format": r"keys its state by|not an optimizer state dict|source layout|param ID",
    "files": r"rank_\d\.pt is missing|holds no rank_<r>\.pt files|unexpected rank_\d\.pt",
    "metadata": (
        r"\.metadata is (missing|damaged or not DCP metadata)|\.metadata refers to"
        r"|not a file inside the checkpoint directory"
    ),
    "distcp": (
        r"\.distcp is (missing|truncated: \d+ bytes, the metadata needs \d+)"
        r"|of \S+\.distcp is damaged or not a torch\.save file"
    ),
}


def _kind(case: str) -> str:
    kind = case.split("/", 1)[1].split("@", 1)[0]
    return kind.rsplit(":", 1)[-1]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("fmt", ["fsdp_full", "plain", "rank_local", "dcp"])
def test_intact_inputs_pass(inputs: dict[str, Path], fmt: str) -> None:
    meta = inspect(fmt, inputs[fmt])
    assert set(meta.state) == {"embed.weight", "proj.weight", "proj.bias", "out.weight", "out.bias"}
    assert meta.state["proj.weight"]["exp_avg"].shape == (6, 6)
    assert meta.param_groups and [p for g in meta.param_groups for p in g["params"]]


def test_every_damaged_input_is_refused_in_one_line(inputs: dict[str, Path], tmp_path: Path) -> None:
    import re

    variants = damaged_variants(inputs, tmp_path)
    assert len(variants) >= 200, len(variants)
    assert {fmt for _, fmt, _ in variants} == {"fsdp_full", "plain", "rank_local", "dcp"}
    problems = []
    slowest = 0.0
    for case, fmt, path in variants:
        start = time.perf_counter()
        try:
            inspect(fmt, path)
        except InputError as exc:
            msg = str(exc)
            if "\n" in msg or str(path) not in msg:
                problems.append(f"{case}: not one line naming {path}: {msg!r}")
            elif not re.search(EXPECTED[_kind(case)], msg):
                problems.append(f"{case}: unexpected message {msg!r}")
        except Exception as exc:  # noqa: BLE001 - every other outcome is the failure being tested for
            problems.append(f"{case}: {type(exc).__name__} instead of InputError: {str(exc)[:300]!r}")
        else:
            problems.append(f"{case}: accepted")
        slowest = max(slowest, time.perf_counter() - start)
    assert not (tmp_path / "MARKER").exists(), "a hostile pickle ran its code"
    assert not problems, f"{len(problems)} of {len(variants)} variants:\n" + "\n".join(problems)
    assert slowest < QUICK_S, f"the slowest refusal took {slowest:.1f} s"


def test_the_hostile_inputs_run_code_through_torch_alone(inputs: dict[str, Path], tmp_path: Path) -> None:
    """The hostile variants are real: torch's own readers, used without care, run them; osdpipe's refuse them."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from osdpipe.io.formats.dcp_reader import DcpReader

    marker = tmp_path / "ran"
    # .metadata: FileSystemReader.read_metadata unpickles it with plain pickle.
    meta_dir = _copy_dir(inputs["dcp"], tmp_path / "meta")
    (meta_dir / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    with pytest.raises(InputError, match="refers to posix.system"):
        DcpReader(str(meta_dir), "optim")
    assert not marker.exists()
    with pytest.raises(AttributeError):  # what it unpickled (os.system's exit status) is no Metadata: after running it
        FileSystemReader(str(meta_dir)).read_metadata()
    assert marker.exists()
    marker.unlink()
    # A param group value: torch 2.13's default planner loads bytes items with weights_only=False.
    full = torch.load(inputs["fsdp_full"], weights_only=True)
    groups = [{**g, "lr": Hostile(marker)} for g in full["param_groups"]]
    item_dir = _dcp_save({"optim": {"state": full["state"], "param_groups": groups}}, tmp_path / "item")
    with pytest.raises(
        InputError, match=r"__0_0\.distcp holds objects torch\.load refuses to load safely \(GLOBAL posix\.system\)"
    ):
        DcpReader(str(item_dir), "optim").meta()
    assert not marker.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(
            {}, storage_reader=FileSystemReader(str(item_dir)), planner=_EmptyStateDictLoadPlanner(), no_dist=True
        )
    assert marker.exists()


def test_damage_inside_a_tensor_item_is_found_when_it_is_read(inputs: dict[str, Path], tmp_path: Path) -> None:
    """Opening a DCP checkpoint checks each item's bounds; a tensor item's inside is checked when a rank reads it."""
    from osdpipe.io.formats.dcp_reader import DcpReader

    metadata = read_dcp_metadata(inputs["dcp"] / ".metadata")
    index, item = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == "optim.state.proj.weight.exp_avg")
    target = _copy_dir(inputs["dcp"], tmp_path / "dcp")
    data = (target / item.relative_path).read_bytes()
    # inside its first header
    (target / item.relative_path).write_bytes(_flip(data, item.offset + 8, 4, random.Random(0)))
    reader = DcpReader(str(target), "optim")
    reader.meta()
    with pytest.raises(InputError) as info:
        reader.read([("proj.weight", "exp_avg")])
    assert str(info.value).startswith(
        f"the item at bytes {item.offset}..{item.offset + item.length} of {target / item.relative_path} is damaged"
    )


def test_missing_rank_file_messages(inputs: dict[str, Path], tmp_path: Path) -> None:
    from osdpipe.io.formats.rank_local import rank_files

    d = tmp_path / "ranks"
    d.mkdir()
    for r in (0, 2, 3):
        (d / f"rank_{r}.pt").write_bytes(b"")
    with pytest.raises(InputError) as info:
        rank_files(d, 4)
    found = "found rank_0.pt, rank_2.pt, rank_3.pt for source.world_size=4"
    assert str(info.value) == f"{d}/rank_1.pt is missing ({found}); copy every rank's file from the job that saved it"
    (d / "rank_1.pt").write_bytes(b"")
    with pytest.raises(InputError, match=r"rank_4\.pt is missing: source\.world_size=6 .* set source\.world_size=4$"):
        rank_files(d, 6)
    with pytest.raises(
        InputError, match=r"unexpected rank_2\.pt, rank_3\.pt\); if 4 ranks saved it, set source\.world_size=4$"
    ):
        rank_files(d, 2)
    (d / "rank_1.pt").unlink()
    (d / "rank_7.pt").write_bytes(b"")
    with pytest.raises(InputError) as info:
        rank_files(d, 2)
    assert "set source.world_size to the number of ranks that saved it" in str(info.value)
    (d / "rank_5.pt").write_bytes(b"")
    with pytest.raises(InputError) as info:
        rank_files(d, 8)
    assert "source.world_size=" not in str(info.value).split(";")[-1], "a gap is no reason to change the world size"


def test_metadata_unpickler_allows_dcp_and_nothing_else(inputs: dict[str, Path]) -> None:
    data = (inputs["dcp"] / ".metadata").read_bytes()
    assert type(DcpMetadataUnpickler(io.BytesIO(data)).load()).__name__ == "Metadata"
    for payload in (pickle.dumps(eval), pickle.dumps(os.getcwd), pickle.dumps(torch.load), pickle.dumps(io.BytesIO)):
        with pytest.raises(pickle.UnpicklingError):
            DcpMetadataUnpickler(io.BytesIO(payload)).load()


def test_dcp_reads_param_groups_without_unsafe_pickle(inputs: dict[str, Path]) -> None:
    """The bytes items (param groups) come back through the weights_only planner, equal to what was saved."""
    from osdpipe.io.formats.dcp_reader import DcpReader

    full = torch.load(inputs["fsdp_full"], weights_only=True)
    meta = DcpReader(str(inputs["dcp"]), "optim").meta()
    assert [{k: v for k, v in g.items() if k != "params"} for g in meta.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in full["param_groups"]
    ]


def test_a_dcp_range_across_chunks_is_read_as_the_chunks_hold_it(inputs: dict[str, Path]) -> None:
    """``read_parts``: a range across a tensor's stored chunks comes back as a view of each chunk's share, in order
    (nothing copied to join them), each chunk the file's own pages mapped into memory (nothing read into memory of the
    process's own, so a share of a few elements holds no chunk); ``Source.parts`` cuts the batch's segment there, and
    placing the parts fills the state as the joined range does."""
    from osdpipe.io.formats.dcp_reader import DcpReader
    from osdpipe.layout.ranges import Segment
    from osdpipe.run.transfer import Batch, Source, place

    reader = DcpReader(str(inputs["dcp"]), "optim")
    reader.meta()
    full = torch.load(inputs["fsdp_full"], weights_only=True)["state"]["proj.weight"]["exp_avg"].reshape(-1)
    item = reader.checkpoint.metadata.state_dict_metadata["optim.state.proj.weight.exp_avg"]
    assert len(item.chunks) == 2, "saved by two FSDP ranks: a chunk each"
    boundary = sorted(c.offsets[0] for c in item.chunks)[1] * (full.numel() // item.size[0])
    start, stop = 1, full.numel() - 4  # most of either chunk: views of them
    parts = reader.read_parts("proj.weight", "exp_avg", start, stop)
    assert [p.numel() for p in parts] == [boundary - 1, full.numel() - 4 - boundary]
    assert all(p.untyped_storage().nbytes() > p.numel() * p.element_size() for p in parts), "views of whole chunks"
    assert torch.equal(torch.cat(parts), full[start:stop])
    assert torch.equal(reader.read_range("proj.weight", "exp_avg", start, stop), full[start:stop])
    start, stop = boundary - 3, boundary + 5  # a few elements of each: views of the mapped file too
    parts = reader.read_parts("proj.weight", "exp_avg", start, stop)
    assert [p.numel() for p in parts] == [3, 5]
    mapped = {rel: len(m) for rel, m in reader.checkpoint._maps.items()}
    assert len(mapped) == 2 and all(p.untyped_storage().nbytes() > p.numel() * p.element_size() for p in parts)
    assert torch.equal(torch.cat(parts), full[start:stop])

    batch = Batch("exp_avg", full.dtype, (Segment("proj.weight", start, stop - start, 10),))
    stored, pieces = Source(reader, None).parts(batch)
    assert stored.segments == (Segment("proj.weight", start, 3, 10), Segment("proj.weight", boundary, 5, 13))
    flat = torch.zeros(20, dtype=full.dtype)
    place(flat, stored, pieces)
    assert torch.equal(flat[10:18], full[start:stop]) and not flat[:10].any() and not flat[18:].any()


# ---------------------------------------------------------------- through the command


def _command(fmt: str, path: Path, out: Path) -> list[str]:
    """The README's command for an input of ``fmt`` at ``path``, for this module's model and source layout."""
    source = (
        ["source.kind=none", "source.world_size=1", "input.param_groups=[[*]]"]
        if fmt == "plain"
        else ["source.world_size=2", "source.wrap=[Linear]"]
    )
    return [
        f"model.factory={MODEL}", f"input.path={path}", f"input.format={fmt}", *source,
        "target.world_size=2", "target.wrap=[Linear]", f"output.path={out}",
    ]


def one_of_each_kind(variants: list[tuple[str, str, Path]]) -> list[tuple[str, str, Path]]:
    """The first variant of each format and kind of damage (``<format>/<kind>@...``), and every hostile one."""
    seen: set[tuple[str, str]] = set()
    chosen = []
    for variant in variants:
        case, fmt, _ = variant
        kind = (fmt, _kind(case))
        if kind not in seen or "hostile" in case:
            seen.add(kind)
            chosen.append(variant)
    return chosen


def test_the_command_refuses_every_kind_of_damaged_input(inputs: dict[str, Path], tmp_path: Path) -> None:
    """One variant of each kind of damage, per format, through the ``osdpipe`` entry point: non-zero exit, one line, no
    hang, nothing written but report.json. Every variant is refused by the same check in-process (the test above); a
    command costs a Hydra composition each, so the command sees each kind once."""
    variants = one_of_each_kind(damaged_variants(inputs, tmp_path / "variants"))
    kinds = {(fmt, _kind(case)) for case, fmt, _ in variants}
    assert {fmt for fmt, _ in kinds} == {"fsdp_full", "plain", "rank_local", "dcp"} and len(kinds) >= 20, sorted(kinds)
    outs = [tmp_path / "out" / str(i) for i in range(len(variants))]
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "support"), env.get("PYTHONPATH", "")]
    )
    commands = [_command(fmt, path, out) for (_, fmt, path), out in zip(variants, outs)]
    results = run_cli_cases(commands, cwd=tmp_path, per_case_s=30, env=env)
    problems = []
    for (case, _, path), out, result in zip(variants, outs, results):
        lines = [line for line in result["stderr"].splitlines() if line.strip()]
        written = sorted(p.name for p in out.iterdir()) if out.exists() else []
        if result["code"] not in (1, 2):
            problems.append(f"{case}: exit {result['code']}")
        elif len(lines) != 1 or not lines[0].startswith("osdpipe: error: ") or str(path) not in lines[0]:
            problems.append(f"{case}: not one error line naming {path}: {lines}")
        elif written not in ([], ["osdpipe.log", "report.json"]):
            problems.append(f"{case}: wrote {written}")
        elif written and (ran := json.loads((out / "report.json").read_text()))["memory"] + ran["stages"]:
            problems.append(
                f"{case}: a world started (its ranks reported {len(ran['memory'])} memory row(s))"
                " before the input was refused"
            )
    assert not (tmp_path / "variants" / "MARKER").exists(), "a hostile pickle ran its code"
    assert not problems, f"{len(problems)} of {len(variants)} variants:\n" + "\n".join(problems[:20])
