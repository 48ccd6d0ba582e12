"""``fsdp1``: ``FullyShardedDataParallel``: flat parameters, sharded, with or without ``use_orig_params``.

Per FSDP unit, one flat parameter: the unit's parameters flattened and
concatenated in registration order (tied ones once), cut across ranks as
``torch.chunk`` cuts it (FULL_SHARD, SHARD_GRAD_OP) or held whole (NO_SHARD).
HYBRID_SHARD and ``_HYBRID_SHARD_ZERO2`` cut it over a shard group of
``shard_group_size`` ranks (rank ``r`` holds chunk ``r % shard_group_size``)
and every replica group holds the same chunks.
With ``use_orig_params`` every parameter starts aligned to
:data:`ALIGNMENT_BYTES` of the forward/backward dtype (mixed precision's
``param_dtype`` when one is set: 8 elements of fp32 parameters under bf16, not
4) and the optimizer sees each parameter's part of the
rank's chunk as a 1-D tensor of its own. Parameters outside every unit
(``wrap_root=false``) stay whole. The layout oracle tests hold this against
real ``FlatParameter`` metadata.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from osdpipe.layout.flat_buffer import FlatBuffer, pack, rank_slice, segments
from osdpipe.layout.kinds.base import LayoutKind, compute_device, device_mesh, register
from osdpipe.layout.ranges import (
    HYBRID_STRATEGIES,
    LayoutSpec,
    LocalTensor,
    Segment,
    shard_group,
    unit_of,
    whole,
    wrapped_modules,
)
from osdpipe.layout.tree import ModuleTree, describe

#: FSDP1 with ``use_orig_params=True`` starts every parameter at an address
#: aligned to this many bytes (a TorchInductor requirement).
ALIGNMENT_BYTES = 16
FLAT_PARAM = "_flat_param"


@dataclass(frozen=True)
class FlatParamLayout:
    """The unsharded flat parameter of one FSDP1 unit: its parameters laid out in one flat buffer."""

    unit: str
    fqns: tuple[str, ...]
    buffer: FlatBuffer

    @property
    def entries(self) -> tuple[tuple[str | None, int], ...]:
        """``(fqn or None for padding, numel)`` in flat order, as FlatParameter's ``_fqns`` interleaved with
        ``_numels_with_padding`` (what the layout oracle compares)."""
        out: list[tuple[str | None, int]] = []
        at = 0
        for fqn, start, stop in self.buffer.entries:
            if start > at:
                out.append((None, start - at))
            out.append((fqn, stop - start))
            at = stop
        if self.buffer.numel > at:
            out.append((None, self.buffer.numel - at))
        return tuple(out)

    @property
    def total(self) -> int:
        return self.buffer.numel


def shards(spec: LayoutSpec) -> bool:
    """Whether flat parameters are cut across ranks."""
    return spec.sharding_strategy != "NO_SHARD" and shard_group(spec, 0)[0] > 1


def flat_param_layouts(tree: ModuleTree, spec: LayoutSpec) -> tuple[FlatParamLayout, ...]:
    """The unsharded flat parameter of every unit, in pre-order of the units.

    Parameters are flattened in ``named_parameters()`` order of the unit, tied
    ones once. With ``use_orig_params`` each parameter starts aligned to
    :data:`ALIGNMENT_BYTES` and the total is padded to a multiple of the world
    size; without it there is no padding until sharding.
    """
    owner = unit_of(tree, spec)
    out = []
    for unit in wrapped_modules(tree, spec):
        params = [p for p in tree.params if owner[p.fqn] == unit]
        if not params:
            continue
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"FSDP unit {unit or '<root>'!r} mixes dtypes {sorted(dtypes)}; FSDP1 needs one dtype per unit"
            )
        compute_itemsize = getattr(torch, spec.param_dtype).itemsize if spec.param_dtype else params[0].itemsize
        # use_orig_params: each start aligned, the end padded for the shard group; without it, padded when chunked
        aligned = ALIGNMENT_BYTES // compute_itemsize if spec.use_orig_params else 1
        multiple = shard_group(spec, 0)[0] if spec.use_orig_params else 1
        buffer = pack([(p.fqn, p.numel) for p in params], align=aligned, multiple=multiple)
        out.append(FlatParamLayout(unit=unit, fqns=tuple(p.fqn for p in params), buffer=buffer))
    return tuple(out)


def flat_param_key(unit: str) -> str:
    return f"{unit}.{FLAT_PARAM}" if unit else FLAT_PARAM


@register
class FSDP1(LayoutKind):
    name = "fsdp1"
    state_dict_types = ("full", "sharded", "local")
    hybrid = True
    has_use_orig_params = True
    sharded_load_needs_a_stepped_optimizer = True

    def hybrid_keys(self, shard_group_size: int) -> dict[str, Any]:
        """FSDP1 cuts over shard groups only under a hybrid strategy;
        both lay the state out alike, and ``HYBRID_SHARD`` is the public one."""
        return {**super().hybrid_keys(shard_group_size), "sharding_strategy": "HYBRID_SHARD"}

    def rank_layout(self, tree: ModuleTree, spec: LayoutSpec, rank: int) -> tuple[LocalTensor, ...]:
        """Without ``use_orig_params`` the wrapped model registers each unit's flat
        parameter on the unit module and keeps unmanaged parameters where they
        were, so the order is a pre-order walk of the modules. With it, the
        original parameters stay registered in their original order.
        """
        owner = unit_of(tree, spec)
        flats = {f.unit: f for f in flat_param_layouts(tree, spec)}

        def shard(flat: FlatParamLayout) -> tuple[int, int, int]:
            if shards(spec):
                return rank_slice(flat.buffer, *shard_group(spec, rank))
            return 0, flat.total, flat.total

        if spec.use_orig_params:
            # Each parameter's part of this rank's chunk, as its own 1-D tensor (dest 0).
            in_shard = {
                seg.fqn: Segment(seg.fqn, seg.start, seg.length, 0)
                for flat in flats.values()
                for seg in segments(flat.buffer, *shard(flat)[:2])
            }
            out = []
            for p in tree.params:
                if owner[p.fqn] is None or not shards(spec):
                    out.append(whole(p))
                elif p.fqn in in_shard:
                    seg = in_shard[p.fqn]
                    out.append(LocalTensor(key=p.fqn, fqns=(p.fqn,), shape=(seg.length,), segments=(seg,), flat=True))
                else:
                    out.append(LocalTensor(key=p.fqn, fqns=(p.fqn,), shape=(0,), segments=(), flat=True))
            return tuple(out)

        out = []
        for module, _cls in tree.modules:
            if module in flats:
                flat = flats[module]
                start, end, size = shard(flat)
                out.append(
                    LocalTensor(
                        key=flat_param_key(module), fqns=flat.fqns, shape=(size,),
                        segments=segments(flat.buffer, start, end), flat=True,
                    )
                )
            out.extend(whole(p) for p in tree.params if p.owner == module and owner[p.fqn] is None)
        return tuple(out)

    def validate(self, spec: LayoutSpec) -> None:
        """Hybrid strategies need a shard group that divides the world; no other strategy takes one."""
        if not spec.wrap_root and not spec.wrap:
            raise ValueError("wrap_root=false with an empty wrap list wraps nothing; list the modules to wrap in wrap")
        check_shard_group(spec, hybrid=spec.sharding_strategy in HYBRID_STRATEGIES)

    def unmanaged(self, tree: ModuleTree, spec: LayoutSpec) -> list[str]:
        return [fqn for fqn, unit in unit_of(tree, spec).items() if unit is None]

    def check(self, tree: ModuleTree, spec: LayoutSpec) -> None:
        """Unknown wrap names, tied parameters across units, units that mix dtypes."""
        flat_param_layouts(tree, spec)

    def wrap(self, model: nn.Module, spec: LayoutSpec) -> nn.Module:
        """Units are the modules whose class name or FQN is in ``spec.wrap``, nested as
        FSDP1's auto-wrapping nests them; with ``wrap_root=False`` the top-most
        units are wrapped where they stand and the root stays a plain module.
        """
        # torch.distributed.fsdp is heavy: only a live model needs it, not the launcher's config check
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        units = set(wrapped_modules(describe(model), spec))
        unit_ids = {id(m) for name, m in model.named_modules() if name in units}

        def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            return True if recurse else id(module) in unit_ids

        kwargs = dict(
            mixed_precision=mixed_precision(spec),
            auto_wrap_policy=policy,
            sharding_strategy=ShardingStrategy[spec.sharding_strategy],
            use_orig_params=spec.use_orig_params,
            device_id=compute_device(),
        )
        if spec.sharding_strategy in HYBRID_STRATEGIES:  # shard within a row of the (replicate, shard) mesh
            kwargs["device_mesh"] = device_mesh((spec.replicas, spec.shard_group_size))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # FSDP1 is deprecated upstream, and it is what users have
            if spec.wrap_root:
                return FSDP(model, **kwargs)
            tops = [n for n in units if not any(n.startswith(u + ".") for u in units)]
            for name in tops:
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name)
                setattr(parent, child, FSDP(parent.get_submodule(child), **kwargs))
            return model

    def to_load(self, model: nn.Module, optim: torch.optim.Optimizer, full_osd: dict[str, Any]) -> dict[str, Any]:
        """``FSDP.optim_state_dict_to_load``."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # heavy: only a live model needs it

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return FSDP.optim_state_dict_to_load(model, optim, full_osd)

    def full_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """``FSDP.optim_state_dict`` with FULL_STATE_DICT, on every rank."""
        # torch.distributed.fsdp is heavy: only a live model needs it, not the launcher's config check
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with FSDP.state_dict_type(
                model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(), full_optim_config(rank0_only=False)
            ):
                return FSDP.optim_state_dict(model, optim)

    def save(self, model: nn.Module, optim: torch.optim.Optimizer, path: Path, state_dict_type: str, key: str) -> None:
        """FULL: ``FSDP.optim_state_dict`` to one file from rank 0;
        SHARDED: to DCP; local: each rank's ``optim.state_dict()``."""
        # torch.distributed.fsdp is heavy: only a live model needs it, not the launcher's config check
        from torch.distributed.fsdp import (
            FullStateDictConfig,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if state_dict_type == "local":
                path.mkdir(exist_ok=True)
                torch.save(optim.state_dict(), path / f"rank_{dist.get_rank()}.pt")
            elif state_dict_type == "full":
                with FSDP.state_dict_type(
                    model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(), full_optim_config(rank0_only=True)
                ):
                    osd = FSDP.optim_state_dict(model, optim)
                if dist.get_rank() == 0:
                    torch.save(osd, path)
            else:
                import torch.distributed.checkpoint as dcp  # DCP is heavy: only a SHARDED save needs it

                with FSDP.state_dict_type(
                    model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
                ):
                    osd = FSDP.optim_state_dict(model, optim)
                dcp.save({key: osd}, checkpoint_id=str(path))


def check_shard_group(spec: LayoutSpec, hybrid: bool) -> None:
    """``shard_group_size`` is set exactly when ``hybrid``,
    and divides the data-parallel ranks (``world_size`` without TP)."""
    size = spec.shard_group_size
    if not hybrid:
        if size is not None:
            raise ValueError(
                f"shard_group_size={size} applies to hybrid sharding only; "
                "set sharding_strategy=HYBRID_SHARD, or leave shard_group_size unset"
            )
        return
    if size is None:
        raise ValueError(
            f"sharding_strategy={spec.sharding_strategy} shards within groups of ranks and replicates across them: "
            "set shard_group_size (PyTorch's default is the ranks of one node)"
        )
    if spec.data_parallel % size:
        ranks = (
            f"world_size={spec.world_size}"
            if spec.tp_size == 1
            else f"the {spec.data_parallel} data-parallel ranks (world_size={spec.world_size} / tp_size={spec.tp_size})"
        )
        raise ValueError(
            f"shard_group_size={size} does not divide {ranks}; choose a divisor, so that every replica is whole"
        )


def mixed_precision(spec: LayoutSpec) -> Any:
    """FSDP1's ``MixedPrecision`` for ``spec`` (``None`` without one)."""
    if spec.param_dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecision  # heavy: only a live model needs it

    return MixedPrecision(param_dtype=getattr(torch, spec.param_dtype))


def full_optim_config(rank0_only: bool) -> Any:
    """FSDP1's FULL optimizer state-dict config, safe on CPU.

    With ``use_orig_params=True`` and ``offload_to_cpu=True`` (the default),
    torch 2.13 on CPU returns every tensor state of a flat parameter as a view
    of one reused buffer (``.cpu()`` does not copy a CPU tensor), so
    ``exp_avg`` comes back equal to ``exp_avg_sq``. Offloading is only useful
    from a GPU anyway.
    """
    from torch.distributed.fsdp import FullOptimStateDictConfig  # heavy: only a live model needs it

    return FullOptimStateDictConfig(offload_to_cpu=torch.cuda.is_available(), rank0_only=rank0_only)
