"""``megatron``: Megatron-Core's GPT on TP x PP x DP ranks, with its distributed optimizer.

The model is the one its save keys (``model.factory=megatron_gpt``: the sharded keys, global over TP and PP, from
Megatron-LM's ``args``); the layout is :mod:`osdpipe.layout.megatron_grid`'s: a rank's optimizer holds each of its
model chunks' local parameters (TP's boxes of the layers its pipeline stage holds), and its distributed optimizer the
rank's DP slice of each gradient bucket, which the save's format lays out (:mod:`osdpipe.io.formats.megatron`).

Megatron-Core builds its own model and optimizer, so this kind wraps no PyTorch model: the checks that need a live
target job say so, and the ``resume`` check steps the output's tensors on bare optimizers, whose parameter is the
fp32 master the distributed optimizer keeps (:attr:`LayoutKind.master_state`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from osdpipe.layout import megatron as gpt_layout
from osdpipe.layout.kinds.base import LayoutKind, register
from osdpipe.layout.megatron_grid import SHARDINGS, grid_of, model_tensors
from osdpipe.layout.ranges import LayoutSpec, LocalTensor
from osdpipe.layout.tree import ModuleTree

#: The model factory this kind lays out (:func:`osdpipe.layout.models.megatron_gpt`).
FACTORY = "megatron_gpt"


@register
class Megatron(LayoutKind):
    name = "megatron"
    tensor_parallel = True
    master_state = "param"
    no_live_job = "megatron-core builds its own model and optimizer"

    def validate(self, spec: LayoutSpec) -> None:
        """The world is TP x PP x DP ranks; virtual stages interleave more than one pipeline stage; the optimizer
        saves its state in a sharding type megatron-core loads."""
        super().validate(spec)
        if spec.world_size % (spec.tp_size * spec.pp_size):
            raise ValueError(f"tp_size={spec.tp_size} x pp_size={spec.pp_size} does not divide "
                             f"world_size={spec.world_size}; the world is TP x PP x data-parallel ranks")
        if why := gpt_layout.interleaving_problem(spec.pp_size, spec.vpp_size):
            raise ValueError(why)
        if (dp := spec.world_size // (spec.tp_size * spec.pp_size)) % spec.ep_size:
            raise ValueError(f"ep_size={spec.ep_size} does not divide the {dp} data-parallel ranks (world_size / "
                             "(tp_size x pp_size)): the expert-parallel ranks are data-parallel ranks")
        if spec.state_sharding not in (None, *SHARDINGS):
            raise ValueError(f"the optimizer's sharding type {spec.state_sharding!r}: one of {', '.join(SHARDINGS)}")

    def settle(self, spec: LayoutSpec, factory: str, kwargs: dict[str, Any]) -> LayoutSpec:
        """The grid (:func:`osdpipe.layout.megatron_grid.grid_of`) of the Megatron GPT ``model.kwargs`` describe; none
        for another model (a Megatron save read for a PyTorch job's: its reader needs no grid of its own), which
        :meth:`check` refuses where the grid is laid out."""
        if factory != FACTORY or "args" not in kwargs:
            return spec
        dp = spec.world_size // (spec.tp_size * spec.pp_size)
        grid = grid_of(kwargs["args"], spec.tp_size, spec.pp_size, dp, spec.vpp_size, spec.state_sharding,
                       spec.ep_size)
        return replace(spec, grid=grid)

    def check(self, tree: ModuleTree, spec: LayoutSpec) -> None:
        """A TP that splits the model's heads, key/value heads and FFN (megatron-core's rule), a PP (times the virtual
        stages) that splits its layers."""
        if spec.grid is None:
            return  # another model than Megatron's GPT: its rank layout is asked for nowhere (rank_layout says so)
        gpt = spec.grid.gpt
        if why := gpt_layout.tp_problem(gpt_layout.tp_sizes(gpt), spec.tp_size, replicated=True):
            raise ValueError(why)
        if why := gpt_layout.virtual_stages_problem(gpt.num_layers, spec.pp_size, spec.vpp_size):
            raise ValueError(why)

    def rank_layout(self, tree: ModuleTree, spec: LayoutSpec, rank: int) -> tuple[LocalTensor, ...]:
        """Every local parameter of rank ``rank``'s model chunks, parameter-shaped (:func:`model_tensors`)."""
        if spec.grid is None:
            raise ValueError(f"kind=megatron lays out a Megatron GPT as its save keys it: model.factory={FACTORY} "
                             "(leave model.factory out where a Megatron save names it)")
        return model_tensors(spec.grid, {p.fqn: p.shape for p in tree.params}, rank)

    def left_out(self, tree: ModuleTree, spec: LayoutSpec) -> dict[str, tuple[int, int]]:
        """The vocabulary's rows past the grid's padded vocabulary, where the model holds more (a save of a TP that
        pads to more rows: only padding, which no token reads)."""
        rows = spec.grid.gpt.padded_vocab_size
        out = {}
        for key in gpt_layout.VOCAB_KEYS:
            if tree.has_param(key) and tree.param(key).shape[0] > rows:
                param = tree.param(key)
                out[key] = (rows * param.numel // param.shape[0], param.numel)
        return out

    def wrap(self, model: nn.Module, spec: LayoutSpec) -> nn.Module:
        raise NotImplementedError("megatron-core builds and wraps its own model; osdpipe lays out its save")
