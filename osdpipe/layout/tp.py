"""Tensor parallelism: which modules a plan names, the styles it names, and the placements PyTorch gives them.

A job's ``tp_plan`` maps module FQN patterns (``fnmatch``) to a style:
``colwise``, ``rowwise`` and ``sequence`` are torch's ``ColwiseParallel()``,
``RowwiseParallel()`` and ``SequenceParallel()``; ``package.module:callable``
is any callable that returns a ``ParallelStyle``, the user's own included.

osdpipe does not keep a table of what each style does to each parameter. It
asks PyTorch (:func:`read_placements`): a ``meta`` model is tensor-parallelized
and ``fully_shard``-ed on the mesh as torchtitan builds it, on PyTorch's fake
process group, and each parameter's mesh and placements are read off. That
needs a process of its own (a process group is one per process, and the
caller may already be in one): a fork of the ranks' server, which has torch
imported (:func:`osdpipe.core.rankserver.call_apart`), once per run, in the
launcher, for each side with ``tp_size > 1``. Where each rank's piece lies
is then pure math (:mod:`osdpipe.layout.boxes`).
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from osdpipe.core import rankserver

if TYPE_CHECKING:  # annotations only: the config's schema pass checks the styles here, before torch is imported
    from osdpipe.layout.ranges import LayoutSpec, Placement

#: The built-in styles: torch's classes of ``torch.distributed.tensor.parallel`` with their defaults.
STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel", "sequence": "SequenceParallel"}
#: Mesh dimension names, as torchtitan names them: (dp, tp), or (dp_replicate, dp_shard, tp) with HSDP.
TP_MESH_NAMES = ("dp", "tp")
HSDP_TP_MESH_NAMES = ("dp_replicate", "dp_shard", "tp")
#: How long the placement probe may take: a model on ``meta`` is parallelized in seconds, so past this it hangs.
PROBE_TIMEOUT_S = 300


def style_problem(style: Any) -> str | None:
    """Why ``style`` names no style (``None``: it does), without importing it."""
    if not isinstance(style, str):
        return f"a style is a string, not {type(style).__name__}"
    if style in STYLES:
        return None
    module, _, attr = style.partition(":")
    if module and attr:
        return None
    return f"style {style!r} is not {', '.join(STYLES)} or package.module:callable"


def make_style(style: str) -> Any:
    """The ``ParallelStyle`` a plan's style names: a built-in one, or what ``package.module:callable`` returns.

    Raises:
        ValueError: naming the style that cannot be imported or made.
    """
    from torch.distributed.tensor import parallel  # heavy (DTensor): only where a job is parallelized

    if style in STYLES:
        return getattr(parallel, STYLES[style])()
    module_name, _, attr = style.partition(":")
    try:
        made = getattr(importlib.import_module(module_name), attr)()
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"tp_plan style {style!r}: {exc}; is {module_name} on PYTHONPATH?") from None
    if not isinstance(made, parallel.ParallelStyle):
        raise ValueError(
            f"tp_plan style {style!r} returned a {type(made).__name__}, "
            "not a torch.distributed.tensor.parallel.ParallelStyle"
        )
    return made


def styled_modules(modules: Iterable[str], plan: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """Module FQN -> style, for every module a pattern of ``plan`` matches (the first pattern that matches wins).

    Raises:
        ValueError: for a pattern that matches no module, naming a few that exist.
    """
    names = [m for m in modules if m]
    out: dict[str, str] = {}
    for pattern, style in plan:
        matched = [m for m in names if fnmatch.fnmatchcase(m, pattern)]
        if not matched:
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no module of the model "
                f"(it has {', '.join(names[:6])}{', ...' * (len(names) > 6)})"
            )
        for m in matched:
            out.setdefault(m, style)
    return out


def mesh_shape(spec: LayoutSpec) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The job's whole mesh and its dimension names: ``(dp, tp)``, or ``(replicate, shard, tp)`` with HSDP."""
    if spec.shard_group_size:
        return (spec.replicas, spec.shard_group_size, spec.tp_size), HSDP_TP_MESH_NAMES
    return (spec.data_parallel, spec.tp_size), TP_MESH_NAMES


def parallelize(model: Any, mesh: Any, spec: LayoutSpec) -> Any:
    """Apply ``spec.tp_plan`` to ``model`` over the mesh's ``tp`` dimension,
    as a job does before ``fully_shard``; the data-parallel sub-mesh."""
    # heavy (DTensor): only where a job is parallelized
    from torch.distributed.tensor.parallel import parallelize_module

    styles = styled_modules((name for name, _ in model.named_modules()), spec.tp_plan)
    parallelize_module(model, mesh["tp"], {fqn: make_style(style) for fqn, style in styles.items()})
    return mesh[mesh.mesh_dim_names[:-1]] if len(mesh.mesh_dim_names) > 2 else mesh[mesh.mesh_dim_names[0]]


def read_placements(factory: str, kwargs: dict[str, Any], spec: LayoutSpec) -> tuple[tuple[str, Placement], ...]:
    """Each parameter's mesh and placements in a job wrapped as ``spec`` says,
    as PyTorch lays them (see the module's doc).

    Raises:
        ValueError: with PyTorch's or the plan's own one-line reason when the model cannot be parallelized so.
    """
    from osdpipe.layout.ranges import Placement  # the layout math imports torch: not for the config's schema pass

    try:
        request = {"factory": factory, "kwargs": kwargs, "spec": _spec_fields(spec)}
        placed = rankserver.call_apart(_probe, (request,), PROBE_TIMEOUT_S)
    except TimeoutError:
        raise ValueError(
            f"PyTorch took over {PROBE_TIMEOUT_S} s to parallelize the model on the meta device; "
            "does its factory or a style wait on something?"
        ) from None
    return tuple(
        (fqn, Placement(tuple(mesh), tuple(placements), tuple(names))) for fqn, mesh, placements, names in placed
    )


def _spec_fields(spec: LayoutSpec) -> dict[str, Any]:
    return {
        "world_size": spec.world_size,
        "shard_group_size": spec.shard_group_size,
        "tp_size": spec.tp_size,
        "tp_plan": spec.tp_plan,
        "wrap": spec.wrap,
    }


def _probe(request: dict[str, Any]) -> list[Any]:
    """In the probe's own process: rank 0 of a fake world builds
    the job on ``meta`` and reports every parameter's placements.

    A ``ValueError`` is the plan's own words (a pattern that matches nothing, a
    style that cannot be made); anything else is PyTorch refusing the plan.
    """
    import warnings

    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from osdpipe.layout.models import build_model
    from osdpipe.layout.ranges import LayoutSpec, wrapped_modules
    from osdpipe.layout.tree import describe

    fields = request["spec"]
    spec = LayoutSpec(
        kind="fsdp2",
        world_size=fields["world_size"],
        shard_group_size=fields["shard_group_size"],
        tp_size=fields["tp_size"],
        tp_plan=tuple(tuple(p) for p in fields["tp_plan"]),
        wrap=tuple(fields["wrap"]),
    )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=spec.world_size)
    try:
        model = build_model(request["factory"], request["kwargs"], device="meta")
        tree = describe(model)
        shape, names = mesh_shape(spec)
        dp_mesh = parallelize(model, init_device_mesh("cpu", shape, mesh_dim_names=names), spec)
        for unit in reversed([u for u in wrapped_modules(tree, spec) if u]):
            fully_shard(model.get_submodule(unit), mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        return [
            (
                tree.canonical(name),
                list(p.device_mesh.shape),
                [str(x) for x in p.placements],
                list(p.device_mesh.mesh_dim_names),
            )
            for name, p in model.named_parameters()
        ]
    finally:
        dist.destroy_process_group()
