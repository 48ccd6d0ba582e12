"""Run real torchtitan (0.3.0) training on CPU, to make and check real checkpoints.

The tests need checkpoints written by torchtitan itself (its trainer, its
``llama3`` ``debugmodel`` with the fused ``attention.wqkv`` saved as wq/wk/wv
through state-dict hooks, FSDP2 over ``gloo``), and a way to see exactly what
state torchtitan holds after loading one, so that a converted checkpoint can be
compared bit for bit with the original.  This module launches
``tests/frameworks/titan_train.py`` (torchtitan's own ``main`` plus the CPU
patches it needs) under ``torchrun --standalone``.

API:

* :func:`make_assets` -- a tiny tokenizer and text dataset, offline.
* :func:`train` -- one torchrun job of torchtitan's trainer.
* :func:`resume_and_dump` -- load a checkpoint in torchtitan, take one step,
  and return the state it loaded (see ``titan_train``'s dump facility).
* :func:`compare_dumps` -- bitwise differences between two dumps.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ENTRY = HERE / "titan_train.py"
DUMP_ENV = "TITAN_DUMP"  # read by titan_train.py

SEQ_LEN = 64
LOCAL_BATCH = 2
SEED = 0
# FSDP2 computes in bfloat16 by default; this CPU (AVX2, no AVX512-BF16) runs
# bf16 matmuls ~6x slower than fp32 (a step: ~4 s vs ~1 s).  The option only
# changes the compute dtype: parameters, optimizer states and checkpoints stay
# float32 either way.  Pass "--training.mixed-precision-param bfloat16" in
# ``extra`` to train exactly as the default config does.
MIXED_PRECISION_PARAM = "float32"

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
UNK = "<unk>"

# ------------------------------------------------------------------- assets


def _words(count: int, rng: random.Random) -> list[str]:
    """A deterministic pseudo-vocabulary of distinct lowercase words."""
    onsets = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z"]
    vowels = ["a", "e", "i", "o", "u"]
    seen: list[str] = []
    found: set[str] = set()
    while len(seen) < count:
        word = "".join(
            rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(1, 3))
        )
        if word not in found:
            found.add(word)
            seen.append(word)
    return seen


def _write_if_changed(path: Path, text: str) -> None:
    """Write only when the content differs, so mtimes (and HF caches) stay valid."""
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def make_assets(directory: Path | str) -> Path:
    """Write a tiny tokenizer and text dataset under ``directory``; return it.

    The torchtitan wheel ships neither its test tokenizer nor its ``c4_test``
    dataset, and CI has no network.  So, deterministically (same bytes on every
    call): ``tokenizer/`` (a word-level ``tokenizer.json`` with 300 words plus
    BOS/EOS/UNK, and a ``tokenizer_config.json`` naming BOS and EOS, which is
    what torchtitan's HuggingFaceTokenizer reads; vocab far below debugmodel's
    2048) and ``c4_test/data.json`` (JSON lines with a ``text`` field, the
    format torchtitan's ``c4_test`` loader reads with
    ``load_dataset(path, split="train")``).  The dataset's Arrow cache is built
    here once, under ``hf_cache/``, so that the ranks of later jobs only read it.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = Path(directory).resolve()
    tok_dir = root / "tokenizer"
    data_dir = root / "c4_test"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)

    rng = random.Random(1234)
    words = _words(300, rng)
    vocab = {UNK: 0, BOS: 1, EOS: 2}
    for word in words:
        vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([UNK, BOS, EOS])
    _write_if_changed(tok_dir / "tokenizer.json", tokenizer.to_str(pretty=True))
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": True,
        "model_max_length": 1024,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_if_changed(tok_dir / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")

    lines = []
    for _ in range(400):
        n = rng.randint(10, 120)
        text = " ".join(rng.choice(words) for _ in range(n))
        lines.append(json.dumps({"text": text}))
    _write_if_changed(data_dir / "data.json", "\n".join(lines) + "\n")

    _warm_dataset_cache(root)
    return root


def _warm_dataset_cache(root: Path) -> None:
    """Build the dataset's Arrow cache once, in a child with the ranks' env."""
    marker = root / "hf_cache" / ".warm"
    data = root / "c4_test" / "data.json"
    if marker.exists() and marker.stat().st_mtime >= data.stat().st_mtime:
        return
    code = (
        "import sys, datasets; "
        "print(len(datasets.load_dataset(sys.argv[1], split='train')))"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(root / "c4_test")],
        env=_env(root),
        check=True,
        capture_output=True,
        timeout=120,
    )
    marker.touch()


# -------------------------------------------------------------------- train


def _env(assets: Path, dump: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(assets / "hf_cache"),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        TORCHINDUCTOR_CACHE_DIR=str(assets / "inductor_cache"),
    )
    env.pop(DUMP_ENV, None)
    if dump is not None:
        env[DUMP_ENV] = str(dump)
    return env


def titan_args(
    assets: Path,
    nproc: int,
    steps: int,
    folder: Path,
    interval: int | None,
    dump_folder: Path,
) -> list[str]:
    """torchtitan command-line options for a small CPU FSDP2 run.

    The model is the default ``llama3`` ``debugmodel`` as users run it; only
    sequence length and batch size are made small (``seq_len`` 64, local
    batch 2) and the compute dtype float32 (see ``MIXED_PRECISION_PARAM``) so
    that a step is fast on CPU.  The comm flight recorder is off (it
    is an NCCL feature) and the seed is fixed so fresh runs repeat.
    """
    return [
        "--module", "llama3",
        "--config", "llama3_debugmodel",
        "--hf-assets-path", str(assets / "tokenizer"),
        "--dump-folder", str(dump_folder),
        "--dataloader.dataset", "c4_test",
        "--dataloader.dataset-path", str(assets / "c4_test"),
        "--training.seq-len", str(SEQ_LEN),
        "--training.local-batch-size", str(LOCAL_BATCH),
        "--training.steps", str(steps),
        "--training.mixed-precision-param", MIXED_PRECISION_PARAM,
        "--parallelism.data-parallel-shard-degree", str(nproc),
        "--parallelism.spmd-backend", "partial_dtensor",
        "--comm.trace-buf-size", "0",
        "--metrics.log-freq", "1",
        "--debug.seed", str(SEED),
        "--checkpoint.enable",
        "--checkpoint.folder", str(Path(folder).resolve()),
        "--checkpoint.interval", str(interval if interval is not None else max(steps, 1)),
    ]


class TitanJobError(RuntimeError):
    """A torchrun job of torchtitan failed or timed out."""


def _kill_group(proc: subprocess.Popen) -> None:
    """End the job's whole process group (torchrun and its ranks)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def train(
    workdir: Path,
    nproc: int,
    steps: int,
    *,
    folder: Path,
    interval: int | None = None,
    extra: Sequence[str] = (),
    load_step_dump: Path | None = None,
    timeout: float = 300,
    assets: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run torchtitan's trainer under ``torchrun --standalone`` for ``steps`` steps.

    Checkpointing is on, into ``folder`` (``--checkpoint.folder``, absolute),
    every ``interval`` steps (default: only at the last step), and the last
    save is a full checkpoint (llama3_debugmodel's config sets
    ``last_save_model_only=False``) unless ``extra`` says otherwise.  As in
    torchtitan, a ``folder`` that already holds ``step-N`` checkpoints is
    resumed from the highest.  ``extra`` passes torchtitan options through
    (later options win).  ``load_step_dump``: the file the dump facility
    writes (see ``titan_train``).  ``assets`` defaults to ``workdir/assets``
    (made if missing).  Raises :class:`TitanJobError` with the output's tail
    on failure or timeout; the job's process group is always ended.
    The result's ``stdout`` holds all ranks' output (stderr merged into it),
    and it has ``.wall`` (seconds of the torchrun call) and ``.log`` (the log
    file under ``workdir/logs``) set.
    """
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    assets = make_assets(workdir / "assets") if assets is None else Path(assets).resolve()
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(nproc),
        str(ENTRY),
        *titan_args(assets, nproc, steps, Path(folder), interval, workdir / "outputs"),
        *extra,
    ]
    if load_step_dump is not None:
        Path(load_step_dump).unlink(missing_ok=True)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    log = logs / f"job-{time.strftime('%H%M%S')}-{os.getpid()}-{time.monotonic_ns()}.log"
    start = time.monotonic()
    with open(log, "w+b") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=_env(assets, load_step_dump),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)
        wall = time.monotonic() - start
        out.seek(0)
        text = out.read().decode(errors="replace")
    result = subprocess.CompletedProcess(cmd, proc.returncode, text, "")
    result.wall = wall  # type: ignore[attr-defined]
    result.log = log  # type: ignore[attr-defined]
    if timed_out or proc.returncode != 0:
        what = f"timed out after {timeout:.0f}s" if timed_out else f"exited {proc.returncode}"
        raise TitanJobError(
            f"torchtitan job {what} ({log}):\n{' '.join(cmd)}\n--- tail ---\n"
            + _tail(text)
        )
    if load_step_dump is not None and not Path(load_step_dump).exists():
        raise TitanJobError(f"job wrote no dump to {load_step_dump}\n" + _tail(text))
    return result


def _tail(text: str, lines: int = 40) -> str:
    """The end of a job's output, with the ranks' exception lines first."""
    all_lines = text.splitlines()
    exc = re.compile(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt)\b.*")
    errors: list[str] = []
    for line in all_lines:
        if exc.match(line) and line not in errors:
            errors.append(line)
    parts = []
    if errors:
        parts += ["exceptions:", *errors[:10], ""]
    starts = [i for i, line in enumerate(all_lines) if "Traceback" in line]
    if starts:
        parts += ["first traceback:", *all_lines[starts[0] : starts[0] + lines], "..."]
    parts += ["last lines:", *all_lines[-20:]]
    return "\n".join(parts)


# ------------------------------------------------------------ resume + dump


def checkpoint_step(path: Path) -> int:
    """The trainer step a torchtitan checkpoint (a ``step-N`` folder) holds.

    Reads ``train_state.step`` from the DCP checkpoint; falls back to the
    folder name when the checkpoint has no train state (model-only).
    """
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    path = Path(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming ... a single process"
            sd = _load_state_dict_from_keys({"train_state"}, checkpoint_id=str(path))
        return int(sd["train_state"]["step"])
    except Exception:
        match = re.search(r"step-(\d+)$", path.name)
        if match is None:
            raise
        return int(match.group(1))


def checkpoint_keys(path: Path) -> list[str]:
    """Every item a DCP checkpoint holds, by its flattened key (``optimizer.state.<fqn>.exp_avg``), from its
    ``.metadata`` alone."""
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def latest_step(folder: Path) -> int:
    """Highest ``step-N`` in ``folder`` that has a ``.metadata`` (torchtitan's rule); -1 if none."""
    steps = [
        int(m.group(1))
        for p in Path(folder).iterdir()
        if (m := re.search(r"step-(\d+)", p.name))
        and ((p / ".metadata").is_file() or (p / "model.safetensors.index.json").is_file())
    ] if Path(folder).is_dir() else []
    return max(steps, default=-1)


def resume_and_dump(
    workdir: Path,
    nproc: int,
    source: Path,
    *,
    steps: int | None = None,
    extra: Sequence[str] = (),
    timeout: float = 300,
    assets: Path | None = None,
    name: str = "dump",
) -> dict[str, Any]:
    """Load ``source`` in torchtitan on ``nproc`` ranks, take one step, return the dump.

    ``source`` is either a checkpoint folder holding ``step-N`` entries
    (resumed as torchtitan's fault-tolerance path: ``--checkpoint.folder
    source``, highest step) or one checkpoint directory (loaded through
    ``--checkpoint.initial-load-path source
    --checkpoint.no-initial-load-model-only`` with an empty folder, i.e. full
    state; pass ``--checkpoint.initial-load-model-only`` in ``extra`` for
    model only: the trainer then starts at step 0 and ``optim`` is empty).
    ``--checkpoint.load-only`` keeps the job from saving, so ``source`` is
    never modified.  ``steps`` (total) defaults to the loaded step + 1, so
    exactly one step runs after the load and ``loss_after`` is its loss.
    Pass ``--checkpoint.exclude-from-loading dataloader`` in ``extra`` when
    ``nproc`` differs from the saving job's.  The dump also carries ``wall``
    (seconds of the torchrun call).
    """
    workdir = Path(workdir).resolve()
    source = Path(source).resolve()
    latest = latest_step(source)
    if latest >= 0:
        folder = source
        args = ["--checkpoint.load-only"]
        loaded = latest
    else:
        folder = workdir / f"{name}-empty-folder"
        folder.mkdir(parents=True, exist_ok=True)
        args = [
            "--checkpoint.initial-load-path", str(source),
            "--checkpoint.no-initial-load-model-only",
            "--checkpoint.load-only",
        ]
        model_only = "--checkpoint.initial-load-model-only" in extra
        if steps is not None:
            loaded = steps - 1
        else:
            # A model-only load leaves the trainer at step 0.
            loaded = 0 if model_only else checkpoint_step(source)
    total = loaded + 1 if steps is None else steps
    dump_path = workdir / f"{name}.pt"
    result = train(
        workdir, nproc, total,
        folder=folder, extra=[*args, *extra], load_step_dump=dump_path,
        timeout=timeout, assets=assets,
    )
    dump = torch.load(dump_path, weights_only=False)
    dump["wall"] = result.wall  # type: ignore[attr-defined]
    return dump


# ------------------------------------------------------------------ compare


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bytes, so -0.0/+0.0 and NaNs compare by bits."""
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.is_floating_point() or t.is_complex():
        return t.view(torch.uint8)
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _diff_value(where: str, a: Any, b: Any, out: list[str]) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            out.append(f"{where}: tensor vs {type(b if isinstance(a, torch.Tensor) else a).__name__}")
        elif a.dtype != b.dtype:
            out.append(f"{where}: dtype {a.dtype} != {b.dtype}")
        elif a.shape != b.shape:
            out.append(f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}")
        elif not torch.equal(_bits(a), _bits(b)):
            n = int((_bits(a) != _bits(b)).sum())
            d = (a.double() - b.double()).abs().max().item() if a.numel() and a.is_floating_point() else None
            out.append(f"{where}: values differ ({n} bytes, max abs diff {d})")
    elif isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a:
                out.append(f"{where}.{key}: only in second")
            elif key not in b:
                out.append(f"{where}.{key}: only in first")
            else:
                _diff_value(f"{where}.{key}", a[key], b[key], out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{where}: length {len(a)} != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _diff_value(f"{where}[{i}]", x, y, out)
    elif type(a) is not type(b) or a != b:
        out.append(f"{where}: {a!r} != {b!r}")


def compare_dumps(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    parts: Sequence[str] = ("step", "model", "optim", "lr_scheduler"),
) -> list[str]:
    """Bitwise differences between two dumps; empty when identical.

    Tensors must have the same dtype, shape and bytes (not allclose).  Model
    differences are per key, optimizer differences per parameter FQN and state
    name (``optim.state.<fqn>.<name>``) and per param-group entry.  ``parts``
    picks the dump entries to compare; add ``"optim_flat"`` for torchtitan's
    own flat optimizer dict, or ``"loss_after"`` for the next step's loss.
    """
    out: list[str] = []
    for part in parts:
        if part not in a or part not in b:
            if part in a or part in b:
                out.append(f"{part}: only in {'first' if part in a else 'second'}")
            continue
        _diff_value(part, a[part], b[part], out)
    return out
