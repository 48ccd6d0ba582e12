"""Two checkouts of osdpipe, alternating, on the same s3 -> s3 conversion under ``runtime.memory_budget``: what a
change did to a run whose output is made as it is written (the path ``benchmarks/s3_reshard.py`` does not take).

Run (from the repository root, after ``python benchmarks/s3_reshard.py --workdir /tmp/s3bench`` made the source):

    git worktree add /tmp/wt_before <commit>
    git worktree add /tmp/wt_after HEAD
    python benchmarks/s3_budget_ab.py /tmp/wt_before /tmp/wt_after --budget 1GB --workdir /tmp/s3bench

It starts moto's server as ``s3_reshard.py`` does, uploads the 1.6 GB source there, and runs the ``osdpipe`` command
of ``s3_reshard.py``'s first path (4 -> 2 FSDP2 ranks, DCP out, offline, ``pipeline.checks=[roundtrip]``) with
``runtime.memory_budget`` (``--budget none``: without) and the overrides ``--set`` gives, each checkout on
``PYTHONPATH``, alternating, ``--repeats`` times; then a table: median, min and max seconds, the CPU seconds of the
command and of the server, the command's peak RSS, and the ranged GETs of the last repeat. (Online, the ranks are
forked from the rank server, not from the command: the client's CPU and RSS are then the command's process alone.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import s3_reshard as bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs=2, help="two osdpipe checkouts (git worktrees): before, after")
    parser.add_argument("--budget", default="1GB", help="runtime.memory_budget (default 1GB; none: no budget)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/s3bench", help="where s3_reshard.py made the source")
    parser.add_argument("--server", choices=("moto", "s3rver"), default="moto", help="as s3_reshard.py's")
    parser.add_argument("--set", nargs="*", default=[], metavar="OVERRIDE",
                        help="more overrides for both checkouts (runtime.mode=online, say)")  # fmt: skip
    opts = parser.parse_args()
    work = Path(opts.workdir).resolve()
    source = work / "src" / "dcp"
    if not (source / ".metadata").exists():
        raise SystemExit(f"no source in {source}: run benchmarks/s3_reshard.py --workdir {work} first")
    log = work / f"{opts.server}-ab.log"
    server, endpoint = bench.start_server(log, "s3", opts.server)
    env = bench.environment(endpoint, "s3", opts.server)
    os.environ.update(env)
    runs: dict[str, list[tuple[float, float, float, float]]] = {c: [] for c in opts.checkouts}
    gets: dict[str, int | str] = {}
    try:
        fs = bench.filesystem("s3")
        fs.mkdir(bench.BUCKET)
        fs.put(f"{source}/", f"{bench.BUCKET}/src/dcp/", recursive=True)
        for repeat in range(opts.repeats):
            for checkout in runs:
                if fs.exists(f"{bench.BUCKET}/out"):
                    fs.rm(f"{bench.BUCKET}/out", recursive=True)
                shutil.rmtree(work / "outputs", ignore_errors=True)
                cmd = [sys.executable, "-m", "osdpipe", *bench.conversion(bench.WIDTH),
                       f"input.path=s3://{bench.BUCKET}/src/dcp", f"output.path=s3://{bench.BUCKET}/out"]  # fmt: skip
                cmd += [] if opts.budget == "none" else [f"runtime.memory_budget={opts.budget}"]
                cmd += opts.set
                logged = log.stat().st_size
                *measured, said = bench.timed(cmd, work, {**env, "PYTHONPATH": checkout}, server)
                if "check roundtrip  pass" not in said:
                    raise SystemExit(f"{checkout}: the roundtrip check did not pass:\n{said[-2000:]}")
                runs[checkout].append(tuple(measured))
                gets[checkout] = bench.requests_in(log, logged)["ranged GET"] if opts.server == "moto" else "-"
                print(bench.said_repeat(repeat, checkout, runs[checkout][-1]), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"\nruntime.memory_budget={opts.budget} {' '.join(opts.set)}, s3 -> s3 on {opts.server}, "
          f"median of {opts.repeats}, alternating")  # fmt: skip
    print("| checkout | median s | min s | max s | client CPU s | server CPU s | peak RSS GB | ranged GETs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for checkout, got in runs.items():
        median, least, most, client, served, rss = bench.medians(got)
        print(f"| {checkout} | {median:.1f} | {least:.1f} | {most:.1f} | {client:.1f} | {served:.1f} | {rss:.2f} | "
              f"{gets[checkout]} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
