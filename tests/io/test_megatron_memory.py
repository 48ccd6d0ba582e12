"""A Megatron conversion reads its source by ranges, through the stages every conversion runs: under
``runtime.memory_budget`` a rank holds the budget, not the save; the config's look at a save reads no tensor; and a
conversion reads only the stored tensors its output needs, each once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_command, user_env
from synthetic_megatron import synthetic_save

from osdpipe.io import checkpoints
from osdpipe.io.formats.dcp_reader import DcpCheckpoint
from osdpipe.io.formats.megatron import iteration_folder


def test_a_conversion_holds_the_budget_not_the_save(tmp_path: Path) -> None:
    """Under ``runtime.memory_budget`` (and ``pipeline.checks=[roundtrip]``, which compares as the output is written),
    the command's own memory (its anonymous peak less what the process held once started, as report.json gives it)
    stays within the budget and a few MB of the process's own, whatever the save's size: into ``dp_reshardable``
    buckets, into another TP's vocabulary padding, and through the map into a PyTorch job's model and torchtitan's
    alike, each rank's output made as it is written, read by ranges of the save's memory-mapped chunks. Without a
    budget a rank holds its output (half the save, and all of it)."""
    source = synthetic_save(tmp_path, tp=2, layers=4, width=256, vocab=8000)  # 6.5M parameters: 104 MB of tensors
    budget = 8 << 20
    grids = {"buckets": ["target.tp_size=1", "target.pp_size=2", "target.world_size=2"],
             "vocabulary": ["target.tp_size=1", "target.world_size=1",  # TP1 pads the vocabulary to fewer rows
                            "output.megatron_optim_format=fully_reshardable"],
             "torchtitan": ["output.checkpoint=torchtitan", "target.kind=fsdp2", "target.world_size=1",
                            "runtime.mode=offline"]}
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
def test_the_configs_look_at_a_save_reads_no_tensor_and_names_the_jobs_parameters(
    tmp_path: Path, monkeypatch, naming: str
) -> None:
    """Working out the config describes a save for a PyTorch job (its parameters by the job's model's names, the
    param groups, the optimizer's states) from common.pt, .metadata and the groups' small items, no tensor's bytes read
    (a read raises here): the run reads the save once."""
    from osdpipe.io.checkpoints.megatron import Megatron
    from osdpipe.io.file_facts import read_facts
    from osdpipe.layout.models import meta_model

    source = synthetic_save(tmp_path, tp=2, pp=2, tied=naming == "torchtitan")

    def no_tensor(*_: object) -> None:
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(DcpCheckpoint, "read_range", no_tensor)
    monkeypatch.setattr(DcpCheckpoint, "read_parts", no_tensor)
    facts = read_facts(str(iteration_folder(source)), "megatron", naming)
    written_in = checkpoints.get("torchtitan" if naming == "torchtitan" else "pytorch")
    model = meta_model(*Megatron().model_from_files(str(source), written_in))
    assert sorted(facts.fqns) == sorted(name for name, _ in model.named_parameters())
    assert facts.optimizer == "AdamW" and facts.steps and facts.kind != "megatron"
    assert set(facts.state_names) == {"step", "exp_avg", "exp_avg_sq"}  # the masters are the weights


def _stored_reads(tmp_path: Path, *args: str) -> dict[str, list[tuple[int, int]]]:
    """The ranges of stored tensors ``osdpipe *args`` reads, by tensor (the faults hook ``OSDPIPE_TEST_RECORD_READS``),
    after checking it succeeded."""
    reads = tmp_path / "reads.txt"
    reads.unlink(missing_ok=True)
    done = run_command([sys.executable, "-m", "osdpipe", *args], cwd=tmp_path, timeout=240,
                       env=user_env(OSDPIPE_TEST_RECORD_READS=str(reads)))
    assert done.returncode == 0, done.stderr[-2000:]
    ranges: dict[str, list[tuple[int, int]]] = {}
    for line in reads.read_text().splitlines():
        flat, start, stop = line.rsplit(" ", 2)
        ranges.setdefault(flat, []).append((int(start), int(stop)))
    assert ranges
    return ranges


def test_a_conversion_into_a_pytorch_job_reads_the_masters_for_the_modules_weights(tmp_path: Path) -> None:
    """Read for a PyTorch job, the save's fp32 masters stand in for the module's weights: no weight of the module is
    read, and every element of every optimizer state is (the map leaves none out but the vocabulary's padding)."""
    source = synthetic_save(tmp_path, tp=2, pp=2)
    read = _stored_reads(tmp_path, "checkpoint=megatron", f"input.path={source}", "output.checkpoint=accelerate",
                         "target.kind=fsdp2", "target.world_size=2", "runtime.mode=offline",
                         f"output.path={tmp_path / 'out'}")
    assert all(flat.startswith("optimizer.") for flat in read), [f for f in read if not f.startswith("optimizer.")]
    checkpoint = DcpCheckpoint(str(iteration_folder(source)), None)
    states = {flat for flat in checkpoint.metadata.state_dict_metadata if flat.startswith("optimizer.distributed")
              and flat.rsplit(".", 1)[-1] in ("param", "exp_avg", "exp_avg_sq")}
    assert set(read) == states


@pytest.mark.parametrize("grid", ["dp_reshardable", "fully_reshardable"])
def test_a_hugging_face_folder_reads_the_fp32_masters_alone(tmp_path: Path, grid: str) -> None:
    """``output.checkpoint=hf`` writes the fp32 masters: the command and ``osdpipe check`` read those alone, each
    once, never the module's weights or the moments (a dp_reshardable save's ``param`` buckets, a model-space save's
    ``optimizer.state.param`` items)."""
    import osdpipe

    source = synthetic_save(tmp_path, tp=2)
    if grid == "fully_reshardable":
        osdpipe.reshard_megatron(source, tmp_path / "model_space", tp=2, dp=1, optim_format=grid)
        source = tmp_path / "model_space"
    out = tmp_path / "hf"
    for args in (["checkpoint=megatron", f"input.path={source}", "output.checkpoint=hf", f"output.path={out}"],
                 ["check", str(out)]):
        read = _stored_reads(tmp_path, *args)
        assert all(flat.endswith(".param") or flat.startswith("optimizer.state.param.") for flat in read), read[:3]
