"""Layout kinds: one module per way a job wraps its model, behind one registry.

A kind (``none``, ``fsdp1``, ...) is everything osdpipe knows about one way of
wrapping a model, and nothing outside its module knows it:

* :meth:`LayoutKind.rank_layout`: pure layout math, the local tensors rank
  ``r``'s optimizer holds and the segments they are made of;
* :meth:`LayoutKind.wrap`: how to wrap a real model that way (generate trains
  a source with it, verify builds the target);
* PyTorch's own answer for it: :meth:`LayoutKind.to_load` (what a rank's
  optimizer loads, converted by PyTorch from a full FQN-keyed state),
  :meth:`LayoutKind.full_state` and :meth:`LayoutKind.save` (how a job of this
  kind saves its optimizer state).

Stages, formats and verify ask the registry (:func:`get`), so adding a kind is
its module plus its :func:`register` line.
"""

from __future__ import annotations

from osdpipe.layout.kinds import ddp, fsdp1, fsdp2, megatron, none  # noqa: F401  (each registers its kind)
from osdpipe.layout.kinds.base import KINDS, LayoutKind, compute_device, device_mesh, find, get, register
from osdpipe.layout.ranges import LayoutSpec, LocalTensor
from osdpipe.layout.tree import ModuleTree

__all__ = ["KINDS", "LayoutKind", "compute_device", "device_mesh", "find", "get", "rank_layout", "register"]


def rank_layout(tree: ModuleTree, spec: LayoutSpec, rank: int) -> tuple[LocalTensor, ...]:
    """The local tensors of rank ``rank``'s optimizer under ``spec``, in ``model.parameters()`` order of the wrapped
    model.

    Each kind computes its own (:meth:`LayoutKind.rank_layout`).
    """
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank} is outside a world of {spec.world_size}")
    return get(spec.kind).rank_layout(tree, spec, rank)
