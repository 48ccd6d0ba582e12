"""A mixture-of-experts save real megatron-core made, EP 2 -> EP 4 within a memory budget, against the limit.

Run (from the repository root, with the ``frameworks`` extra; about 20 GB of free disk and 8 GB of memory for the
save's one training step):

    python benchmarks/megatron_moe_reshard.py --repeats 3 --workdir /tmp/moe_bench

The source is made once (kept in ``--workdir``): real megatron-core 0.16.1 trains the tests' GPT (GQA, SwiGLU, RoPE,
RMSNorm, untied; hidden 1024, 6 layers, vocabulary 32000) with 8 experts in every layer (SequentialMLP, top-2, each
of FFN 2048) one step on 2 CPU ranks at EP 2 DP 2 with its DistributedOptimizer (a ChainedOptimizer: the dense
parameters' over DP 2, the experts' over expert DP 1) and saves it as Megatron-LM does (``dp_reshardable``, fp32:
about 6 GB; tests/frameworks/mcore.py's harness). Then, alternating in every repeat:

* ``osdpipe``: ``osdpipe checkpoint=megatron ... target.ep_size=4 target.world_size=4 runtime.memory_budget=1GB
  pipeline.checks=[roundtrip]``, a fresh process, offline: the experts' buffers laid out again over 4 expert-parallel
  ranks (expert DP 1), the dense ones over DP 4;
* ``limit``: every file of the source's folder copied by ``dd`` with ``conv=fdatasync``.

Then once each: ``runtime.workers=2`` (the same bytes, compared file by file) and EP 2 -> EP 1 on 2 ranks (the
experts dense: one optimizer). Each row gives the median seconds, the ratio to the limit and the peak RSS of the
largest process (report.json's ``memory``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megatron_reshard import ROOT, dd, osdpipe, print_table, run_once  # noqa: E402

#: The GPT the source is of, as the tests' megatron-core harness names its settings (tests/frameworks/mcore.py).
DIMS = {"VOCAB": 32000, "HIDDEN": 1024, "FFN": 2816, "LAYERS": 6, "HEADS": 16, "GROUPS": 4}
#: Its experts, as the harness's ``--moe`` takes them; the source's EP.
MOE = {"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 2048, "ep": 2}
BUDGET = "1GB"


def make_source(work: Path) -> Path:
    """The source: real megatron-core's save of the GPT of :data:`DIMS` with the experts of :data:`MOE` after one
    step at EP 2 DP 2."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "support")]
    from frameworks import mcore

    out = work / "source"
    argv = mcore.save_argv(out, tp=1, pp=1, sharding="dp_reshardable", steps=1, moe=MOE)
    argv += ["--dims", json.dumps(DIMS), "--no-truth"]
    mcore.run_job(work, 2, argv, label="save-source", timeout=3600)
    return out


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
    print(f"source: {size / 1e9:.2f} GB, real megatron-core MoE ({MOE['num_experts']} experts a layer) at EP2 DP2 "
          f"(dp_reshardable), {source}")
    grid = ("target.ep_size=4", "target.world_size=4", "runtime.mode=offline")
    budget = ("runtime.memory_budget=" + BUDGET, "pipeline.checks=[roundtrip]")
    rows: dict[str, list[tuple[float, float | None]]] = {"osdpipe EP2 -> EP4": [], "limit": []}
    for _ in range(opts.repeats):
        for path in rows:
            out = work / f"out_{path.split()[0]}"
            shutil.rmtree(out, ignore_errors=True)
            if path == "limit":
                rows[path].append((dd(source, out), None))
            else:
                seconds, peak, _ = osdpipe(source, out, *grid, *budget)
                rows[path].append((seconds, peak))
    kept = work / "out_osdpipe"
    once = {"osdpipe EP2 -> EP4, runtime.workers=2": (*grid, "runtime.workers=2", *budget),
            "osdpipe EP2 -> EP1 (2 ranks: the experts dense)": ("target.ep_size=1", "target.world_size=2", *budget)}
    same = run_once(source, work, once, rows, kept)
    shutil.rmtree(work / "out_limit", ignore_errors=True)
    limit = statistics.median(s for s, _ in rows["limit"])
    print(f"\nMoE EP2 DP2 -> EP4 DP4 (offline), runtime.memory_budget={BUDGET}; median of {opts.repeats} "
          "(alternating) or one run")
    print_table(rows, limit)
    print(f"\nruntime.workers=2 wrote the same bytes as one worker: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
