"""Proof of a Megatron-LM save osdpipe wrote: read back, it holds the source's state, bit for bit.

The output is read by the same reader as the source (:func:`osdpipe.io.formats.megatron.read_save`), which places
every bucket and tensor back into global tensors by the target's layout, so a wrong bucket offset, a piece on the wrong
TP rank, a lost step or a changed hyperparameter shows as a difference. The vocabulary's rows compare up to the shorter
of the two paddings; rows the target adds must be zero.
"""

from __future__ import annotations

from typing import Any

import torch

from osdpipe.core.compare import bits_equal
from osdpipe.io.formats.megatron import MegatronSave
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


def roundtrip_problems(source: MegatronSave, written: MegatronSave) -> list[str]:
    """Every way the save ``written`` (read back) does not hold ``source``'s state: the model's weights, each
    parameter's fp32 master and moments, the param groups' hyperparameters and step, the iteration, the scheduler."""
    if source.weights_only != written.weights_only:
        held = "the weights alone" if written.weights_only else "an optimizer's state"
        return [f"the written save holds {held}, the source does not"]
    problems = []
    for key, weight in source.model.items():
        if key not in written.model:
            problems.append(f"model {key}: missing")
            continue
        why = tensor_problem(f"model {key}", weight, written.model[key], key in VOCAB_KEYS)
        problems += [why] if why else []
        for state, tensor in source.optim.get(key, {}).items():
            why = tensor_problem(f"{state} {key}", tensor, written.optim[key][state], key in VOCAB_KEYS)
            problems += [why] if why else []
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
    gpt: Any, vocab: int, source: dict[str, dict[str, torch.Tensor]], step: float, groups: list[dict[str, Any]],
    written: MegatronSave,
) -> list[str]:
    """Every way the Megatron save ``written`` (read back), mapped to its Hugging Face model again
    (:func:`osdpipe.layout.megatron_hf.to_hf`, the vocabulary cut to ``vocab``), fails to hold the Hugging Face
    source's state bitwise: ``source[state][name]`` for ``weights`` (the model and the fp32 masters alike),
    ``exp_avg`` and ``exp_avg_sq`` (those ``source`` holds: a Hugging Face folder holds the weights alone); every
    param group's ``step``; each source group's hyperparameters, in the written group holding the same parameters."""
    from osdpipe.layout import megatron_hf

    problems = []
    back = {"model weights": megatron_hf.to_hf(gpt, written.model, vocab)}
    if not written.weights_only:
        back.update({state: megatron_hf.to_hf(gpt, {k: s[state] for k, s in written.optim.items()}, vocab)
                     for state in ("param", "exp_avg", "exp_avg_sq")})
    against = {"model weights": "weights", "param": "weights", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    for state, tensors in back.items():
        for name, want in source.get(against[state], {}).items():
            if tensors[name].dtype != want.dtype or tensors[name].shape != want.shape or \
                    not bits_equal(tensors[name], want):
                problems.append(f"{state} {name}: differs from the Hugging Face source's")
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
