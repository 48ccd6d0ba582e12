"""A Hugging Face Llama's training checkpoint -> a Megatron-LM save: the time and the peak memory of the conversion and
of ``osdpipe check`` of its output, for one or two checkouts of osdpipe side by side.

Run (from the repository root; about 8 GB of free disk):

    python benchmarks/into_megatron.py --repeats 3
    git worktree add /tmp/wt_before <commit>
    python benchmarks/into_megatron.py --repeats 3 --checkouts /tmp/wt_before .   # before and after, alternating

The source is made once: the Megatron-LM save real megatron-core makes in ``benchmarks/megatron_reshard.py`` (hidden
1024, 20 layers, vocabulary 32000, fp32 weights, masters and moments after one step: 4.4 GB at TP2 DP1), converted
by this checkout into the Hugging Face Llama's accelerate ``save_state`` folder of an FSDP2 job on 2 ranks (the fp32
masters as the weights, Adam's moments, the step). Then, alternating in every repeat, each checkout on
``PYTHONPATH`` in a fresh process:

* ``convert``: ``osdpipe checkpoint=accelerate input.path=SOURCE output.checkpoint=megatron target.tp_size=2
  target.pp_size=2 target.world_size=4 output.path=OUT`` and ``--overrides`` (read through the map into Megatron's
  GPT, written, checked, committed);
* ``check``: ``osdpipe check OUT`` (every file against the manifest; the source read and mapped again and held
  against the output read back).

It prints one table: each path's median, min and max seconds, and its peak RSS against the source's bytes.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import megatron_reshard

HERE = Path(__file__).resolve().parent.parent


def peak_of(cmd: list[str]) -> int:
    """Run ``cmd``; print the peak RSS (kB) of the largest process it made, as ``peak_rss_kb=``; its exit code."""
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr[-3000:])
    print(f"peak_rss_kb={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}")
    return done.returncode


def timed(cmd: list[str], checkout: Path, cwd: Path) -> tuple[float, float]:
    """Seconds of ``cmd`` run with ``checkout``'s osdpipe in a fresh process, and its peak RSS in GB."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--peak", *cmd], cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{checkout}: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    said = [line for line in done.stdout.splitlines() if line.startswith("peak_rss_kb=")]
    return seconds, int(said[-1].split("=")[1]) / 1e6


def make_source(work: Path) -> Path:
    """The accelerate folder every checkout converts (made once, by this checkout): the ``save_state`` folder the
    conversion writes under its output (``dcp/``, ``config.json`` in it)."""
    source = work / "accelerate"
    if (source / "manifest.json").exists():
        return source / "dcp"
    megatron = work / "megatron" / "source"  # where megatron_reshard.make_source saves
    if not (megatron / "latest_checkpointed_iteration.txt").exists():
        shutil.rmtree(megatron.parent, ignore_errors=True)
        megatron = megatron_reshard.make_source(megatron.parent)
    shutil.rmtree(source, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "osdpipe", "checkpoint=megatron", f"input.path={megatron}",
                    "output.checkpoint=accelerate", "target.kind=fsdp2", "target.world_size=2",
                    f"output.path={source}", "runtime.mode=offline"], cwd=work, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(HERE)})  # fmt: skip
    return source / "dcp"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/into_megatron", help="keeps the source between invocations")
    parser.add_argument("--checkouts", nargs="+", default=[str(HERE)], help="osdpipe checkouts (git worktrees)")
    parser.add_argument("--overrides", nargs="*", default=[], help="keys of the conversion")
    parser.add_argument("--peak", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.peak:
        return peak_of(opts.peak)
    work = Path(opts.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    source = make_source(work)
    size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    print(f"source: {size / 1e9:.2f} GB, accelerate FSDP2 at 2 ranks (a Llama of Megatron's GPT), {source}")
    checkouts = [Path(c).resolve() for c in opts.checkouts]
    runs: dict[tuple[Path, str], list[tuple[float, float]]] = {}
    for repeat in range(opts.repeats):
        for checkout in checkouts:
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            convert = [sys.executable, "-m", "osdpipe", "checkpoint=accelerate", f"input.path={source}",
                       "output.checkpoint=megatron", "target.tp_size=2", "target.pp_size=2", "target.world_size=4",
                       f"output.path={out}", *opts.overrides]  # fmt: skip
            for path, cmd in (("convert", convert), ("check", [sys.executable, "-m", "osdpipe", "check", str(out)])):
                seconds, peak = timed(cmd, checkout, work)
                runs.setdefault((checkout, path), []).append((seconds, peak))
                print(f"  repeat {repeat + 1}: {checkout} {path}: {seconds:.1f} s, peak RSS {peak:.2f} GB", flush=True)
    print(f"\nmedian of {opts.repeats}, alternating; accelerate FSDP2 2 ranks -> Megatron TP2 PP2 DP1 "
          f"{' '.join(opts.overrides)}")
    print("| checkout | path | median s | min s | max s | peak RSS GB | x source |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (checkout, path), got in runs.items():
        seconds, peak = [s for s, _ in got], max(p for _, p in got)
        print(f"| {checkout} | {path} | {statistics.median(seconds):.1f} | {min(seconds):.1f} | {max(seconds):.1f} | "
              f"{peak:.2f} | {peak * 1e9 / size:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
