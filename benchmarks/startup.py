"""What ``osdpipe`` costs before it does anything, and what a small conversion costs next to torch's own start-up.

Run:

    python benchmarks/startup.py            # median of 3
    python benchmarks/startup.py --runs 5

Each command runs as a user runs it, in a fresh process, timed whole (wall
seconds, ``time.perf_counter`` around the subprocess), once as a warm-up and
then ``--runs`` times; the table shows the medians side by side:

* ``osdpipe --help``, ``osdpipe --version`` and a config error
  (``target.world_size=zero``) against 0.5 s: none of them needs torch
  (about two seconds to import);
* the default conversion (``osdpipe output.path=<tmp>``: the built-in model
  trained on 2 ranks, converted to 3, every default check) against
  ``python -c "import torch.distributed"`` on the same machine, the ratio
  against 1.8;
* beside them, the floor no conversion that steps a real FSDP1 optimizer
  can go under: ``import torch.distributed.fsdp, torch._dynamo``, what a
  rank imports before its first step (``Optimizer.step`` imports
  ``torch._dynamo`` on every call, to mark a graph break), and the
  conversion as a multiple of it.

The commands alternate run by run, so that a machine whose speed drifts
slows them alike.

The command is the ``osdpipe`` script beside this Python (``python -m
osdpipe`` where there is none): a shim in front of it (pyenv's) would add its
own start-up. Exit code 0 when every figure is within its limit, 1 otherwise,
2 when a command did not do what it should (its output is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Seconds that --help, --version and a config error may take.
QUICK_LIMIT_S = 0.5
#: How many times ``import torch.distributed`` the default conversion may take.
CONVERSION_LIMIT = 1.8
#: torchrun's environment: the benchmark must not join a world it runs inside.
WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def osdpipe_command() -> list[str]:
    """The ``osdpipe`` console script of this Python's environment, or ``python -m osdpipe``."""
    script = Path(sys.executable).with_name("osdpipe")
    return [str(script)] if script.exists() else [sys.executable, "-m", "osdpipe"]


def run(cmd: list[str], expect: int, env: dict[str, str]) -> float:
    """Wall seconds of ``cmd`` in a fresh process; exits the benchmark (code 2) if it does not end with ``expect``."""
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    seconds = time.perf_counter() - start
    if done.returncode != expect:
        print(
            f"{' '.join(cmd)}: exit {done.returncode}, expected {expect}\n{done.stdout}\n{done.stderr}", file=sys.stderr
        )
        sys.exit(2)
    return seconds


def timed(cmds: dict[str, tuple[list[str], int]], runs: int, env: dict[str, str]) -> dict[str, list[float]]:
    """Each command's wall seconds over ``runs`` rounds after one warm-up round; the commands alternate within a round.

    An ``{out}`` in a command becomes a new directory every run.
    """
    times: dict[str, list[float]] = {name: [] for name in cmds}
    with tempfile.TemporaryDirectory(prefix="osdpipe-startup-") as scratch:
        for round_ in range(runs + 1):
            for index, (name, (cmd, expect)) in enumerate(cmds.items()):
                args = [a.replace("{out}", str(Path(scratch) / f"{index}-{round_}")) for a in cmd]
                seconds = run(args, expect, env)
                if round_ > 0:
                    times[name].append(seconds)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each command, after one warm-up (default 3)")
    runs = parser.parse_args().runs
    env = {k: v for k, v in os.environ.items() if k not in WORLD_ENV}
    osdpipe = osdpipe_command()
    shown = " ".join(osdpipe) if len(osdpipe) > 1 else "osdpipe"

    quick = timed(
        {
            f"{shown} --help": ([*osdpipe, "--help"], 0),
            f"{shown} --version": ([*osdpipe, "--version"], 0),
            f"{shown} target.world_size=zero": ([*osdpipe, "target.world_size=zero"], 2),
        },
        runs,
        env,
    )
    baseline = 'python -c "import torch.distributed"'
    floor_cmd = 'python -c "import torch.distributed.fsdp, torch._dynamo"'
    conversion = f"{shown} output.path=<tmp>"
    slow = timed(
        {
            baseline: ([sys.executable, "-c", "import torch.distributed"], 0),
            floor_cmd: ([sys.executable, "-c", "import torch.distributed.fsdp, torch._dynamo"], 0),
            conversion: ([*osdpipe, "output.path={out}"], 0),
        },
        runs,
        env,
    )

    rows = []
    ok = True
    for name, seconds in quick.items():
        median = statistics.median(seconds)
        within = median <= QUICK_LIMIT_S
        ok &= within
        rows.append((name, median, seconds, f"{QUICK_LIMIT_S:.2f} s", "yes" if within else "NO"))
    base = statistics.median(slow[baseline])
    rows.append((baseline, base, slow[baseline], "", ""))
    floor = statistics.median(slow[floor_cmd])
    rows.append((floor_cmd, floor, slow[floor_cmd], "", f"{floor / base:.2f}x"))
    median = statistics.median(slow[conversion])
    ratio = median / base
    within = ratio <= CONVERSION_LIMIT
    ok &= within
    verdict = f"{ratio:.2f}x {'yes' if within else 'NO'} ({median / floor:.2f}x the floor)"
    rows.append(
        (conversion, median, slow[conversion], f"{CONVERSION_LIMIT:.1f}x = {CONVERSION_LIMIT * base:.2f} s", verdict)
    )

    print(f"osdpipe start-up: wall seconds, median of {runs} after a warm-up ({sys.executable}, {os.cpu_count()} CPUs)")
    width = max(len(r[0]) for r in rows)
    print(f"{'command':<{width}}  {'median':>8}  {'runs':<22}  {'limit':<16}  within")
    for name, median, seconds, limit, verdict in rows:
        spread = " ".join(f"{s:.2f}" for s in seconds)
        print(f"{name:<{width}}  {median:>6.2f} s  {spread:<22}  {limit:<16}  {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
