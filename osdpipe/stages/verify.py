"""verify: prove the converted state right, or say exactly where it is wrong.

Three checks, each reported in ``report.json``:

* ``roundtrip``: every element of every converted tensor equals the same
  element of the source, bitwise; padding is zero; scalar state equals the
  source's; and the target ranks' pieces together cover every element of every
  source tensor. Together: gathered back, the result *is* the source.
* ``reference``: on the target world, PyTorch's own conversion gives the same
  bytes, keys and param groups (``FSDP.optim_state_dict_to_load`` from the
  full source state for ``rank_local``, ``FSDP.rekey_optim_state_dict`` for
  ``plain``; for FQN-keyed outputs, the full state
  a target FSDP model reports after loading the source).
* ``load_step``: the target optimizer loads the result and takes a step, and
  its state stays finite.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from osdpipe.collective import from_rank0, gather_to_all
from osdpipe.compare import bits_equal, diff
from osdpipe.context import CheckResult, Context
from osdpipe.formats import TensorRef
from osdpipe.reference import fsdp_full_state, fsdp_to_load, live_target, pytorch_to_load, train_step
from osdpipe.stages import stage


def _result_state(ctx: Context, key: str) -> dict[str, Any] | None:
    assert ctx.result is not None
    rkey = ctx.result_keys.get(key)
    return None if rkey is None else ctx.result["state"].get(rkey)


def check_roundtrip(ctx: Context) -> CheckResult:
    """Compare this rank's converted tensors with the source, range by range, and check coverage."""
    assert ctx.meta is not None and ctx.reader is not None
    problems: list[str] = []
    for tensor in ctx.target_layout():
        if ctx.id_keyed and tensor.key not in ctx.optimizer_keys[ctx.rank]:
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
            flat = value.reshape(-1)
            covered = torch.zeros(flat.numel(), dtype=torch.bool)
            wanted = [(s.fqn, name) for s in tensor.segments if isinstance(ctx.meta.state.get(s.fqn, {}).get(name), TensorRef)]
            source = ctx.reader.read(wanted)
            for seg in tensor.segments:
                got = flat[seg.dest : seg.dest + seg.length]
                covered[seg.dest : seg.dest + seg.length] = True
                src = source.get((seg.fqn, name))
                want = src.reshape(-1)[seg.start : seg.start + seg.length] if src is not None else torch.zeros_like(got)
                if not bits_equal(got, want):
                    bad = int((got != want).nonzero()[0]) if (got != want).any() else 0
                    problems.append(f"{tensor.key}.{name}: differs from {seg.fqn}[{seg.start + bad}] (flat) : {got[bad].item()} vs {want[bad].item()}")
            padding = flat[~covered]
            if padding.numel() and bool((padding != 0).any()):
                problems.append(f"{tensor.key}.{name}: padding is not zero")
    if ctx.rank == 0:  # pure layout math over all target ranks: one rank suffices
        problems.extend(_coverage_gaps(ctx))
    return CheckResult("roundtrip", not problems, "; ".join(problems[:5]) or "every element equals the source bitwise; every source element is covered")


def _coverage_gaps(ctx: Context) -> list[str]:
    """Source tensor elements that no target rank holds (computed from all target layouts)."""
    assert ctx.meta is not None
    held: dict[str, list[tuple[int, int]]] = {}
    ranks = ctx.spec.target.world_size if ctx.id_keyed else ctx.world_size
    for r in range(ranks):
        for tensor in ctx.target_layout(r):
            if ctx.id_keyed and tensor.key not in ctx.optimizer_keys[r]:
                continue
            for seg in tensor.segments:
                held.setdefault(seg.fqn, []).append((seg.start, seg.start + seg.length))
    gaps = []
    for fqn, entries in ctx.meta.state.items():
        if not any(isinstance(v, TensorRef) for v in entries.values()):
            continue
        numel = ctx.tree.param(fqn).numel
        mask = torch.zeros(numel, dtype=torch.bool)
        for lo, hi in held.get(fqn, []):
            mask[lo:hi] = True
        if not bool(mask.all()):
            gaps.append(f"{fqn}: {int((~mask).sum())} of {numel} elements are held by no target rank")
    return gaps


def _full_source(ctx: Context) -> dict[str, Any]:
    """The whole source as a full FQN-keyed state dict (for PyTorch's reference conversion)."""
    assert ctx.meta is not None and ctx.reader is not None
    items = [(f, n) for f, entries in ctx.meta.state.items() for n, v in entries.items() if isinstance(v, TensorRef)]
    tensors = ctx.reader.read(items)
    state = {f: {n: tensors.get((f, n), v) for n, v in entries.items()} for f, entries in ctx.meta.state.items()}
    out: dict[str, Any] = {"state": {**state, **ctx.meta.extra}}
    if ctx.meta.param_groups is not None:
        out["param_groups"] = ctx.meta.param_groups
    return out


def _full_output(ctx: Context) -> dict[str, Any]:
    """The FQN-keyed output gathered to full tensors on every rank (``fsdp_full`` or ``dcp``)."""
    assert ctx.result is not None
    if ctx.spec.output.format == "fsdp_full":
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


def _target(ctx: Context) -> tuple[Any, Any]:
    if ctx.live is None:
        ctx.live = live_target(ctx.spec, ctx.spec.target.spec(), ctx.tree, ctx.rank)
    return ctx.live


def _loadable(ctx: Context) -> dict[str, Any]:
    """What this rank's target optimizer loads from the output."""
    assert ctx.result is not None
    if ctx.id_keyed:
        return ctx.result
    model, optim = _target(ctx)
    return fsdp_to_load(model, optim, _full_output(ctx))


def check_reference(ctx: Context) -> CheckResult:
    model, optim = _target(ctx)
    full = _full_source(ctx)
    if ctx.id_keyed:
        expected, got, what = pytorch_to_load(ctx.spec.target.kind, model, optim, full), ctx.result, "PyTorch's conversion"
    else:
        fresh_model, fresh_optim = live_target(ctx.spec, ctx.spec.target.spec(), ctx.tree, ctx.rank)
        fresh_optim.load_state_dict(fsdp_to_load(fresh_model, fresh_optim, full))
        expected, got, what = fsdp_full_state(fresh_model, fresh_optim), _full_output(ctx), "FSDP.optim_state_dict after loading the source"
    problems = diff(got, expected)
    return CheckResult("reference", not problems, "; ".join(problems) or f"equals {what} bitwise")


def check_load_step(ctx: Context) -> CheckResult:
    model, optim = _target(ctx)
    # load_state_dict keeps tensors that need no cast: a copy stops the step from changing the result.
    loadable = copy.deepcopy(_loadable(ctx))
    if "param_groups" not in loadable:
        # A source without param groups converts to state only (as PyTorch's own
        # conversion does); load_state_dict needs groups, so the target's own are
        # what a resuming job pairs it with.
        loadable["param_groups"] = optim.state_dict()["param_groups"]
    optim.load_state_dict(loadable)
    train_step(ctx.spec, model, optim, step=10_000)
    bad = [
        f"{k}.{n}"
        for k, s in optim.state_dict()["state"].items()
        for n, v in s.items()
        if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all())
    ]
    return CheckResult("load_step", not bad, f"non-finite state after a step: {bad[:5]}" if bad else "loaded; one step left all state finite")


CHECKS = {"roundtrip": check_roundtrip, "reference": check_reference, "load_step": check_load_step}


@stage("verify")
def verify(ctx: Context) -> None:
    layout = ctx.target_layout()
    ctx.optimizer_keys = gather_to_all({layout[i].key for g in ctx.target_groups(layout) for i in g})
    ctx.checks = []
    for name in ctx.spec.pipeline.checks:
        try:
            result = CHECKS[name](ctx)
        except Exception as exc:  # a check that cannot run has failed, and says why
            result = CheckResult(name, False, f"{type(exc).__name__}: {exc}")
        ctx.checks.append(result)
    per_rank = gather_to_all(ctx.checks)
    combined = []
    for i, check in enumerate(ctx.checks):
        failed = [(r, checks[i]) for r, checks in enumerate(per_rank) if not checks[i].ok]
        detail = "; ".join(f"rank {r}: {c.detail}" for r, c in failed[:3]) if failed else check.detail
        combined.append(CheckResult(check.name, not failed, detail))
    ctx.checks = combined
