"""``resume``: training resumes from the output as it would have from the source
(see :mod:`osdpipe.verify.resume_training`).

No two state tensors share memory, and a target job that loads the output
and takes ``pipeline.resume_steps`` steps holds what a job resuming from the
source holds, step counters exactly.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

from osdpipe.core.sizes import show_size
from osdpipe.io.loading import load_model_local
from osdpipe.layout import kinds
from osdpipe.layout.optim import resolve_optimizer
from osdpipe.layout.ranges import WEIGHTS, LocalTensor
from osdpipe.run.live_jobs import each_computed_twice, live_target
from osdpipe.run.products import CheckResult
from osdpipe.run.stages.rekey import param_ids
from osdpipe.verify.checks.common import (
    Subject,
    full_model_output,
    full_output,
    local_model_output,
    model_only,
    source_tensor_bytes,
    whole,
    with_groups,
    within_full_state_limit,
)
from osdpipe.verify.resume_training import (
    SHOWN,
    bare_steps,
    by_group,
    compare_batch,
    in_batches,
    is_elementwise,
    live_steps,
    reference_for,
    shared_memory,
    state_bytes,
)


def run(ctx: Subject) -> CheckResult:
    """The output resumes as the source would (:mod:`osdpipe.verify.resume_training`):
    loaded into a live target where one can be built, else into bare optimizers."""
    assert ctx.result is not None
    live = ctx.world.builds_target and kinds.get(ctx.spec.target.kind).no_live_job is None and (
        ctx.id_keyed or within_full_state_limit(ctx))
    return resume_result(
        ctx, ctx.result["state"], (lambda model, optim: _load_result(ctx, model, optim)) if live else None
    )


def _load_result(ctx: Subject, model: Any, optim: Any) -> None:
    """This rank's result into a live target job,
    the way a user loads the output format (from memory: the bytes save writes).

    A whole checkpoint's model weights load with it: each rank's local pieces
    as ``osdpipe.load_rank_local`` loads them, or PyTorch's own full load of
    the model (what a ``dcp`` output loads by).
    """
    assert ctx.result is not None
    kind = kinds.get(ctx.spec.target.kind)
    if model_only(ctx):  # nothing to load into the optimizer: it starts fresh, as the reference from the source does
        kind.load_model_full(model, full_model_output(ctx), hooked=bool(ctx.tree.key_maps))
        return
    if ctx.id_keyed:  # what osdpipe.load_rank_local (rank_local) or optim.load_state_dict (plain) does with the file
        loadable = kind.loadable(optim, copy.deepcopy(ctx.result))  # one deepcopy: what the result shares stays shared
        optim.load_state_dict(with_groups(loadable, optim))
        if whole(ctx):
            load_model_local(model, copy.deepcopy(local_model_output(ctx)), "the output")
    else:
        kind.load_full(model, optim, copy.deepcopy(full_output(ctx)))
        if whole(ctx):
            kind.load_model_full(model, full_model_output(ctx), hooked=bool(ctx.tree.key_maps))


def resume_result(ctx: Subject, written: dict[Any, Any], load: Any) -> CheckResult:
    """The ``resume`` check on this rank: ``written`` is the output's ``state`` as it is written (or was read back).

    ``load(model, optim)`` loads the output into a fresh live target job;
    ``None``: no live target can be built, and a bare optimizer per local
    tensor of the output loads it (:func:`osdpipe.verify.resume_training.bare_steps`).
    """
    steps = ctx.spec.pipeline.resume_steps
    shared = shared_memory(written, _param_names(ctx) if ctx.id_keyed else None)
    problems: list[str] = []
    parts = [] if shared else ["storage: no two state tensors share memory"]
    why_not = _resume_steps_skip(ctx)
    if why_not is not None:
        ctx.warnings.append(f"verify's resume check ran its storage part only: its steps {why_not}")
        parts.append(f"steps not run: they {why_not}")
    else:
        assert ctx.meta is not None
        master = kinds.get(ctx.spec.target.kind).master_state
        reference = reference_for(ctx.spec, ctx.meta, ctx.reader, ctx.tree, master)
        if load is not None:
            model, optim = live_target(ctx.spec, ctx.plan.target_spec, ctx.tree, ctx.rank)
            load(model, optim)
            stepped = live_steps(ctx.spec, model, optim, ctx.optimizer_layout(), ctx.tree, weights_loaded=whole(ctx))
            # compared a batch at a time, as the bare target is: each batch's reference holds its ranges alone
            batches: Any = in_batches(stepped, [state_bytes(s.state) for s in stepped], ctx.spec.runtime.piece_bytes)
            target = f"the {ctx.spec.target.kind} target job"
        else:
            weights = ctx.keyed.weights if ctx.keyed is not None else None
            batches = bare_steps(
                ctx.spec, ctx.target_layout(), _output_state_of(ctx), ctx.tree, ctx.spec.runtime.piece_bytes, weights,
                master,
            )
            no_job = kinds.get(ctx.spec.target.kind).no_live_job
            target = "bare optimizers over the output's tensors (no live target job: " + (
                f"{no_job})"
                if no_job is not None
                else "runtime.mode=offline)"
                if not ctx.world.builds_target
                else "loading an FQN-keyed output needs the whole state, over pipeline.full_state_checks_max)"
            )
        count = 0
        # A bare batch's synthetic values are computed once for it and for its reference, which asks for the same
        # ranges when it steps them alone (elementwise). A live target steps the whole rank before the reference
        # starts, and a whole-model reference asks for whole parameters: keeping their values would hold the rank's.
        once = load is None and reference.elementwise
        sharing = each_computed_twice(ctx.spec.runtime.piece_bytes) if once else nullcontext(None)
        with sharing as pairs:
            for batch in batches:
                count += len(batch)
                problems += compare_batch(batch, reference, ctx.meta, steps)
                if pairs is not None:
                    pairs.clear()
                if len(problems) >= SHOWN:
                    break
        start = "from the checkpoint's own weights, " if whole(ctx) else ""
        parts.append(
            f"steps: {target} loaded it and took {steps} step(s) {start}on synthetic gradients ({count} tensor(s)): "
            "every 0-dim state "
            "(step counters) equals a job resuming from the source, every state and parameter element bitwise"
        )
    if shared:  # after the steps' findings, which say what the sharing does
        problems = problems[:SHOWN] + [
            f"{len(shared)} pair(s) of state tensors share memory, so a step of one changes the other: "
            f"{'; '.join(shared[:3])}"
        ]
    return CheckResult("resume", not problems, "; ".join(problems) or "; ".join(parts))


def _param_names(ctx: Subject) -> dict[int, str]:
    """Param ID -> the parameter(s) its local tensor holds, for messages about a param-ID keyed output."""
    layout = {t.key: t for t in ctx.target_layout()}
    return {
        pid: ", ".join(layout[key].fqns[:2]) + (" ..." if len(layout[key].fqns) > 2 else "")
        for key, pid in param_ids(ctx.ctx).items()
    }


def _resume_steps_skip(ctx: Subject) -> str | None:
    """Why the resume check's steps cannot run here (its storage part always does), or ``None``."""
    if ctx.reading_ranks is not None and any(reader != r for r, reader in enumerate(ctx.reading_ranks)):
        # said on every rank alike: the steps are collective
        return "need the source on every rank, which runtime.transfer=scatter does not read everywhere"
    if ctx.meta is None or ctx.reader is None:
        return "need the source, to step a reference from it, and none was read (give input.path)"
    cls = resolve_optimizer(ctx.spec.optim.name)
    if not is_elementwise(cls) and not within_full_state_limit(ctx):
        limit = ctx.spec.pipeline.full_state_checks_max
        return (
            f"need a reference over the whole model for {cls.__name__}, which osdpipe does not know to be elementwise "
            f"(osdpipe.verify.resume_training.ELEMENTWISE), "
            f"and the source holds {show_size(source_tensor_bytes(ctx))} of tensor state, "
            f"over pipeline.full_state_checks_max={show_size(limit or 0)}"
        )
    return None


def _output_state_of(ctx: Subject) -> Any:
    """For a bare target: each local tensor's state as the output holds it, in the parts of it each param group holds
    (:func:`osdpipe.verify.resume_training.by_group`), each with that group; none where its optimizer does not hold
    it."""
    assert ctx.result is not None
    groups = ctx.result.get("param_groups") or []
    state = ctx.result["state"]
    if ctx.id_keyed:
        ids = param_ids(ctx.ctx)
        group_of_key = {k: g for g in groups for k in g["params"]}

        def by_id(tensor: LocalTensor) -> list[tuple[LocalTensor, dict[str, Any], dict[str, Any]]]:
            key = ids.get(tensor.key)
            return [] if key is None else [(tensor, state.get(key, {}), group_of_key.get(key, {}))]

        return by_id
    group_of_fqn = {f: g for g in groups for f in g["params"]}
    held = set(group_of_fqn) if groups else None

    def by_fqn(tensor: LocalTensor) -> list[tuple[LocalTensor, dict[str, Any], dict[str, Any]]]:
        if held is not None and not any(f in held for f in tensor.fqns):
            return []
        if tensor.states is not None and set(tensor.states) <= {WEIGHTS} or tensor.key not in state:
            return []  # the model's weights alone (Megatron's model boxes beside its optimizer's buckets), or no state
        return by_group(tensor, state[tensor.key], lambda fqn: group_of_fqn.get(fqn, {}))

    return by_fqn


def skip_reason(ctx: Subject) -> str | None:
    return None  # it runs on every conversion (resume may run its storage part only, and says why)

