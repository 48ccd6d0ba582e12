"""verify: prove the converted state right, or say exactly where it is wrong.

Five checks, each reported in ``report.json`` when it ran:

* ``roundtrip``: every element of every converted tensor equals the same
  element of the source, bitwise; padding is zero; scalar state equals the
  source's; and the target ranks' pieces together cover every element of every
  source tensor. Together: gathered back, the result *is* the source.
* ``reference``: on the target world, PyTorch's own conversion gives the same
  bytes, keys and param groups (``FSDP.optim_state_dict_to_load`` from the
  full source state for ``rank_local``, ``FSDP.rekey_optim_state_dict`` for
  ``plain``; for FQN-keyed outputs, the full state
  a target FSDP model reports after loading the source).
* ``load_step``: the target optimizer loads the result and takes a step on
  synthetic gradients (no forward pass), and every state element that was
  finite stays finite.
* ``resume``: training resumes from the output as it would have from the
  source: no two state tensors share memory, and a target job that loads it
  and takes ``pipeline.resume_steps`` steps holds what a job resuming from
  the source holds, step counters exactly (:mod:`osdpipe.resume`).
* ``replicas`` (where a side is hybrid-sharded: HYBRID_SHARD, HSDP): the
  source's replica groups hold the same state, and so do the output's.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from osdpipe import formats, kinds
from osdpipe.collective import from_rank0, gather_to_all, one_line, scatter_from
from osdpipe.compare import bits_equal, diff
from osdpipe.sizes import show_size
from osdpipe.context import CheckResult, Context, SkippedCheck
from osdpipe.formats import TensorRef, full_state
from osdpipe.layout import LocalTensor, uncovered
from osdpipe.loading import PARAM_LAYOUT
from osdpipe.optim import resolve_optimizer
from osdpipe.reference import live_target, train_step
from osdpipe.resume import SHOWN, bare_steps, compare_batch, is_elementwise, live_steps, reference_for, shared_memory
from osdpipe.stages.rekey import param_ids
from osdpipe.transfer import Batch, batch_sha256, plan, stateful


def _result_state(ctx: Context, key: str) -> dict[str, Any] | None:
    assert ctx.result is not None
    rkey = ctx.result_keys.get(key)
    return None if rkey is None else ctx.result["state"].get(rkey)


def check_roundtrip(ctx: Context) -> CheckResult:
    """Compare this rank's converted tensors with the source, batch by batch, and check coverage.

    A rank that reads the source compares the bytes themselves (and names the
    first differing element); a rank whose bytes were sent to it
    (``runtime.transfer=scatter``) compares each batch's sha256 with the
    digest its reading rank took of the source while sending it.
    """
    assert ctx.meta is not None
    sent = _sent_digests(ctx)
    problems: list[str] = []
    for tensor in ctx.target_layout():
        if ctx.id_keyed and tensor.key not in ctx.held_keys(ctx.rank):
            continue  # a parameter outside the target optimizer carries no state there
        state = _result_state(ctx, tensor.key)
        entry = ctx.flat_state.get(tensor.key)
        if entry is None:
            if state:
                problems.append(f"{tensor.key}: has state where the source has none")
            continue
        if state is None:
            problems.append(f"{tensor.key}: state missing")
            continue
        comparable = set()  # the state names whose tensors have the layout's shape: their bytes are compared below
        for name, expected in entry.items():
            value = state.get(name)
            if not isinstance(expected, TensorRef):
                sources = [ctx.meta.state[f][name] for f in tensor.fqns if name in ctx.meta.state.get(f, {})]
                if any(diff(value, s) for s in sources):
                    problems.append(f"{tensor.key}.{name}: {value!r} differs from the source's {sources[0]!r}")
                continue
            if not torch.is_tensor(value) or tuple(value.shape) != tensor.shape:
                problems.append(f"{tensor.key}.{name}: expected a tensor of shape {tensor.shape}")
                continue
            problems += _zero_where_no_state(tensor, name, value.reshape(-1), ctx)
            comparable.add(name)
        work = [(i, b) for i, b in enumerate(plan(tensor, entry, ctx.meta, ctx.spec.runtime.piece_bytes)) if b.name in comparable]
        problems += _compare_read(tensor, state, work, ctx) if sent is None else _compare_sent(tensor, state, work, sent, ctx)
    if ctx.rank == 0:  # pure layout math over all target ranks: one rank suffices
        problems.extend(_coverage_gaps(ctx))
    return CheckResult("roundtrip", not problems, "; ".join(problems[:5]) or "every element equals the source bitwise; every source element is covered")


def _sent_digests(ctx: Context) -> dict[tuple[str, str, int], str] | None:
    """The digests this rank's reading rank took of the batches it sent here (``None``: this rank reads the source itself)."""
    if ctx.reading_ranks is None or not any(reader != r for r, reader in enumerate(ctx.reading_ranks)):
        return None
    mine: dict[tuple[str, str, int], str] = {}
    for reader in sorted(set(ctx.reading_ranks)):  # collectives: every rank takes part, also those that read for themselves
        per_rank = [ctx.sent_digests.get(r, {}) for r in range(ctx.world_size)] if ctx.rank == reader else None
        got = scatter_from(reader, per_rank)  # each rank gets its own digests only, not every receiver's
        if reader == ctx.reading_ranks[ctx.rank]:
            mine = got
    return None if ctx.reads_itself else mine


def _zero_where_no_state(tensor: LocalTensor, name: str, flat: torch.Tensor, ctx: Context) -> list[str]:
    """Padding, and the ranges of parameters without state ``name`` in the source, hold zeros."""
    assert ctx.meta is not None
    problems = []
    if any(bool(flat[lo:hi].any()) for lo, hi in uncovered(0, flat.numel(), [(s.dest, s.dest + s.length) for s in tensor.segments])):
        problems.append(f"{tensor.key}.{name}: padding is not zero")
    have = set(stateful(tensor, name, ctx.meta))
    for seg in tensor.segments:
        if seg not in have and bool(flat[seg.dest : seg.dest + seg.length].any()):
            problems.append(f"{tensor.key}.{name}: {seg.fqn} has no {name} in the source, but its range is not zero")
    return problems


def _compare_read(tensor: LocalTensor, state: dict[str, Any], work: list[tuple[int, Batch]], ctx: Context) -> list[str]:
    """Each batch of the result against the same ranges read from the source, bitwise."""
    source, problems = ctx.source(), []
    for _, batch in work:
        flat = state[batch.name].reshape(-1)
        for seg, want in zip(batch.segments, source.pieces(batch), strict=True):
            got = flat[seg.dest : seg.dest + seg.length]
            if not bits_equal(got, want):
                bad = int((got != want).nonzero()[0]) if (got != want).any() else 0
                problems.append(f"{tensor.key}.{batch.name}: differs from {seg.fqn}[{seg.start + bad}] (flat) : {got[bad].item()} vs {want[bad].item()}")
        source.done(batch)
    return problems


def _compare_sent(tensor: LocalTensor, state: dict[str, Any], work: list[tuple[int, Batch]], sent: dict[tuple[str, str, int], str], ctx: Context) -> list[str]:
    """Each batch of the result (``i``: its place in the plan) against the digest its reading rank took of the source."""
    assert ctx.reading_ranks is not None
    problems = []
    for i, batch in work:
        if batch_sha256(state, batch) != sent.get((tensor.key, batch.name, i)):
            first, last = batch.segments[0], batch.segments[-1]
            where = f"{first.fqn}[{first.start}..{first.start + first.length}]" + (f" .. {last.fqn}" if len(batch.segments) > 1 else "")
            problems.append(f"{tensor.key}.{batch.name}: elements {where} (flat) differ from what rank {ctx.reading_ranks[ctx.rank]} read from the source")
    return problems


def _coverage_gaps(ctx: Context) -> list[str]:
    """Source tensor elements that no target rank holds (computed from all target layouts)."""
    assert ctx.meta is not None
    held: dict[str, list[tuple[int, int]]] = {}
    ranks = ctx.spec.target.world_size if ctx.id_keyed else ctx.world_size
    for r in range(ranks):
        for tensor in ctx.target_layout(r):
            if ctx.id_keyed and tensor.key not in ctx.held_keys(r):
                continue
            for seg in tensor.segments:
                held.setdefault(seg.fqn, []).append((seg.start, seg.start + seg.length))
    gaps = []
    for fqn, entries in ctx.meta.state.items():
        if not any(isinstance(v, TensorRef) for v in entries.values()):
            continue
        numel = ctx.tree.param(fqn).numel
        missing = sum(hi - lo for lo, hi in uncovered(0, numel, held.get(fqn, [])))
        if missing:
            gaps.append(f"{fqn}: {missing} of {numel} elements are held by no target rank")
    return gaps


def _full_source(ctx: Context) -> dict[str, Any]:
    """The whole source as a full FQN-keyed state dict (for PyTorch's reference conversion)."""
    assert ctx.meta is not None and ctx.reader is not None
    return full_state(ctx.reader, ctx.meta)


def _full_output(ctx: Context) -> dict[str, Any]:
    """The FQN-keyed output gathered to full tensors on every rank (``fsdp_full`` or ``dcp``)."""
    assert ctx.result is not None
    if ctx.output_format.one_writer:  # rank 0 holds it all
        return from_rank0("verify", lambda: ctx.result)
    pieces = gather_to_all(ctx.result["state"])
    state: dict[str, dict[str, Any]] = {}
    for fqn in pieces[0]:
        state[fqn] = {}
        for name, value in pieces[0][fqn].items():
            if torch.is_tensor(value) and value.dim() > 0:
                state[fqn][name] = torch.cat([p[fqn][name] for p in pieces if fqn in p and p[fqn][name].numel()], dim=0)
            else:
                state[fqn][name] = value
    return {**ctx.result, "state": state}


def live_target_of(ctx: Context) -> tuple[Any, Any]:
    """This rank's live target model and optimizer, built once per context."""
    if ctx.live is None:
        ctx.live = live_target(ctx.spec, ctx.spec.target.spec(), ctx.tree, ctx.rank)
    return ctx.live


def _loadable(ctx: Context) -> dict[str, Any]:
    """What this rank's target optimizer loads from the output."""
    assert ctx.result is not None
    if ctx.id_keyed:
        return ctx.result
    model, optim = live_target_of(ctx)
    return kinds.get(ctx.spec.target.kind).to_load(model, optim, _full_output(ctx))


def check_reference(ctx: Context) -> CheckResult:
    kind = kinds.get(ctx.spec.target.kind)
    model, optim = live_target_of(ctx)
    full = _full_source(ctx)
    if ctx.id_keyed:
        expected, got, what = kind.to_load(model, optim, full), {k: v for k, v in ctx.result.items() if k != PARAM_LAYOUT}, "PyTorch's conversion"
    else:
        fresh_model, fresh_optim = live_target(ctx.spec, ctx.spec.target.spec(), ctx.tree, ctx.rank)
        fresh_optim.load_state_dict(kind.loadable(fresh_optim, kind.to_load(fresh_model, fresh_optim, full)))
        expected, got, what = kind.full_state(fresh_model, fresh_optim), _full_output(ctx), "the full state PyTorch reports after loading the source"
    problems = diff(got, expected, sequence_types=False)  # a tuple of hyperparameters PyTorch loads back as a list is the same
    return CheckResult("reference", not problems, "; ".join(problems) or f"equals {what} bitwise")


def _nonfinite(value: Any) -> torch.Tensor | None:
    """Where this rank's piece of a floating state tensor is NaN or infinite (``None``: nowhere, or not a floating tensor)."""
    if hasattr(value, "to_local"):  # a DTensor (FSDP2): this rank's elements, without a collective
        value = value.to_local()
    if not (torch.is_tensor(value) and (value.is_floating_point() or value.is_complex())):
        return None
    mask = ~torch.isfinite(value.detach())
    return mask.cpu() if bool(mask.any()) else None


def _named(tensor: LocalTensor, name: str, mask: torch.Tensor) -> list[str]:
    """``"<fqn> <name> (<n> elements)"`` for each parameter of ``tensor`` with elements in ``mask``.

    A per-element state maps to parameters through the layout's segments (the
    rest is padding); a scalar state is shared by every parameter of the tensor.
    """
    if mask.numel() != tensor.numel or mask.dim() == 0:
        shown = ", ".join(tensor.fqns[:3]) + (f" and {len(tensor.fqns) - 3} more" if len(tensor.fqns) > 3 else "")
        return [f"{shown} {name}"]
    flat = mask.reshape(-1)
    out, named = [], 0
    for seg in tensor.segments:
        n = int(flat[seg.dest : seg.dest + seg.length].sum())
        named += n
        if n:
            out.append(f"{seg.fqn} {name} ({n} element{'s' if n != 1 else ''})")
    rest = int(flat.sum()) - named
    if rest:
        out.append(f"padding of {tensor.key} {name} ({rest} element{'s' if rest != 1 else ''})")
    return out


def check_load_step(ctx: Context) -> CheckResult:
    """The target optimizer loads the result and takes one step on synthetic gradients (:func:`load_and_step`)."""
    return load_and_step(ctx, _loadable(ctx))


def load_and_step(ctx: Context, loadable: dict[str, Any]) -> CheckResult:
    """This rank's target optimizer loads ``loadable`` and takes one step on synthetic gradients; its state must stay finite.

    ``loadable`` is what the optimizer's kind loads on this rank: the
    param-ID keyed state, or what the kind's ``to_load`` made of a full one.

    The rule, element by element: a state element fails when it is NaN or
    infinite after the step but was finite in the loaded state (an element the
    step creates counts as finite before it). Elements already non-finite in
    the loaded state come from the source: with ``input.allow_nonfinite`` they
    are carried and reported, not failed; without it they fail too. Failures
    name parameters by FQN (through this rank's layout), never by param ID.
    """
    model, optim = live_target_of(ctx)
    # load_state_dict keeps tensors that need no cast: a copy stops the step from changing the result.
    loadable = kinds.get(ctx.spec.target.kind).loadable(optim, copy.deepcopy(loadable))
    optim.load_state_dict(_with_groups(loadable, optim))
    layout = ctx.optimizer_layout()
    tensor_of = {id(p): t for p, t in zip(model.parameters(), layout)}  # the live model is built on this layout
    loaded = {id(p): {n: _nonfinite(v) for n, v in state.items()} for p, state in optim.state.items()}
    carried = [w for p, state in optim.state.items() for n, mask in loaded[id(p)].items() if mask is not None for w in _named(tensor_of[id(p)], n, mask)]
    train_step(ctx.spec, model, optim, step=10_000, layout=layout, tree=ctx.tree)
    new_bad = []
    for param, state in optim.state.items():
        for name, value in state.items():
            after = _nonfinite(value)
            before = loaded.get(id(param), {}).get(name)
            if after is not None and before is not None and before.shape == after.shape:
                after = after & ~before
            if after is not None and bool(after.any()):
                new_bad += _named(tensor_of[id(param)], name, after)
    allowed = ctx.spec.input.allow_nonfinite
    problems = []
    if new_bad:
        problems.append(f"non-finite after a step where the loaded state was finite: {', '.join(new_bad[:5])}" + (" ..." if len(new_bad) > 5 else ""))
    if carried and not allowed:
        problems.append(f"non-finite in the loaded state (set input.allow_nonfinite=true to carry it): {', '.join(carried[:5])}" + (" ..." if len(carried) > 5 else ""))
    if problems:
        return CheckResult("load_step", False, "; ".join(problems))
    detail = "loaded; one step left all state finite"
    if carried:
        detail = f"loaded; one step left finite every element that was finite (non-finite in the source, carried: {', '.join(carried[:3])})"
    return CheckResult("load_step", True, detail)


def check_resume(ctx: Context) -> CheckResult:
    """The output resumes as the source would (:mod:`osdpipe.resume`): loaded into a live target where one can be built, else into bare optimizers."""
    assert ctx.result is not None
    live = ctx.world.builds_target and (ctx.id_keyed or _within_full_state_limit(ctx))
    return resume_result(ctx, ctx.result["state"], (lambda model, optim: _load_result(ctx, model, optim)) if live else None)


def _load_result(ctx: Context, model: Any, optim: Any) -> None:
    """This rank's result into a live target optimizer, the way a user loads the output format (from memory: the bytes save writes)."""
    assert ctx.result is not None
    if ctx.id_keyed:  # what osdpipe.load_rank_local (rank_local) or optim.load_state_dict (plain) does with the file
        loadable = kinds.get(ctx.spec.target.kind).loadable(optim, copy.deepcopy(ctx.result))  # one deepcopy: what the result shares stays shared
        optim.load_state_dict(_with_groups(loadable, optim))
    else:
        kinds.get(ctx.spec.target.kind).load_full(model, optim, copy.deepcopy(_full_output(ctx)))


def _with_groups(loadable: dict[str, Any], optim: Any) -> dict[str, Any]:
    """A source without param groups converts to state only (as PyTorch's own conversion does); load_state_dict needs
    groups, so the target's own are what a resuming job pairs it with."""
    if "param_groups" not in loadable:
        loadable["param_groups"] = optim.state_dict()["param_groups"]
    return loadable


def resume_result(ctx: Context, written: dict[Any, Any], load: Any) -> CheckResult:
    """The ``resume`` check on this rank: ``written`` is the output's ``state`` as it is written (or was read back).

    ``load(model, optim)`` loads the output into a fresh live target job;
    ``None``: no live target can be built, and a bare optimizer per local
    tensor of the output loads it (:func:`osdpipe.resume.bare_steps`).
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
        reference = reference_for(ctx.spec, ctx.meta, ctx.source().reader, ctx.tree)
        if load is not None:
            model, optim = live_target(ctx.spec, ctx.spec.target.spec(), ctx.tree, ctx.rank)
            load(model, optim)
            batches: Any = [live_steps(ctx.spec, model, optim, ctx.optimizer_layout(), ctx.tree)]
            target = f"the {ctx.spec.target.kind} target job"
        else:
            batches = bare_steps(ctx.spec, ctx.target_layout(), _output_state_of(ctx), ctx.tree, ctx.spec.runtime.piece_bytes)
            target = "bare optimizers over the output's tensors (no live target job: " + (
                "runtime.mode=offline)" if not ctx.world.builds_target else "loading an FQN-keyed output needs the whole state, over pipeline.full_state_checks_max)"
            )
        count = 0
        for batch in batches:
            count += len(batch)
            problems += compare_batch(batch, reference, ctx.meta, steps)
            if len(problems) >= SHOWN:
                break
        parts.append(
            f"steps: {target} loaded it and took {steps} step(s) on synthetic gradients ({count} tensor(s)): every 0-dim state "
            "(step counters) equals a job resuming from the source, every state and parameter element bitwise"
        )
    if shared:  # after the steps' findings, which say what the sharing does
        problems = problems[:SHOWN] + [f"{len(shared)} pair(s) of state tensors share memory, so a step of one changes the other: {'; '.join(shared[:3])}"]
    return CheckResult("resume", not problems, "; ".join(problems) or "; ".join(parts))


def _param_names(ctx: Context) -> dict[int, str]:
    """Param ID -> the parameter(s) its local tensor holds, for messages about a param-ID keyed output."""
    layout = {t.key: t for t in ctx.target_layout()}
    return {pid: ", ".join(layout[key].fqns[:2]) + (" ..." if len(layout[key].fqns) > 2 else "") for key, pid in param_ids(ctx).items()}


def _resume_steps_skip(ctx: Context) -> str | None:
    """Why the resume check's steps cannot run here (its storage part always does), or ``None``."""
    if ctx.reading_ranks is not None and any(reader != r for r, reader in enumerate(ctx.reading_ranks)):
        return "need the source on every rank, which runtime.transfer=scatter does not read everywhere"  # said on every rank alike: the steps are collective
    if ctx.meta is None or ctx.reader is None:
        return "need the source, to step a reference from it, and none was read (give input.path)"
    cls = resolve_optimizer(ctx.spec.optim.name)
    if not is_elementwise(cls) and not _within_full_state_limit(ctx):
        limit = ctx.spec.pipeline.full_state_checks_max
        return (
            f"need a reference over the whole model for {cls.__name__}, which osdpipe does not know to be elementwise "
            f"(osdpipe.resume.ELEMENTWISE), and the source holds {show_size(source_tensor_bytes(ctx))} of tensor state, over "
            f"pipeline.full_state_checks_max={show_size(limit or 0)}"
        )
    return None


def _within_full_state_limit(ctx: Context) -> bool:
    limit = ctx.spec.pipeline.full_state_checks_max
    return limit is None or source_tensor_bytes(ctx) <= limit


def _output_state_of(ctx: Context) -> Any:
    """For a bare target: each local tensor's state and param group as the output holds them (``None``: its optimizer does not hold it)."""
    assert ctx.result is not None
    groups = ctx.result.get("param_groups") or []
    if ctx.id_keyed:
        ids = param_ids(ctx)
        key_of = ids.get
    else:
        held = {f for g in groups for f in g["params"]} if groups else None
        key_of = lambda key: key if held is None or key in held else None  # noqa: E731
    group_of = {k: g for g in groups for k in g["params"]}

    def state_of(tensor: LocalTensor) -> tuple[dict[str, Any], dict[str, Any]] | None:
        key = key_of(tensor.key)
        if key is None:
            return None
        return ctx.result["state"].get(key, {}), group_of.get(key, {})

    return state_of


def has_replicas(ctx: Context) -> tuple[bool, bool]:
    """Whether the source files, and the target files, come in replica groups (hybrid sharding, read or written per rank)."""
    source = formats.get(ctx.input_format).holds_replicas and ctx.spec.source.spec().replicas > 1
    return source, ctx.id_keyed and ctx.spec.target.spec().replicas > 1


def _first_replica_digests(ctx: Context, mine: dict[str, str], first: int) -> dict[str, str]:
    """The state digests of rank ``first`` (which holds this rank's shard in the first replica group).

    ``first`` is never later than this rank, so every world has it
    (:meth:`~osdpipe.world.World.published`): a process group gathers
    them, and a process playing ranks in turn has seen it go by.
    """
    return ctx.world.published("replica digests", ctx.rank, mine)[first]


def check_replicas(ctx: Context) -> CheckResult:
    """Replica groups agree: the source's (read from one group), and the output's (written for every group).

    Each rank compares a share of the source's rank files with the first
    replica group's; the output's ranks compare their state's digests with
    the rank that holds the same shard in the first group.
    """
    from osdpipe.digest import tensor_digests
    from osdpipe.formats.rank_local import replica_mismatches

    source, target = has_replicas(ctx)
    problems: list[str] = []
    if source:
        readers = sorted(set(ctx.reading_ranks)) if ctx.reading_ranks is not None else list(range(ctx.world_size))
        share = readers.index(ctx.rank) if ctx.rank in readers else None  # the ranks that read the input share the files out
        mine = [r for r in range(ctx.spec.source.world_size) if share is not None and r % len(readers) == share]
        try:  # not raised: every rank must reach the gather below
            problems += [f"source {p}" for p in replica_mismatches(ctx.input_path, ctx.spec.source.spec(), mine)]
        except Exception as exc:  # noqa: BLE001
            problems.append(f"source replicas unreadable: {one_line(exc)}")
    if target:
        assert ctx.result is not None
        digests = tensor_digests(ctx.result)
        first = ctx.rank % (ctx.spec.target.shard_group_size or ctx.world_size)
        theirs = _first_replica_digests(ctx, digests, first)
        if digests != theirs:
            differ = sorted(k for k in digests.keys() | theirs.keys() if digests.get(k) != theirs.get(k))
            problems.append(f"output rank {ctx.rank} differs from rank {first}, which holds the same shard: {', '.join(differ[:3])}")
    sides = " and ".join(s for s, applies in (("the source's", source), ("the output's", target)) if applies)
    return CheckResult("replicas", not problems, "; ".join(problems[:5]) or f"{sides} replica groups hold the same state bitwise")


CHECKS = {"roundtrip": check_roundtrip, "reference": check_reference, "load_step": check_load_step, "resume": check_resume, "replicas": check_replicas}
#: Checks that build the real target job (on every rank, with the whole source state): they need its world, and memory.
NEED_TARGET_WORLD = ("reference", "load_step")


def source_tensor_bytes(ctx: Context) -> int:
    """The bytes of the source's tensor state (what a check holding the whole state holds on every rank)."""
    assert ctx.meta is not None
    return sum(math.prod(v.shape) * v.torch_dtype.itemsize for entries in ctx.meta.state.values() for v in entries.values() if isinstance(v, TensorRef))


def skip_reason(ctx: Context, name: str) -> str | None:
    """Why check ``name`` does not run on this conversion, or ``None`` when it does (in words that follow the check's name)."""
    if name == "replicas" and not any(has_replicas(ctx)):
        return "applies only where a side has replica groups (HYBRID_SHARD, HSDP)"
    if name in NEED_TARGET_WORLD:
        if not ctx.world.builds_target:
            return "needs a live target world (runtime.mode=online)"
        if ctx.spec.runtime.transfer == "scatter":
            return "needs the whole source on every rank, which runtime.transfer=scatter does not read everywhere"
        limit, size = ctx.spec.pipeline.full_state_checks_max, source_tensor_bytes(ctx)
        if limit is not None and size > limit:
            return (
                f"needs the whole state on every rank or a live target model, and the source holds {show_size(size)} of tensor state, over "
                f"pipeline.full_state_checks_max={show_size(limit)}: raise it (or set it to null) to run it"
            )
    return None



def verify(ctx: Context) -> None:
    # A live optimizer's groups (Python API) are known on its own rank only: shared (a rank not yet published computes its own, ctx.held_keys).
    ctx.optimizer_keys.update(ctx.world.published("held keys", ctx.rank, ctx.held_keys(ctx.rank)))
    ctx.checks, ctx.skipped_checks = [], []
    for name in ctx.spec.pipeline.checks:
        why = skip_reason(ctx, name)
        if why is not None:
            ctx.skipped_checks.append(SkippedCheck(name, why))
            if name != "replicas":  # a check that cannot apply is no news; one left out for size or mode is
                ctx.warnings.append(f"verify did not run {name}: it {why}")
            continue
        try:
            result = CHECKS[name](ctx)
        except Exception as exc:  # a check that cannot run has failed, and says why
            result = CheckResult(name, False, f"{type(exc).__name__}: {exc}")
        ctx.checks.append(result)
    # Each rank's own results: osdpipe.loop combines every rank's after the last.
