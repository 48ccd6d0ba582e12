"""``osdpipe inspect`` reads metadata and headers, not tensor data: its time does not grow with the checkpoint.

Run:

    python benchmarks/inspect_speed.py --sizes 0.4,1.6 --repeats 5

For each size of Adam state it synthesizes the same checkpoints as
``checkpoint_scale.py`` (an ``fsdp_full`` file of the ``mlp``'s state, and a
4-rank ``dcp`` checkpoint of it), then times, alternating in every repeat,
whole commands in fresh processes:

* ``import torch`` and ``import torch.distributed.checkpoint``: the floor,
  Python's and torch's start-up, which inspect cannot go below (reading a
  DCP ``.metadata`` needs DCP's classes);
* ``osdpipe inspect`` of the file and of the directory.

It prints the medians and what inspect adds to its floor. The page cache is
left as it is: inspect reads a few pages either way.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_scale import synthesize, width_for  # noqa: E402


def seconds(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.4,1.6", help="GB of Adam state, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = parser.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="osdpipe-inspect-"))
    py = sys.executable
    rows = []
    for size in (float(s) for s in args.sizes.split(",")):
        directory = root / f"{size}GB"
        directory.mkdir(parents=True, exist_ok=True)
        full, dcp = synthesize(width_for(size), directory, 4)
        commands = {
            "import torch": [py, "-c", "import torch"],
            "inspect fsdp_full": [py, "-m", "osdpipe", "inspect", str(full)],
            "import torch.distributed.checkpoint": [py, "-c", "import torch.distributed.checkpoint"],
            "inspect dcp (4 ranks)": [py, "-m", "osdpipe", "inspect", str(dcp)],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, cmd in commands.items():
                times[name].append(seconds(cmd))
        medians = {name: statistics.median(t) for name, t in times.items()}
        state_gb = sum(p.stat().st_size for p in [full]) / 1e9
        rows.append((size, state_gb, medians))
    print(
        f"| state GB | file GB | {' | '.join(rows[0][2])} "
        "| inspect fsdp_full - import torch | inspect dcp - import dcp |"
    )
    print("| --- " * (len(rows[0][2]) + 4) + "|")
    for size, file_gb, m in rows:
        values = " | ".join(f"{v:.2f}" for v in m.values())
        extra_full = m["inspect fsdp_full"] - m["import torch"]
        extra_dcp = m["inspect dcp (4 ranks)"] - m["import torch.distributed.checkpoint"]
        print(f"| {size} | {file_gb:.2f} | {values} | {extra_full:.2f} | {extra_dcp:.2f} |")
    print(f"\nmedians of {args.repeats} runs, seconds, whole commands in fresh processes; checkpoints in {root}")


if __name__ == "__main__":
    main()
