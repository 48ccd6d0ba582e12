"""Real Megatron-Core (0.16.1) checkpoints on CPU: the helpers of ``mcore_job.py`` and the tests' launchers.

osdpipe reads and writes Megatron-LM's ``torch_dist`` folders
(``SAVE/latest_checkpointed_iteration.txt``, ``SAVE/iter_0000003/``).  Its
tests need the real megatron-core to write such folders and to load what
osdpipe writes, on a CPU-only machine with gloo.  Megatron-LM's own
``save_checkpoint`` / ``load_checkpoint`` (``megatron/training``) are not in
the wheel, so this module builds the same state dict with megatron-core's API
(see :func:`generate_state_dict`) and follows ``load_checkpoint``'s steps
(:func:`load_checkpoint`).

Two halves:

* the launcher side (:func:`save`, :func:`load`, :func:`job_command`), imported by
  the tests: it must not import megatron (nor patch anything) in the pytest process;
* the worker side (everything taking ``ctx``), used only inside the ranks that
  ``mcore_job.py`` runs, after :func:`apply_cpu_patches`.

The dump (the gathered truth) is ``{"model": {key: full tensor}, "optim": {key:
{"param", "exp_avg", "exp_avg_sq", "step"}}, "param_groups": [...], "iteration",
"scheduler", "args", "replicas_unequal"}`` with ``key`` the model's ``sharded_state_dict()`` key:
layers stacked along a leading axis, full over TP and PP, vocabulary padded. The saved state is the main replicas';
``replicas_unequal`` names each weight or state whose other replicas (a norm on every TP rank, a tied embedding's
copy on the last stage) hold anything else (:func:`dump_differences` reports it).
Every local piece is put in place by its ShardedTensor's own metadata
(``global_shape``/``global_offset``; factories such as SwiGLU's ``linear_fc1``
are built with the tensor in question), never by a hand-written TP rule.
A mixture of experts (a job's ``--moe``) is no exception: an expert's weights and states are keyed
``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[layers, experts, ...]``, placed at their layer and
global expert (``ep_rank * local experts + local index``) by the same metadata, from whichever of the
ChainedOptimizer's DistributedOptimizers holds them (the experts' own at EP > 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ENTRY = HERE / "mcore_job.py"

SEED = 1234
VOCAB, HIDDEN, FFN, LAYERS, HEADS, GROUPS, SEQ = 1000, 64, 128, 4, 4, 2, 16
MICRO_BATCH, GLOBAL_BATCH = 2, 8
LR, MIN_LR, WEIGHT_DECAY, BETAS, EPS, CLIP = 1e-3, 1e-4, 0.1, (0.9, 0.95), 1e-8, 1.0
WARMUP_ITERS, TRAIN_ITERS = 2, 10
DIVISIBLE_BY = 128
#: RMSNorm's epsilon and RoPE's base: the harness's GPT's, or a save's own (:func:`configure_from`).
NORM_EPS, ROTARY_BASE = 1e-5, 10000
#: Each head's dimension (``kv_channels``); ``None``: hidden / heads, Megatron-LM's default. A save's own, where the
#: GPT is built from it (:func:`configure_from`: a Qwen3's is its own).
KV_CHANNELS: int | None = None
#: Llama 3.1's RoPE scaling factor (Megatron-LM's --use-rope-scaling); ``None``: unscaled. A save's own, where the GPT
#: is built from it (:func:`configure_from`).
ROPE_SCALING: float | None = None
#: Megatron-LM's ``--add-bias-linear`` (biases on all four linear layers) and ``--add-qkv-bias`` (on linear_qkv alone,
#: as Qwen2's attention): the harness's GPT has none (``--disable-bias-linear``, as Llama), a job given ``--bias``
#: builds them, and a save's own are taken with its dimensions (:func:`configure_from`).
BIAS_LINEAR, BIAS_QKV = False, False
#: The GPT's norm, position embedding, MLP, embeddings and attention: the harness's own (``llama``: RMSNorm, RoPE,
#: SwiGLU, untied, GQA), or Megatron-LM's defaults where its arguments are silent (``gpt``, :data:`MODELS`: LayerNorm,
#: a learned position table, GeLU, the output layer tied to the word embedding, a key and a value per head), set by
#: :func:`use_model`.
NORM, POSITIONS, SWIGLU, TIED, GQA = "RMSNorm", "rope", True, False, True
#: Megatron-LM's ``--openai-gelu`` (the tanh approximation) where the MLP is a GeLU's: a save's own, where the GPT is
#: built from it (:func:`configure_from`; a Hugging Face GPT-2's ``gelu_new``); else the exact GeLU.
OPENAI_GELU = False
#: The positions the GPT is built for (a learned table's rows): the tokens of a batch, or a save's own.
MAX_POSITIONS = SEQ
#: Megatron-LM's ``--overlap-grad-reduce --ddp-bucket-size N``: the DDP cuts the first stage's gradient buffer into
#: buckets of about N elements (the layout of a ``dp_reshardable`` optimizer); ``None``: off, one bucket per buffer.
BUCKET_SIZE: int | None = None
#: Megatron-LM's ``--overlap-grad-reduce --ddp-num-buckets N``: the bucket size is the rank's parameters over N, as
#: Megatron-LM's ``get_model`` derives it; ``None``: not counted.
NUM_BUCKETS: int | None = None
#: Megatron-LM's ``--qk-layernorm``: a norm on each head's query and key (Qwen3's, OLMo2's attention).
QK_LAYERNORM = False
#: A mixture of experts in every layer's MLP: Megatron-LM's ``--num-experts``, ``--moe-router-topk`` and
#: ``--moe-ffn-hidden-size`` (``None``: ``ffn_hidden_size``, as Megatron-LM's ``validate_args``); ``None`` experts: the
#: dense MLP. Set by a job's ``--moe`` (:data:`MOE_OPTIONS`), or a save's own (:func:`configure_from`). Why these
#: alone: the experts are the local spec's SequentialMLP (no grouped GEMM, which needs Transformer Engine), routed
#: with the ``allgather`` dispatcher and no auxiliary loss, what trains on CPU with gloo (frameworks-on-cpu.md).
NUM_EXPERTS: int | None = None
MOE_TOPK, MOE_FFN = 2, None
#: The ``--moe`` JSON's names (``ep``: expert_model_parallel_size, a layout, not the GPT's) and the setting each sets.
MOE_OPTIONS = {"num_experts": "NUM_EXPERTS", "moe_router_topk": "MOE_TOPK", "moe_ffn_hidden_size": "MOE_FFN"}
#: ``llama_tied``: the harness's with its output layer tied to the word embedding (Llama 3.2's 1B and 3B).
MODELS = {"llama": ("RMSNorm", "rope", True, False, True), "gpt": ("LayerNorm", "learned_absolute", False, True, False),
          "llama_tied": ("RMSNorm", "rope", True, True, True)}
#: Size of the synthetic gradients (:func:`synthetic_grad`): small enough that the global grad norm stays far below
#: CLIP, so clipping (whose norm is summed in a layout-dependent order) never acts and a resume is elementwise.
SYNTH_SCALE = 1e-4

#: Seconds each launched command took, appended as (label, seconds): for reports.
TIMINGS: list[tuple[str, float]] = []


# ----------------------------------------------------------------------------------------------------------------------
# Launcher side (pytest process): no megatron import here.


def truth_path(folder: Path) -> Path:
    """Where ``save`` puts the gathered state at save time: beside the folder (which holds only Megatron's files)."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".truth.pt")


def job_command(nproc: int, *argv: str) -> list[str]:
    """``torchrun --standalone`` running ``mcore_job.py`` with ``argv`` on ``nproc`` CPU ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(ENTRY),
            *argv]


def run_job(workdir: Path, nproc: int, argv: list[str], *, label: str, timeout: float = 600,
            megatron_from: Path | None = None) -> float:
    """Run one job (logged to ``workdir/label.log``, killed as a process group on timeout); its seconds.
    ``megatron_from``: a folder holding another megatron-core, imported instead of the installed one."""
    from frameworks.launch import run_logged, worker_env

    extra = {"PYTHONPATH": os.pathsep.join(p for p in (str(megatron_from), os.environ.get("PYTHONPATH", "")) if p)}
    seconds = run_logged(job_command(nproc, *argv), Path(workdir), label=label, timeout=timeout,
                         what=f"megatron-core job ({nproc} ranks)", env=worker_env(**extra if megatron_from else {}))
    TIMINGS.append((label, seconds))
    return seconds


def save_argv(out: Path, *, tp: int, pp: int, sharding: str, bf16: bool = False, steps: int = 3,
              resume_truth: int = 0, dump_after: Path | None = None, logits: Path | None = None, bias: str = "none",
              model: str = "llama", also: tuple[tuple[str, Path, Path], ...] = (), vpp: int = 1,
              bucket: int | None = None, qk: bool = False, num_buckets: int | None = None,
              moe: dict | None = None) -> list[str]:
    """``mcore_job.py``'s ``save`` sub-command for one job (:func:`save` says what each option does)."""
    argv = ["save", "--tp", str(tp), "--pp", str(pp), "--steps", str(steps), "--sharding", sharding, "--out", str(out),
            "--bias", bias, "--model", model, *(["--vpp", str(vpp)] if vpp > 1 else []),
            *(["--bucket-size", str(bucket)] if bucket is not None else []), *(["--qk-layernorm"] if qk else []),
            *(["--num-buckets", str(num_buckets)] if num_buckets is not None else []),
            *(["--moe", json.dumps(moe)] if moe else [])]
    if bf16:
        argv.append("--bf16")
    if logits is not None:
        argv += ["--logits", str(logits)]
    if resume_truth:
        argv += ["--resume-truth", str(resume_truth), "--dump-after", str(dump_after)]
    for kind, folder, after in also:
        argv += ["--also", kind, str(folder), str(after)]
    return argv


def save(workdir: Path, out: Path, *, tp: int, pp: int, dp: int, timeout: float = 600,
         megatron_from: Path | None = None, **options: Any) -> Path:
    """Train ``steps`` steps at TP x PP x DP and save ``out`` as Megatron-LM would; return ``out``.

    ``truth_path(out)`` receives the gathered state at save time. ``options`` (:func:`save_argv`): the ``sharding``
    type; ``bf16``; ``steps``; with ``resume_truth``, the same job then takes that many synthetic steps
    (:func:`synthetic_grad`) and dumps to ``dump_after``; with ``logits`` (TP1 PP1 only), the saved model's logits on
    :func:`probe_tokens` go there first (:func:`write_logits`); ``bias``: ``linear`` (``--add-bias-linear``) or
    ``qkv`` (``--add-qkv-bias``) builds the GPT with those biases (:data:`BIAS_LINEAR`); ``model``: one of
    :data:`MODELS`; ``also``: ``(sharding, folder, dump_after)`` of each further save the same job makes of the same
    trained state, in another sharding type (one training for both); ``vpp``: model chunks per pipeline stage
    (virtual pipeline stages, the interleaved schedule); ``bucket``: :data:`BUCKET_SIZE`; ``qk``:
    :data:`QK_LAYERNORM`; ``num_buckets``: :data:`NUM_BUCKETS`; ``moe``: a mixture of experts,
    ``{"num_experts", "moe_router_topk", "moe_ffn_hidden_size", "ep"}`` (:data:`MOE_OPTIONS`; ``ep`` the expert
    parallel size, which must divide DP). ``megatron_from``: a
    folder holding megatron-core 0.13, which the job imports instead (:func:`legacy_megatron`).
    """
    argv = save_argv(out, tp=tp, pp=pp, **options)
    run_job(workdir, tp * pp * dp, argv, label=f"save-{Path(out).name}", timeout=timeout, megatron_from=megatron_from)
    check_saved(argv)
    return Path(out)


def check_saved(argv: list[str]) -> None:
    """Raise unless the ``save`` job ``argv`` (:func:`save_argv`) left each of its folders and truths."""
    also = [argv[i + 2] for i, a in enumerate(argv) if a == "--also"]
    for folder in (argv[argv.index("--out") + 1], *also):
        if not (Path(folder) / "latest_checkpointed_iteration.txt").is_file() or not truth_path(folder).is_file():
            raise RuntimeError(
                f"megatron-core job left no {folder}/latest_checkpointed_iteration.txt or no {truth_path(folder)}")


#: The last megatron-core that saves ``fully_sharded_model_space`` (0.14 refuses a ShardedTensor's
#: ``flattened_range``, which that type is made of); the job runs on it too, with the shims marked "0.13" here.
LEGACY = "megatron-core==0.13.1"


def legacy_megatron(root: Path) -> Path | None:
    """A folder holding :data:`LEGACY`: ``$OSDPIPE_TEST_MEGATRON_013`` where set, else installed into ``root`` with
    ``pip --target`` (never over the installed megatron-core); ``None`` where pip cannot get it."""
    import subprocess

    if os.environ.get("OSDPIPE_TEST_MEGATRON_013"):
        return Path(os.environ["OSDPIPE_TEST_MEGATRON_013"])
    target = Path(root) / "megatron-core-0.13"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                           LEGACY], capture_output=True, text=True, timeout=600)
    return target if done.returncode == 0 and (target / "megatron" / "core").is_dir() else None


def load_argv(folder: Path, dump: Path, *, tp: int, pp: int, bf16: bool = False, sharding: str | None = None,
              resume: int = 0, dump_after: Path | None = None, dims_from_save: bool = False,
              no_load_rng: bool = False, logits: Path | None = None, bias: str = "none",
              model: str = "llama", vpp: int = 1, bucket: int | None = None, qk: bool = False,
              num_buckets: int | None = None, moe: dict | None = None) -> list[str]:
    """``mcore_job.py``'s ``load`` sub-command for one load (:func:`load` says what each option does)."""
    argv = ["load", "--tp", str(tp), "--pp", str(pp), "--from", str(folder), "--dump", str(dump), "--bias", bias,
            "--model", model, *(["--vpp", str(vpp)] if vpp > 1 else []),
            *(["--bucket-size", str(bucket)] if bucket is not None else []), *(["--qk-layernorm"] if qk else []),
            *(["--num-buckets", str(num_buckets)] if num_buckets is not None else []),
            *(["--moe", json.dumps(moe)] if moe else [])]
    if bf16:
        argv.append("--bf16")
    if dims_from_save:
        argv.append("--dims-from-save")
    if no_load_rng:
        argv.append("--no-load-rng")
    if logits is not None:
        argv += ["--logits", str(logits)]
    if sharding:
        argv += ["--sharding", sharding]
    if resume:
        argv += ["--resume", str(resume), "--dump-after", str(dump_after)]
    return argv


def load(workdir: Path, folder: Path, dump: Path, *, tp: int, pp: int, dp: int, label: str | None = None,
         timeout: float = 600, **options: Any) -> Path:
    """Load ``folder`` with megatron-core at TP x PP x DP as Megatron-LM's ``load_checkpoint`` does; dump it.

    ``options`` (:func:`load_argv`): ``bf16``; ``sharding``; ``resume`` synthetic steps, then a second dump to
    ``dump_after``; ``dims_from_save``: the GPT is built with the dimensions of the save's own ``args``
    (:func:`configure_from`), not the harness's; ``no_load_rng``: as Megatron-LM's ``--no-load-rng`` (a save without
    RNG states); ``logits``: the loaded model's logits on :func:`probe_tokens` go there (any TP and PP:
    :func:`write_logits`); ``bias``, ``model`` and ``moe``: as :func:`save`'s (``moe``'s ``ep``: the loading job's)."""
    run_job(workdir, tp * pp * dp, load_argv(folder, dump, tp=tp, pp=pp, **options),
            label=label or f"load-{Path(dump).stem}", timeout=timeout)
    return Path(dump)


def each(workdir: Path, world: int, jobs: list[list[str]], *, label: str, timeout: float = 900,
         megatron_from: Path | None = None) -> None:
    """Every job of ``jobs`` (each :func:`save_argv`'s or :func:`load_argv`'s, its TP x PP dividing ``world``) in one
    megatron-core launch on ``world`` ranks, one after the other, each built afresh (:func:`teardown` between); each
    save checked as :func:`save` checks it.

    Why one launch: importing megatron-core takes about 10 s of CPU per rank, so a launch on 2 to 4 ranks costs
    20 to 25 s on 2 cores before it builds anything, and a load itself a few seconds; tests that run many jobs at
    one world size pay the start once."""
    plan = Path(workdir) / f"{label}.plan.json"
    plan.write_text(json.dumps(jobs))
    run_job(workdir, world, ["each", "--plan", str(plan)], label=label, timeout=timeout, megatron_from=megatron_from)
    for argv in jobs:
        if argv[0] == "save":
            check_saved(argv)


def probe_tokens() -> torch.Tensor:
    """Fixed tokens ``[2, SEQ]`` (of the true vocabulary) whose logits two frameworks' forward passes compare."""
    gen = torch.Generator().manual_seed(SEED + 40)
    return torch.randint(0, VOCAB, (2, SEQ), generator=gen)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def dump_differences(expected: dict, actual: dict, *, what: tuple[str, ...] = ("model", "optim", "param_groups",
                                                                               "iteration", "scheduler")) -> list[str]:
    """Where two dumps differ, one line each (empty: bitwise equal): weights, masters, moments, steps, groups, ...

    Bitwise, dtype and shape included: padding rows of the vocabulary count too, so a reader that loses them shows.
    """
    out: list[str] = []

    def tensor(name: str, x: Any, y: Any) -> None:
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if x != y:
                out.append(f"{name}: {x!r} != {y!r}")
        elif x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{name}: {x.dtype}{tuple(x.shape)} != {y.dtype}{tuple(y.shape)}")
        elif not torch.equal(_bits(x), _bits(y)):
            diff = (x.double() - y.double()).abs()
            out.append(f"{name}: {int((diff != 0).sum())} elements differ, max {float(diff.max()):.3g}")

    for part in ("model", "optim"):
        if part not in what:
            continue
        e, a = expected[part], actual[part]
        if e.keys() != a.keys():
            out.append(f"{part} keys: missing {sorted(e.keys() - a.keys())}, extra {sorted(a.keys() - e.keys())}")
        for key in sorted(e.keys() & a.keys()):
            if part == "model":
                tensor(f"model {key}", e[key], a[key])
            else:
                for state in ("param", "exp_avg", "exp_avg_sq", "step"):
                    tensor(f"optim {key} {state}", e[key].get(state), a[key].get(state))
    for part in ("param_groups", "iteration", "scheduler"):
        if part in what and expected[part] != actual[part]:
            out.append(f"{part}: {expected[part]!r} != {actual[part]!r}")
    for name, dump in (("expected", expected), ("actual", actual)):
        if dump.get("replicas_unequal"):
            out.append(f"{name}: replicas unequal to the main one: {', '.join(dump['replicas_unequal'][:5])}")
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Worker side: the CPU patches.

_PATCHED = False


def _cpu_device(device: Any) -> Any:
    """``device`` with CUDA (a "cuda" string, a CUDA torch.device, a bare index) turned into "cpu"."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


def apply_cpu_patches() -> None:
    """Make megatron-core 0.16.1 build, train, save and load on CPU with gloo (frameworks-on-cpu.md lists why).

    Only ever called inside a worker rank, before megatron builds anything: it changes torch process-wide.
    """
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    import numpy as np

    if not hasattr(np, "product"):
        # megatron-core 0.13 (the legacy job, which saves fully_sharded_model_space) still calls np.product,
        # gone in numpy 2.
        np.product = np.prod
    cuda = torch.cuda
    # 1-2: buffers are allocated on torch.cuda.current_device(); synchronize/empty_cache have nothing to wait for.
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    # 3: tensor factories given device="cuda" (scale tensors of the mixed-precision optimizer, etc.).
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
                 "zeros_like", "ones_like", "empty_like", "full_like"):
        orig = getattr(torch, name)

        def factory(*args, __orig=orig, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return __orig(*args, **kwargs)

        setattr(torch, name, factory)
    # 4: the distributed optimizer accepts only torch.cuda.*Tensor types.
    orig_type = torch.Tensor.type

    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = orig_type(self)
            if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = tensor_type
    # 5: .cuda() is a no-op.
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    # Tensor.to("cuda") and friends.
    orig_to = torch.Tensor.to

    def tensor_to(self, *args, **kwargs):
        args = tuple(_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return orig_to(self, *args, **kwargs)

    torch.Tensor.to = tensor_to
    _patch_cuda_rng()
    _patch_distrib_optimizer()
    _patch_moe_router()


class _FakeCudaRng:
    """A CPU generator standing in for the CUDA default generator.

    Why: Megatron-LM's ``_set_random_seed`` seeds the CUDA RNG tracker
    (``model_parallel_cuda_manual_seed``) and its checkpoints hold
    ``cuda_rng_state`` and the tracker's states; on a CPU-only torch every
    ``torch.cuda`` RNG call raises.  With this stand-in the tracker, ``fork``
    and the saved ``rng_state`` have the structure they have on a GPU; the
    state tensors are CPU generator states (5056 bytes, not CUDA's 16).
    """

    gen = torch.Generator()


def _patch_cuda_rng() -> None:
    gen = _FakeCudaRng.gen
    torch.cuda.manual_seed = lambda seed: gen.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: gen.manual_seed(int(seed))
    torch.cuda.get_rng_state = lambda device="cuda": gen.get_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": gen.set_state(state)
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: gen.get_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: gen.set_state(new_state)


def _patch_distrib_optimizer() -> None:
    """Work around megatron-core 0.16.1's ``_set_main_param_and_optimizer_states`` with torch's own AdamW.

    Why: it copies every key of the optimizer state, ``step`` included, from the loaded tensors: a
    ``fully_reshardable`` load has no ``step`` there (KeyError: 'step'), and the copy into an fp32 main
    param (a view of the model's parameter) is not under ``no_grad`` ("a view of a leaf Variable that
    requires grad is being used in an in-place operation").  This version copies under ``no_grad`` and
    skips keys the loaded state lacks; ``step`` is restored from the param groups afterwards
    (:func:`restore_steps`).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return orig(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():
            for key, tensor in dst.items():
                if key in tensors and key != "step":
                    tensor.copy_(tensors[key])

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _patch_moe_router() -> None:
    """Let the MoE router's gating run without Transformer Engine: ``moe_utils.te_general_gemm = None``.

    Why: megatron-core 0.16.1's router gating (``transformer/moe/moe_utils.py``) tests ``te_general_gemm is not None``
    but defines the name only when Transformer Engine imports (NameError otherwise); with ``None`` it takes its torch
    matmul. Where the module has the name already (TE installed, another megatron-core) it is left alone.
    """
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # a megatron-core without MoE utilities: nothing to patch
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def hf_logits_gap(folder: Path, probe: dict) -> tuple[float, float]:
    """How far Megatron's logits (``probe``: :func:`write_logits`' tokens and logits) are from transformers' own
    forward of the Hugging Face folder ``folder`` (``from_pretrained``, eager attention) on the same tokens, over the
    true vocabulary: ``(max |diff|, max |HF logit|)``. The tests hold the first within 1e-4 of the second
    (``test_megatron_hf.py`` says why). The model is the one ``config.json``'s ``architectures`` names (a Llama, or a
    Qwen2 for a GPT with ``linear_qkv``'s bias alone)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        reference = model(probe["tokens"]).logits
    logits = probe["logits"][..., : reference.shape[-1]]
    return float((logits - reference).abs().max()), float(reference.abs().max())


# ----------------------------------------------------------------------------------------------------------------------
# Worker side: building the job.


def configure_from(folder: Path) -> None:
    """Take the GPT's dimensions from the Megatron save at ``folder`` (its ``common.pt``'s ``args``, as Megatron-LM's
    ``--use-checkpoint-args`` does), instead of the harness's own: what a save osdpipe made from another model
    needs. Worker side, before :func:`setup`."""
    from megatron.core import dist_checkpointing

    args = dist_checkpointing.load_common_state_dict(str(checkpoint_dir(Path(folder))[0]))["args"]
    restore({
        "VOCAB": args.vocab_size, "HIDDEN": args.hidden_size, "FFN": args.ffn_hidden_size, "LAYERS": args.num_layers,
        "HEADS": args.num_attention_heads, "KV_CHANNELS": args.kv_channels,
        "GROUPS": args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        "NORM_EPS": args.norm_epsilon, "ROTARY_BASE": args.rotary_base,
        "DIVISIBLE_BY": args.make_vocab_size_divisible_by,
        # Megatron-LM's --use-rope-scaling --rope-scaling-factor (Llama 3.1's), as its model provider passes them
        "ROPE_SCALING": getattr(args, "rope_scaling_factor", 8.0) if getattr(args, "use_rope_scaling", False) else None,
        "BIAS_LINEAR": bool(args.add_bias_linear), "BIAS_QKV": bool(getattr(args, "add_qkv_bias", False)),
        "NORM": args.normalization, "POSITIONS": args.position_embedding_type, "SWIGLU": bool(args.swiglu),
        "TIED": not args.untie_embeddings_and_output_weights, "GQA": bool(args.group_query_attention),
        "OPENAI_GELU": bool(getattr(args, "openai_gelu", False)),
        "MAX_POSITIONS": int(args.max_position_embeddings),
        "QK_LAYERNORM": bool(getattr(args, "qk_layernorm", False)),
        "NUM_EXPERTS": getattr(args, "num_experts", None) or None,
        **({"MOE_TOPK": args.moe_router_topk, "MOE_FFN": args.moe_ffn_hidden_size}
           if getattr(args, "num_experts", None) else {}),
    })  # fmt: skip


def use_model(name: str) -> None:
    """Build the GPT :data:`MODELS` names ``name`` from now on (worker side, before :func:`setup`)."""
    restore(dict(zip(("NORM", "POSITIONS", "SWIGLU", "TIED", "GQA"), MODELS[name], strict=True)))


#: The module's globals a job's options change (:func:`use_model`, :func:`configure_from`, the bias flags), each set
#: through :func:`restore`: what :func:`settings` keeps and :func:`restore` puts back between the jobs of one launch.
_SETTINGS = ("VOCAB", "HIDDEN", "FFN", "LAYERS", "HEADS", "KV_CHANNELS", "GROUPS", "NORM_EPS", "ROTARY_BASE",
             "DIVISIBLE_BY", "ROPE_SCALING", "BIAS_LINEAR", "BIAS_QKV", "NORM", "POSITIONS", "SWIGLU", "TIED", "GQA",
             "OPENAI_GELU", "MAX_POSITIONS", "BUCKET_SIZE", "NUM_BUCKETS", "QK_LAYERNORM", "NUM_EXPERTS", "MOE_TOPK",
             "MOE_FFN")


def head_dim() -> int:
    """Each head's dimension in the GPT the harness builds now."""
    return KV_CHANNELS or HIDDEN // HEADS


def settings() -> dict[str, Any]:
    """The GPT the harness builds now, as :data:`_SETTINGS` name it."""
    return {name: globals()[name] for name in _SETTINGS}


def restore(saved: dict[str, Any]) -> None:
    """Build the GPT of ``saved`` (:func:`settings`, or some of its names) from now on: a launch's next job starts
    from the harness's own, never from the dimensions the last one took from its save. The one place a job's options
    change the module's globals: a name :data:`_SETTINGS` does not list is refused, so none escapes the restore."""
    if unknown := set(saved) - set(_SETTINGS):
        raise KeyError(f"not a harness setting: {sorted(unknown)} (add it to _SETTINGS)")
    globals().update(saved)


def teardown(job: Job) -> None:
    """Let go of ``job`` and Megatron's parallel state (its process groups, its memory buffer), so that the same
    ranks can build the next job at another TP and PP (:func:`setup` seeds afresh, the RNG tracker included)."""
    from megatron.core import parallel_state

    torch.distributed.barrier()
    job.extras.clear()
    parallel_state.destroy_model_parallel()


def checkpoint_dir(load_dir: Path) -> tuple[Path, bool]:
    """The folder Megatron-LM's ``read_metadata`` and ``get_checkpoint_name`` load from ``load_dir``, and whether it
    is a ``release`` one: the tracker file says an iteration (``iter_<7 digits>/``) or ``release`` (``release/``)."""
    said = (Path(load_dir) / "latest_checkpointed_iteration.txt").read_text().strip()
    if said == "release":
        return Path(load_dir) / "release", True
    return Path(load_dir) / f"iter_{int(said):07d}", False


def padded_vocab(vocab: int, tp: int, divisible_by: int | None = None) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: a multiple of ``make_vocab_size_divisible_by * TP``."""
    multiple = (divisible_by or DIVISIBLE_BY) * tp
    return int(math.ceil(vocab / multiple) * multiple)


def make_args(*, tp: int, pp: int, world: int, bf16: bool, sharding: str, iteration: int = 0,
              vpp: int = 1, ep: int = 1) -> argparse.Namespace:
    """The ``args`` Megatron-LM keeps in ``common.pt``: its ``arguments.py`` names, this test model's values.

    Why a Namespace with these fields: Megatron-LM's ``load_checkpoint`` and
    ``load_args_from_checkpoint`` read them (TP/PP/world sizes for the reshard
    checks, the model shape for ``check_checkpoint_args``), and so will
    osdpipe's reader.
    """
    dp = world // (tp * pp)
    args = argparse.Namespace(
        # parallelism
        rank=0, world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        data_parallel_size=dp, context_parallel_size=1, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_layers_per_virtual_pipeline_stage=LAYERS // (pp * vpp) if vpp > 1 else None,
        num_virtual_stages_per_pipeline_rank=None, sequence_parallel=False, use_distributed_optimizer=True,
        data_parallel_random_init=False, overlap_param_gather=False, ddp_bucket_size=BUCKET_SIZE,
        overlap_grad_reduce=BUCKET_SIZE is not None or NUM_BUCKETS is not None, ddp_num_buckets=NUM_BUCKETS,
        # model
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=GROUPS if GQA else HEADS, group_query_attention=GQA, kv_channels=head_dim(),
        seq_length=SEQ,
        max_position_embeddings=MAX_POSITIONS, encoder_seq_length=SEQ, decoder_seq_length=None, normalization=NORM,
        norm_epsilon=NORM_EPS, swiglu=SWIGLU, squared_relu=False, position_embedding_type=POSITIONS,
        use_rotary_position_embeddings=POSITIONS == "rope", add_position_embedding=POSITIONS == "learned_absolute",
        rotary_base=ROTARY_BASE, rotary_percent=1.0,
        use_rope_scaling=ROPE_SCALING is not None, rope_scaling_factor=ROPE_SCALING or 8.0,
        rotary_interleaved=False, untie_embeddings_and_output_weights=not TIED, add_bias_linear=BIAS_LINEAR,
        # the job builds its MLP unfused (setup's bias_activation_fusion): the exact GeLU, where it has one
        bias_gelu_fusion=False, bias_swiglu_fusion=False, openai_gelu=OPENAI_GELU,
        add_qkv_bias=BIAS_QKV, apply_query_key_layer_scaling=False, qk_layernorm=QK_LAYERNORM, num_experts=None,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, transformer_impl="local", spec=None,
        is_hybrid_model=False, heterogeneous_layers_config_path=None, heterogeneous_layers_config_encoded_json=None,
        vocab_size=VOCAB, padded_vocab_size=padded_vocab(VOCAB, tp), make_vocab_size_divisible_by=DIVISIBLE_BY,
        tokenizer_type="NullTokenizer", vocab_file=None, tokenizer_model=None,
        # precision
        bf16=bf16, fp16=False, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        accumulate_allreduce_grads_in_fp32=bf16, main_grads_dtype=torch.float32, main_params_dtype=torch.float32,
        # optimizer and schedule
        optimizer="adam", lr=LR, min_lr=MIN_LR, lr_decay_style="cosine", lr_warmup_iters=WARMUP_ITERS,
        lr_warmup_fraction=None, lr_warmup_init=0.0, lr_decay_iters=TRAIN_ITERS, lr_wsd_decay_iters=None,
        weight_decay=WEIGHT_DECAY, start_weight_decay=WEIGHT_DECAY, end_weight_decay=WEIGHT_DECAY,
        weight_decay_incr_style="constant", adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
        clip_grad=CLIP, loss_scale=None, use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
        # training
        micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, train_iters=TRAIN_ITERS, seed=SEED,
        iteration=iteration, consumed_train_samples=iteration * GLOBAL_BATCH, skipped_train_samples=0,
        consumed_valid_samples=0,
        # checkpointing
        ckpt_format="torch_dist", use_dist_ckpt=True, auto_detect_ckpt_format=False,
        dist_ckpt_optim_fully_reshardable=sharding == "fully_reshardable",
        distrib_optim_fully_reshardable_mem_efficient=False, ckpt_fully_parallel_save=True,
        ckpt_fully_parallel_load=False, ckpt_assume_constant_structure=False,
        dist_ckpt_strictness="assume_ok_unexpected",
        async_save=False, no_save_optim=None, no_save_rng=None, no_load_optim=None, no_load_rng=None,
        finetune=False, save=None, load=None, save_interval=None, non_persistent_save_interval=None,
    )
    if NUM_EXPERTS:
        vars(args).update(moe_args())
    return args


def moe_args() -> dict[str, Any]:
    """The MoE fields of Megatron-LM's ``args`` (its ``--num-experts`` and TransformerConfig's ``moe_*`` names) for
    the harness's experts (:data:`NUM_EXPERTS`); only a MoE job's ``args`` hold them (a dense one's: as before).

    Why: a reader of the save (osdpipe, Megatron-LM's ``--use-checkpoint-args``) learns the experts' count, their
    hidden size and the router from them, as from a Megatron-LM MoE run's; the router's and dispatcher's settings
    are the ones the job trains with (:func:`setup`), each equal to TransformerConfig's default.
    """
    return {"num_experts": NUM_EXPERTS, "moe_router_topk": MOE_TOPK, "moe_ffn_hidden_size": MOE_FFN or FFN,
            "moe_layer_freq": 1, "moe_grouped_gemm": False, "moe_token_dispatcher_type": "allgather",
            "moe_aux_loss_coeff": 0.0, "moe_router_load_balancing_type": "aux_loss", "moe_z_loss_coeff": None,
            "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
            "moe_router_topk_scaling_factor": None, "moe_router_dtype": None, "moe_input_jitter_eps": None,
            "moe_shared_expert_intermediate_size": None}


@dataclass
class Job:
    """What one rank holds: Megatron's objects and the parallel layout."""

    args: argparse.Namespace
    #: The DistributedDataParallel-wrapped model chunks: one, or with virtual pipeline stages one per virtual stage
    #: (Megatron-LM's ``model`` list).
    chunks: list[Any]
    gpts: list[Any]  # the unwrapped GPTModel of each chunk
    optimizer: Any
    scheduler: Any
    config: Any
    tp: int
    pp: int
    dp: int
    vpp: int = 1
    #: The expert parallel size (``expert_model_parallel_size``); its experts' data parallel size is DP / ep.
    ep: int = 1
    extras: dict = field(default_factory=dict)


def setup(*, tp: int, pp: int, bf16: bool, sharding: str, vpp: int = 1, ep: int = 1) -> Job:
    """Start gloo, Megatron's parallel state and the RNG, then build the GPT (``vpp`` chunks of it per stage: virtual
    pipeline stages), DDP, optimizer and scheduler.

    With :data:`NUM_EXPERTS`, every layer's MLP is a mixture of experts split over ``ep`` ranks (expert tensor
    parallel = TP, as Megatron-LM's default): the parallel state then has the expert groups, and the optimizer is a
    ChainedOptimizer of two DistributedOptimizers where ``ep`` > 1 (dense over DP, experts over the expert DP).

    Follows Megatron-LM's ``initialize_megatron`` + ``setup_model_and_optimizer`` (``get_model``, ``Float16Module``
    for bf16, ``DistributedDataParallel`` with :data:`BUCKET_SIZE` and overlap_grad_reduce where it is set,
    ``get_megatron_optimizer``, ``get_optimizer_param_scheduler``).
    """
    apply_cpu_patches()
    import torch.nn.functional as F
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.utils import openai_gelu

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    world = torch.distributed.get_world_size()
    if world % (tp * pp):
        raise SystemExit(f"world {world} is not a multiple of TP {tp} x PP {pp}")
    if ep > 1 and not NUM_EXPERTS:
        raise SystemExit(f"expert parallel size {ep} without experts")
    if world % (tp * pp * ep):
        raise SystemExit(f"world {world} is not a multiple of TP {tp} x PP {pp} x EP {ep}")
    virtual = {"virtual_pipeline_model_parallel_size": vpp} if vpp > 1 else {}  # megatron-core 0.13 jobs pass none
    # only a MoE job names the expert groups: a dense one initialises as before
    experts = {"expert_model_parallel_size": ep, "expert_tensor_parallel_size": tp} if NUM_EXPERTS else {}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             **virtual, **experts)
    # Megatron-LM's _set_random_seed: a seed per PP stage, then the model-parallel CUDA RNG tracker.
    seed = SEED + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    torch.manual_seed(seed)
    import numpy as np

    np.random.seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)

    args = make_args(tp=tp, pp=pp, world=world, bf16=bf16, sharding=sharding, vpp=vpp, ep=ep)
    args.rank = torch.distributed.get_rank()
    dtype = args.params_dtype
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=GROUPS if GQA else HEADS, kv_channels=head_dim(), normalization=NORM,
        layernorm_epsilon=NORM_EPS,
        gated_linear_unit=SWIGLU, activation_func=F.silu if SWIGLU else openai_gelu if OPENAI_GELU else F.gelu,
        add_bias_linear=BIAS_LINEAR,
        add_qkv_bias=BIAS_QKV,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        use_cpu_initialization=True, perform_initialization=True, bf16=bf16, params_dtype=dtype,
        pipeline_dtype=dtype, autocast_dtype=dtype if bf16 else None,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, qk_layernorm=QK_LAYERNORM,
        **virtual,
        # the experts (moe_args says why these): SequentialMLP, the allgather dispatcher, no auxiliary loss
        **({"num_moe_experts": NUM_EXPERTS, "moe_router_topk": MOE_TOPK, "moe_ffn_hidden_size": MOE_FFN or FFN,
            "moe_token_dispatcher_type": "allgather", "moe_aux_loss_coeff": 0.0, "moe_grouped_gemm": False,
            **experts} if NUM_EXPERTS else {}),
    )
    spec = get_gpt_layer_local_spec(normalization=NORM, qk_layernorm=QK_LAYERNORM,
                                    **({"num_experts": NUM_EXPERTS, "moe_grouped_gemm": False} if NUM_EXPERTS else {}))
    gpts, modules = [], []
    for chunk in range(vpp):  # Megatron-LM's get_model: a chunk per virtual stage, each its own DDP
        stage = {"ignore_virtual": False, "vp_stage": chunk} if vpp > 1 else {}
        gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                       max_sequence_length=MAX_POSITIONS, pre_process=parallel_state.is_pipeline_first_stage(**stage),
                       post_process=parallel_state.is_pipeline_last_stage(**stage), parallel_output=True,
                       share_embeddings_and_output_weights=TIED, position_embedding_type=POSITIONS,
                       rotary_base=ROTARY_BASE, **({"vp_stage": chunk} if vpp > 1 else {}),
                       # only where scaled: megatron-core 0.13 (the legacy saves' job) may not know the keywords
                       **({"rope_scaling": True, "rope_scaling_factor": ROPE_SCALING}
                          if ROPE_SCALING is not None else {}))
        gpts.append(gpt)
        modules.append(Float16Module(config, gpt) if bf16 else gpt)
    bucket_size = BUCKET_SIZE
    if NUM_BUCKETS is not None:  # Megatron-LM's get_model: the rank's parameters, every chunk's, over the count
        bucket_size = sum(p.nelement() for module in modules for p in module.parameters()) // NUM_BUCKETS
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=bf16, overlap_grad_reduce=bucket_size is not None,
                                               overlap_param_gather=False, use_distributed_optimizer=True,
                                               check_for_nan_in_grad=False, bucket_size=bucket_size)
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=module, disable_bucketing=chunk > 0)
              for chunk, module in enumerate(modules)]
    opt_config = OptimizerConfig(optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WEIGHT_DECAY,
                                 adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS, clip_grad=CLIP,
                                 bf16=bf16, params_dtype=dtype, use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(opt_config, chunks)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP_ITERS * GLOBAL_BATCH,
        lr_decay_steps=TRAIN_ITERS * GLOBAL_BATCH, lr_decay_style="cosine", start_wd=WEIGHT_DECAY,
        end_wd=WEIGHT_DECAY, wd_incr_steps=TRAIN_ITERS * GLOBAL_BATCH, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=False)
    # Megatron-LM's train(): DP gradient sync and the loss scale hook.
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return Job(args=args, chunks=chunks, gpts=gpts, optimizer=optimizer, scheduler=scheduler, config=config,
               tp=tp, pp=pp, dp=world // (tp * pp), vpp=vpp, ep=ep)


def _batch(iteration: int, microbatch: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """The synthetic token batch of one microbatch: fixed by (iteration, microbatch, global sample index)."""
    gen = torch.Generator().manual_seed(SEED * 7919 + iteration * 131 + microbatch * 17 + dp_rank)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ).contiguous()}


def train(job: Job, steps: int, start: int = 0) -> list[float]:
    """``steps`` iterations of Megatron-LM's ``train_step``: real forward/backward through Megatron's schedule."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank = parallel_state.get_data_parallel_rank()
    num_micro = GLOBAL_BATCH // (MICRO_BATCH * job.dp)
    losses = []

    def loss_func(loss_mask, output_tensor):
        per_token = output_tensor.float().view(-1)
        loss = (per_token * loss_mask.view(-1)).sum() / loss_mask.sum()
        # clone: the schedule divides the returned loss in place by the number of microbatches.
        return loss, {"lm loss": loss.detach().clone()}

    for it in range(start, start + steps):
        # with virtual stages, the interleaved schedule takes an iterator per chunk, each of every microbatch
        batches = [iter([_batch(it, m, dp_rank) for m in range(num_micro)]) for _ in job.chunks]

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            return out, lambda t: loss_func(torch.ones(MICRO_BATCH, SEQ), t)

        for chunk in job.chunks:
            chunk.zero_grad_buffer()
        job.optimizer.zero_grad()
        reduced = get_forward_backward_func()(forward_step_func=forward_step,
                                              data_iterator=batches if job.vpp > 1 else batches[0],
                                              model=job.chunks, num_microbatches=num_micro, seq_length=SEQ,
                                              micro_batch_size=MICRO_BATCH, decoder_seq_length=SEQ,
                                              forward_only=False)
        ok, _, _ = job.optimizer.step()
        if not ok:
            raise RuntimeError(f"optimizer step {it + 1} was skipped")
        job.scheduler.step(increment=GLOBAL_BATCH)
        if reduced:
            losses.append(float(sum(r["lm loss"] for r in reduced) / len(reduced)))
    job.args.iteration = start + steps
    job.args.consumed_train_samples = (start + steps) * GLOBAL_BATCH
    return losses


# ----------------------------------------------------------------------------------------------------------------------
# Worker side: the state dict Megatron-LM's save_checkpoint writes.


def sharded_metadata(job: Job, sharding: str) -> dict:
    """Megatron-LM's ``_build_sharded_state_dict_metadata`` for ``--ckpt-format torch_dist``."""
    from megatron.core import parallel_state

    md: dict[str, Any] = {"distrib_optim_sharding_type": sharding}
    if sharding == "fully_reshardable":
        md["distrib_optim_fully_reshardable_mem_efficient"] = job.args.distrib_optim_fully_reshardable_mem_efficient
    md["singleton_local_shards"] = False
    md["chained_optim_avoid_prefix"] = True
    md["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return md


def rng_state() -> Any:
    """Megatron-LM's ``get_rng_state`` for torch_dist: one ShardedObject per (PP, TP) rank, replicated over DP."""
    import numpy as np
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return ShardedObject("rng_state", [state],
                         (parallel_state.get_pipeline_model_parallel_world_size(),
                          parallel_state.get_tensor_model_parallel_world_size()),
                         (pp_rank, tp_rank),
                         replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def flops_so_far(iteration: int) -> float:
    """A floating-point-operation count for ``num_floating_point_operations_so_far`` (6 x params x tokens; with
    experts, the params a token passes through: ``topk`` experts' MLPs)."""
    mlp = MOE_TOPK * 3 * HIDDEN * (MOE_FFN or FFN) if NUM_EXPERTS else 3 * HIDDEN * FFN
    params = (2 * padded_vocab(VOCAB, 1) * HIDDEN + LAYERS * (HIDDEN * (HEADS + 2 * GROUPS) * head_dim()
              + HIDDEN * HEADS * head_dim() + mlp))
    return float(6 * params * iteration * GLOBAL_BATCH * SEQ)


def generate_state_dict(job: Job, md: dict, *, rng: Any, is_loading: bool = False, iteration: int | None = None,
                        with_optimizer: bool = True) -> dict:
    """Megatron-LM's ``generate_state_dict`` for torch_dist: one model chunk's under ``model``, or with virtual pipeline
    stages each chunk's under ``model<i>``."""
    sd: dict[str, Any] = {"args": job.args, "checkpoint_version": 3.0}
    if iteration is not None:
        sd["iteration"] = iteration
    for name, gpt in zip(model_keys(job), job.gpts, strict=True):
        sd[name] = gpt.sharded_state_dict(metadata=md)
    if with_optimizer:
        kwargs = {"metadata": md, "is_loading": True} if is_loading else {"metadata": md}
        sd["optimizer"] = job.optimizer.sharded_state_dict(sd, **kwargs)
        sd["opt_param_scheduler"] = job.scheduler.state_dict()
    if rng is not None:
        sd["rng_state"] = rng
    return sd


def model_keys(job: Job) -> list[str]:
    """Where Megatron-LM's state dict holds each model chunk's: ``model``, or ``model0``, ``model1``, ... with
    several."""
    return ["model"] if len(job.chunks) == 1 else [f"model{i}" for i in range(len(job.chunks))]


def save_checkpoint(job: Job, save_dir: Path, iteration: int, sharding: str) -> None:
    """Megatron-LM's ``save_checkpoint`` for ``--ckpt-format torch_dist`` (synchronous, persistent, no rerun state).

    Writes ``save_dir/iter_<7 digits>/`` through ``dist_checkpointing.save`` with the default torch_dist strategy
    (``--ckpt-fully-parallel-save`` is on by default in Megatron-LM: the fully parallel wrapper over DP), then the
    tracker file on rank 0.
    """
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    ckpt_dir = Path(save_dir) / f"iter_{iteration:07d}"
    md = sharded_metadata(job, sharding)
    job.args.save = str(save_dir)
    job.args.iteration = iteration
    sd = generate_state_dict(job, md, rng=rng_state(), iteration=iteration)
    sd["num_floating_point_operations_so_far"] = flops_so_far(iteration)
    if torch.distributed.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    strategy = get_default_save_sharded_strategy("torch_dist")
    if job.args.ckpt_fully_parallel_save:
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True), False)
    dist_checkpointing.save(sd, str(ckpt_dir), strategy, validate_access_integrity=True,
                            content_metadata={k: v for k, v in md.items() if k != "dp_cp_group"})
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        (Path(save_dir) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()


def load_checkpoint(job: Job, load_dir: Path, no_load_rng: bool = False) -> dict:
    """Megatron-LM's ``load_checkpoint`` for torch_dist, with the CPU/torch-AdamW workarounds; returns what it read.

    Steps as Megatron-LM: the tracker file; the common state dict on every rank; RNG only at the same TP/PP; the
    content metadata; the dp_reshardable (TP, PP) refusal; ``generate_state_dict(is_loading=True)``;
    ``dist_checkpointing.load`` with the default strategy; ``model.load_state_dict``; ``optimizer.load_state_dict``;
    the scheduler; the RNG.  Workarounds: one dummy optimizer step before the template (torch AdamW has no state
    before its first step and ``state_dict()`` asserts) and :func:`restore_steps` after the optimizer's load.
    """
    import numpy as np
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    ckpt_dir, release = checkpoint_dir(Path(load_dir))
    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    ckpt_args = common.get("args") or argparse.Namespace()
    ckpt_tp_pp = (getattr(ckpt_args, "tensor_model_parallel_size", 1),
                  getattr(ckpt_args, "pipeline_model_parallel_size", 1))
    run_tp_pp = (job.tp, job.pp)
    md = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    if release or getattr(ckpt_args, "no_save_optim", False):  # the weights alone: Megatron-LM loads no optimizer
        return _load_weights_only(job, ckpt_dir, md or {}, release, ckpt_tp_pp)
    if md is None:
        md = {"distrib_optim_sharding_type": "dp_zero_gather_scatter"}
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if ckpt_tp_pp != run_tp_pp and md["distrib_optim_sharding_type"] not in \
            DistributedOptimizer.checkpoint_fully_reshardable_formats:
        raise RuntimeError(f"(TP, PP) mismatch after resume ({run_tp_pp} vs {ckpt_tp_pp} from checkpoint): not "
                           f"supported for DistributedOptimizer with sharding type {md['distrib_optim_sharding_type']}")
    md["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    job.args.dist_ckpt_optim_fully_reshardable = md["distrib_optim_sharding_type"] == "fully_reshardable"
    load_rng = ckpt_tp_pp == run_tp_pp and not no_load_rng  # Megatron-LM: --no-load-rng
    for opt in dist_optimizers(job):
        opt._init_optimizer_states_with_dummy_values()
    sd = generate_state_dict(job, md, rng=rng_state() if load_rng else None, is_loading=True)
    strategy = get_default_load_sharded_strategy(str(ckpt_dir))
    state = dist_checkpointing.load(sd, str(ckpt_dir), strategy, strict=job.args.dist_ckpt_strictness)
    for name, chunk in zip(model_keys(job), job.chunks, strict=True):
        chunk.load_state_dict(state[name], strict=True)
    job.optimizer.load_state_dict(state["optimizer"])
    restore_steps(job, state["optimizer"])
    job.scheduler.load_state_dict(state["opt_param_scheduler"])
    if load_rng and "rng_state" in state:
        rs = state["rng_state"][0]
        random.setstate(rs["random_rng_state"])
        np.random.set_state(rs["np_rng_state"])
        torch.set_rng_state(rs["torch_rng_state"])
        torch.cuda.set_rng_state(rs["cuda_rng_state"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rs["rng_tracker_states"])
    job.args.iteration = state["iteration"]
    job.args.consumed_train_samples = getattr(state["args"], "consumed_train_samples", 0)
    torch.distributed.barrier()
    return {"iteration": state["iteration"], "content_metadata": {k: v for k, v in md.items() if k != "dp_cp_group"},
            "ckpt_tp_pp": ckpt_tp_pp, "rng_loaded": load_rng}


def _load_weights_only(job: Job, ckpt_dir: Path, md: dict, release: bool, ckpt_tp_pp: tuple) -> dict:
    """Megatron-LM's ``load_checkpoint`` of a save without optimizer state (a ``release`` folder, or one saved with
    ``--no-save-optim``): the model alone, no RNG (``release``, or ``args.no_save_rng``), the optimizer and the
    scheduler left as built (fresh), ``reload_model_params`` for a bf16 job's fp32 masters, iteration 0 for a
    ``release`` save (else the save's)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    md = {**md, "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    sd = generate_state_dict(job, md, rng=None, is_loading=True, with_optimizer=False)
    state = dist_checkpointing.load(sd, str(ckpt_dir), get_default_load_sharded_strategy(str(ckpt_dir)),
                                    strict=job.args.dist_ckpt_strictness)
    for name, chunk in zip(model_keys(job), job.chunks, strict=True):
        chunk.load_state_dict(state[name], strict=True)
    if job.args.bf16:
        job.optimizer.reload_model_params()
    job.args.iteration = 0 if release else state["iteration"]
    job.args.consumed_train_samples = getattr(state["args"], "consumed_train_samples", 0)
    torch.distributed.barrier()
    return {"iteration": job.args.iteration, "content_metadata": {k: v for k, v in md.items() if k != "dp_cp_group"},
            "ckpt_tp_pp": ckpt_tp_pp, "rng_loaded": False, "release": release, "optimizer_loaded": False}


def dist_optimizers(job: Job) -> list[Any]:
    """The DistributedOptimizers inside ``get_megatron_optimizer``'s ChainedOptimizer: one, or with experts at EP > 1
    two (the dense parameters', then the experts')."""
    return list(getattr(job.optimizer, "chained_optimizers", [job.optimizer]))


def restore_steps(job: Job, optimizer_sd: dict) -> None:
    """Give every parameter its own ``step`` tensor, set to the step the checkpoint's param groups hold.

    Why: megatron-core 0.16.1 without TE/Apex gives all parameters ONE shared ``step`` tensor on load (torch
    AdamW's in-place ``step += 1`` then advances it once per parameter), and a ``dp_reshardable`` load then
    copies back the pre-load local ``step`` (the dummy step's 1) from its LocalNonpersistentObject. Each
    DistributedOptimizer from its own state (a ChainedOptimizer of several loads ``{index: state}``).
    """
    opts = dist_optimizers(job)
    for opt, state in zip(opts, [optimizer_sd] if len(opts) == 1 else [optimizer_sd[i] for i in range(len(opts))],
                          strict=True):
        groups = state["optimizer"]["param_groups"]
        steps = {g["step"] for g in groups if "step" in g}
        if len(steps) != 1:
            raise RuntimeError(f"checkpoint param groups hold steps {steps}")
        step = float(steps.pop())
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if p in inner.state:
                    inner.state[p]["step"] = torch.tensor(step, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------------------
# Worker side: placing local pieces by their ShardedTensor metadata, and gathering.


def param_metadata(job: Job) -> dict[int, Any]:
    """id(model parameter) -> its ShardedTensor or ShardedTensorFactory in the model's ``sharded_state_dict()``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if "param_metadata" in job.extras:
        return job.extras["param_metadata"]
    params = {id(p): p for gpt in job.gpts for p in gpt.parameters()}
    found = {}
    for sh in (sh for gpt in job.gpts for sh in nested_values(gpt.sharded_state_dict())):
        if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and id(sh.data) in params:
            found[id(sh.data)] = sh
    missing = [n for gpt in job.gpts for n, p in gpt.named_parameters() if id(p) not in found]
    if missing:
        raise RuntimeError(f"parameters without sharded metadata: {missing}")
    job.extras["param_metadata"] = found
    return found


def pieces(meta: Any, tensor: torch.Tensor) -> list[Any]:
    """The ShardedTensors that ``meta`` (a parameter's ShardedTensor or factory) makes of ``tensor``.

    ``tensor`` has the parameter's local shape (a state, a gradient); the pieces' ``data`` are views of it.
    """
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(meta, ShardedTensorFactory):
        built = meta.build_fn(meta.key, tensor, meta.replica_id, meta.flattened_range)
        out = [s for s in nested_values(built) if isinstance(s, ShardedTensor)]
    else:
        out = [replace(meta, data=tensor, dtype=tensor.dtype)]
    for s in out:
        if s.flattened_range is not None:
            raise RuntimeError(f"flattened model tensor {s.key} not supported")
    return out


def _is_main(replica_id: Any) -> bool:
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    return is_main_replica(replica_id)


def _local_records(job: Job) -> dict:
    """This rank's main-replica pieces of weights and optimizer states, and per-key steps and groups (to gather).

    Every DistributedOptimizer of the job's (with experts at EP > 1 a second one, for the experts over their expert
    DP group) gives the pieces of its own parameters: an expert's are put in place by its ShardedTensor as any
    other's (the layer axis, then the global expert ``ep_rank * local experts + local index``)."""
    metas = param_metadata(job)
    model_pieces, optim_pieces, replicas, steps, groups, buckets = [], [], [], {}, {}, []
    for opt_idx, opt in enumerate(dist_optimizers(job)):
        # fp32 masters and moments per model parameter, whole over the optimizer's DP group (its own gather); none
        # where the optimizer has not stepped yet (a fresh one, after loading a save of the weights alone): torch's
        # Adam makes its state on the first step, and the gather asks for it
        fresh = not opt.optimizer.state
        world = None
        try:
            world = None if fresh else opt.get_parameter_state_dp_zero(use_gloo_comm=True, empty_data=False,
                                                                        return_on_all_ranks=True)
        except TypeError:  # megatron-core 0.13 (the legacy job): gathered on DP rank 0 only
            held = [opt.get_parameter_state_dp_zero()]
            torch.distributed.broadcast_object_list(held, group=opt.data_parallel_group_gloo, group_src=0)
            world = held[0]
        for gbuf_idx, buffer in enumerate(opt.buffers):
            (dtype, tensors), = world[gbuf_idx].items() if world is not None else [(None, None)]
            # the gathered state is the buffer's buckets cut at their unpadded sizes, one after the other
            before = [sum(b.numel_unpadded for b in buffer.buckets[:i]) - bucket.offset
                      for i, bucket in enumerate(buffer.buckets)]
            for param, (start, end, bucket_id) in buffer.param_index_map.items():
                meta = metas[id(param)]
                key = meta.key
                for st in pieces(meta, param.detach().clone()):
                    record = (st.key, tuple(st.global_shape), st.global_slice(), st.data.clone())
                    if _is_main(st.replica_id):
                        model_pieces.append(record)
                    else:
                        replicas.append(("model", *record))
                for state in ("param", "exp_avg", "exp_avg_sq") if tensors is not None else ():
                    at = before[bucket_id]
                    local = tensors[state][start + at:end + at].reshape(param.shape).clone()
                    for st in pieces(meta, local):
                        record = (state, st.key, tuple(st.global_shape), st.global_slice(), st.data.clone())
                        (optim_pieces if _is_main(st.replica_id) else replicas).append(record)
                if param in opt.model_param_group_index_map:
                    g, order = opt.model_param_group_index_map[param]
                    main = opt.optimizer.param_groups[g]["params"][order]
                    st_state = opt.optimizer.state.get(main, {})
                    if "step" in st_state:
                        steps.setdefault(key, set()).add(float(st_state["step"]))
                    groups.setdefault(_group_id(opt.optimizer.param_groups[g]), set()).add(key)
        if opt.data_parallel_group.rank() == 0:
            buckets.append(_bucket_layout(job, opt, opt_idx))
    return {"model": model_pieces, "optim": optim_pieces, "replicas": replicas, "steps": steps, "groups": groups,
            "buckets": buckets}


def _group_id(group: dict) -> tuple:
    """A param group by what tells Megatron's groups apart, not by its index: megatron-core 0.13 orders a stage's
    groups as its first parameters come (decay first on the first PP stage, no decay first on a later one)."""
    return tuple(float(group.get(k, 1.0)) for k in ("wd_mult", "lr_mult"))


def _bucket_layout(job: Job, opt: Any, opt_idx: int = 0) -> dict:
    """How this (PP, TP) rank's DistributedOptimizer lays its parameters out in the grad buffers' buckets.

    Why: a ``dp_reshardable`` checkpoint holds the optimizer state as these buckets, one flat tensor per
    ``optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_<dtypes>.bucket_idx_<b>.<state>``; a reader needs
    the map from bucket ranges to model keys, which this records from the live objects (for the dumps and NOTES).
    ``optimizer_idx``: the optimizer's place in the ChainedOptimizer (1: the experts' at EP > 1, whose ``dp_size``
    is the expert DP's and whose ``dp_group_idx`` its rank in the expert TP x EP x PP group); ``ep_rank``: this
    rank's expert parallel rank.
    """
    from megatron.core import parallel_state

    names = {id(p): n for gpt in job.gpts for n, p in gpt.named_parameters()}
    metas = param_metadata(job)
    out = {"dp_group_idx": opt.data_parallel_group_idx, "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
           "pp_rank": parallel_state.get_pipeline_model_parallel_rank(), "dp_size": opt.data_parallel_group.size(),
           "optimizer_idx": opt_idx, "ep_rank": parallel_state.get_expert_model_parallel_rank(), "gbufs": []}
    for gbuf_idx, buffer in enumerate(opt.buffers):
        dtypes = (buffer.param_dtype, buffer.grad_dtype)
        buckets = []
        for b, bucket in enumerate(buffer.buckets):
            params = []
            for param, (start, end, bucket_id) in buffer.param_index_map.items():
                if bucket_id != b:
                    continue
                sts = pieces(metas[id(param)], param.detach())
                params.append({"name": names[id(param)], "key": metas[id(param)].key, "shape": tuple(param.shape),
                               "start": start - bucket.offset, "end": end - bucket.offset,
                               "global": [_slice_repr(st.global_slice()) for st in sts],
                               "global_shape": tuple(sts[0].global_shape)})
            params.sort(key=lambda e: e["start"])
            buckets.append({"bucket_idx": b, "numel": bucket.grad_data.numel(), "numel_unpadded": bucket.numel_unpadded,
                            "offset_in_buffer": bucket.offset, "params": params})
        out["gbufs"].append({"gbuf_idx": gbuf_idx, "dtype_key": f"dtype_{dtypes}", "numel": buffer.numel,
                             "numel_unpadded": buffer.numel_unpadded, "buckets": buckets})
    return out


def _slice_repr(where: tuple) -> list:
    """A global_slice as plain data: ints stay, slices become [start, stop]."""
    return [[s.start, s.stop] if isinstance(s, slice) else s for s in where]


def _assemble(records: list[tuple]) -> dict[str, torch.Tensor]:
    """Full tensors from ``(key, global_shape, global_slice, data)`` pieces; every element must be covered once."""
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for key, shape, where, data in records:
        if key not in full:
            full[key] = torch.zeros(shape, dtype=data.dtype)
            covered[key] = torch.zeros(shape, dtype=torch.int32)
        full[key][where] = data
        covered[key][where] += 1
    for key, count in covered.items():
        if not bool((count == 1).all()):
            raise RuntimeError(f"{key}: pieces cover {int((count == 0).sum())} elements 0 times and "
                               f"{int((count > 1).sum())} more than once")
    return full


def gather(job: Job) -> dict | None:
    """The dump (module docstring) on rank 0, None elsewhere; a collective: every rank calls it."""
    local = _local_records(job)
    everything = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(local, everything, dst=0)
    if torch.distributed.get_rank() != 0:
        return None
    model = _assemble([r for rank in everything for r in rank["model"]])
    optim: dict[str, dict[str, Any]] = {}
    for state in ("param", "exp_avg", "exp_avg_sq"):
        full = _assemble([r[1:] for rank in everything for r in rank["optim"] if r[0] == state])
        for key, t in full.items():
            optim.setdefault(key, {})[state] = t
    # every other replica (a norm on each TP rank, a tied embedding's copy on the last stage) must hold what the main
    # one holds: it is not saved, but the job computes with it
    unequal = sorted({f"{what} {key}" for rank in everything for what, key, _, where, data in rank["replicas"]
                      if not torch.equal(_bits((model[key] if what == "model" else optim[key][what])[where]),
                                         _bits(data))})
    steps: dict[str, set] = {}
    group_keys: dict[tuple, set] = {}
    for rank in everything:
        for key, vals in rank["steps"].items():
            steps.setdefault(key, set()).update(vals)
        for g, keys in rank["groups"].items():
            group_keys.setdefault(g, set()).update(keys)
    for key in optim:
        vals = steps.get(key, set())
        # One value if the ranks agree (as they must); all of them otherwise, so that a comparison shows it.
        optim[key]["step"] = torch.tensor(vals.pop()) if len(vals) == 1 else sorted(vals)
    param_groups = []
    for opt in dist_optimizers(job):
        experts = {g for p, (g, _) in opt.model_param_group_index_map.items() if not getattr(p, "allreduce", True)}
        for g, group in enumerate(opt.optimizer.param_groups):
            # "step": a load leaves the checkpoint's group step in torch's param groups, unused and stale (AdamW
            # counts per parameter, in "optim"), so it is left out for the dumps of a save and a load to compare.
            hyper = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in group.items()
                     if k not in ("params", "step")}
            hyper["params"] = sorted(group_keys.get(_group_id(group), ()))
            # the experts' group at EP > 1 (their own optimizer's, flagged is_expert_parallel) is one entry with the
            # dense group of the same hyperparameters, whose keys it shares (_group_id): at EP 1 the experts are in
            # that dense group, and the dumps of the two layouts compare; any other difference stays an entry
            if g in experts and hyper.get("is_expert_parallel") is True and \
                    {**hyper, "is_expert_parallel": False} in param_groups:
                continue
            param_groups.append(hyper)
    buckets = sorted((b for r in everything for b in r["buckets"]),
                     key=lambda b: (b["optimizer_idx"], b["dp_group_idx"]))
    return {"model": model, "optim": optim, "param_groups": param_groups, "iteration": job.args.iteration,
            "buckets": buckets, "replicas_unequal": unequal,
            "scheduler": job.scheduler.state_dict(), "args": dict(vars(job.args)),
            # a MoE job's also names its expert parallel size (a dense one's as before: tests compare it whole)
            "layout": {"tp": job.tp, "pp": job.pp, "dp": job.dp, "vpp": job.vpp,
                       **({"ep": job.ep} if NUM_EXPERTS else {})}}


def write_dump(job: Job, path: Path, extra: dict | None = None) -> None:
    """:func:`gather` and ``torch.save`` on rank 0 (atomically); a collective."""
    dump = gather(job)
    if dump is not None:
        dump.update(extra or {})
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(dump, tmp)
        os.replace(tmp, path)
    torch.distributed.barrier()


# ----------------------------------------------------------------------------------------------------------------------
# Worker side: synthetic steps (comparable across layouts).


def synthetic_grad(key: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    """The full global gradient of ``key`` at resume ``step``: a fixed function of (key, global index, step).

    fp32 values computed in float64; so small (``SYNTH_SCALE``) that gradient clipping never acts.
    """
    salt = zlib.crc32(key.encode()) % 10007
    n = math.prod(shape)
    idx = torch.arange(n, dtype=torch.float64)
    g = torch.sin(idx * 0.6180339887 + salt * 0.001 + step * 1.7) + 0.5 * torch.cos(idx * 0.0137 * (step + 1) + salt)
    return (SYNTH_SCALE * g).to(torch.float32).reshape(shape)


def synthetic_steps(job: Job, steps: int) -> None:
    """``steps`` optimizer steps on synthetic gradients written into each parameter's ``main_grad`` (this rank's
    slice of the global gradient, by the parameter's ShardedTensor metadata), then the scheduler's step."""
    metas = param_metadata(job)
    for k in range(steps):
        for chunk in job.chunks:
            chunk.zero_grad_buffer()
        job.optimizer.zero_grad()
        cache: dict[str, torch.Tensor] = {}
        for param in (p for gpt in job.gpts for p in gpt.parameters()):
            grad = param.main_grad
            for st in pieces(metas[id(param)], grad):
                if st.key not in cache:
                    cache[st.key] = synthetic_grad(st.key, tuple(st.global_shape), job.args.iteration + k)
                if st.data.data_ptr() < grad.data_ptr() or \
                        st.data.data_ptr() >= grad.data_ptr() + grad.numel() * grad.element_size():
                    raise RuntimeError(f"{st.key}: a sharded piece is not a view of main_grad")
                st.data.copy_(cache[st.key][st.global_slice()].to(grad.dtype))
        ok, norm, _ = job.optimizer.step()
        if not ok:
            raise RuntimeError("synthetic optimizer step was skipped")
        if norm is not None and norm >= CLIP:
            raise RuntimeError(f"synthetic grad norm {norm} would be clipped")
        job.scheduler.step(increment=GLOBAL_BATCH)
    job.args.iteration += steps
    job.args.consumed_train_samples = job.args.iteration * GLOBAL_BATCH


# ----------------------------------------------------------------------------------------------------------------------
# Worker side: the model's own forward pass.


def write_logits(job: Job, path: Path) -> None:
    """The GPT's logits on :func:`probe_tokens` (its eval forward, no labels: ``[b, s, padded vocab]``), with the
    tokens, ``torch.save``d on rank 0: at TP1 PP1 the model's own forward; otherwise through Megatron's pipeline
    schedule, forward only, the last stage's vocabulary-parallel logits gathered over TP (:func:`_pipeline_logits`)."""
    if job.vpp > 1:
        raise NotImplementedError("logits of a job with virtual pipeline stages (no test asks for them)")
    if job.tp != 1 or job.pp != 1:
        return _pipeline_logits(job, path)
    tokens = probe_tokens()
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens).contiguous()
    (gpt,) = job.gpts
    was_training = gpt.training
    gpt.eval()
    with torch.no_grad():
        logits = gpt(tokens, positions, None)
    gpt.train(was_training)
    if torch.distributed.get_rank() == 0:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"tokens": tokens, "logits": logits.detach().float().clone()}, tmp)
        os.replace(tmp, path)
    torch.distributed.barrier()


def _pipeline_logits(job: Job, path: Path) -> None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = probe_tokens()
    batch = {"tokens": tokens, "position_ids": torch.arange(SEQ).unsqueeze(0).expand_as(tokens).contiguous()}
    held: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None)

        def collect(output_tensor, non_loss_data=False):
            held.append(output_tensor.detach().float().clone())
            return output_tensor if not non_loss_data else None

        return out, collect

    (gpt,) = job.gpts
    was_training = gpt.training
    gpt.eval()
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=job.chunks,
                                    num_microbatches=1, seq_length=SEQ, micro_batch_size=tokens.shape[0],
                                    decoder_seq_length=SEQ, forward_only=True, collect_non_loss_data=True)
    gpt.train(was_training)
    full = None
    if parallel_state.is_pipeline_last_stage():
        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(held[0]) for _ in range(job.tp)]
        torch.distributed.all_gather(parts, held[0].contiguous(), group=group)
        if parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0:
            full = torch.cat(parts, dim=-1)
    gathered = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(full, gathered, dst=0)
    if torch.distributed.get_rank() == 0:
        (logits,) = [g for g in gathered if g is not None]
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"tokens": tokens, "logits": logits}, tmp)
        os.replace(tmp, path)
    torch.distributed.barrier()


@contextlib.contextmanager
def quiet_warnings():
    """Megatron warns once per import that TE/Apex are missing: nothing to act on here."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def trained_on(loaded: dict, after: dict, step: int) -> list[str]:
    """What is wrong with a job that loaded ``loaded`` (a dump) at ``step`` and took one step to ``after``: its step
    and iteration not ``step + 1``, a master that did not move, a master or moment not finite (empty: nothing)."""
    found = []
    steps = sorted({float(s["step"]) for s in after["optim"].values()})
    if after["iteration"] != step + 1 or steps != [float(step + 1)]:
        found.append(f"iteration {after['iteration']}, steps {steps}")
    found += [f"{k} did not move" for k in loaded["optim"]
              if torch.equal(loaded["optim"][k]["param"], after["optim"][k]["param"])]
    found += [f"{k} {n} not finite" for k, s in after["optim"].items() for n in ("param", "exp_avg")
              if not bool(torch.isfinite(s[n]).all())]
    return found
