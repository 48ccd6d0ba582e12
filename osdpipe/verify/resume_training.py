"""The ``resume`` check: training resumes from the output exactly as it would have from the source.

A conversion can equal the source element for element and still resume
wrongly. PyTorch's FSDP1 FULL state holds one ``step`` tensor per FSDP unit,
shared by all of the unit's parameters; a per-parameter optimizer that loads
that sharing advances the one tensor once per parameter at every step, and
Adam's bias correction is wrong from then on. Only a job that loads the
output and steps sees that, so this check is one:

* **storage**: no two state tensors of the output share memory;
* **steps**: the target job loads the output as a user does for its format,
  starts from synthetic parameters and takes ``pipeline.resume_steps``
  optimizer steps on synthetic gradients (:mod:`osdpipe.layout.synthetic`: a function
  of the parameter's name and the element's global index, so every layout
  sees the same gradient for the same element). A reference takes the same
  steps from the source state, every tensor its own. Every 0-dim state (the
  step counters) must equal the reference's exactly, every state tensor and
  parameter element bitwise.

For an elementwise optimizer (:data:`ELEMENTWISE`: each element's update
depends on that element alone) the reference of any range is computed from
that range alone, so each rank checks its own ranges, at any size, as
``roundtrip`` does. Another optimizer is compared with a reference over the
whole model, which holds the whole state: only up to
``pipeline.full_state_checks_max``.

Where no live target job can be built (offline, or an FQN-keyed output whose
loading needs the whole state on every rank past
``pipeline.full_state_checks_max``), bare optimizers over the output's local
tensors play the target, a batch of at most ``runtime.memory_budget / 2`` at
a time (without a budget, as much as the largest tensor's state): they load the
state as written and take the same steps. The check's
detail says which target ran. Either target is compared with its reference
in those batches (:func:`in_batches`), so the reference holds one batch's
ranges stepped from the source at a time, never the rank's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from osdpipe.core.compare import bits_equal
from osdpipe.io.formats import SourceMeta, SourceReader, TensorRef, full_state, local_part, own_copy
from osdpipe.io.formats.base import WEIGHTS
from osdpipe.layout.optim import bare_optimizer, resolve_optimizer
from osdpipe.layout.ranges import LocalTensor, Segment
from osdpipe.layout.tree import ModuleTree
from osdpipe.run.live_jobs import local_grad, local_values, synthetic_grad, synthetic_param, train_step

#: The ``torch.optim`` optimizers whose update of an element reads only that
#: element (its gradient, parameter and state) and 0-dim state. A user's own
#: class says so with a class attribute ``osdpipe_elementwise = True``.
ELEMENTWISE = frozenset(
    {"Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "ASGD", "Rprop"}
)
#: The step numbers of the resume steps' gradients: apart from generate's (0, 1, ...) and load_step's.
FIRST_STEP = 20_000
#: Problems a failed check names at most, per rank.
SHOWN = 3

T = TypeVar("T")


def is_elementwise(cls: type[torch.optim.Optimizer]) -> bool:
    """Whether ``cls`` updates every element from that element alone (see :data:`ELEMENTWISE`)."""
    if getattr(cls, "osdpipe_elementwise", False):
        return True
    return cls.__module__.startswith("torch.optim") and cls.__name__ in ELEMENTWISE


# ---------------------------------------------------------------------------
# storage
# ---------------------------------------------------------------------------


def shared_memory(state: dict[Any, Any], names: dict[Any, str] | None = None) -> list[str]:
    """Pairs of state tensors (of an optimizer state dict's ``state``) whose memory overlaps,
    as ``"step of 0 (embed.weight) and of 3 (head.bias)"``.

    Overlap, not only one storage object: two views of one buffer that share
    bytes are the same hazard, as an in-place update of one changes the other.
    ``names`` names a state key's parameter where the key is a param ID.
    """
    names = names or {}
    spans = []
    for key, entry in state.items():
        if not isinstance(entry, dict):
            continue
        for name, value in entry.items():
            tensor = local_part(value)
            size = tensor.numel() * tensor.element_size() if torch.is_tensor(tensor) else 0
            if size:
                who = f"{key} ({names[key]})" if key in names else str(key)
                spans.append((tensor.device, tensor.data_ptr(), tensor.data_ptr() + size, f"{name} of {who}"))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    found = []
    for (dev_a, _, end_a, name_a), (dev_b, start_b, _, name_b) in zip(spans, spans[1:]):
        if dev_a == dev_b and start_b < end_a:
            found.append(f"{name_a} and {name_b}")
    return found


# ---------------------------------------------------------------------------
# the reference: the same steps from the source state
# ---------------------------------------------------------------------------


#: One range of one parameter: ``(fqn, start, stop)`` of its flattened view.
Range = tuple[str, int, int]


def loaded_optimizer(
    config: Any, groups: list[tuple[str, list[torch.Tensor], dict[str, Any] | None]], states: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """One optimizer over bare tensors holding ``states`` (one per tensor, in group order),
    as a loaded checkpoint leaves it.

    ``groups`` are ``(an fqn of the group, its tensors, the hyperparameters
    saved for it)``; ``None``: the configured ones (:func:`osdpipe.layout.optim.options_for`).
    """
    optim = bare_optimizer(config, [(fqn, tensors) for fqn, tensors, _ in groups])
    own = optim.state_dict()["param_groups"]  # the IDs the tensors got, and the configured hyperparameters
    saved = [
        {**_hyperparameters(mine if hyper is None else hyper), "params": mine["params"]}
        for (_, _, hyper), mine in zip(groups, own)
    ]
    optim.load_state_dict({"state": {i: state for i, state in enumerate(states) if state}, "param_groups": saved})
    return optim


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters: everything but the parameters it holds."""
    return {k: copy.deepcopy(v) for k, v in group.items() if k not in ("params", "param_names")}


def _grouped(items: list[Any], key: Callable[[Any], Any]) -> list[list[Any]]:
    """``items`` in groups of equal ``key``, in the order each key first appears."""
    groups: dict[Any, list[Any]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


class Reference:
    """What a job that loaded the source, every tensor its own,
    holds after the resume steps, for any ranges of any parameters.

    Elementwise optimizers step just the ranges asked for (:meth:`pieces`
    reads only those ranges of the source), all of them in one optimizer with
    the source's param groups; others step the whole model once, from the
    whole source state, and are sliced.

    Args:
        optim_config: ``optim.*``: how to build the optimizer class (its
            hyperparameters come from the source's param groups where it has them).
        meta: the source's canonical metadata (scalar state, param groups).
        reader: reads ranges of the source's tensor state.
        tree: the model's module tree.
        seed: ``generate.seed``, of the synthetic parameters and gradients.
        steps: how many steps.
        elementwise: whether ranges may be stepped alone.
        master: the state that holds the parameter the optimizer steps, where the source keeps a master copy of its
            own (Megatron's distributed optimizer: ``param``, fp32); ``None``: the model's weights, or synthetic ones.
    """

    def __init__(
        self,
        optim_config: Any,
        meta: SourceMeta,
        reader: SourceReader,
        tree: ModuleTree,
        seed: int,
        steps: int,
        elementwise: bool,
        master: str | None = None,
    ) -> None:
        self.config, self.meta, self.reader, self.tree = optim_config, meta, reader, tree
        self.seed, self.steps, self.elementwise, self.master = seed, steps, elementwise, master
        self._group_of = {f: i for i, g in enumerate(meta.param_groups or []) for f in g["params"]}
        self._whole: dict[str, tuple[torch.Tensor, dict[str, Any]]] | None = None

    def pieces(
        self, ranges: list[Range], device: torch.device | None = None
    ) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """Each range of its parameter, and of its state, after the steps (0-dim state whole), in the order asked;
        stepped on ``device``, the target's (``None``: the CPU): a CUDA job's optimizer rounds as CUDA's kernels do
        (its ``exp_avg_sq`` differs from the CPU's in the last bit), so the reference steps where the target did."""
        if not ranges:
            return []  # a batch of tensors with no element on this rank (an optimizer of no tensors cannot be built)
        device = device or torch.device("cpu")
        if not self.elementwise:
            whole = self._stepped_whole(device)
            return [
                (
                    whole[f][0].reshape(-1)[lo:hi],
                    {n: v.reshape(-1)[lo:hi] if _is_tensor_state(v) else v for n, v in whole[f][1].items()},
                )
                for f, lo, hi in ranges
            ]
        params = [self._start(f, lo, hi).to(device) for f, lo, hi in ranges]  # the state follows (load_state_dict)
        by_group = _grouped(list(range(len(ranges))), lambda i: self._group_of.get(ranges[i][0]))
        order = [i for g in by_group for i in g]  # an optimizer numbers its tensors group by group
        groups = [(ranges[g[0]][0], [params[i] for i in g], self._saved_group(ranges[g[0]][0])) for g in by_group]
        optim = loaded_optimizer(self.config, groups, [self._source_state(*ranges[i]) for i in order])
        self._step(optim, [(ranges[i], params[i]) for i in order])
        return [(p, optim.state[p]) for p in params]

    def _dtype(self, fqn: str) -> torch.dtype:
        """The dtype the optimizer steps ``fqn`` in: its master's, where it keeps one, else the parameter's."""
        held = self.meta.state.get(fqn, {}).get(self.master) if self.master is not None else None
        return held.torch_dtype if isinstance(held, TensorRef) else getattr(torch, self.tree.param(fqn).dtype)

    def _start(self, fqn: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of parameter ``fqn`` as the job starts: the source's master copy where its
        optimizer keeps one, the source's weights in a whole checkpoint, else synthetic."""
        held = self.meta.state.get(fqn, {})
        for name in (self.master, WEIGHTS):
            if name is not None and name in held:
                return self.reader.read_range(fqn, name, start, stop).clone()
        return synthetic_param(self.seed, fqn, start, stop, self._dtype(fqn))

    def _saved_group(self, fqn: str) -> dict[str, Any] | None:
        index = self._group_of.get(fqn)
        return None if index is None or self.meta.param_groups is None else self.meta.param_groups[index]

    def _source_state(self, fqn: str, start: int, stop: int) -> dict[str, Any]:
        """The source's state of ``fqn`` for elements ``[start, stop)``:
        its own copy of every tensor range and scalar."""
        return {
            name: self.reader.read_range(fqn, name, start, stop).clone()
            if isinstance(value, TensorRef)
            else own_copy(value)
            for name, value in self.meta.state.get(fqn, {}).items()
            if name not in (WEIGHTS, self.master)
        }

    def _step(self, optim: torch.optim.Optimizer, items: list[tuple[Range, torch.Tensor]]) -> None:
        """The resume steps on ``items`` (each range and its tensor):
        synthetic gradients for the trainable, then one optimizer step."""
        trainable = [((f, lo, hi), p) for (f, lo, hi), p in items if self.tree.param(f).requires_grad]
        for k in range(self.steps):
            for (fqn, lo, hi), param in trainable:
                grad = synthetic_grad(self.seed, FIRST_STEP + k, fqn, lo, hi, self._dtype(fqn))
                param.grad = grad.view(param.shape).to(param.device)
            optim.step()

    def _stepped_whole(self, device: torch.device) -> dict[str, tuple[torch.Tensor, dict[str, Any]]]:
        """Every parameter whole, stepped on ``device`` from the whole source state
        in one optimizer with the source's param groups (computed once)."""
        if self._whole is None:
            full = full_state(self.reader, self.meta)["state"]
            groups = (
                [g["params"] for g in self.meta.param_groups]
                if self.meta.param_groups
                else [[p.fqn for p in self.tree.params]]
            )
            fqns = [f for g in groups for f in g]
            params = {
                f: self._start(f, 0, self.tree.param(f).numel).view(self.tree.param(f).shape).to(device) for f in fqns
            }
            saved = self.meta.param_groups or [None]
            optim = loaded_optimizer(
                self.config,
                [(g[0], [params[f] for f in g], hyper) for g, hyper in zip(groups, saved)],
                [full.get(f, {}) for f in fqns],
            )
            self._step(optim, [((f, 0, self.tree.param(f).numel), params[f]) for f in fqns])
            self._whole = {f: (params[f], optim.state[params[f]]) for f in fqns}
        return self._whole


def _is_tensor_state(value: Any) -> bool:
    return torch.is_tensor(value) and value.dim() > 0


# ---------------------------------------------------------------------------
# the target: the output loaded, stepped
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Stepped:
    """One local tensor of the target after the steps:
    its parameter and the optimizer's state for it (local tensors)."""

    tensor: LocalTensor
    param: torch.Tensor
    state: dict[str, Any]


def set_synthetic_params(params: list[nn.Parameter], layout: tuple[LocalTensor, ...], seed: int) -> None:
    """Give each of a live model's ``params`` (described by ``layout``) its synthetic starting value:
    its segments, zero in the padding."""
    with torch.no_grad():
        for param, tensor in zip(params, layout):
            local = local_part(param)
            values = local_values(
                tensor, lambda fqn, start, stop: synthetic_param(seed, fqn, start, stop, local.dtype), local.dtype
            )
            local.copy_(values.to(local.device))


def live_steps(
    spec: Any,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    layout: tuple[LocalTensor, ...],
    tree: ModuleTree,
    *,
    weights_loaded: bool = False,
) -> list[Stepped]:
    """The live target, already loaded, through the resume steps; each parameter its optimizer holds.

    It starts from synthetic parameters, unless the output held the model's
    weights and they were loaded (``weights_loaded``: a whole checkpoint).
    """
    params = list(model.parameters())
    if not weights_loaded:
        set_synthetic_params(params, layout, spec.generate.seed)
    for k in range(spec.pipeline.resume_steps):
        train_step(spec, model, optim, FIRST_STEP + k, layout, tree)
    held = {id(p) for g in optim.param_groups for p in g["params"]}
    return [
        Stepped(tensor, local_part(param).detach(), {n: local_part(v) for n, v in optim.state.get(param, {}).items()})
        for param, tensor in zip(params, layout)
        if id(param) in held
    ]


#: What a bare target needs of one local tensor: its state and its param group as the output holds them.
Held = tuple[dict[str, Any], dict[str, Any]]


def by_group(
    tensor: LocalTensor, state: dict[str, Any], group_of: Callable[[str], Any]
) -> list[tuple[LocalTensor, dict[str, Any], Any]]:
    """A local tensor and its state, as the parts of it each param group holds (``group_of(fqn)``): the tensor itself
    where its parameters are in one group; else one flat part per group, made of the tensor's elements of that
    group's parameters (a distributed optimizer's bucket holds norms without weight decay beside matrices with it),
    each with a copy of the tensor's 0-dim state of its own, as each parameter of the job has its own."""
    groups = list({id(g): g for g in (group_of(s.fqn) for s in tensor.segments)}.values())
    if len(groups) <= 1:
        return [(tensor, state, groups[0] if groups else group_of(tensor.fqns[0]))]
    parts = []
    for i, group in enumerate(groups):
        mine = [s for s in tensor.segments if group_of(s.fqn) is group]
        at, segments = 0, []
        for seg in mine:
            segments.append(Segment(seg.fqn, seg.start, seg.length, at))
            at += seg.length
        part = LocalTensor(f"{tensor.key}[group {i}]", tuple(dict.fromkeys(s.fqn for s in mine)), (at,),
                           tuple(segments), flat=True, states=tensor.states)
        held = {
            name: torch.cat([value.reshape(-1)[s.dest : s.dest + s.length] for s in mine])
            if _is_tensor_state(value) else own_copy(value)
            for name, value in state.items()
        }
        parts.append((part, held, group))
    return parts


def bare_steps(
    spec: Any,
    layout: tuple[LocalTensor, ...],
    state_of: Callable[[LocalTensor], list[tuple[LocalTensor, dict[str, Any], dict[str, Any]]]],
    tree: ModuleTree,
    batch_bytes: int | None,
    weights: dict[str, torch.Tensor] | None = None,
    master: str | None = None,
) -> Iterator[list[Stepped]]:
    """The output's local tensors in bare optimizers,
    loaded with their state as written, through the resume steps; a batch at a time.

    ``state_of(tensor)`` gives what the output holds for the tensor, as the parts of it that lie in one param group
    each (:func:`by_group`): ``(part, its state, its param group)`` (none: the target optimizer does not hold it);
    each starts from its master copy where the optimizer keeps one (``master``: Megatron's ``param``), else from the
    output's ``weights`` for it (a whole checkpoint's, by layout key), else from synthetic parameters. A batch is at
    most ``batch_bytes`` of state (``None``: the largest tensor's, :func:`in_batches`), in one optimizer with a param
    group per group of the output, as the target's optimizer holds them. 0-dim state is copied once per object, so
    state the output shares between tensors stays shared here, and shows in the steps.
    """
    scalars: dict[int, Any] = {}
    held = [(part, (state, group)) for t in layout for part, state, group in state_of(t)]
    for batch in in_batches(held, [state_bytes(state) for _, (state, _) in held], batch_bytes):
        dtypes = [
            state[master].dtype if master in state else getattr(torch, tree.param(t.fqns[0]).dtype)
            for t, (state, _) in batch
        ]
        params = [
            state[master].clone().reshape(t.shape)
            if master in state
            else weights[t.key].clone().reshape(t.shape)
            if weights is not None and t.key in weights
            else local_values(
                t, lambda fqn, lo, hi, dtype=dtype: synthetic_param(spec.generate.seed, fqn, lo, hi, dtype), dtype
            )
            for (t, (state, _)), dtype in zip(batch, dtypes)
        ]
        states = [
            {
                n: (v.clone() if _is_tensor_state(v) else scalars.setdefault(id(v), own_copy(v)))
                for n, v in state.items()
                if n != master
            }
            for _, (state, _) in batch
        ]
        by_groups = _grouped(list(range(len(batch))), lambda i: id(batch[i][1][1]))
        order = [i for g in by_groups for i in g]
        groups = [(batch[g[0]][0].fqns[0], [params[i] for i in g], batch[g[0]][1][1] or None) for g in by_groups]
        optim = loaded_optimizer(spec.optim, groups, [states[i] for i in order])
        trainable = [
            i for i, (t, _) in enumerate(batch) if t.stepped and all(tree.param(f).requires_grad for f in t.fqns)
        ]
        for k in range(spec.pipeline.resume_steps):
            for i in trainable:
                params[i].grad = local_grad(batch[i][0], spec.generate.seed, FIRST_STEP + k, dtypes[i])
            optim.step()
        yield [Stepped(t, p, dict(optim.state.get(p, {}))) for (t, _), p in zip(batch, params)]


def in_batches(items: list[T], sizes: list[int], limit: int | None) -> Iterator[list[T]]:
    """``items`` (whose tensor state is ``sizes`` bytes each) in batches of at most ``limit`` bytes of it, in order
    (an item larger than that is a batch alone).

    ``None`` (no ``runtime.memory_budget``): at most the largest item's, as a piece is a whole local tensor without
    a budget. A bare batch's state is cloned and stepped beside the output, and each batch's reference holds the
    same ranges stepped from the source, so the rank's whole state at once would hold a second copy of it (a 1.6 GB
    FSDP2 checkpoint 4 -> 2 offline peaked at 4.7 GB, and at 1.6 GB this way: docs/speed.md); small tensors still
    share a batch, and an optimizer step."""
    if limit is None:
        limit = max(sizes, default=0)
    batch: list[T] = []
    size = 0
    for item, nbytes in zip(items, sizes, strict=True):
        if batch and size + nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes
    if batch:
        yield batch


def state_bytes(state: dict[str, Any]) -> int:
    """The bytes of an optimizer state's tensors (0-dim state, the step counters, left out)."""
    return sum(v.numel() * v.element_size() for v in state.values() if _is_tensor_state(v))


# ---------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------


def pieces_of(tensor: LocalTensor) -> tuple[Segment, ...]:
    """The ranges to compare: the segments, or,
    for a stepped tensor that holds no element (an empty FSDP2 chunk), its 0-dim state alone."""
    if tensor.segments or not tensor.stepped:
        return tensor.segments
    return (Segment(tensor.fqns[0], 0, 0, 0),)


def compare_batch(batch: list[Stepped], reference: Reference, meta: SourceMeta, steps: int) -> list[str]:
    """Where a batch of stepped local tensors differs from the reference (stepped for all their ranges at once)."""
    segments = [(s, seg) for s in batch for seg in pieces_of(s.tensor)]
    device = batch[0].param.device if batch else None  # where the target stepped: the reference steps there too
    refs = reference.pieces([(seg.fqn, seg.start, seg.start + seg.length) for _, seg in segments], device)
    problems: list[str] = []
    for (stepped, seg), (ref_param, ref_state) in zip(segments, refs):
        problems += compare(stepped, seg, ref_param, ref_state, meta, steps)
    return problems


def compare(
    stepped: Stepped, seg: Segment, ref_param: torch.Tensor, ref_state: dict[str, Any], meta: SourceMeta, steps: int
) -> list[str]:
    """Where one range of a stepped local tensor differs from the reference's:
    0-dim state exactly, tensors and the parameter bitwise."""
    problems: list[str] = []
    scalars: list[str] = []
    found: list[str] = []
    for name in sorted(set(stepped.state) | set(ref_state), key=str):
        if name not in stepped.state or name not in ref_state:
            has, lacks = ("the target", "the reference") if name not in ref_state else ("the reference", "the target")
            problems.append(f"{seg.fqn}: {has} has state {name!r} after {steps} step(s), {lacks} has none")
            continue
        got, want = stepped.state[name], ref_state[name]
        if _is_tensor_state(got):
            found += _differ(
                f"{seg.fqn} {name}", got.reshape(-1)[seg.dest : seg.dest + seg.length], want, seg.start, steps
            )
        elif not _same_scalar(got, want):
            source = meta.state.get(seg.fqn, {}).get(name)
            was = "" if source is None else f" from the source's {_show(source)}"
            scalars.append(
                f"{seg.fqn}: {name} is {_show(got)} after {steps} step(s){was}; "
                f"a job resuming from the source has {_show(want)}"
            )
    found += _differ(
        f"{seg.fqn} (the parameter)",
        stepped.param.reshape(-1)[seg.dest : seg.dest + seg.length],
        ref_param,
        seg.start,
        steps,
    )
    # A 0-dim state that is off (a step counter) is the cause; the tensors it then steps differently are its echo.
    return problems + (scalars or found[:1])


def _same_scalar(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return bits_equal(a.reshape(-1).cpu(), b.reshape(-1).cpu())
    return type(a) is type(b) and a == b


def _show(value: Any) -> str:
    return repr(value.item()) if torch.is_tensor(value) and value.numel() == 1 else repr(value)


def _differ(what: str, got: torch.Tensor, want: torch.Tensor, start: int, steps: int) -> list[str]:
    got, want = got.detach().cpu(), want.detach().cpu()
    if bits_equal(got, want):
        return []
    if got.shape != want.shape or got.dtype != want.dtype:
        return [f"{what}: {tuple(got.shape)} {got.dtype} where the reference has {tuple(want.shape)} {want.dtype}"]
    bad = (
        got.view(torch.uint8).reshape(got.numel(), -1) != want.view(torch.uint8).reshape(want.numel(), -1)
    ).any(dim=1)
    i = int(bad.nonzero()[0])
    return [
        f"{what}: {int(bad.sum())} of {got.numel()} element(s) differ from a job resuming from the source "
        f"after {steps} step(s), first at flat index {start + i}: {got[i].item()!r} vs {want[i].item()!r}"
    ]


def reference_for(
    spec: Any, meta: SourceMeta, reader: SourceReader, tree: ModuleTree, master: str | None = None
) -> Reference:
    """The reference of this conversion: range by range for an elementwise optimizer, else over the whole model
    (``master``: the state that holds the parameter the optimizer steps, where it keeps a copy of its own)."""
    elementwise = is_elementwise(resolve_optimizer(spec.optim.name))
    return Reference(spec.optim, meta, reader, tree, spec.generate.seed, spec.pipeline.resume_steps, elementwise,
                     master)
