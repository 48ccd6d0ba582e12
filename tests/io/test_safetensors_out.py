"""osdpipe.io.safetensors_out: streamed safetensors export, checked against the format's reference reader."""

from __future__ import annotations

import hashlib
import json
import struct
import weakref
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load_file

from osdpipe.io.safetensors_out import INDEX_FILE, TensorSpec, file_order, shard_names, shard_plan, write_safetensors


def _sample_tensors() -> dict[str, torch.Tensor]:
    """One tensor of every kind the export must carry, in the order they are written."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed.weight": torch.randn(5, 3, generator=g),
        "model.norm.weight": torch.randn(7, generator=g).to(torch.float16),
        "model.layers.0.attn.q.weight": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "model.layers.0.attn.scale": torch.randn(2, 2, 2, generator=g, dtype=torch.float64),
        "model.steps": torch.randint(-(2**40), 2**40, (3,), generator=g, dtype=torch.int64),
        "model.int32": torch.randint(-(2**31), 2**31 - 1, (2, 3), generator=g, dtype=torch.int32),
        # 3 bytes: every tensor after it starts at an odd offset of the data section.
        "model.int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "model.uint8": torch.randint(0, 256, (9,), generator=g, dtype=torch.uint8),
        "model.mask": torch.tensor([True, False, True, True, False]),
        "model.scalar": torch.tensor(3.25),
        "model.empty": torch.zeros(0, 4),
        "model.transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    }
    if hasattr(torch, "float8_e4m3fn"):
        tensors["model.fp8"] = torch.tensor([0.5, -1.0, 448.0]).to(torch.float8_e4m3fn)
    assert not tensors["model.transposed"].is_contiguous()
    return tensors


def _specs(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


def _assert_bitwise_equal(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(expected)
    for name, value in expected.items():
        got = loaded[name]
        assert got.dtype == value.dtype, name
        assert got.shape == value.shape, name
        # Compare bytes, not values: float8 has no torch.equal kernel, and -0.0 == 0.0.
        assert torch.equal(
            got.contiguous().view(-1).view(torch.uint8), value.contiguous().view(-1).view(torch.uint8)
        ), name


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def test_one_file_reads_back_bitwise_with_reference_reader(tmp_path: Path) -> None:
    tensors = _sample_tensors()
    digests = write_safetensors(tmp_path, _specs(tensors), lambda spec: tensors[spec.name])

    assert list(digests) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    path = tmp_path / "model.safetensors"
    _assert_bitwise_equal(load_file(path), tensors)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}

    n, header = _header(path)
    assert (8 + n) % 8 == 0  # the data section starts 8-byte aligned
    assert path.read_bytes()[8 : 8 + n].rstrip(b" ").endswith(b"}")  # padded with spaces only
    # metadata first, then file order
    assert list(header) == ["__metadata__", *(spec.name for spec in file_order(_specs(tensors)))]
    assert header["model.empty"] == {
        "dtype": "F32", "shape": [0, 4], "data_offsets": [header["model.empty"]["data_offsets"][0]] * 2
    }
    assert header["model.scalar"]["shape"] == []


def test_sharded_files_and_index_read_back_bitwise(tmp_path: Path) -> None:
    tensors = _sample_tensors()
    specs = _specs(tensors)
    # 64 bytes per file: the float32 5x3 (60 B) and 2x2x2 float64 (64 B) tensors fill files alone;
    # nothing is larger than the limit, so every file is a run of consecutive specs.
    digests = write_safetensors(tmp_path, specs, lambda spec: tensors[spec.name], max_shard_size=64)

    plan = shard_plan(specs, 64)
    names = shard_names(len(plan))
    assert len(plan) > 3
    assert list(digests) == [*names, INDEX_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(digests)

    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"] == {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}
    assert index["weight_map"] == {spec.name: name for name, shard in zip(names, plan) for spec in shard}

    loaded: dict[str, torch.Tensor] = {}
    for name, shard in zip(names, plan):
        content = load_file(tmp_path / name)
        assert list(_header(tmp_path / name)[1])[1:] == [spec.name for spec in file_order(shard)]
        assert set(content) == {name_ for name_, file in index["weight_map"].items() if file == name}
        with safetensors.safe_open(str(tmp_path / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        assert (8 + _header(tmp_path / name)[0]) % 8 == 0
        loaded.update(content)
    _assert_bitwise_equal(loaded, tensors)


def _u8(name: str, size: int) -> TensorSpec:
    """A spec of exactly ``size`` bytes."""
    return TensorSpec(name, (size,), torch.uint8)


def _names(plan: list[list[TensorSpec]]) -> list[list[str]]:
    return [[spec.name for spec in shard] for shard in plan]


def test_shard_plan_follows_huggingface_hub_greedy_rule() -> None:
    # huggingface_hub's own docstring example: limit 10, sizes [6, 6, 2, 6, 2, 2] -> [6], [6+2], [6+2+2].
    specs = [_u8(f"t{i}", s) for i, s in enumerate([6, 6, 2, 6, 2, 2])]
    assert _names(shard_plan(specs, 10)) == [["t0"], ["t1", "t2"], ["t3", "t4", "t5"]]
    # Exactly at the limit stays in the shard; one byte over starts a new one.
    assert _names(shard_plan([_u8("a", 6), _u8("b", 4)], 10)) == [["a", "b"]]
    assert _names(shard_plan([_u8("a", 6), _u8("b", 5)], 10)) == [["a"], ["b"]]
    # A tensor over the limit gets a shard of its own, placed before the shard being filled,
    # which goes on collecting the tensors after it (as huggingface_hub does).
    specs = [_u8("a", 2), _u8("big", 20), _u8("c", 3), _u8("d", 6)]
    assert _names(shard_plan(specs, 10)) == [["big"], ["a", "c"], ["d"]]
    assert _names(shard_plan([_u8("big", 11)], 10)) == [["big"]]
    # Sizes are bytes: three float32 (3,) tensors are 12 bytes each.
    floats = [TensorSpec(f"f{i}", (3,), torch.float32) for i in range(3)]
    assert _names(shard_plan(floats, 24)) == [["f0", "f1"], ["f2"]]
    # None: one shard; no tensors: still one (empty) file.
    assert _names(shard_plan(specs, None)) == [["a", "big", "c", "d"]]
    assert shard_plan([], 10) == [[]] and shard_plan([], None) == [[]]
    with pytest.raises(ValueError):
        shard_plan(specs, 0)


def test_shard_names_as_transformers_names_them() -> None:
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(3) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    assert shard_names(12)[10] == "model-00011-of-00012.safetensors"
    with pytest.raises(ValueError):
        shard_names(0)


def test_index_is_exact_with_an_oversized_tensor_between_others(tmp_path: Path) -> None:
    tensors = {
        "z.first": torch.arange(2, dtype=torch.float32),  # 8 B
        "b.big": torch.arange(10, dtype=torch.float32),  # 40 B > limit: its own file, numbered first
        "m.third": torch.arange(3, dtype=torch.int16),  # 6 B: joins z.first
        "a.fourth": torch.arange(4, dtype=torch.float16),  # 8 B: 8 + 6 + 8 > 16, a new file
    }
    digests = write_safetensors(tmp_path, _specs(tensors), lambda spec: tensors[spec.name], max_shard_size=16)

    assert list(digests) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    # As transformers writes it: keys sorted (weight_map by name), indent 2, a final newline.
    assert (tmp_path / INDEX_FILE).read_text() == (
        "{\n"
        '  "metadata": {\n'
        '    "total_size": 62\n'
        "  },\n"
        '  "weight_map": {\n'
        '    "a.fourth": "model-00003-of-00003.safetensors",\n'
        '    "b.big": "model-00001-of-00003.safetensors",\n'
        '    "m.third": "model-00002-of-00003.safetensors",\n'
        '    "z.first": "model-00002-of-00003.safetensors"\n'
        "  }\n"
        "}\n"
    )
    assert list(load_file(tmp_path / "model-00002-of-00003.safetensors")) == ["z.first", "m.third"]
    loaded = {}
    for name in list(digests)[:3]:
        loaded.update(load_file(tmp_path / name))
    _assert_bitwise_equal(loaded, tensors)


def test_produce_is_called_once_in_order_and_no_tensor_is_kept(tmp_path: Path) -> None:
    tensors = _sample_tensors()
    specs = _specs(tensors)
    # 160 B: a file of its own, before the one being filled
    specs.insert(3, TensorSpec("model.oversized", (40,), torch.float32))
    calls: list[str] = []
    produced: list[weakref.ref] = []

    def produce(spec: TensorSpec) -> torch.Tensor:
        # Every tensor handed out before this call must be gone already: the writer
        # keeps none (nor its contiguous copy, which would keep its storage alive).
        alive = [calls[i] for i, ref in enumerate(produced) if ref() is not None]
        assert not alive, f"still referenced when {spec.name} is produced: {alive}"
        calls.append(spec.name)
        if spec.name == "model.oversized":
            value = torch.arange(80, dtype=torch.float32)[::2]  # non-contiguous, a view of a larger storage
        else:
            value = tensors[spec.name].clone()
            if spec.name == "model.transposed":
                value = value.t().contiguous().t()  # a fresh non-contiguous tensor no one else holds
        produced.append(weakref.ref(value))
        return value

    write_safetensors(tmp_path, specs, produce, max_shard_size=64)
    assert calls == [spec.name for shard in shard_plan(specs, 64) for spec in file_order(shard)]
    assert sorted(calls) == sorted(spec.name for spec in specs)  # each once
    assert all(ref() is None for ref in produced)


def test_every_tensor_starts_at_a_multiple_of_its_element_size(tmp_path: Path) -> None:
    """Bytes, then a float32, then a 3-byte int8, then a float64: written largest element first, each aligned."""
    import json
    import struct

    specs = [
        TensorSpec("a.bytes", (3,), torch.uint8),
        TensorSpec("b.f32", (3,), torch.float32),
        TensorSpec("c.i8", (3,), torch.int8),
        TensorSpec("d.f64", (1,), torch.float64),
        TensorSpec("e.f16", (1,), torch.float16),
    ]
    write_safetensors(tmp_path, specs, lambda spec: torch.ones(spec.shape, dtype=spec.dtype))
    raw = (tmp_path / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    assert (8 + length) % 8 == 0
    for spec in specs:
        begin = header[spec.name]["data_offsets"][0]
        assert begin % spec.dtype.itemsize == 0, (spec.name, begin)
    assert [n for n in header if n != "__metadata__"] == ["d.f64", "b.f32", "e.f16", "a.bytes", "c.i8"]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (torch.zeros(3, 2), r"shape \(3, 2\) dtype torch.float32.*shape \(2, 3\) dtype torch.float32"),
        (
            torch.zeros(2, 3, dtype=torch.float16),
            r"shape \(2, 3\) dtype torch.float16.*shape \(2, 3\) dtype torch.float32",
        ),
        (torch.zeros(6), r"shape \(6,\) dtype torch.float32.*shape \(2, 3\) dtype torch.float32"),
    ],
)
def test_a_tensor_unlike_its_spec_is_refused(tmp_path: Path, value: torch.Tensor, said: str) -> None:
    specs = [TensorSpec("ok", (1,), torch.float32), TensorSpec("layers.1.w", (2, 3), torch.float32)]
    produce = {"ok": torch.ones(1), "layers.1.w": value}.__getitem__
    with pytest.raises(ValueError, match=r"'layers\.1\.w' \(file model-00002-of-00002\.safetensors\).*" + said):
        write_safetensors(tmp_path, specs, lambda spec: produce(spec.name), max_shard_size=24)
    assert not (tmp_path / INDEX_FILE).exists()


def test_digests_match_the_files_and_output_is_reproducible(tmp_path: Path) -> None:
    tensors = _sample_tensors()
    runs = []
    for run in ("one", "two"):
        directory = tmp_path / run
        directory.mkdir()
        digests = write_safetensors(directory, _specs(tensors), lambda spec: tensors[spec.name], max_shard_size=64)
        assert {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in digests} == digests
        runs.append({p.name: p.read_bytes() for p in directory.iterdir()})
    assert runs[0] == runs[1]


def test_a_failure_midway_leaves_no_index_and_no_complete_looking_shard(tmp_path: Path) -> None:
    specs = [TensorSpec(f"t{i}", (4,), torch.float32) for i in range(4)]  # 16 B each, two per 32 B file

    def produce(spec: TensorSpec) -> torch.Tensor:
        if spec.name == "t3":
            raise OSError("source went away")
        return torch.ones(4)

    with pytest.raises(OSError, match="source went away"):
        write_safetensors(tmp_path, specs, produce, max_shard_size=32)
    assert not (tmp_path / INDEX_FILE).exists()
    load_file(tmp_path / "model-00001-of-00002.safetensors")  # finished before the failure
    with pytest.raises(Exception):  # header promises t3's bytes, which never came
        load_file(tmp_path / "model-00002-of-00002.safetensors")


def test_existing_files_are_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        write_safetensors(tmp_path, [TensorSpec("w", (1,), torch.float32)], lambda spec: torch.ones(1))
    assert (tmp_path / "model.safetensors").read_bytes() == b"old"


def test_refused_inputs_and_given_metadata(tmp_path: Path) -> None:
    spec = TensorSpec("w", (2,), torch.float32)
    with pytest.raises(ValueError, match="listed twice"):
        write_safetensors(tmp_path, [spec, spec], lambda s: torch.ones(2))
    with pytest.raises(ValueError, match="reserved"):
        write_safetensors(tmp_path, [TensorSpec("__metadata__", (2,), torch.float32)], lambda s: torch.ones(2))
    with pytest.raises(TypeError):
        write_safetensors(tmp_path, [spec], lambda s: torch.ones(2), metadata={"format": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        TensorSpec("w", (-1,), torch.float32)
    assert list(tmp_path.iterdir()) == []  # all refused before any file was opened

    write_safetensors(tmp_path, [spec], lambda s: torch.ones(2), metadata={"format": "pt", "producer": "osdpipe"})
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "producer": "osdpipe"}


def test_no_tensors_gives_one_empty_readable_file(tmp_path: Path) -> None:
    digests = write_safetensors(tmp_path, [], lambda spec: pytest.fail("nothing to produce"), max_shard_size=8)
    assert list(digests) == ["model.safetensors"]
    assert load_file(tmp_path / "model.safetensors") == {}


def test_lazy_conjugate_and_negative_views_are_written_resolved(tmp_path: Path) -> None:
    # contiguous() keeps torch's lazy conj/neg bits; the bytes written must be the values the tensor shows.
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    n = torch.tensor([1.0, -2.0])._neg_view()
    assert z.is_conj() and n.is_neg()
    tensors = {"z": z, "n": n}
    write_safetensors(tmp_path, _specs(tensors), lambda spec: tensors[spec.name])
    loaded = load_file(tmp_path / "model.safetensors")
    _assert_bitwise_equal(loaded, {"z": z.resolve_conj(), "n": n.resolve_neg()})
