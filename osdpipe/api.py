"""Python API: reshard a checkpoint into a live training job, one call per rank.

Inside an already-initialized process group, every rank of the target job
calls :func:`load_optimizer_state` with its wrapped model and its optimizer::

    model = FSDP(build_model(), auto_wrap_policy=..., use_orig_params=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    osdpipe.load_optimizer_state(
        model, optim, "/ckpt/optim.pt",
        model_config={"factory": "mypkg.models:build", "kwargs": {"depth": 12}},
        source={"world_size": 8, "wrap": ["Block"]},
        target={"world_size": 4, "wrap": ["Block"], "use_orig_params": True},
    )

It runs the same stages as the ``osdpipe`` command (load, broadcast, flatten,
shard, rekey, verify), but keys the result by *this* optimizer's param groups,
whatever order its parameters were given in, and loads it. Where
``FSDP.optim_state_dict_to_load`` needs the full state on every rank and a
source of the same wrapping, this reads only what the rank needs, from any
supported layout, and checks the result before loading it.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from osdpipe.io.loading import check_fits
from osdpipe.layout import kinds
from osdpipe.layout.optim import check_matches_layout
from osdpipe.pipeline import loop
from osdpipe.run.collective import StageError
from osdpipe.run.products import Keyed
from osdpipe.run.world import GroupWorld
from osdpipe.spec.config import LayoutConfig, validate
from osdpipe.spec.plan import plan_run
from osdpipe.spec.reconcile import Given, reconcile
from osdpipe.verify.checks.common import LIVE_TARGET

#: Verify checks that leave the caller's model and optimizer untouched (load_step would train them).
API_CHECKS = ["roundtrip", "reference"]


def optimizer_name(cls: type) -> str:
    """How ``optim.name`` names a live optimizer's class:
    ``Adam`` for ``torch.optim``'s, ``package.module:Class`` for a user's."""
    return cls.__name__ if getattr(torch.optim, cls.__name__, None) is cls else f"{cls.__module__}:{cls.__qualname__}"


def _live_groups(model: nn.Module, optim: torch.optim.Optimizer, layout: tuple) -> list[list[int]]:
    """The optimizer's param groups as indices into ``layout`` (``model.parameters()`` order), checked by shape."""
    params = list(model.parameters())
    check_matches_layout(params, layout)
    index = {id(p): i for i, p in enumerate(params)}
    groups = []
    for g, group in enumerate(optim.param_groups):
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in index]
        if missing:
            raise ValueError(f"optimizer param group {g} holds parameters of shapes {missing} that are not the model's")
        groups.append([index[id(p)] for p in group["params"]])
    return groups


def reshard_optimizer_state(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    checkpoint: str,
    *,
    model_config: dict[str, Any],
    source: dict[str, Any],
    target: dict[str, Any],
    input_format: str | None = None,
    input_key: str | None = None,
    input_param_groups: list[list[str]] | None = None,
    checks: list[str] | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """This rank's optimizer state for ``optim``, converted from ``checkpoint``; collective over the world.

    Args:
        model: this rank's wrapped target model (FSDP1, or unwrapped for ``target.kind=none``).
        optim: its optimizer; the result is keyed by its param groups.
        checkpoint: the source file or directory.
        model_config: ``model.*`` of the config: ``factory``, ``kwargs``, ``seed``, ``units``.
        source: ``source.*`` of the config: the layout the checkpoint was saved under.
        target: ``target.*`` of the config: how ``model`` is wrapped (its world size is this world's).
        input_format: ``fsdp_full``, ``dcp``, ``plain`` or ``rank_local`` (``None``: what the files are).
        input_key: the top-level key of a DCP checkpoint (``None``: the one that holds optimizer state).
        input_param_groups: for param-ID keyed inputs, the saving optimizer's groups as FQN patterns.
        checks: verify checks to run (default: ``roundtrip`` and ``reference``).
        timeout_s: timeout of the collectives.

    Returns:
        A state dict that ``optim.load_state_dict`` takes.

    Raises:
        StageError: when a stage fails on any rank, or a verify check fails (on every rank).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "reshard_optimizer_state runs inside an initialized process group; call dist.init_process_group first"
        )
    target_kind = target.get("kind", LayoutConfig.model_fields["kind"].default)
    given_input = {"format": input_format, "key": input_key, "param_groups": input_param_groups}
    raw = {
        "model": model_config,
        "source": source,
        "target": {**target, "world_size": target.get("world_size", dist.get_world_size())},
        "input": {"path": checkpoint, **{k: v for k, v in given_input.items() if v is not None}},
        "optim": {"name": optimizer_name(type(optim)), "lr": optim.param_groups[0]["lr"]},
        # Nothing is saved: the output section only selects param-ID keyed results,
        # as the target's own optimizer holds them.
        "output": {
            "path": os.path.join(tempfile.gettempdir(), "osdpipe-api-unsaved"),
            "format": kinds.get(target_kind).saved_format("local"),
            "overwrite": True,
        },
        "pipeline": {
            "stages": ["load", "broadcast", "flatten", "shard", "rekey", "verify"],
            "checks": API_CHECKS if checks is None else checks,
        },
        "runtime": {"timeout_s": timeout_s, "progress": False},
    }
    # What the caller said of the checkpoint is checked against its files; what they left out is read from them.
    given = Given(
        [f"source.{k}" for k in source]
        + [f"input.{k}" for k, v in given_input.items() if v is not None]
        + ["optim.name"]
    )
    raw, notes = reconcile(raw, given)
    for note in notes:
        warnings.warn(f"osdpipe: {note}", stacklevel=2)
    spec = validate(raw)
    if spec.target.world_size != dist.get_world_size():
        raise ValueError(f"target.world_size={spec.target.world_size} but this world has {dist.get_world_size()} ranks")
    world = GroupWorld()
    plan = plan_run(spec)
    plan = plan.with_optimizer_groups(_live_groups(model, optim, plan.optimizer_layout(world.rank)))
    world.kept[(LIVE_TARGET, world.rank)] = (model, optim)  # the checks load into the caller's own job, not a new one
    report, played = loop.run_stages(plan, world)
    failed = {c.name: c.detail for c in report.checks if not c.ok}
    if failed:
        raise StageError("verify", {0: "; ".join(f"{k}: {v}" for k, v in failed.items())})
    keyed = played.find(Keyed)
    assert keyed is not None
    return keyed.state_dict


def load_optimizer_state(
    model: nn.Module, optim: torch.optim.Optimizer, checkpoint: str, **kwargs: Any
) -> dict[str, Any]:
    """:func:`reshard_optimizer_state`, then ``optim.load_state_dict`` with it; returns the state loaded.

    Before anything is loaded, every state tensor is held against the
    parameter it goes to (:func:`osdpipe.io.loading.check_fits`): its shape, and
    the parameters an FSDP1 flat parameter is made of.
    """
    state = reshard_optimizer_state(model, optim, checkpoint, **kwargs)
    check_fits(optim, state, model=model, where=checkpoint)
    optim.load_state_dict(state)
    return state


def reshard_megatron(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    tp: int,
    pp: int = 1,
    dp: int = 1,
    optim_format: str | None = None,
    overwrite: bool = False,
    workers: int = 1,
    vpp: int = 1,
    checks: list[str] | None = None,
    memory_budget: int | None = None,
) -> dict[str, Any]:
    """Reshard a Megatron-LM ``torch_dist`` save to TP ``tp`` x PP ``pp`` x DP ``dp`` with ``vpp`` model chunks per
    pipeline stage (virtual pipeline stages; 1: none), optimizer included, offline and without Megatron; prove it;
    commit it whole: the ``osdpipe`` command's ``checkpoint=megatron`` conversion, through the same stages.

    ``source`` is a Megatron-LM save folder (``latest_checkpointed_iteration.txt``) or one ``iter_<N>`` folder;
    ``output`` receives a save folder that Megatron-LM's ``load_checkpoint`` at the new parallelism loads.
    ``optim_format`` (``dp_reshardable`` or ``fully_reshardable``; ``None``: the source's) is how the distributed
    optimizer is saved: a ``dp_reshardable`` source, which Megatron itself refuses at another TP or PP, converts to
    either. ``checks`` are the verify checks (``None``: the command's default); ``overwrite`` replaces a previous
    output whole; ``workers`` processes convert the target's ranks (``runtime.workers``); ``memory_budget`` (bytes)
    bounds what each holds (``runtime.memory_budget``). ``report.json`` and ``manifest.json`` are written as the
    command writes them.

    Returns:
        ``{"folder", "iteration", "source", "target", "rng_from", "checks"}``: where the iteration folder is, the two
        parallelisms (``tp``, ``pp``, ``vpp``, ``dp``) and sharding types, which source (PP, TP) rank's RNG states each
        target (PP, TP) rank got, and what each check proved.

    Raises:
        osdpipe.spec.config.ConfigError: the config does not fit the save (a TP that does not split its heads), or
            ``output`` holds a conversion and ``overwrite`` is false.
        ValueError: the save cannot be read (an ``InputError``, one line).
        RuntimeError: a stage or a check failed (nothing is committed); its line.
    """
    from osdpipe.io.formats.megatron_items import rng_source
    from osdpipe.io.formats.megatron_reader import MegatronFiles  # the Megatron path: only this call needs it
    from osdpipe.pipeline.execute import check_source, execute

    raw: dict[str, Any] = {
        "checkpoint": {"layout": "megatron"},
        "input": {"path": os.fspath(source), "format": "megatron"},
        "source": {"kind": "megatron"},
        "target": {"kind": "megatron", "tp_size": tp, "pp_size": pp, "vpp_size": vpp, "world_size": tp * pp * dp},
        "output": {"path": os.fspath(output), "format": "megatron", "overwrite": overwrite,
                   "megatron_optim_format": optim_format},
        "runtime": {"mode": "offline", "workers": workers, "progress": False, "memory_budget": memory_budget},
        **({"pipeline": {"checks": checks}} if checks is not None else {}),
    }
    given = Given(["target", "output.overwrite", "runtime"]
                  + (["output.megatron_optim_format"] if optim_format is not None else []))
    raw, notes = reconcile(raw, given)
    plan = plan_run(validate(raw))
    check_source(plan)
    report = execute(plan, warnings=notes, source_checked=True)
    if not report.ok:
        raise RuntimeError(report.failure)
    files = MegatronFiles(plan.input_path)
    grid = plan.target_spec.grid
    return {
        "folder": os.path.join(os.fspath(output), files.folder.name),
        "iteration": files.iteration,
        "source": {"tp": files.tp, "pp": files.pp, "vpp": files.vpp, "dp": files.dp, "sharding": files.sharding},
        "target": {"tp": grid.tp, "pp": grid.pp, "vpp": grid.vpp, "dp": grid.dp,
                   "sharding": grid.sharding if files.sharding is not None else None},
        "rng_from": {f"{p}.{t}": list(rng_source(grid, files.tp, files.pp, p, t))
                     for p in range(grid.pp) for t in range(grid.tp)} if files.has_rng else {},
        "checks": {c.name: c.detail for c in report.checks},
    }
