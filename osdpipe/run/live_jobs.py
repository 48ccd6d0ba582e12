"""Live jobs, for verify and the tests: real wrapped models and optimizers, and the step they take.

Nothing here is used to *produce* a conversion; it is what conversions are
checked against, and how a source is trained (:func:`train_step`). PyTorch's
own conversions for each layout kind are in :mod:`osdpipe.layout.kinds`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from osdpipe.layout import kinds, synthetic
from osdpipe.layout.kinds import rank_layout
from osdpipe.layout.models import build_model
from osdpipe.layout.optim import build_optimizer, check_matches_layout
from osdpipe.layout.ranges import LayoutSpec, LocalTensor
from osdpipe.layout.tree import ModuleTree
from osdpipe.spec.config import RunSpec

#: The largest magnitude of a synthetic gradient element: small, so that a few steps keep every state finite and tame.
GRAD_SCALE = 1e-2


def live_target(
    spec: RunSpec, layout_spec: LayoutSpec, tree: ModuleTree, rank: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A real, wrapped model and its optimizer, as the job resuming on ``layout_spec`` builds them."""
    model = kinds.get(layout_spec.kind).wrap(
        build_model(spec.model.factory, spec.model.kwargs, seed=spec.model.seed), layout_spec
    )
    return model, build_optimizer(spec.optim, model, rank_layout(tree, layout_spec, rank))


def synthetic_grad(seed: int, step: int, fqn: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flattened gradient of parameter ``fqn``
    (canonical FQN) at ``step``, on the CPU.

    Element ``i`` depends only on ``(seed, step, fqn, i)`` (:mod:`osdpipe.layout.synthetic`),
    so every layout of the parameter sees the same values and a rank computes
    only the elements it holds.
    """
    return _values(synthetic.grad_key(seed, step, fqn), start, stop, GRAD_SCALE, dtype)


def synthetic_param(seed: int, fqn: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[start, stop)`` of parameter ``fqn``'s synthetic starting value,
    in ``[-1, 1)`` (the resume check's jobs start there)."""
    return _values(synthetic.param_key(seed, fqn), start, stop, 1.0, dtype)


def _values(key: str, start: int, stop: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """:func:`osdpipe.layout.synthetic.values`, or, inside :func:`each_computed_twice`, the copy kept of its first
    computation; the caller owns the tensor either way."""
    pairs, asked = _pairs, (key, start, stop, scale, dtype)
    if pairs is not None and (kept := pairs.take(asked)) is not None:
        return kept
    out = synthetic.values(key, start, stop, scale, dtype)
    if pairs is not None:
        pairs.keep(asked, out)
    return out


class Pairs:
    """Synthetic values computed once and asked for again (:func:`each_computed_twice`): each kept until its second
    asking takes it, within ``limit`` bytes (what does not fit is computed again when asked)."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.held = limit, 0
        self._kept: dict[tuple, torch.Tensor] = {}

    def take(self, asked: tuple) -> torch.Tensor | None:
        kept = self._kept.pop(asked, None)
        if kept is not None:
            self.held -= kept.numel() * kept.element_size()
        return kept

    def keep(self, asked: tuple, out: torch.Tensor) -> None:
        nbytes = out.numel() * out.element_size()
        if self.limit is None or self.held + nbytes <= self.limit:
            self._kept[asked] = out.clone()  # the first asker may step its own in place
            self.held += nbytes

    def clear(self) -> None:
        """Let go of what was kept and not taken (a range one side asked for and the other did not)."""
        self._kept.clear()
        self.held = 0


_pairs: Pairs | None = None


@contextmanager
def each_computed_twice(limit: int | None) -> Iterator[Pairs]:
    """Within it, synthetic values (:func:`synthetic_grad`, :func:`synthetic_param`) asked for a second time are the
    first computation's copy.

    The resume check's two sides, the output's target and the reference from the source, start the same elements
    from the same synthetic parameters and step them on the same synthetic gradients: every range computed twice,
    and the hash was most of the check's time (a 1.6 GB conversion offline: 44 % of the whole run). A value is a
    pure function of its key and index, so the copy is the bits the second computation would have made. ``limit``:
    the most bytes kept at once (``None``: no bound); the caller clears (:meth:`Pairs.clear`) between the batches it
    compares. Not nested: the outer holds."""
    global _pairs
    outer = _pairs
    _pairs = outer or Pairs(limit)
    try:
        yield _pairs
    finally:
        _pairs = outer


def local_values(
    tensor: LocalTensor, piece: Callable[[str, int, int], torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """Local tensor ``tensor`` filled segment by segment with ``piece(fqn, start, stop)``, zero in the padding."""
    flat = torch.zeros(tensor.numel, dtype=dtype)
    for seg in tensor.segments:
        flat[seg.dest : seg.dest + seg.length] = piece(seg.fqn, seg.start, seg.start + seg.length)
    return flat.view(tensor.shape)


def local_grad(tensor: LocalTensor, seed: int, step: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The gradient FSDP gives local tensor ``tensor``: its segments of the synthetic gradients, zero in the padding.

    ``None`` for a tensor the optimizer does not step (an empty
    ``use_orig_params`` shard), which FSDP leaves without a gradient.
    """
    if not tensor.stepped:
        return None
    return local_values(tensor, lambda fqn, start, stop: synthetic_grad(seed, step, fqn, start, stop, dtype), dtype)


def set_synthetic_grads(params: list[nn.Parameter], layout: tuple[LocalTensor, ...], seed: int, step: int) -> None:
    """Give each of ``params`` (in ``model.parameters()`` order, described by ``layout``) its synthetic gradient.

    Parameters that do not require a gradient are left alone, as backward
    leaves them.
    """
    check_matches_layout(params, layout)
    for param, tensor in zip(params, layout):
        if not param.requires_grad:
            continue
        grad = local_grad(tensor, seed, step, param.dtype)
        param.grad = None if grad is None else as_param(param, grad.to(param.device))


def as_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's piece) as a tensor like ``param``:
    a DTensor of its placement when ``param`` is one (FSDP2)."""
    from torch.distributed.tensor import DTensor  # heavy: only FSDP2's parameters are DTensors

    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def train_step(
    spec: RunSpec,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    step: int,
    layout: tuple[LocalTensor, ...],
    tree: ModuleTree,
) -> None:
    """One optimizer step on synthetic gradients: no forward pass, no input, so any model trains.

    Every trainable parameter of ``model`` (so every one ``optim`` holds) gets the slice of :func:`synthetic_grad`
    (seeded by ``generate.seed``, ``step`` and the canonical FQN) that FSDP
    would give this rank's local tensor: the segments ``layout`` names, zero in
    the padding, no gradient at all for an empty shard. The same step on any
    layout is the same step of the unwrapped model.

    Args:
        spec: the run; ``generate.seed`` and the model come from it.
        model: the live (wrapped) model; ``layout`` describes its ``parameters()``.
        optim: its optimizer.
        step: the step number, part of the gradient's seed.
        layout: this rank's local tensors (:func:`~osdpipe.layout.kinds.rank_layout` of the layout ``model`` is
            wrapped with).
        tree: the module tree of the unwrapped model.
    """
    optim.zero_grad(set_to_none=True)
    # Every trainable parameter gets its gradient, as backward gives one; the optimizer steps those it holds.
    set_synthetic_grads(list(model.parameters()), layout, spec.generate.seed, step)
    optim.step()
