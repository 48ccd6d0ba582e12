"""Time and bytes of each stage for a larger MLP, 4 source ranks -> 2 target ranks.

Run: python benchmarks/reshard.py --width 1024 --depth 8
Prints one table row per stage (seconds are the slowest rank's; bytes summed over ranks).
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time

from osdpipe.pipeline.execute import execute
from osdpipe.spec.config import validate
from osdpipe.spec.plan import plan_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--source-ranks", type=int, default=4)
    parser.add_argument("--target-ranks", type=int, default=2)
    parser.add_argument(
        "--checks",
        default="roundtrip,load_step",
        help="verify checks to run (reference needs the full state on every rank)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        spec = validate(
            {
                "model": {"factory": "mlp", "kwargs": {"width": args.width, "depth": args.depth}},
                "source": {"world_size": args.source_ranks, "wrap": ["Linear"]},
                "target": {"world_size": args.target_ranks, "wrap": ["Linear"], "use_orig_params": True},
                "generate": {"steps": 1},
                "pipeline": {"checks": args.checks.split(",") if args.checks else []},
                "runtime": {"progress": False},
                "output": {"path": out},
            }
        )
        start = time.perf_counter()
        report = execute(plan_run(spec))
        total = time.perf_counter() - start
    params = args.depth * (args.width * args.width + args.width)
    print(
        f"mlp width={args.width} depth={args.depth}: {params:,} parameters, "
        f"{args.source_ranks} -> {args.target_ranks} ranks, ok={report.ok}"
    )
    print(f"{'stage':<10} {'seconds':>10} {'MB moved':>10}")
    for s in report.stages:
        print(f"{s.name:<10} {s.seconds:>10.3f} {s.bytes / 1e6:>10.1f}")
    print(f"{'total':<10} {total:>10.3f}   (incl. generating the source and starting both worlds)")
    print(f"launcher peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB")


if __name__ == "__main__":
    main()
