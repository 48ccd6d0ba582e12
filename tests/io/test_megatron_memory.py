"""A Megatron conversion into another Megatron grid reads its source by ranges, through the stages every conversion
runs: under ``runtime.memory_budget`` a rank holds the budget, not the save. A conversion by Megatron's own stages
(a Hugging Face folder of the save; a PyTorch job's layout) still holds the save's tensors it reads: a save that needs
more memory than the machine has available is refused in one line before anything is read or written, rather than
killed for memory hours into the read; what the machine has available is the kernel's own figure, or a cgroup's limit
where that is lower."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_command, user_env
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


def test_a_save_larger_than_the_memory_available_is_refused_in_one_line_before_anything_is_read(
    tmp_path: Path, monkeypatch
) -> None:
    """Into a PyTorch job's layout (the save read whole, mapped to its model's names) the reader holds the optimizer's
    states (the fp32 masters stand in for the module's weights): refused one byte short of those, read with them."""
    from osdpipe.io.formats.megatron_source import MegatronReader

    source = synthetic_save(tmp_path, tp=2)
    checkpoint = DcpCheckpoint(str(iteration_folder(source)), None)
    need, optimizer = stored_bytes(checkpoint), stored_bytes(checkpoint, weights=False)
    assert 0 < optimizer < need
    monkeypatch.setattr(memory, "available_bytes", lambda: optimizer - 1)
    with pytest.raises(InputError, match=r"reading this save's optimizer states \(param, exp_avg, exp_avg_sq\) takes"):
        MegatronReader(str(source))
    monkeypatch.setattr(memory, "available_bytes", lambda: optimizer)  # exactly enough for the reader
    assert MegatronReader(str(source)).states


def test_the_pytorch_jobs_reader_reads_and_holds_no_module_weights(tmp_path: Path) -> None:
    """The reader of a Megatron save for a PyTorch job serves the fp32 masters as the weights, so the module's copy
    (the training dtype's) is never read: it reads the optimizer's bytes alone."""
    from osdpipe.io.formats.megatron_source import STATES, MegatronReader

    source = synthetic_save(tmp_path, tp=2)
    checkpoint = DcpCheckpoint(str(iteration_folder(source)), None)
    told: list[tuple[int, int]] = []
    save = read_save(source, weights=False, on_read=lambda done, total: told.append((done, total)))
    assert save.model == {} and set(next(iter(save.optim.values()))) == set(STATES)
    assert told[-1][1] == stored_bytes(checkpoint, weights=False)
    assert told[-1][0] <= told[-1][1]  # a dp_reshardable bucket's padding is listed, not read
    whole = read_save(source)
    assert whole.model and all(k in whole.optim for k in save.optim)
    reader = MegatronReader(str(source))
    assert set(reader.states) == set(STATES) and reader.states["param"]


def test_a_conversion_to_another_grid_holds_the_budget_not_the_save(tmp_path: Path) -> None:
    """Under ``runtime.memory_budget`` (and ``pipeline.checks=[roundtrip]``, which compares as the output is written),
    the command's own memory (its anonymous peak less what the process held once started, as report.json gives it)
    stays within the budget and a few MB of the process's own, whatever the save's size: into ``dp_reshardable``
    buckets and into another TP's vocabulary padding alike, each rank's output made as it is written, read by ranges
    of the save's memory-mapped chunks. Without a budget a rank holds its output (half the save, and all of it)."""
    source = synthetic_save(tmp_path, tp=2, layers=4, width=256, vocab=8000)  # 6.5M parameters: 104 MB of tensors
    budget = 8 << 20
    grids = {"buckets": ["target.tp_size=1", "target.pp_size=2", "target.world_size=2"],
             "vocabulary": ["target.tp_size=1", "target.world_size=1",  # TP1 pads the vocabulary to fewer rows
                            "output.megatron_optim_format=fully_reshardable"]}
    for name, args in grids.items():
        for limit in (budget, None):  # a process each: one that ran a conversion before keeps what it freed
            out = tmp_path / f"{name}-{limit}"
            done = subprocess.run([sys.executable, "-m", "osdpipe", "checkpoint=megatron", f"input.path={source}",
                                   *args, f"output.path={out}", f"runtime.memory_budget={limit or 'null'}",
                                   "pipeline.checks=[roundtrip]"], capture_output=True, text=True, timeout=240,
                                  env=user_env())
            assert done.returncode == 0, done.stderr[-2000:]
            report = json.loads((out / "report.json").read_text())
            peak = report["memory"][0]
            held = peak["peak_anonymous"] - peak["baseline_anonymous"]
            output = max(report["output_bytes"])  # a rank's output: more than the budget and the process's own
            assert output > limit + (24 << 20) if limit is not None else True
            if limit is None:
                assert held > output, f"{name}: held {held} bytes, a rank's output {output}"
            else:
                assert report["memory_budget"] == limit and held < limit + (24 << 20), f"{name}: held {held} bytes"


@pytest.mark.parametrize("naming", ["hf", "torchtitan"])
def test_the_configs_look_at_a_save_reads_no_tensor_and_describes_what_the_run_reads(
    tmp_path: Path, monkeypatch, naming: str
) -> None:
    """Working out the config describes a save for a PyTorch job (its parameters' names, shapes and dtypes, the param
    groups) from common.pt, .metadata and the groups' small items: the same description as the save read whole, with
    no tensor's bytes read (a read raises here), so the run reads the save once."""
    from osdpipe.io.formats.megatron_source import MegatronReader

    source = synthetic_save(tmp_path, tp=2, pp=2, tied=naming == "torchtitan")
    read = MegatronReader(str(source), naming).meta()

    def no_tensor(*_: object) -> None:
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(DcpCheckpoint, "read_range", no_tensor)
    monkeypatch.setattr(DcpCheckpoint, "read_parts", no_tensor)
    described = MegatronReader(str(source), naming, tensors=False).meta()
    assert described.param_groups == read.param_groups and read.param_groups
    assert described.state.keys() == read.state.keys()
    for fqn, entry in read.state.items():
        assert described.state[fqn] == entry, fqn  # TensorRefs: shape and dtype; the step's value
    with pytest.raises(AssertionError, match="a tensor was read"):
        MegatronReader(str(source), naming)


def _stored_reads(tmp_path: Path, *args: str) -> list[str]:
    """The stored tensors ``osdpipe *args`` reads, in order, one line each (the faults hook
    ``OSDPIPE_TEST_RECORD_READS``), after checking it succeeded and that it read none twice."""
    reads = tmp_path / "reads.txt"
    reads.unlink(missing_ok=True)
    done = run_command([sys.executable, "-m", "osdpipe", *args], cwd=tmp_path, timeout=240,
                       env=user_env(OSDPIPE_TEST_RECORD_READS=str(reads)))
    assert done.returncode == 0, done.stderr[-2000:]
    read = reads.read_text().splitlines()
    twice = sorted({flat for flat in read if read.count(flat) > 1})
    assert read and not twice, f"read more than once: {twice[:3]}"
    return read


def test_a_conversion_into_a_pytorch_job_reads_each_tensor_of_the_save_once(tmp_path: Path) -> None:
    """The command works out its config and checks the source with the save described, and the run reads it: every
    stored tensor of the optimizer is read once, and no weight of the module (the masters stand in for them). Before,
    the config's look, the source's check and the load stage each read the whole save."""
    source = synthetic_save(tmp_path, tp=2, pp=2)
    read = _stored_reads(tmp_path, "checkpoint=megatron", f"input.path={source}", "output.checkpoint=accelerate",
                         "target.kind=fsdp2", "target.world_size=2", "runtime.mode=offline",
                         f"output.path={tmp_path / 'out'}")
    assert all(flat.startswith("optimizer.") for flat in read)


@pytest.mark.parametrize("grid", ["dp_reshardable", "fully_reshardable"])
def test_a_hugging_face_folder_reads_the_fp32_masters_alone(tmp_path: Path, monkeypatch, grid: str) -> None:
    """``output.checkpoint=hf`` writes the fp32 masters: the command and ``osdpipe check`` read those alone, each
    once, never the module's weights or the moments (a dp_reshardable save's ``param`` buckets, a model-space save's
    ``optimizer.state.param`` items), and the memory refusal counts them alone."""
    import osdpipe
    from osdpipe.io.formats.megatron import MASTERS

    source = synthetic_save(tmp_path, tp=2)
    if grid == "fully_reshardable":
        osdpipe.reshard_megatron(source, tmp_path / "model_space", tp=2, dp=1, optim_format=grid)
        source = tmp_path / "model_space"
    checkpoint = DcpCheckpoint(str(iteration_folder(source)), None)
    masters = stored_bytes(checkpoint, weights=False, states=MASTERS)
    assert 0 < masters < stored_bytes(checkpoint, weights=False)
    out = tmp_path / "hf"
    for args in (["checkpoint=megatron", f"input.path={source}", "output.checkpoint=hf", f"output.path={out}"],
                 ["check", str(out)]):
        read = _stored_reads(tmp_path, *args)
        assert all(flat.endswith(".param") or flat.startswith("optimizer.state.param.") for flat in read), read[:3]
    monkeypatch.setattr(memory, "available_bytes", lambda: masters - 1)
    with pytest.raises(InputError, match=r"reading this save's optimizer states \(param\) takes"):
        read_save(source, within_memory=True, weights=False, states=MASTERS)
    monkeypatch.setattr(memory, "available_bytes", lambda: masters)
    assert set(next(iter(read_save(source, within_memory=True, weights=False, states=MASTERS).optim.values()))) == {
        "param"}
