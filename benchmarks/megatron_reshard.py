"""A save real megatron-core made, converted within a memory budget against the limit: TP2 DP1 -> TP1 DP2, offline.

Run (from the repository root, with the ``frameworks`` extra; about 25 GB of free disk and 10 GB of memory for the
save's one training step):

    python benchmarks/megatron_reshard.py --repeats 3 --workdir /tmp/megatron_bench

The source is made once (kept in ``--workdir``): real megatron-core 0.16.1 trains the tests' GPT (GQA, SwiGLU, RoPE,
RMSNorm, untied) at hidden 1024, 20 layers, vocabulary 32000, one step on 2 CPU ranks at TP2 DP1 with its
DistributedOptimizer, and saves it as Megatron-LM's ``save_checkpoint`` does (``dp_reshardable``, fp32: 4.6 GB;
tests/frameworks/mcore.py's harness). Then, alternating in every repeat:

* ``osdpipe``: ``osdpipe checkpoint=megatron ... target.tp_size=1 target.world_size=2 runtime.memory_budget=1GB
  pipeline.checks=[roundtrip]``, a fresh process: read by ranges, each rank's output made as it is written and
  compared with the source as it is, committed (synced);
* ``limit``: every file of the source's folder copied by ``dd`` with ``conv=fdatasync`` (as osdpipe syncs what it
  commits): reading and writing the same bytes once.

Then once each: ``runtime.workers=2`` (two processes, a target rank each: the same bytes, compared file by file),
the default checks (``roundtrip`` and ``resume``: a rank's output held for the steps), and through the model map, in
the same budget: a Hugging Face folder (``output.checkpoint=hf``: the fp32 masters as ``LlamaForCausalLM``'s weights)
and a torchtitan step folder for 2 FSDP2 ranks (``output.checkpoint=torchtitan``: llama3, optimizer included). Each
row gives the median seconds, the ratio to the limit and the peak RSS of the largest process (report.json's
``memory``).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The GPT the source is of, as the tests' megatron-core harness names its settings (tests/frameworks/mcore.py).
DIMS = {"VOCAB": 32000, "HIDDEN": 1024, "FFN": 2816, "LAYERS": 20, "HEADS": 16, "GROUPS": 4}
BUDGET = "1GB"


def make_source(work: Path) -> Path:
    """The source: real megatron-core's save of the GPT of :data:`DIMS` after one step at TP2 DP1."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "support")]
    from frameworks import mcore

    out = work / "source"
    argv = mcore.save_argv(out, tp=2, pp=1, sharding="dp_reshardable", steps=1)
    argv += ["--dims", json.dumps(DIMS), "--no-truth"]
    mcore.run_job(work, 2, argv, label="save-source", timeout=3600)
    return out


#: The target grid of the main rows: TP1 PP1 DP2.
GRID = ("target.tp_size=1", "target.world_size=2")


def osdpipe(source: Path, out: Path, *extra: str) -> tuple[float, float, dict]:
    """Seconds of the command in a fresh process, the largest process's peak RSS in GB, and its report."""
    cmd = [sys.executable, "-m", "osdpipe", "checkpoint=megatron", f"input.path={source}", f"output.path={out}",
           "runtime.progress=false", *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"osdpipe failed: {done.stderr[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    return seconds, max(m["peak_rss"] for m in report["memory"]) / 1e9, report


def dd(source: Path, out: Path) -> float:
    """Seconds of copying every file of ``source`` with ``dd conv=fdatasync``."""
    copy = (f"cd '{source}' && find . -type d -exec mkdir -p '{out}/{{}}' ';' && find . -type f -exec "
            f"dd if='{{}}' of='{out}/{{}}' bs=16M conv=fdatasync status=none ';'")
    start = time.perf_counter()
    subprocess.run(["bash", "-c", copy], check=True)
    return time.perf_counter() - start


def same_files(a: Path, b: Path) -> bool:
    """Whether two outputs hold the same save, file by file (the run's record and manifest aside)."""
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file() and p.parent != a)
    return names == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file() and p.parent != b) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", required=True)
    opts = parser.parse_args()
    work = Path(opts.workdir)
    work.mkdir(parents=True, exist_ok=True)
    source = work / "source"
    if not (source / "latest_checkpointed_iteration.txt").exists():
        shutil.rmtree(source, ignore_errors=True)
        source = make_source(work)
    size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    print(f"source: {size / 1e9:.2f} GB, real megatron-core at TP2 DP1 (dp_reshardable), {source}")
    rows: dict[str, list[tuple[float, float | None]]] = {"osdpipe": [], "limit": []}
    budget = ("runtime.memory_budget=" + BUDGET, "pipeline.checks=[roundtrip]")
    for _ in range(opts.repeats):
        for path in rows:
            out = work / f"out_{path}"
            shutil.rmtree(out, ignore_errors=True)
            if path == "osdpipe":
                seconds, peak, _ = osdpipe(source, out, *GRID, *budget)
                rows[path].append((seconds, peak))
            else:
                rows[path].append((dd(source, out), None))
    kept = work / "out_osdpipe"
    once = {"osdpipe runtime.workers=2": (*GRID, "runtime.workers=2", *budget),
            "osdpipe, default checks (roundtrip, resume)": (*GRID, "runtime.memory_budget=" + BUDGET),
            "osdpipe -> Hugging Face folder (map)": ("output.checkpoint=hf", *budget),
            "osdpipe -> torchtitan step folder, FSDP2 x2 (map)": (
                "output.checkpoint=torchtitan", "target.kind=fsdp2", "target.world_size=2", *budget)}
    same = run_once(source, work, once, rows, kept)
    shutil.rmtree(work / "out_limit", ignore_errors=True)
    limit = statistics.median(s for s, _ in rows["limit"])
    print(f"\nTP2 DP1 -> TP1 DP2 (and through the map), runtime.memory_budget={BUDGET}; median of {opts.repeats} "
          "(alternating) or one run")
    print_table(rows, limit)
    print(f"\nruntime.workers=2 wrote the same bytes as one worker: {same}")
    return 0


def run_once(source: Path, work: Path, once: dict[str, tuple[str, ...]],
             rows: dict[str, list[tuple[float, float | None]]], kept: Path) -> bool | None:
    """Each row of ``once`` run one time (its overrides), added to ``rows``, its checks and recorded budget printed;
    whether the ``runtime.workers`` row wrote the same files as ``kept`` (``None``: no such row)."""
    same = None
    for name, extra in once.items():
        out = work / f"out_{len(rows)}"
        shutil.rmtree(out, ignore_errors=True)
        seconds, peak, report = osdpipe(source, out, *extra)
        rows[name] = [(seconds, peak)]
        if "workers" in name:
            same = same_files(kept, out)
        checks = {c["name"]: c["ok"] for c in report["checks"]}
        print(f"{name}: checks {checks}, memory_budget recorded: {report['memory_budget']}")
        shutil.rmtree(out, ignore_errors=True)
    return same


def print_table(rows: dict[str, list[tuple[float, float | None]]], limit: float) -> None:
    """The side-by-side table: per path its runs' median, min and max seconds, the median's ratio to ``limit`` and
    the largest peak RSS."""
    print("| path | runs | median s | min s | max s | x limit | peak RSS GB (largest process) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path, got in rows.items():
        seconds = [s for s, _ in got]
        peaks = [r for _, r in got if r is not None]
        peak = f"{max(peaks):.2f}" if peaks else "-"
        print(f"| {path} | {len(got)} | {statistics.median(seconds):.1f} | {min(seconds):.1f} | {max(seconds):.1f} "
              f"| {statistics.median(seconds) / limit:.2f} | {peak} |")


if __name__ == "__main__":
    sys.exit(main())
