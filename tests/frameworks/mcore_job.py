"""One rank of a real megatron-core 0.16.1 job on CPU (launched by ``mcore.py`` under ``torchrun --standalone``).

Sub-commands (world N = TP x PP x DP, DP = N / (TP x PP)):

* ``save --tp T --pp P [--vpp V] --steps 3 --sharding dp_reshardable|fully_reshardable|fully_sharded_model_space
  [--bf16] [--bias none|linear|qkv] [--model llama|gpt] --out SAVE_DIR [--also SHARDING SAVE_DIR2 OUT2.pt]...
  [--resume-truth K --dump-after OUT2.pt] [--dims JSON] [--no-truth] [--moe JSON]``: with ``--dims``, the GPT of
  those settings (:func:`mcore.restore`'s names: a benchmark's larger one), and with ``--no-truth`` no gathered
  dump; with ``--moe`` (save and load), every layer's MLP a mixture of experts, ``{"num_experts": E,
  "moe_router_topk": K, "moe_ffn_hidden_size": F, "ep": EP}`` (:data:`mcore.MOE_OPTIONS`; ``ep``, the expert
  parallel size, divides DP, and is the job's own: a load names its own); train ``steps``
  steps (real forward/backward through
  Megatron's pipeline schedule), write exactly what Megatron-LM's ``save_checkpoint`` writes for
  ``--ckpt-format torch_dist``, and dump the gathered state to ``SAVE_DIR.truth.pt``; each ``--also`` saves the
  same trained job again in another sharding type to ``SAVE_DIR2`` (its own truth dump beside it; ``OUT2.pt``: where
  its resume truth goes); with ``--resume-truth`` the same live job then takes K synthetic steps and dumps again;
  with ``--logits OUT.pt`` (TP1 PP1) the trained model's logits on :func:`mcore.probe_tokens`, after the save, go to
  ``OUT.pt``.
* ``load --tp T --pp P [--vpp V] --from SAVE_DIR [--bf16] [--bias B] [--model M] [--sharding S] --dump OUT.pt
  [--resume K --dump-after OUT2.pt] [--dims-from-save] [--no-load-rng] [--logits OUT3.pt] [--moe JSON]``: build the
  job at that layout (with the save's own GPT dimensions, experts included: ``--dims-from-save``), load as
  Megatron-LM's ``load_checkpoint`` does (without its RNG states: ``--no-load-rng``), dump, optionally the loaded
  model's logits; optionally K synthetic steps and a second dump.
* ``each --plan PLAN.json``: each job of the plan (a JSON list of ``save`` or ``load`` argument lists), in turn, each
  built afresh at its own TP and PP on the same ranks (:func:`mcore.teardown` between): one launch for many.

The CPU patches are applied here, in the rank, never in the process that launches it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from frameworks import mcore  # noqa: E402
from frameworks.launch import run_then_leave  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mcore_job.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("save", "load"):
        s = sub.add_parser(name)
        s.add_argument("--tp", type=int, default=1)
        s.add_argument("--pp", type=int, default=1)
        s.add_argument("--vpp", type=int, default=1)
        s.add_argument("--bf16", action="store_true")
        s.add_argument("--sharding", choices=("dp_reshardable", "fully_reshardable", "fully_sharded_model_space"),
                       default=None)
        s.add_argument("--dump-after", type=Path, default=None)
        s.add_argument("--bias", choices=("none", "linear", "qkv"), default="none")
        s.add_argument("--model", choices=sorted(mcore.MODELS), default="llama")
        s.add_argument("--bucket-size", type=int, default=None)
        s.add_argument("--qk-layernorm", action="store_true")
        s.add_argument("--num-buckets", type=int, default=None)
        # a mixture of experts: {"num_experts", "moe_router_topk", "moe_ffn_hidden_size", "ep"} (mcore.MOE_OPTIONS)
        s.add_argument("--moe", type=json.loads, default=None)
    save = sub.choices["save"]
    save.add_argument("--steps", type=int, default=3)
    save.add_argument("--out", type=Path, required=True)
    save.add_argument("--also", nargs=3, action="append", default=[], metavar=("SHARDING", "SAVE_DIR", "DUMP_AFTER"))
    save.add_argument("--resume-truth", type=int, default=0)
    save.add_argument("--logits", type=Path, default=None)
    # the GPT's dimensions as the harness's settings name them (a benchmark's larger GPT), and no gathered truth
    save.add_argument("--dims", type=json.loads, default=None)
    save.add_argument("--no-truth", action="store_true")
    load = sub.choices["load"]
    load.add_argument("--from", dest="src", type=Path, required=True)
    load.add_argument("--dump", type=Path, required=True)
    load.add_argument("--resume", type=int, default=0)
    load.add_argument("--dims-from-save", action="store_true")
    load.add_argument("--no-load-rng", action="store_true")
    load.add_argument("--logits", type=Path, default=None)
    each = sub.add_parser("each")
    each.add_argument("--plan", type=Path, required=True)
    return p.parse_args(argv)


def log(msg: str) -> None:
    import torch

    if torch.distributed.get_rank() == 0:
        print(f"[mcore_job] {msg}", flush=True)


def main() -> None:
    opts = parse(sys.argv[1:])
    if opts.cmd == "each":
        harness = mcore.settings()
        for argv in json.loads(opts.plan.read_text()):
            mcore.restore(harness)
            job = run(parse(argv))
            mcore.teardown(job)
    else:
        run(opts)
    import torch

    torch.distributed.barrier()
    stop_children()


def run(opts: argparse.Namespace):
    """One ``save`` or ``load`` on these ranks; the job it built."""
    if (opts.resume_truth if opts.cmd == "save" else opts.resume) and opts.dump_after is None:
        raise SystemExit("--resume/--resume-truth needs --dump-after")
    start = time.monotonic()
    mcore.restore({"BIAS_LINEAR": opts.bias == "linear", "BIAS_QKV": opts.bias == "qkv",
                   "BUCKET_SIZE": opts.bucket_size, "QK_LAYERNORM": opts.qk_layernorm,
                   "NUM_BUCKETS": opts.num_buckets})
    mcore.use_model(opts.model)
    moe = dict(opts.moe or {})
    ep = int(moe.pop("ep", 1))
    if unknown := set(moe) - set(mcore.MOE_OPTIONS):
        raise SystemExit(f"--moe: unknown {sorted(unknown)} (known: {sorted(mcore.MOE_OPTIONS)} and ep)")
    mcore.restore({mcore.MOE_OPTIONS[name]: value for name, value in moe.items()})
    if opts.cmd == "save" and opts.dims:
        mcore.restore(opts.dims)
    with mcore.quiet_warnings():
        if opts.cmd == "load" and opts.dims_from_save:
            mcore.apply_cpu_patches()
            mcore.configure_from(opts.src.resolve())
        job = mcore.setup(tp=opts.tp, pp=opts.pp, bf16=opts.bf16, sharding=opts.sharding or "dp_reshardable",
                          vpp=opts.vpp, ep=ep)
    experts = f" EP{job.ep} experts={mcore.NUM_EXPERTS}" if mcore.NUM_EXPERTS else ""
    log(f"built TP{job.tp} PP{job.pp} VPP{job.vpp} DP{job.dp}{experts} bf16={opts.bf16} in "
        f"{time.monotonic() - start:.1f}s")
    if opts.cmd == "save":
        sharding = opts.sharding or "dp_reshardable"
        losses = mcore.train(job, opts.steps)
        log(f"trained {opts.steps} steps, losses {losses}")
        saves = [(sharding, opts.out.resolve(), opts.dump_after)] + [(s, Path(o).resolve(), Path(d))
                                                                      for s, o, d in opts.also]
        for kind, out, _ in saves:  # one trained job, saved as each sharding type: what the job held is the same
            job.args.dist_ckpt_optim_fully_reshardable = kind == "fully_reshardable"
            mcore.save_checkpoint(job, out, opts.steps, kind)
            log(f"saved {out}")
            if not opts.no_truth:
                mcore.write_dump(job, mcore.truth_path(out), {"sharding": kind, "losses": losses})
        if opts.logits:
            mcore.write_logits(job, opts.logits.resolve())
        if opts.resume_truth:
            mcore.synthetic_steps(job, opts.resume_truth)
            for kind, _, dump_after in saves:
                mcore.write_dump(job, dump_after.resolve(), {"sharding": kind, "resumed": opts.resume_truth})
    else:
        info = mcore.load_checkpoint(job, opts.src.resolve(), no_load_rng=opts.no_load_rng)
        log(f"loaded {opts.src} {json.dumps(info, default=str)}")
        mcore.write_dump(job, opts.dump.resolve(), {"loaded": info})
        if opts.logits:
            mcore.write_logits(job, opts.logits.resolve())
        if opts.resume:
            mcore.synthetic_steps(job, opts.resume)
            mcore.write_dump(job, opts.dump_after.resolve(), {"loaded": info, "resumed": opts.resume})
    log(f"done in {time.monotonic() - start:.1f}s")
    return job


def stop_children() -> None:
    """Stop the processes this rank started: megatron-core's ``dist_checkpointing`` keeps a spawn-context Manager
    (its write-results queue, ``strategies/filesystem_async.py``) whose server process, about 190 MB, would outlive
    the job, as :func:`run_then_leave` leaves without the interpreter's teardown (seen: a hundred of them, and the
    OOM killer, after a few dozen jobs)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=10)


if __name__ == "__main__":
    run_then_leave(main)
