"""A Megatron conversion holds its source whole (not streamed yet), and one into another Megatron grid its output read
back beside it: a save whose tensors, that many times over, need more memory than the machine has available is
refused in one line before anything is read or written, rather than killed for memory hours into the read; what the
machine has available is the kernel's own figure, or a cgroup's limit where that is lower."""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic_megatron import synthetic_save

from osdpipe.core import memory
from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.dcp_reader import DcpCheckpoint
from osdpipe.io.formats.megatron import iteration_folder, read_save, stored_bytes, vocabulary_padding_bytes


def _meminfo(path: Path, available_kb: int, swap_kb: int) -> Path:
    path.write_text(f"MemTotal:       99999999 kB\nMemFree:          1 kB\nMemAvailable:   {available_kb} kB\n"
                    f"SwapTotal:      {swap_kb} kB\nSwapFree:       {swap_kb} kB\n")
    return path


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_available_memory_is_memavailable_and_swapfree_or_a_lower_cgroup_limit(tmp_path: Path, monkeypatch,
                                                                               version: str) -> None:
    monkeypatch.setattr(memory, "_MEMINFO", _meminfo(tmp_path / "meminfo", 1000, 24))
    limit, usage = tmp_path / "limit", tmp_path / "usage"
    monkeypatch.setattr(memory, "_CGROUPS", ((limit, usage),))
    assert memory.available_bytes() == 1024 * 1024  # no cgroup files: the kernel's figure
    limit.write_text("max\n" if version == "v2" else f"{2**63 - 4096}\n")
    usage.write_text("5\n")
    assert memory.available_bytes() == 1024 * 1024  # no limit
    limit.write_text("400005\n")
    assert memory.available_bytes() == 400000  # the group's limit, less what it holds, is lower
    limit.write_text(str(10**12))
    assert memory.available_bytes() == 1024 * 1024  # a limit above what the machine has: the machine's
    monkeypatch.setattr(memory, "_MEMINFO", tmp_path / "absent")
    assert memory.available_bytes() is None  # nothing known: nothing is refused on it


def test_the_saves_stored_bytes_are_what_reading_it_holds_and_its_padding(tmp_path: Path) -> None:
    """What the refusal stands on: the tensors the save's metadata lists are, in bytes, what the read holds, and the
    padding a dp_reshardable bucket puts between its parameters (at most 63 elements each: 0.4 % of this tiny model,
    nothing of a real one), which every conversion's output, held beside, outweighs."""
    source = synthetic_save(tmp_path, tp=2)
    save = read_save(source)
    held = sum(t.nbytes for t in save.model.values()) + sum(t.nbytes for s in save.optim.values() for t in s.values())
    padding = 63 * 4 * len(save.optim) * len(next(iter(save.optim.values()))) * 2  # per state, parameter and TP rank
    assert held <= stored_bytes(DcpCheckpoint(str(iteration_folder(source)), None)) <= held + padding


def _twice(source: Path) -> int:
    """What a conversion of ``source`` into another Megatron grid is refused under: the save, and its read-back."""
    checkpoint = DcpCheckpoint(str(iteration_folder(source)), None)
    stored = stored_bytes(checkpoint)
    return 2 * stored - vocabulary_padding_bytes(checkpoint, read_save(source).args, 3)


def test_a_save_larger_than_the_memory_available_is_refused_in_one_line_before_anything_is_written(
    tmp_path: Path, monkeypatch
) -> None:
    """Into another Megatron grid the run holds the save and its output read back beside it (the verify stage), so it
    needs the save's bytes twice (less the vocabulary's padding, which the target may pad less); into a PyTorch job's
    layout (the range pipeline's reader) or a Hugging Face folder, once at the least."""
    import osdpipe
    from osdpipe.io.formats.megatron_source import MegatronReader

    source = synthetic_save(tmp_path, tp=2)
    need, twice = stored_bytes(DcpCheckpoint(str(iteration_folder(source)), None)), _twice(source)
    assert need < twice < 2 * need  # this save pads its vocabulary (1000 rows to 1152)
    out = tmp_path / "out"
    monkeypatch.setattr(memory, "available_bytes", lambda: twice - 1)  # the save fits once, not with its read-back
    with pytest.raises(InputError) as err:
        osdpipe.reshard_megatron(source, out, tp=1, dp=2)
    said = str(err.value)
    assert "\n" not in said and "holds its tensors twice at once" in said and "run it on a machine with more" in said
    assert f"{twice / 1e9:.1f} GB of memory" in said
    assert not out.exists() or not any(out.iterdir())
    assert MegatronReader(str(source)).states  # a conversion into a PyTorch job's layout holds it once: read

    monkeypatch.setattr(memory, "available_bytes", lambda: need - 1)
    with pytest.raises(InputError, match="reading this save whole takes"):
        MegatronReader(str(source))
    monkeypatch.setattr(memory, "available_bytes", lambda: twice)  # exactly enough: converted
    assert osdpipe.reshard_megatron(source, out, tp=1, dp=2)["target"]["dp"] == 2


@pytest.mark.parametrize("tp", [1, 4])
def test_the_read_back_beside_the_save_is_what_the_twice_stands_on(tmp_path: Path, tp: int) -> None:
    """What ``copies_held=2`` stands on: the written save, read back, holds the source's tensor bytes again (each
    weight, master and moment) but for the vocabulary's padding rows, which a grid of fewer TP ranks pads less; the
    verify stage holds both."""
    import osdpipe

    source = synthetic_save(tmp_path, tp=2)
    osdpipe.reshard_megatron(source, tmp_path / "out", tp=tp, dp=1)
    back, save = read_save(tmp_path / "out"), read_save(source)

    def held(s):
        return sum(t.nbytes for t in s.model.values()) + sum(t.nbytes for o in s.optim.values() for t in o.values())

    padding = vocabulary_padding_bytes(DcpCheckpoint(str(iteration_folder(source)), None), save.args, 3)
    assert held(back) >= held(save) - padding > 0
    assert (held(back) < held(save)) == (tp == 1)  # TP1 pads to 1056 rows, TP4 to 1152 as TP2 does
