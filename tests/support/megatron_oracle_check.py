"""A test oracle's proof of a Megatron-LM save: read back whole (:mod:`megatron_oracle`), it holds a source bit for bit.

The tests hold the product's Megatron output (written rank by rank through the stage loop) against its source with
this check, independent of the product's own ``roundtrip`` check: a save read back by :func:`megatron_oracle.read_save`,
which places every bucket and tensor back by the target's layout, so a wrong bucket offset, a piece on the wrong TP
rank, a lost step or a changed hyperparameter shows as a difference. :func:`read_back_problems` holds each tensor
against the source's as it is read (:class:`Compared`); :func:`roundtrip_problems` two saves read whole;
:func:`hf_source_problems` a save against the Hugging Face source it was made of. The vocabulary's rows compare up to
the shorter of the two paddings; rows the target adds must be zero.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from megatron_oracle import Box, MegatronSave, read_save
from megatron_oracle_deferred import box_of

from osdpipe.core.compare import bits_equal, differing_bits
from osdpipe.layout.megatron import VOCAB_KEYS

#: Param-group entries that are not hyperparameters the output must keep: the members, which the groups do not list.
_NOT_KEPT = ("params",)


def tensor_problem(name: str, source: torch.Tensor, written: torch.Tensor, vocab: bool) -> str | None:
    """How ``written`` fails to hold ``source`` bitwise (``None``: it holds it); ``vocab``: compare the shared rows, and
    want the rows only ``written`` has to be zero."""
    if written.dtype != source.dtype:
        return f"{name}: {written.dtype}, the source's {source.dtype}"
    if vocab:
        rows = min(source.shape[0], written.shape[0])
        if written.shape[1:] != source.shape[1:]:
            return f"{name}: shape {tuple(written.shape)}, the source's {tuple(source.shape)}"
        if not bits_equal(written[:rows], source[:rows]):
            return f"{name}: rows [0, {rows}) differ from the source's"
        if written.shape[0] > rows and bool(written[rows:].any()):
            return f"{name}: the padding rows [{rows}, {written.shape[0]}) it adds are not zero"
        return None
    if written.shape != source.shape or not bits_equal(written, source):
        return f"{name}: differs from the source's"
    return None


class Compared:
    """A :class:`megatron_oracle.Placement` that holds each tensor of a written save, as it is read back,
    against the source's, and keeps only what differs (:attr:`problems`, then :meth:`missing`)."""

    def __init__(self, source: MegatronSave) -> None:
        self.source = source
        self.problems: list[str] = []
        self._seen: set[tuple[str, str | None]] = set()
        self._misshapen: set[str] = set()  # keys whose written shape is not the source's: said once, not compared

    def _source(self, key: str, state: str | None) -> torch.Tensor | None:
        if key in self._misshapen:
            return None
        return self.source.model.get(key) if state is None else self.source.optim.get(key, {}).get(state)

    def expect(self, shapes: dict[str, tuple[int, ...]]) -> None:
        for key, shape in shapes.items():
            want = self.source.model.get(key)
            rows = 1 if key in VOCAB_KEYS else 0  # a vocabulary's rows are padded for each grid's TP
            if want is None:
                self.problems.append(f"model {key}: not in the source")
            elif tuple(shape)[rows:] != tuple(want.shape)[rows:]:
                self.problems.append(f"{key}: shape {tuple(shape)}, the source's {tuple(want.shape)}")
                self._misshapen.add(key)

    def whole(self, key: str, state: str | None, tensor: torch.Tensor) -> None:
        self._seen.add((key, state))
        name = f"model {key}" if state is None else f"{state} {key}"
        if (want := self._source(key, state)) is not None:
            why = tensor_problem(name, want, tensor, key in VOCAB_KEYS)
            self.problems += [why] if why else []

    def block(self, key: str, state: str, box: Box, block: torch.Tensor) -> None:
        self._seen.add((key, state))
        if (want := self._source(key, state)) is not None and differing_bits(block, _box_of(want, box)):
            past = f" (rows past the source's {want.shape[0]} must be zero)" if key in VOCAB_KEYS else ""
            self.problems.append(f"{state} {key}: differs from the source's at {_shown(box)}{past}")

    def tied_copy(self, key: str, state: str, box: Box, block: torch.Tensor) -> int:
        want = self._source(key, state)
        return block.numel() if want is None else differing_bits(block, _box_of(want, box))

    def missing(self) -> list[str]:
        """The source's tensors the written save held nowhere."""
        held = [(key, None) for key in self.source.model]
        held += [(key, state) for key, states in self.source.optim.items() for state in states]
        return [f"{'model' if state is None else state} {key}: missing" for key, state in held
                if (key, state) not in self._seen]


def _box_of(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    return box_of(tensor, tuple((s.start, s.stop) for s in box))


def _shown(box: Box) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in box) + "]"


def read_back_problems(source: MegatronSave, folder: Path) -> list[str]:
    """Every way the save written into ``folder`` does not hold ``source``'s state (:func:`roundtrip_problems`' list),
    found as it is read: each tensor held against the source's and let go."""
    compared = Compared(source)
    back = read_save(folder, placed=compared)
    return _kind_problem(source, back) or [*compared.problems, *compared.missing(), *_fact_problems(source, back)]


def roundtrip_problems(source: MegatronSave, written: MegatronSave) -> list[str]:
    """Every way the save ``written`` (read back whole) does not hold ``source``'s state: the model's weights, each
    parameter's fp32 master and moments, the param groups' hyperparameters and step, the iteration, the scheduler, and
    a tied embedding's copy equal to the embedding."""
    if why := _kind_problem(source, written):
        return why
    compared = Compared(source)
    compared.expect({key: tuple(t.shape) for key, t in written.model.items()})
    for key, weight in written.model.items():
        compared.whole(key, None, weight)
    for key, states in written.optim.items():
        for state, tensor in states.items():
            compared.whole(key, state, tensor)
    return [*compared.problems, *compared.missing(), *_fact_problems(source, written)]


def _kind_problem(source: MegatronSave, written: MegatronSave) -> list[str]:
    if source.weights_only != written.weights_only:
        held = "the weights alone" if written.weights_only else "an optimizer's state"
        return [f"the written save holds {held}, the source does not"]
    return []


def _fact_problems(source: MegatronSave, written: MegatronSave) -> list[str]:
    """What the read-back ``written`` holds beside the tensors, held against ``source``: the param groups, the
    iteration, the scheduler, and what reading it found to note (a tied copy unequal to the embedding)."""
    problems = [f"the written save: {note}" for note in written.notes]
    if _groups(source.param_groups) != _groups(written.param_groups):
        problems.append(f"param groups: {_groups(written.param_groups)}, the source's {_groups(source.param_groups)}")
    if written.iteration != source.iteration:
        problems.append(f"iteration {written.iteration}, the source's {source.iteration}")
    if written.scheduler != source.scheduler:
        problems.append("the scheduler's state differs from the source's")
    return problems


def _groups(groups: list[dict[str, Any]]) -> list[tuple]:
    return sorted(
        (tuple(g["params"]), tuple(sorted((k, repr(v)) for k, v in g.items() if k not in _NOT_KEPT))) for g in groups
    )


def hf_source_problems(
    gpt: Any, vocab: int, source: Callable[[str], dict[str, torch.Tensor] | None], step: float,
    groups: list[dict[str, Any]], written: MegatronSave,
) -> list[str]:
    """Every way the Megatron save ``written`` (read back), mapped to its Hugging Face model again
    (:func:`osdpipe.layout.megatron_hf.to_hf`, the vocabulary cut to ``vocab``), fails to hold the Hugging Face
    source's state bitwise: ``source(state)`` (the source's tensors of one state by name; ``None``: it has none) for
    ``weights`` (the model and the fp32 masters alike), ``exp_avg`` and ``exp_avg_sq`` (a Hugging Face folder holds
    the weights alone); every param group's ``step``; each source group's hyperparameters, in the written group holding
    the same parameters.

    One state at a time: the source's tensors of a state are asked for, held against the written save's, and let go
    before the next, so that a caller that reads them from disk holds a third of them at most."""
    from osdpipe.layout import megatron_hf

    problems = []
    # each source state, and the written save's tensors that must hold it: the model's weights and the masters both
    # hold the source's weights
    held_by = {"weights": {"model weights": written.model}}
    if not written.weights_only:
        held_by["weights"]["param"] = {k: s["param"] for k, s in written.optim.items()}
        held_by.update({state: {state: {k: s[state] for k, s in written.optim.items()}}
                        for state in ("exp_avg", "exp_avg_sq")})
    for source_state, holders in held_by.items():
        wanted = source(source_state)
        if not wanted:
            continue
        for label, tensors in holders.items():
            back = megatron_hf.to_hf(gpt, tensors, vocab)
            for name, want in wanted.items():
                mapped = back[name]
                if mapped.dtype != want.dtype or mapped.shape != want.shape or not bits_equal(mapped, want):
                    problems.append(f"{label} {name}: differs from the Hugging Face source's")
            del back  # before the next state's are made
        del wanted  # before the next state's are read
    for group in written.param_groups:
        if group.get("step") != step:
            problems.append(f"param group step {group.get('step')!r}, the source's {step!r}")
    written_by_params = {tuple(sorted(g["params"])): g for g in written.param_groups}
    for group in groups:
        got = written_by_params.get(tuple(sorted(group["params"])))
        if got is None:
            problems.append(f"no written param group holds {len(group['params'])} parameters as the source's does")
            continue
        for key, value in group.items():
            if key != "params" and repr(got.get(key)) != repr(value):
                problems.append(f"param group {key}: {got.get(key)!r}, the source's {value!r}")
    return problems
