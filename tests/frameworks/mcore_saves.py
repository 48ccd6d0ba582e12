"""The Megatron-LM saves the framework tests share: each trained and saved once per session by real megatron-core 0.16.1
(:mod:`frameworks.mcore`), beside the state gathered from the live job (``mcore.truth_path``), which the tests hold
osdpipe's outputs against."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
from frameworks import mcore


class Save(NamedTuple):
    """How one source is trained and saved: its grid, its sharding type, its dtype, its linear biases
    (``none``, ``linear``: Megatron-LM's ``--add-bias-linear``, ``qkv``: ``--add-qkv-bias``), its GPT
    (:data:`frameworks.mcore.MODELS`: ``llama``, the harness's, ``llama_tied``, the same with tied embeddings, or
    ``gpt``, Megatron-LM's defaults: LayerNorm, a learned position table, GeLU, tied embeddings) and its model chunks
    per pipeline stage (``vpp``: virtual pipeline stages, trained by megatron-core's interleaved schedule), and its
    DDP's bucket size (``bucket``: ``--overlap-grad-reduce --ddp-bucket-size``; ``None``: one bucket per buffer), and
    whether each head's query and key are normed (``qk``: ``--qk-layernorm``); ``num_buckets``: the buckets counted
    instead (``--overlap-grad-reduce --ddp-num-buckets``: the rank's parameters over the count make the size)."""

    tp: int
    pp: int
    dp: int
    sharding: str
    bf16: bool = False
    bias: str = "none"
    model: str = "llama"
    vpp: int = 1
    bucket: int | None = None
    qk: bool = False
    num_buckets: int | None = None


#: The bucket size of the bucketed source: its first stage's parameters (about 140,000 elements) in 4 buckets.
BUCKET = 20_000
#: The ranks every source is saved on.
WORLD = 4
#: Each saved once by real megatron-core on :data:`WORLD` ranks (the converted ones go on 2 more synthetic steps after
#: the save: what a converted output's resume must equal).
SAVES = {
    "tp2_dp2": Save(2, 1, 2, "dp_reshardable"),
    "tp1_pp2_dp2": Save(1, 2, 2, "dp_reshardable"),
    "tp2_pp2": Save(2, 2, 1, "dp_reshardable"),
    "tp2_dp2_fully": Save(2, 1, 2, "fully_reshardable"),
    "tp1_pp2_dp2_fully": Save(1, 2, 2, "fully_reshardable"),
    "tp2_pp2_fully": Save(2, 2, 1, "fully_reshardable"),
    "tp4_bf16": Save(4, 1, 1, "dp_reshardable", bf16=True),
    "tp2_dp2_fs": Save(2, 1, 2, "fully_sharded_model_space"),
    "tp1_pp2_dp2_fs": Save(1, 2, 2, "fully_sharded_model_space"),
    "tp2_dp2_bias": Save(2, 1, 2, "dp_reshardable", bias="linear"),
    "tp2_pp2_qkv_bias": Save(2, 2, 1, "fully_reshardable", bias="qkv"),
    "gpt_tp2_pp2": Save(2, 2, 1, "dp_reshardable", bias="linear", model="gpt"),
    "gpt_tp2_pp2_fully": Save(2, 2, 1, "fully_reshardable", bias="linear", model="gpt"),
    "tied_tp2_pp2": Save(2, 2, 1, "dp_reshardable", model="llama_tied"),
    "tp1_pp2_vpp2_dp2": Save(1, 2, 2, "dp_reshardable", vpp=2),
    "tp1_pp2_vpp2_dp2_fully": Save(1, 2, 2, "fully_reshardable", vpp=2),
    "tp1_pp2_dp2_buckets": Save(1, 2, 2, "dp_reshardable", bucket=BUCKET),
    "gpt_qk_tp2_pp2": Save(2, 2, 1, "dp_reshardable", bias="linear", model="gpt", qk=True),
    "tp2_dp2_counted": Save(2, 1, 2, "dp_reshardable", num_buckets=5),  # 4 buckets: each closes once past a fifth
    "qwen3_tp2_pp2": Save(2, 2, 1, "dp_reshardable", qk=True),  # the harness's GPT with head norms: a Qwen3
}
#: The sources converted (the issue's three parallelisms, each in both sharding types Megatron-LM writes, a bf16
#: job's, the legacy type at two, a GPT with every linear bias, Megatron-LM's default GPT over PP, whose tied
#: embedding has a copy on the last stage, a job of virtual pipeline stages, one whose first stage's gradient
#: buffer is cut into buckets of a size and one whose buckets are counted, and Megatron-LM's default GPT with
#: --qk-layernorm), and the targets each is written for,
#: (TP, PP, DP), in the type ``output.megatron_optim_format`` unset gives (``DEFAULT_OUTPUT``).
CONVERTED = ("tp2_dp2", "tp1_pp2_dp2", "tp2_pp2", "tp2_dp2_fully", "tp1_pp2_dp2_fully", "tp2_pp2_fully", "tp4_bf16",
             "tp2_dp2_fs", "tp1_pp2_dp2_fs", "tp2_dp2_bias", "gpt_tp2_pp2", "tp1_pp2_vpp2_dp2", "tp1_pp2_dp2_buckets",
             "gpt_qk_tp2_pp2", "tp2_dp2_counted")


def make_saves(root: Path) -> dict[str, Path]:
    """Every source of :data:`SAVES` saved under ``root`` by real megatron-core (about 2 minutes on 2 cores): the
    session fixture ``megatron_saves`` (tests/frameworks/conftest.py) makes them once for every test module.

    Sources that differ only in their sharding type are one job, trained once and saved once in each type
    (:func:`mcore.save`'s ``also``): what the job held is the same. The jobs run one after the other in one launch
    on 4 ranks (:func:`mcore.each`), the legacy ones in a second on megatron-core 0.13: a launch's start (importing
    megatron-core on each rank) costs about 20 s, a job a few seconds."""
    legacy = mcore.legacy_megatron(root) if any(s.sharding == "fully_sharded_model_space" for s in SAVES.values()) \
        else None
    jobs: dict[Save, list[str]] = {}  # the job (its sharding type blanked) -> the sources it saves
    for name, s in SAVES.items():  # a fully_sharded_model_space source is another megatron-core's job: its own
        legacy_type = s.sharding == "fully_sharded_model_space"
        jobs.setdefault(s._replace(sharding=name if legacy_type else ""), []).append(name)
    launches: dict[bool, list[list[str]]] = {False: [], True: []}  # legacy or not -> its jobs
    out = {}
    for names in jobs.values():
        first, rest = names[0], names[1:]
        s = SAVES[first]
        is_legacy = s.sharding == "fully_sharded_model_space"
        if is_legacy and legacy is None:
            continue  # its tests skip, naming what is missing
        if s.tp * s.pp * s.dp != WORLD:
            raise ValueError(f"{first}: every source is saved on {WORLD} ranks, one launch for all")
        resumed = {"resume_truth": 2, "dump_after": resumed_path(root / first)} if first in CONVERTED else {}
        also = tuple((SAVES[n].sharding, root / n, resumed_path(root / n)) for n in rest)
        launches[is_legacy].append(mcore.save_argv(root / first, tp=s.tp, pp=s.pp, sharding=s.sharding, bf16=s.bf16,
                                                   bias=s.bias, model=s.model, also=also, vpp=s.vpp,
                                                   bucket=s.bucket, qk=s.qk, num_buckets=s.num_buckets,
                                                   **resumed))
        out.update({n: root / n for n in names})
    for is_legacy, argvs in launches.items():
        if argvs:
            mcore.each(root, WORLD, argvs, label="save-legacy" if is_legacy else "save", timeout=900,
                       megatron_from=legacy if is_legacy else None)
    return out


def saved(saves: dict[str, Path], name: str) -> Path:
    """Source ``name``'s folder; a skip where it could not be saved (a legacy one without megatron-core 0.13)."""
    if name not in saves:
        pytest.skip(f"{mcore.LEGACY} could not be installed apart, so no {SAVES[name].sharding} source")
    return saves[name]


def resumed_path(folder: Path) -> Path:
    return folder.with_name(folder.name + ".resumed.pt")
