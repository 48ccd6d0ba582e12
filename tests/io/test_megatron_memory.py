"""A Megatron conversion holds its source whole (not streamed yet): a save larger than the memory the machine has
available is refused in one line before anything is read or written, rather than killed for memory hours into the
read; what the machine has available is the kernel's own figure, or a cgroup's limit where that is lower."""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic_megatron import synthetic_save

from osdpipe.core import memory
from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.dcp_reader import DcpCheckpoint
from osdpipe.io.formats.megatron import iteration_folder, read_save, stored_bytes


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


def test_a_save_larger_than_the_memory_available_is_refused_in_one_line_before_anything_is_written(
    tmp_path: Path, monkeypatch
) -> None:
    import osdpipe

    source = synthetic_save(tmp_path, tp=2)
    need = stored_bytes(DcpCheckpoint(str(iteration_folder(source)), None))
    monkeypatch.setattr(memory, "available_bytes", lambda: need - 1)
    out = tmp_path / "out"
    with pytest.raises(InputError) as err:
        osdpipe.reshard_megatron(source, out, tp=1, dp=2)
    said = str(err.value)
    assert "\n" not in said and "reading this save whole takes" in said and "run it on a machine with more" in said
    assert not out.exists() or not any(out.iterdir())
    with pytest.raises(InputError, match="reading this save whole"):  # a conversion into a PyTorch job's layout too
        from osdpipe.io.formats.megatron_source import MegatronReader

        MegatronReader(str(source))
    monkeypatch.setattr(memory, "available_bytes", lambda: need)  # exactly enough: converted
    assert osdpipe.reshard_megatron(source, out, tp=1, dp=2)["target"]["dp"] == 2
