"""osdpipe.reshard_megatron against the limit: a 1.6 GB Megatron-LM save, TP2 PP2 DP1 -> TP1 PP1 DP4, offline.

Run (from the repository root; about 10 GB of free disk):

    python benchmarks/megatron_reshard.py --repeats 3

The source is synthesised once: a GPT of Megatron-LM's shape (GQA, SwiGLU, untied, hidden 1024, 4 layers, vocabulary
20000 padded) with random fp32 weights, masters and moments, written by osdpipe's own writer at TP2 PP2 DP1
``dp_reshardable`` (the tests show megatron-core loads what that writer writes). Then, alternating in every repeat:

* ``osdpipe``: ``osdpipe.reshard_megatron(source, out, tp=1, pp=1, dp=4)`` in a fresh process: read whole,
  written for the target, read back and compared bit for bit, committed (synced);
* ``osdpipe 2 writers``: the same with ``workers=2`` (the command's ``runtime.workers=2``): two forked processes
  write the output's files;
* ``limit``: every file of the source's folder copied by ``dd`` with ``conv=fdatasync`` (as osdpipe syncs what it
  commits): reading and writing the same bytes once.

It prints one table: median seconds, the ratio to the limit, and each path's peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPT = {
    "num_layers": 4, "hidden_size": 1024, "ffn_hidden_size": 4096, "num_attention_heads": 16, "num_query_groups": 4,
    "group_query_attention": True,
    "kv_channels": 64, "vocab_size": 20000, "make_vocab_size_divisible_by": 128, "swiglu": True,
    "untie_embeddings_and_output_weights": True, "transformer_impl": "local", "add_bias_linear": False,
    "normalization": "RMSNorm", "position_embedding_type": "rope", "seq_length": 2048,
}


def make_source(folder: Path) -> int:
    """The synthetic source at TP2 PP2 DP1; its bytes on disk."""
    import torch

    from osdpipe.io.formats.megatron import MegatronSave
    from osdpipe.io.formats.megatron_writer import Target, target_args, write_save
    from osdpipe.layout import megatron as layout

    args = target_args({**GPT, "iteration": 100}, Target(2, 2, 1, "dp_reshardable"))
    gpt = layout.Gpt(
        GPT["num_layers"], GPT["hidden_size"], GPT["ffn_hidden_size"], GPT["num_attention_heads"],
        GPT["num_query_groups"], GPT["kv_channels"], args["padded_vocab_size"], True,
    )
    generator = torch.Generator().manual_seed(0)
    shapes = layout.global_shapes(gpt)
    model = {k: torch.randn(s, generator=generator) for k, s in shapes.items()}
    optim = {
        k: {"param": model[k].clone(), "exp_avg": torch.randn(s, generator=generator),
            "exp_avg_sq": torch.rand(s, generator=generator)}
        for k, s in shapes.items()
    }
    one_dim = sorted(k for k in shapes if layout.without_weight_decay(k, shapes[k]))
    # torch.optim.AdamW's hyperparameters, as megatron-core's optimizer on CPU saves them (a framework's job reads them)
    hyper = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False, "maximize": False, "foreach": None,
             "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True, "step": 100.0}
    groups = [
        {**hyper, "wd_mult": 1.0, "weight_decay": 0.1, "params": sorted(set(shapes) - set(one_dim))},
        {**hyper, "wd_mult": 0.0, "weight_decay": 0.0, "params": one_dim},
    ]
    save = MegatronSave(folder, 100, args, "dp_reshardable", model, optim, groups, {"num_steps": 100},
                        common={"checkpoint_version": 3.0, "num_floating_point_operations_so_far": 0.0},
                        gbuf_dtypes="torch.float32, torch.float32")
    write_save(save, folder, Target(2, 2, 1, "dp_reshardable"))
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def timed(cmd: list[str]) -> tuple[float, float | None]:
    """Seconds of ``cmd`` in a fresh process, and the peak RSS in GB it reports (``peak_rss_kb=`` on stdout)."""
    start = time.perf_counter()
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    said = [line for line in done.stdout.splitlines() if line.startswith("peak_rss_kb=")]
    return seconds, (int(said[-1].split("=")[1]) / 1e6 if said else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--convert", nargs=3, metavar=("SOURCE", "OUT", "WORKERS"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.convert:
        import osdpipe

        osdpipe.reshard_megatron(opts.convert[0], opts.convert[1], tp=1, pp=1, dp=4, workers=int(opts.convert[2]))
        print(f"peak_rss_kb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}")
        return 0
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="megatron_bench_"))
    source = work / "source"
    if not (source / "latest_checkpointed_iteration.txt").exists():
        shutil.rmtree(source, ignore_errors=True)
        size = make_source(source)
    else:
        size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    print(f"source: {size / 1e9:.2f} GB at TP2 PP2 DP1 (dp_reshardable), {source}")
    runs: dict[str, list[tuple[float, float]]] = {"osdpipe": [], "osdpipe 2 writers": [], "limit": []}
    for _ in range(opts.repeats):
        for path in runs:
            out = work / f"out_{path.replace(' ', '_')}"
            shutil.rmtree(out, ignore_errors=True)
            if path.startswith("osdpipe"):
                workers = "2" if "writers" in path else "1"
                runs[path].append(timed([sys.executable, __file__, "--convert", str(source), str(out), workers]))
            else:
                copy = (f"cd '{source}' && find . -type d -exec mkdir -p '{out}/{{}}' ';' && find . -type f -exec "
                        f"dd if='{{}}' of='{out}/{{}}' bs=16M conv=fdatasync status=none ';'")
                runs[path].append(timed(["bash", "-c", copy]))
            shutil.rmtree(out, ignore_errors=True)
    limit = statistics.median(s for s, _ in runs["limit"])
    print(f"\nmedian of {opts.repeats}, alternating; TP2 PP2 DP1 -> TP1 PP1 DP4")
    print("| path | median s | min s | max s | x limit | peak RSS GB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path, got in runs.items():
        seconds = [s for s, _ in got]
        median = statistics.median(seconds)
        peaks = [r for _, r in got if r is not None]
        peak = f"{max(peaks):.2f}" if peaks else "-"
        print(f"| {path} | {median:.1f} | {min(seconds):.1f} | {max(seconds):.1f} | {median / limit:.2f} | {peak} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
