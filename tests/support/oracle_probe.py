"""What real FSDP says about a wrapped model, as plain data: shared by the FSDP2 and hybrid layout oracles.

The oracles (``test_fsdp2_oracle.py``, ``test_hybrid_oracle.py``) wrap real
models with real ``fully_shard`` / ``FullyShardedDataParallel`` and compare
what they hold with osdpipe's pure layout math. This module is what runs on
the ranks: it marks every element of a model with a value that names it
(:func:`fill_marked`), and reads back, per parameter or flat parameter, the
shapes, placements, FlatParameter metadata and local values, as plain
picklable / JSON-able data. Nothing here calls osdpipe's layout functions:
the comparison happens in the test process.

Run as a script, it is the *fake process group* probe for large worlds::

    python tests/support/oracle_probe.py '<json request>'

The request names a world size, the ranks to probe and the cases (FSDP2
``fully_shard`` or FSDP1 ``FullyShardedDataParallel``); each rank joins
PyTorch's fake process group on its own (``FakeStore``), wraps every case,
and leaves the group before the next rank. Only construction happens there:
no collective carries data on a fake group (no state-dict gathering, no
step). Both FSDPs cut each rank's shard out of the full local tensor while
constructing, without a collective, so the local values that come back are
real. The answer is one JSON object on stdout: ``{"ranks": {rank: [per-case result]}}``.
"""

from __future__ import annotations

import functools
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: The value of the first element of the first parameter; 0 is left for padding.
FIRST_MARK = 1


def marks(named_numels: list[tuple[str, int]]) -> dict[str, int]:
    """The value of element 0 of each parameter: element ``i`` of parameter ``fqn`` holds ``marks[fqn] + i``.

    Every element of the model gets a distinct positive integer (exact in
    float32 for models under 2**24 elements), so a local tensor's values say
    which elements of which parameter a rank holds, and 0 is padding.
    """
    out, next_mark = {}, FIRST_MARK
    for fqn, numel in named_numels:
        out[fqn] = next_mark
        next_mark += numel
    return out


def fill_marked(model: nn.Module) -> dict[str, int]:
    """Give every element of ``model`` its mark (:func:`marks`), in ``named_parameters()`` order (tied ones once)."""
    params = list(model.named_parameters())
    where = marks([(name, p.numel()) for name, p in params])
    with torch.no_grad():
        for name, p in params:
            p.copy_((torch.arange(p.numel(), dtype=torch.float64) + where[name]).view(p.shape).to(p.dtype))
    return where


def local_values(tensor: torch.Tensor) -> list[int]:
    """A local tensor's values, flattened, as integers (marks and padding zeros)."""
    return [int(v) for v in tensor.detach().reshape(-1).to(torch.float64).tolist()]


def expected_values(numel: int, segments: Any, where: dict[str, int]) -> list[int]:
    """The values a local tensor of ``numel`` elements made of ``segments`` (osdpipe ``Segment``) holds after
    :func:`fill_marked`: marks, 0 in the padding."""
    out = [0] * numel
    for s in segments:
        out[s.dest : s.dest + s.length] = range(where[s.fqn] + s.start, where[s.fqn] + s.start + s.length)
    return out


#: Words of a world that failed to *form* (its rendezvous port taken by another process between
#: ``free_port`` and the store's bind, on a machine running other tests), not of a wrapped model.
NETWORK_FLAKES = (
    "DistNetworkError", "Broken pipe", "Connection reset", "Connection refused", "Address already in use", "EADDRINUSE"
)


def spawn_world(fn: Any, world_size: int, args: tuple, timeout_s: float) -> Any:
    """``run_local_world(fn, world_size, args)`` on gloo, spawned once more if the world could not form
    (:data:`NETWORK_FLAKES`).

    Any other failure, a hang (``timeout_s``) included, is raised at once.
    """
    from osdpipe.run.launch import run_local_world

    try:
        return run_local_world(fn, world_size, args, backend="gloo", timeout_s=timeout_s)
    except Exception as exc:
        if not any(word in str(exc) for word in NETWORK_FLAKES):
            raise
    return run_local_world(fn, world_size, args, backend="gloo", timeout_s=timeout_s)


_WORLDS: dict[tuple[str, int], tuple[Any, str | None]] = {}


def world_once(what: str, fn: Any, world_size: int, args: tuple, timeout_s: float) -> Any:
    """Every rank's result of ``fn(*args)`` on a world of ``world_size``,
    spawned once per ``what`` and size and shared by every case.

    A world that fails is remembered, not respawned for every case that asks
    for it: each of them fails with its error.
    """
    import pytest

    key = (what, world_size)
    if key not in _WORLDS:
        try:
            _WORLDS[key] = (spawn_world(fn, world_size, args, timeout_s), None)
        except Exception as exc:  # noqa: BLE001 - said by every case below
            _WORLDS[key] = (None, f"{type(exc).__name__}: {exc}")
    results, error = _WORLDS[key]
    if error is not None:
        pytest.fail(f"the {what} world of {world_size} rank(s) failed: {error}", pytrace=False)
    return results


@functools.cache
def meta_tree(factory: str, kwargs: tuple[tuple[str, Any], ...] = ()) -> Any:
    """The module tree of ``factory(**dict(kwargs))`` built on the meta device (cached: kwargs as sorted items)."""
    from osdpipe.layout.models import build_model
    from osdpipe.layout.tree import describe

    return describe(build_model(factory, dict(kwargs), seed=0, device="meta"))


def tree_of(models: dict[str, tuple[str, dict[str, Any]]], label: str) -> Any:
    """:func:`meta_tree` of the model ``models[label]`` names (a test module's MODELS table)."""
    factory, kwargs = models[label]
    return meta_tree(factory, tuple(sorted(kwargs.items())))


def tree_marks(tree: Any) -> dict[str, int]:
    """Where each parameter's marks start (:func:`marks`), in the tree's parameter order."""
    return marks([(p.fqn, p.numel) for p in tree.params])


def clean_fqn(name: str) -> str:
    """A name of an FSDP1-wrapped model without FSDP1's ``_fsdp_wrapped_module`` parts."""
    return ".".join(part for part in name.split(".") if part != "_fsdp_wrapped_module")


# ---------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------


def fsdp2_params(model: nn.Module, with_values: bool = True) -> list[dict[str, Any]]:
    """Per parameter of a ``fully_shard``-ed model, in ``parameters()`` order: what its DTensor says."""
    out = []
    for name, p in model.named_parameters():
        local = p.to_local()
        out.append(
            dict(
                fqn=name,
                shape=tuple(p.shape),
                local_shape=tuple(local.shape),
                placements=tuple(str(x) for x in p.placements),
                mesh=tuple(p.device_mesh.shape),
                mesh_dim_names=tuple(p.device_mesh.mesh_dim_names or ()),
                values=local_values(local) if with_values else None,
            )
        )
    return out


def direct_fully_shard(model: nn.Module, units: list[str], mesh: Any) -> nn.Module:
    """``fully_shard`` on the modules named (by FQN or class name) in ``units``, innermost first, then on the root.

    The wrapping a user writes by hand; the oracles use it beside osdpipe's own
    ``FSDP2.wrap`` so that the layout is not only checked against osdpipe.
    """
    from torch.distributed.fsdp import fully_shard

    chosen = [m for name, m in model.named_modules() if name and (name in units or type(m).__name__ in units)]
    for module in reversed(chosen):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def direct_fsdp2_tp(
    model: nn.Module, units: list[str], world_size: int, tp_size: int, plan: dict[str, str]
) -> nn.Module:
    """FSDP2 over tensor parallelism as torchtitan writes it: a (dp, tp) mesh, torch's styles on the modules ``plan``'s
    patterns match, then ``fully_shard`` over dp."""
    import fnmatch

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}
    mesh = init_device_mesh("cpu", (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    chosen = {}
    for name, _ in model.named_modules():
        for pattern, style in plan.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                chosen.setdefault(name, styles[style]())
    # src_data_rank=None: each rank cuts its piece from its own full tensor; the default scatters rank 0's,
    # which a fake group does not carry
    parallelize_module(model, mesh["tp"], chosen, src_data_rank=None)
    return direct_fully_shard(model, units, mesh["dp"])


# ---------------------------------------------------------------------------
# FSDP1
# ---------------------------------------------------------------------------


def fsdp1_metadata(wrapped: nn.Module, with_values: bool = True) -> dict[str, Any]:
    """Per FSDP1 unit with a flat parameter, its FlatParameter metadata;
    per parameter of the wrapped model, its name, local shape, values."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = []
    for name, module in wrapped.named_modules():
        if not isinstance(module, FSDP) or module._handle is None:  # no handle: every parameter is in a nested unit
            continue
        handle = module._handle
        fp = handle.flat_param
        units.append(
            dict(
                unit=clean_fqn(name),
                fqns=tuple(fp._fqns),
                numels_with_padding=tuple(int(n) for n in fp._numels_with_padding),
                is_padding_mask=tuple(bool(b) for b in fp._is_padding_mask),
                local_numel=int(fp.numel()),
                shard_param_infos=tuple(
                    (
                        bool(i.in_shard),
                        i.offset_in_shard,
                        i.numel_in_shard,
                        i.intra_param_start_idx,
                        i.intra_param_end_idx,
                    )
                    for i in fp._shard_param_infos
                ),
                sharded=bool(handle.uses_sharded_strategy),
                strategy=str(module.sharding_strategy.name),
                shard_group=(module.process_group.size(), module.process_group.rank()),
            )
        )
    params = [
        dict(fqn=clean_fqn(n), local_shape=tuple(p.shape), values=local_values(p) if with_values else None)
        for n, p in wrapped.named_parameters()
    ]
    return dict(units=units, params=params)


def direct_fsdp1(
    model: nn.Module, units: list[str], strategy: str, use_orig_params: bool, mesh: Any = None
) -> nn.Module:
    """``FullyShardedDataParallel`` with a ``CustomPolicy`` that wraps the modules named
    (FQN or class) in ``units``, and the root."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import CustomPolicy

    chosen = {id(m) for name, m in model.named_modules() if name and (name in units or type(m).__name__ in units)}
    kwargs: dict[str, Any] = dict(
        auto_wrap_policy=CustomPolicy(lambda m: id(m) in chosen),
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )
    if mesh is not None:
        kwargs["device_mesh"] = mesh
    return FSDP(model, **kwargs)


# ---------------------------------------------------------------------------
# The fake-process-group probe
# ---------------------------------------------------------------------------


def _probe_rank(world_size: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Wrap every case on the current (fake) rank; a case's failure is its result, not the probe's."""
    from torch.distributed.device_mesh import init_device_mesh

    from osdpipe.layout.models import build_model

    meshes: dict[tuple[int, ...], Any] = {}

    def mesh(shape: tuple[int, ...]) -> Any:
        if shape not in meshes:
            names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
            meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
        return meshes[shape]

    out: list[Any] = []
    for case in cases:
        try:
            model = build_model(case["factory"], case["kwargs"], seed=0)
            fill_marked(model)
            group = case.get("shard_group_size")
            shape = (world_size // group, group) if group else (world_size,)
            if case["kind"] == "fsdp2_tp":
                wrapped = direct_fsdp2_tp(model, case["wrap"], world_size, case["tp_size"], case["tp_plan"])
                out.append(dict(params=fsdp2_params(wrapped)))
            elif case["kind"] == "fsdp2":
                direct_fully_shard(model, case["wrap"], mesh(shape))
                out.append(dict(params=fsdp2_params(model)))
            else:
                hybrid = case["strategy"] in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
                wrapped = direct_fsdp1(
                    model, case["wrap"], case["strategy"], case["use_orig_params"], mesh(shape) if hybrid else None
                )
                out.append(fsdp1_metadata(wrapped))
        except Exception as exc:  # noqa: BLE001 - reported per case
            out.append(dict(error=f"{type(exc).__name__}: {exc}"))
    return out


def probe_fake_world(world_size: int, ranks: list[int], cases: list[dict[str, Any]]) -> dict[int, list[Any]]:
    """Each of ``ranks`` in turn joins a fake group of ``world_size`` ranks, wraps every case, and leaves."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    results = {}
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            results[rank] = _probe_rank(world_size, cases)
        finally:
            dist.destroy_process_group()
    return results


def run_fake_world(
    world_size: int, ranks: list[int], cases: list[dict[str, Any]], timeout_s: float
) -> dict[int, list[Any]]:
    """In the test process: :func:`probe_fake_world` in a subprocess of its own (the fake group must not live here)."""
    from helpers import clean_env, run_command

    request = json.dumps(dict(world_size=world_size, ranks=ranks, cases=cases))
    proc = run_command(
        [sys.executable, __file__, request], cwd=Path(__file__).parent, timeout=timeout_s, env=clean_env()
    )
    if proc.returncode != 0:
        import pytest

        pytest.fail(f"the fake-process-group probe of {world_size} ranks failed:\n{proc.stderr[-4000:]}", pytrace=False)
    return {int(r): v for r, v in json.loads(proc.stdout)["ranks"].items()}


def main(argv: list[str]) -> None:
    request = json.loads(argv[1])
    warnings.simplefilter("ignore")  # FSDP1's deprecation, the world-size-1 NO_SHARD switch
    torch.set_num_threads(1)
    results = probe_fake_world(request["world_size"], request["ranks"], request["cases"])
    json.dump({"ranks": {str(r): v for r, v in results.items()}}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv)
