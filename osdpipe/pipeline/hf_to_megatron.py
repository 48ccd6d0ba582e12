"""A Hugging Face ``LlamaForCausalLM``'s, ``Qwen2ForCausalLM``'s, ``Qwen3ForCausalLM``'s or ``GPT2LMHeadModel``'s whole
checkpoint -> a Megatron-LM ``torch_dist`` save, optimizer included.

The source is read by osdpipe's own readers of the checkpoint's layout (the HF Trainer's or accelerate's folder,
PyTorch's own: ``checkpoint=accelerate|pytorch``, :func:`osdpipe.run.stages.load.open_input`): every parameter's
weights (the fp32 masters: an fp32 job's weights, FSDP's full state dict of a mixed-precision one), ``exp_avg``,
``exp_avg_sq`` and ``step``, and the param groups. The model's dimensions are the folder's ``config.json``, which
gives Megatron's ``args`` (:func:`osdpipe.layout.megatron_hf.megatron_args`). Every tensor goes through the same map
(:func:`osdpipe.layout.megatron_hf.from_hf`), the vocabulary padded with zero rows to Megatron's padded size, into a
:class:`~osdpipe.io.formats.megatron.MegatronSave`, which the Megatron conversion's own stages write for the target's
TP x PP x DP, read back and prove (:func:`osdpipe.pipeline.megatron.convert`); the read-back, mapped to Hugging
Face's names again, must hold the source's tensors bit for bit.

What a Megatron save holds that the source does not say:

* param groups as Megatron's optimizer keys them (``wd_mult``, ``lr_mult``, ``is_expert_parallel``,
  ``is_decoupled_lr``, ``max_lr``, ``min_lr``) beside the source's own hyperparameters and ``step``: its two groups
  must be Megatron's (weight decay for every matrix, none for the 1-D norms), which the HF Trainer's are;
* the scheduler (``opt_param_scheduler``, which Megatron-LM's load requires): a constant one at the source's learning
  rate and weight decay, as a transformers scheduler (a Python function of the step) has no Megatron equivalent;
* no RNG states: the source's are another framework's; Megatron-LM's ``load_checkpoint`` then needs
  ``--no-load-rng`` (it exits on a save without them: "Unable to load rng state from checkpoint").
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from osdpipe.io import hf_folder
from osdpipe.io.formats.base import WEIGHTS, InputError, SourceMeta, SourceReader
from osdpipe.io.formats.megatron import MegatronSave, gpt_of
from osdpipe.io.remote_input import as_path
from osdpipe.layout import llama_titan, megatron_hf
from osdpipe.layout.megatron import LAYERS, without_weight_decay
from osdpipe.pipeline import megatron
from osdpipe.run import progress
from osdpipe.run.report import Report
from osdpipe.spec.config import RunSpec
from osdpipe.spec.megatron import MEGATRON, MegatronJob
from osdpipe.spec.plan import Plan

#: Adam's per-parameter states a Megatron save holds beside the master weights.
MOMENTS = ("exp_avg", "exp_avg_sq")

#: What becomes of each part of the source checkpoint.
_FATES = {
    "model": "converted: mapped to Megatron's GPT (the fp32 masters and the weights), laid out for the target's TP "
             "and PP, the vocabulary padded with zero rows",
    "optimizer": "converted: exp_avg, exp_avg_sq and step mapped the same way, laid out for the target's TP, PP and "
                 "DP; the param groups keyed as Megatron's optimizer keys them",
    "framework": "left out: it describes how the saving framework laid out its own files",
    "other": "left out: a Megatron save has no place for another framework's entries (its scheduler, RNG states, "
             "trainer state); the scheduler written is a constant one at the source's learning rate",
}


#: ``model.factory`` where the user names none: the model the folder's ``config.json`` describes.
FROM_CONFIG = hf_folder.MODEL_FROM_CONFIG


def source_config(raw: dict[str, Any], given: Any) -> dict[str, Any]:
    """The config of reading the source alone, as the range pipeline reads a whole checkpoint: the command's
    (``raw``, a plain dict; ``given``: the keys the user set), its target one process (the Megatron target is not a
    layout kind of that pipeline), nothing of Megatron's; and, where the user names no model, the model of the
    folder's ``config.json``."""
    out = copy.deepcopy(raw)
    out["target"] = {**out["target"], "kind": "fsdp2", "world_size": 1, "tp_size": 1, "pp_size": 1, "vpp_size": 1,
                     "tp_plan": {}, "shard_group_size": None, "wrap": None}
    out["output"] = {**out["output"], "checkpoint": None, "megatron_optim_format": None, "model_format": None}
    out["model"] = source_model(raw, given)
    return out


def source_model(raw: dict[str, Any], given: Any) -> dict[str, Any]:
    """The model the source is read as: the user's; else what the checkpoint's own files name (a torchtitan
    folder's ``model_args.json``: its llama3 or qwen3); else the model of the folder's ``config.json``."""
    model = dict(raw.get("model") or {})
    named = (raw.get("checkpoint") or {}).get("model") is not None  # torchtitan's names, checkpoint.model/flavor
    if "model.factory" in given or "model" in given or named:
        return model
    from osdpipe.io import checkpoints

    path = raw["input"]["path"]
    named = checkpoints.get(raw["checkpoint"]["layout"]).model_from_files(path, checkpoints.get(MEGATRON))
    factory, kwargs = named if named is not None else (FROM_CONFIG, {"path": path})
    return {**model, "factory": factory, "kwargs": kwargs, "units": None}


def hf_model_config(model: dict[str, Any], path: str) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of the model the source is read as (``model``: :func:`source_model`'s):
    torchtitan's llama3 or qwen3 as transformers' Llama or Qwen3 (:func:`osdpipe.layout.llama_titan.hf_config`), or
    the folder's own.

    Raises:
        InputError: neither: the folder has no ``config.json``, or is damaged.
    """
    if (args := titan_args(model)) is not None:
        return llama_titan.hf_config(args)
    return hf_folder.read_config(path)


def titan_args(model: dict[str, Any]) -> dict[str, Any] | None:
    """The keywords of ``torchtitan_llama3`` or ``torchtitan_qwen3`` of a torchtitan source (``model``:
    :func:`source_model`'s): its ``model_args.json``'s, or those of torchtitan's own registry flavor
    (``model=torchtitan``); ``None``: the source is no torchtitan model.

    Raises:
        InputError: a registry model that is no such llama3 or qwen3.
    """
    kwargs = model.get("kwargs") or {}
    if model.get("factory") in llama_titan.FAMILIES:
        return kwargs
    if model.get("factory") != "torchtitan":
        return None
    from osdpipe.layout.models import torchtitan_flavor_args

    try:
        return torchtitan_flavor_args(kwargs.get("name", "llama3"), kwargs.get("flavor", "debugmodel"))
    except ValueError as exc:
        raise InputError(str(exc)) from None


def without_advice(notes: list[str], source: dict[str, Any]) -> list[str]:
    """``notes`` (what reconciling ``source``, :func:`source_config`'s, found to say) without what the source's own
    framework would do with a conversion in its own layout (its RNG files per process, its ``load_state``): the output
    is a Megatron save, which has none of them."""
    from osdpipe.io import checkpoints

    layout = checkpoints.get(source["checkpoint"]["layout"])
    try:
        advice = set(layout.advice(source["input"]["path"], source["target"], source["output"]["format"]))
    except (InputError, OSError):
        return notes
    return [n for n in notes if n not in advice]


def refusal(raw: dict[str, Any], given: Any) -> str | None:
    """Why the command's config (``raw``) cannot convert its source to Megatron, from the folder's ``config.json``
    alone (``None``: nothing yet): no ``config.json``, a model Megatron cannot express, a grid that does not divide
    it. Asked before anything is read or written."""
    path, target = raw["input"]["path"], raw["target"]
    try:
        config = hf_model_config(source_model(raw, given), path)
        megatron_hf.megatron_args(config, int(target["tp_size"]), int(target["pp_size"]), int(target["world_size"]),
                                  vpp=int(target["vpp_size"]))
    except ValueError as exc:  # InputError among them
        return f"input.path={path}: {exc}"
    return None


def job_of(spec: RunSpec, plan: Plan) -> MegatronJob:
    """The Megatron conversion ``spec`` (checked, ``output.checkpoint=megatron``) asks of the source ``plan`` reads."""
    target = spec.target
    return MegatronJob(
        source=plan.input_path,
        output=spec.output.path,
        tp=target.tp_size,
        pp=target.pp_size,
        dp=target.world_size // (target.tp_size * target.pp_size),
        optim_format=spec.output.megatron_optim_format or "fully_reshardable",
        overwrite=spec.output.overwrite,
        fsync=spec.output.fsync,
        workers=spec.runtime.workers,
        vpp=target.vpp_size,
    )


def hf_source(plan: Plan, job: MegatronJob) -> megatron.Source:
    """The :class:`osdpipe.pipeline.megatron.Source` of the Hugging Face checkpoint ``plan`` reads, for ``job``.

    It holds none of the source's tensors beside the save made of them: ``read`` maps one state of every parameter
    at a time and lets it go, and ``problems`` reads each state again to hold the written save against it
    (:func:`osdpipe.verify.megatron.hf_source_problems`). A second read of the source costs less than the memory of
    a second copy of the state, which is what bounds a conversion on one machine."""
    held: dict[str, Any] = {}

    def read() -> MegatronSave:
        reader, meta = open_hf_input(plan)
        states = hf_states(plan, reader)  # kept for problems: the reader holds no tensor, only where they are
        save, step, groups, notes = source_save(plan, job, meta, states)
        held.update(save=save, states=states, step=step, groups=groups, notes=notes)
        return save

    def problems(written: MegatronSave) -> list[str]:
        from osdpipe.verify.megatron import hf_source_problems

        save = held["save"]
        return hf_source_problems(gpt_of(save.args), int(save.args["vocab_size"]), held["states"], held["step"],
                                  held["groups"], written)

    def entries() -> list[dict[str, Any]]:
        read = plan.checkpoint.read(as_path(plan.input_path))
        kept = hf_folder.RECORD in held["save"].common if "save" in held else False
        return [{"name": e.name, "part": e.part, "where": e.where, "size": e.size,
                 "fate": _KEPT if kept and e.name in (hf_folder.CONFIG, hf_folder.GENERATION_CONFIG)
                 else _FATES[e.part]}
                for e in read.entries]

    return megatron.Source(read, problems, entries, lambda: held.get("notes", []))


#: What becomes of the checkpoint's ``config.json`` and ``generation_config.json``: what ``args`` cannot hold of them.
_KEPT = (f"kept: in common.pt's {hf_folder.RECORD!r} (config.json also as common.pt's args), written back by "
         "output.checkpoint=hf")


def open_hf_input(plan: Plan) -> tuple[SourceReader, SourceMeta]:
    """The reader of the source ``plan`` reads, and its metadata, checked to hold every parameter's weights and
    Adam's state.

    Raises:
        InputError: a parameter without weights, ``exp_avg``, ``exp_avg_sq`` or ``step``.
    """
    from osdpipe.io.formats import canonical_meta
    from osdpipe.run.stages.load import open_input

    reader = open_input(plan)
    meta = canonical_meta(reader.meta(), plan.tree, where=plan.input_path)
    missing = [p.fqn for p in plan.tree.params if not {WEIGHTS, *MOMENTS, "step"} <= set(meta.state.get(p.fqn, {}))]
    if missing:
        raise InputError(f"{plan.input_path}: no weights or Adam state (exp_avg, exp_avg_sq, step) for "
                         f"{', '.join(missing[:3])}; a Megatron save's distributed optimizer is Adam's: convert a "
                         "checkpoint of Adam or AdamW that has stepped")
    return reader, meta


def hf_states(plan: Plan, reader: SourceReader) -> Callable[[str], dict[str, torch.Tensor]]:
    """What reads one state of every parameter of the source (``weights``, ``exp_avg`` or ``exp_avg_sq``) by its
    Hugging Face name: torchtitan's llama3 or qwen3 rearranged as transformers' Llama or Qwen3 (copy-only), each
    tensor checked to be
    fp32, as a Megatron save's masters and moments are.

    One state at a time, so that a caller holds a third of the source's tensors at most.

    Raises (from the function returned):
        InputError: a tensor that is not float32.
    """
    names = [p.fqn for p in plan.tree.params]
    args = titan_args(plan.spec.model.model_dump(mode="json"))
    heads = llama_titan.heads_of(args) if args is not None else None

    def state(name: str) -> dict[str, torch.Tensor]:
        got = reader.read([(n, name) for n in names])
        tensors = {n: got.pop((n, name)) for n in names}
        if heads is not None:
            tensors = llama_titan.from_titan(heads, tensors)
        bad = sorted(f"{n} ({t.dtype})" for n, t in tensors.items() if t.dtype != torch.float32)
        if bad:
            raise InputError(f"{plan.input_path}: {name} {', '.join(bad[:3])} not float32; a Megatron save's masters "
                             "and moments are fp32: not supported yet")
        return tensors

    return state


def source_save(
    plan: Plan, job: MegatronJob, meta: SourceMeta, read_state: Callable[[str], dict[str, torch.Tensor]]
) -> tuple[MegatronSave, float, list[dict[str, Any]], list[str]]:
    """The Megatron save of the source ``plan`` reads (its metadata ``meta`` and ``read_state``, from
    :func:`open_hf_input` and :func:`hf_states`), for ``job``'s grid; the step, the source's param groups (its
    hyperparameters, their parameters as Megatron's keys), and what the report warns of the source.

    Each state of the source is read, mapped and let go before the next is read: the save's tensors and one state of
    the source's are all it holds at once.

    Raises:
        InputError: one line: what Megatron cannot express, a TP or PP that does not divide the model, a source
            without Adam's state, tensors that are not fp32, steps that differ between parameters, param groups other
            than Megatron's.
    """
    where = plan.input_path
    model = plan.spec.model.model_dump(mode="json")
    config = hf_model_config(model, where)
    # a folder's own config.json (not one made of torchtitan's model): kept for the way back to a Hugging Face folder
    record = {} if titan_args(model) is not None else {hf_folder.RECORD: hf_folder.record_of(where, config)}
    steps = {float(meta.state[p.fqn]["step"]) for p in plan.tree.params}
    if len(steps) != 1:
        raise InputError(f"{where}: the parameters were stepped {sorted(steps)} times; a Megatron save holds one step "
                         "for all of them")
    step = steps.pop()
    if not step.is_integer():
        raise InputError(f"{where}: step {step} is no whole number of steps")
    try:
        args = megatron_hf.megatron_args(config, job.tp, job.pp, job.tp * job.pp * job.dp, iteration=int(step),
                                         sharding=job.optim_format or "fully_reshardable")
    except ValueError as exc:
        raise InputError(f"{where}: {exc}") from None
    gpt = gpt_of(args)
    mapped: dict[str, dict[str, torch.Tensor]] = {}
    for state in (WEIGHTS, *MOMENTS):
        try:
            mapped[state] = megatron_hf.from_hf(gpt, read_state(state), gpt.padded_vocab_size)
        except ValueError as exc:
            raise InputError(f"{where}: {exc}") from None
    shapes = {p.fqn: tuple(p.shape) for p in plan.tree.params}
    groups, megatron_groups, scheduler, notes = _groups(meta.param_groups, shapes, mapped[WEIGHTS], step, where)
    save = MegatronSave(
        folder=as_path(where),
        iteration=int(step),
        args=args,
        sharding=job.optim_format or "fully_reshardable",
        # the fp32 weights are the model's and the masters' both: one tensor, as nothing writes into a save's
        # tensors (the writer and the checks only read them), where a copy for each held the weights twice
        model=mapped[WEIGHTS],
        optim={k: {"param": mapped[WEIGHTS][k], **{s: mapped[s][k] for s in MOMENTS}} for k in mapped[WEIGHTS]},
        param_groups=megatron_groups,
        scheduler=scheduler,
        common={"checkpoint_version": 3.0, "opt_param_scheduler": scheduler,
                "num_floating_point_operations_so_far": 0, **record},
        extra_state=extra_state(gpt.num_layers),
    )
    return save, step, groups, notes


#: The local layer spec's linears of a decoder layer, each with an ``_extra_state`` item per layer.
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def extra_state(layers: int) -> dict[str, bytes]:
    """The linears' ``_extra_state`` items a Megatron save holds and megatron-core's load asks for: one per linear
    and global layer, ``<key>._extra_state/shard_<layer>_<layers>``, each ``torch.save([None])`` (the local spec's
    linears' ``get_extra_state`` is ``None``, megatron-core ``tensor_parallel/layers.py``; a ShardedObject is stored
    as the list of its data, ``dist_checkpointing/strategies/torch.py`` ``_mcore_to_torch_sharded_object``)."""
    import io

    data = io.BytesIO()
    torch.save([None], data)
    raw = data.getvalue()
    return {f"{LAYERS}{linear}._extra_state/shard_{i}_{layers}": raw for i in range(layers) for linear in LINEARS}


def _groups(
    source: list[dict[str, Any]] | None, shapes: dict[str, tuple[int, ...]], weights: dict[str, torch.Tensor],
    step: float, where: str,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any], list[str]]:
    """The source's param groups with Megatron's keys as their parameters; the groups as Megatron's optimizer keys
    them (its identifying keys and ``step`` beside the source's hyperparameters); a constant scheduler at the
    source's learning rate and weight decay (``shapes``: each Hugging Face parameter's); and what the report warns
    (:data:`ONE_GROUP`, where one source group holds every parameter).

    Megatron's default groups (megatron-core ``optimizer/__init__.py`` ``_get_param_groups``) put every 1-D
    parameter (the norms) in a group without weight decay (``wd_mult`` 0) and the rest in one with it; osdpipe's
    reader assigns them so. A source grouped otherwise is refused.
    """
    groups = source or []
    decays = [g for g in groups if float(g.get("weight_decay", 0.0)) != 0.0]
    plain = [g for g in groups if float(g.get("weight_decay", 0.0)) == 0.0]
    as_megatron = (
        len(decays) == 1 and len(plain) == 1
        and {n for n in decays[0]["params"]} == {n for n, s in shapes.items() if len(s) > 1}
        and {n for n in plain[0]["params"]} == {n for n, s in shapes.items() if len(s) == 1}
    )
    one = len(groups) == 1 and set(groups[0]["params"]) == set(shapes)  # torchtitan's default: one group for all
    if one:
        decays = plain = groups  # Megatron's two, each with the source's hyperparameters (ONE_GROUP says the rest)
    elif not as_megatron:
        raise InputError(f"{where}: param groups other than Megatron's two (weight decay for every matrix, none for "
                         "the 1-D norms, as the HF Trainer groups them) or one for all: not supported yet")
    by_decay = {True: sorted(k for k, t in weights.items() if not without_weight_decay(k, tuple(t.shape))),
                False: sorted(k for k, t in weights.items() if without_weight_decay(k, tuple(t.shape)))}
    out, megatron_groups = [], []
    for group, decay in ((decays[0], True), (plain[0], False)):
        hyper = {k: v for k, v in group.items() if k != "params"}
        out.append({**hyper, "params": by_decay[decay]})
        lr = float(group["lr"])
        megatron_groups.append({
            **hyper, "wd_mult": 1.0 if decay else 0.0, "lr_mult": 1.0, "is_expert_parallel": False,
            "is_decoupled_lr": False, "default_config": True, "max_lr": lr, "min_lr": lr, "step": step,
            "params": by_decay[decay],
        })
    lr, wd = float(decays[0]["lr"]), float(decays[0]["weight_decay"])
    steps = max(1, int(step))
    scheduler = {"max_lr": lr, "lr_warmup_steps": 0, "num_steps": int(step), "lr_decay_style": "constant",
                 "lr_decay_steps": steps, "min_lr": lr, "start_wd": wd, "end_wd": wd,
                 "wd_incr_style": "constant", "wd_incr_steps": steps}
    return out, megatron_groups, scheduler, [ONE_GROUP] if one else []


def check_problems(raw: dict[str, Any], folder: Path) -> list[str]:
    """What ``osdpipe check`` finds of the Megatron save ``folder`` a conversion of ``raw`` (its manifest's config)
    wrote: its source read again as the command read it, mapped again, and held against the save read back a tensor at
    a time, bit for bit (the verify stage's proof: :func:`osdpipe.verify.megatron.written_problems`)."""
    from osdpipe.spec.config import validate
    from osdpipe.spec.plan import plan_run
    from osdpipe.spec.reconcile import Given, reconcile
    from osdpipe.verify.megatron import written_problems

    given = Given(["model.factory"])  # the manifest names the model the conversion built
    source, _ = reconcile(source_config(raw, given), given)
    plan = plan_run(validate(source))
    target = raw["target"]
    job = MegatronJob(source=plan.input_path, output=str(folder), tp=int(target["tp_size"]),
                      pp=int(target["pp_size"]),
                      dp=int(target["world_size"]) // (int(target["tp_size"]) * int(target["pp_size"])))
    read = hf_source(plan, job)
    return written_problems(read.read(), folder, read.problems)


#: What the report says where the source has one param group for every parameter (torchtitan's default).
ONE_GROUP = (
    "the source's one param group decays every parameter, the norms too; a Megatron save holds Megatron's two groups "
    "(megatron-core _get_param_groups: wd_mult 0 for the 1-D norms), each written with the source's hyperparameters, "
    "and Megatron's scheduler sets the norms' weight decay to 0 from its first step"
)


def run_command(spec: RunSpec, plan: Plan, notes: list[str]) -> Report:
    """The ``osdpipe`` command's conversion of a Hugging Face model's checkpoint to Megatron (``spec``: the command's
    config, checked; ``plan``: the source's, as the range pipeline reads it). Writes ``report.json`` and
    ``osdpipe.log`` into ``output.path``, whatever happens.

    Raises:
        Contradiction: ``output.path`` holds a conversion and ``output.overwrite`` is false (exit 2).
        OutputError: ``output.path`` cannot be written.
    """
    job = job_of(spec, plan)
    # the manifest records the model the source was read as (the model of its config.json, or the user's), which
    # osdpipe check reads it as again
    config = {**spec.model_dump(mode="json"), "model": plan.spec.model.model_dump(mode="json")}
    return into_megatron(spec, job, config, hf_source(plan, job), notes)


def into_megatron(spec: RunSpec, job: MegatronJob, config: dict[str, Any], source: megatron.Source,
                  notes: list[str]) -> Report:
    """The command's run of ``job``, a conversion of another framework's ``source`` into a Megatron-LM save
    (``config``: what its manifest records): ``report.json`` and ``osdpipe.log`` written into ``output.path`` first
    (unfinished) and last, whatever happens.

    Raises:
        Contradiction: ``output.path`` holds a conversion and ``output.overwrite`` is false (exit 2).
        OutputError: ``output.path`` cannot be written.
    """
    from osdpipe.io import output
    from osdpipe.pipeline.execute import record
    from osdpipe.spec.reconcile import Contradiction

    out = Path(spec.output.path)
    if not spec.output.overwrite and (why := megatron._held(out)) is not None:
        raise Contradiction(why)
    output.check_writable(out)
    record(out, Report.unfinished(), spec)
    display = progress.Display(progress.wanted(spec.runtime.progress))
    try:
        report = megatron.execute(job, config, notes, display, source)
    finally:
        display.close()
    record(out, report, spec)
    return report
