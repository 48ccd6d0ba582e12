"""What a loaded optimizer state shows of itself:
the part of every format's :meth:`~osdpipe.io.formats.base.Format.read_facts` they share.

The optimizer and its hyperparameters per param group, the step range, the
state names, dtypes and bytes (:mod:`osdpipe.io.file_facts` gathers them into a
``Facts``). Files are memory-mapped, so a tensor's bytes are never read,
with one exception: :func:`moments_alike` compares a few elements first, and
reads the rest only when every parameter's first elements agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from osdpipe.core.compare import bits_equal
from osdpipe.io import fetched_memory
from osdpipe.io.formats.base import local_part
from osdpipe.layout.optim_infer import NOT_HYPERPARAMETERS, Inferred, infer

if TYPE_CHECKING:  # annotations only: osdpipe.io.file_facts imports the formats
    from osdpipe.io.file_facts import Facts

#: Elements of each moment compared before any whole tensor is (see :func:`moments_alike`).
_FIRST = 16
#: What to say of a checkpoint whose first moments were overwritten by its second (:func:`moments_alike`).
MOMENTS_ALIKE = (
    "exp_avg equals exp_avg_sq for every parameter: no optimizer keeps them so, "
    "and PyTorch 2.13's FSDP1 use_orig_params FULL_STATE_DICT path on CPU saves them so "
    "(offload_to_cpu=True reuses one buffer); this checkpoint has lost its first moments"
)


@dataclass
class Unit:
    """An FSDP1 unit the files show: the parameters it flattens (when named), and its flat size without padding."""

    fqns: list[str]
    numel: int


def describe_state(facts: Facts, state: dict[Any, dict[str, Any]], param_groups: list[dict[str, Any]] | None) -> None:
    """Optimizer, hyperparameters, step range and state names, from a loaded state."""
    names: set[str] = set()
    steps: list[float] = []
    for entry in state.values():
        if not isinstance(entry, dict):
            continue
        names.update(map(str, entry))
        step = entry.get("step")
        step = local_part(step)
        if (torch.is_tensor(step) and step.numel() == 1) or isinstance(step, (int, float)):
            steps.append(float(step))
    facts.state_names = sorted(names)
    if steps:
        facts.steps = [min(steps), max(steps)]
    _describe_optimizer(facts, param_groups, names)


def tally(facts: Facts, state: dict[Any, Any]) -> None:
    """Add the dtypes and bytes of a loaded state's tensors (memory-mapped: their sizes, not their bytes, are read)."""
    for entry in state.values():
        for value in entry.values() if isinstance(entry, dict) else []:
            local = local_part(value)
            if torch.is_tensor(local) and local.dim() > 0:
                dtype = str(local.dtype).removeprefix("torch.")
                facts.dtypes[dtype] = facts.dtypes.get(dtype, 0) + local.numel() * local.element_size()
    facts.state_bytes = sum(facts.dtypes.values())


def _describe_optimizer(facts: Facts, param_groups: list[dict[str, Any]] | None, names: set[str]) -> None:
    guess: Inferred = infer(param_groups, names)
    facts.optimizer, facts.optimizer_candidates, facts.optimizer_why = guess.name, list(guess.candidates), guess.why
    facts.param_groups = [
        {**{k: _plain(v) for k, v in g.items() if k not in NOT_HYPERPARAMETERS}, "params": len(g.get("params", []))}
        for g in param_groups or []
    ]
    named = [list(g.get("params", [])) for g in param_groups or []]
    if named and all(isinstance(p, str) for g in named for p in g):
        facts.group_fqns = named


def _plain(value: Any) -> Any:
    """A hyperparameter as JSON holds it (a tensor lr as its number)."""
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value if isinstance(value, (bool, int, float, str, list, type(None))) else repr(value)


def moments_alike(state: dict[Any, dict[str, Any]]) -> bool:
    """Whether ``exp_avg`` equals ``exp_avg_sq`` bitwise for every parameter that has both (and one has an element).

    No optimizer keeps them equal: a file where they are was saved through a
    path that overwrote one with the other (PyTorch 2.13's FSDP1
    ``use_orig_params`` FULL state on CPU), and has lost the first moments.
    """
    pairs = []
    for entry in state.values():
        a, b = (entry.get("exp_avg"), entry.get("exp_avg_sq")) if isinstance(entry, dict) else (None, None)
        a, b = local_part(a), local_part(b)
        if torch.is_tensor(a) and torch.is_tensor(b) and a.dim() > 0 and a.numel():
            pairs.append((a, b))
    if not pairs:
        return False
    # a few elements each first: a healthy file differs there, and its tensors are never read (nor fetched) whole
    fetched_memory.fetch_many([(t, 0, min(_FIRST, t.numel())) for pair in pairs for t in pair])
    for a, b in pairs:
        if not bits_equal(a.reshape(-1)[:_FIRST], b.reshape(-1)[:_FIRST]):
            return False
    fetched_memory.fetch_all(pairs)
    return all(bits_equal(a, b) for a, b in pairs)


def describe_meta(facts: Facts, meta: Any) -> None:
    """The optimizer, hyperparameters, steps, state names, dtypes and bytes of a reader's metadata (a
    :class:`~osdpipe.io.formats.base.SourceMeta`: tensors described, never read), and its parameters' names: what a
    format that reads its source whole (DeepSpeed's, Megatron's) shows of it."""
    from osdpipe.io.formats.base import TensorRef

    described = {
        fqn: {n: torch.empty(v.shape, dtype=v.torch_dtype, device="meta") if isinstance(v, TensorRef) else v
              for n, v in entry.items()}
        for fqn, entry in meta.state.items()
    }
    describe_state(facts, described, meta.param_groups)
    tally(facts, described)
    facts.params = len(described)
    facts.fqns = sorted(described)
