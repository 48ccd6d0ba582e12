"""Which parameter each param ID of a param-ID keyed optimizer state stands for.

``optim.state_dict()`` keys state by the position of each parameter in the
optimizer's param groups, concatenated: the order the optimizer *received*
its parameters, which need not be ``named_parameters()`` order. Nothing here
assumes that order. Either the user says how the optimizer was built (its
param groups as FQN patterns), and every resulting pair is checked by shape;
or IDs are matched to parameters by the shape of their state, and a match that
the checkpoint cannot decide is refused.

Pure functions over the module tree and the checkpoint's metadata: no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from osdpipe.layout.optim import pattern_members
from osdpipe.layout.ranges import full_layout
from osdpipe.layout.tree import ModuleTree

#: Param ID -> state name -> shape of each positive-dimension tensor (0-dim and non-tensor state left out).
StateShapes = dict[int, dict[str, tuple[int, ...]]]


def how_to_give_groups(tree: ModuleTree) -> str:
    """How to name the saving optimizer's param groups, with an example in this model's names."""
    tops = list(dict.fromkeys(p.fqn if "." not in p.fqn else p.fqn.split(".")[0] + ".*" for p in tree.params))
    example = f"[[{tops[-1]}],[{','.join(tops[:-1])}]]" if len(tops) > 1 else "[[*]]"
    return (
        "give the param groups of the optimizer that saved it, as FQN patterns (fnmatch) per group "
        "in the order it received its parameters: "
        "input.param_groups=[[<group 0 patterns>],[<group 1 patterns>],...], "
        f"e.g. input.param_groups={example}; "
        "an optimizer built over model.parameters() is input.param_groups=[[*]]"
    )


class IdMapError(ValueError):
    """Param IDs that cannot be mapped to parameters safely; the message says why and what to do."""


def _listing(problems: list[str], limit: int = 3) -> str:
    """The first ``limit`` problems, and how many more there are."""
    return "; ".join(problems[:limit]) + (f"; and {len(problems) - limit} more" if len(problems) > limit else "")


def _short(items: Sequence[object], limit: int = 8) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}]"


def expand_groups(tree: ModuleTree, id_groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """The canonical FQNs of each group's patterns: in pattern order, each parameter once.

    Raises:
        IdMapError: if a group matches no parameter, or a parameter falls into two groups.
    """
    layout = full_layout(tree)
    try:
        members = pattern_members([list(g) for g in id_groups], layout, where="input.param_groups")
    except ValueError as exc:
        raise IdMapError(str(exc)) from None
    return [[layout[i].key for i in group] for group in members]


def map_by_groups(
    tree: ModuleTree, saved_groups: list[list[int]], state_shapes: StateShapes, id_groups: Sequence[Sequence[str]]
) -> dict[int, str]:
    """Map IDs to FQNs by the optimizer's param groups, then check every pair by shape.

    The k-th ID of saved group g is the k-th parameter ``id_groups[g]`` names,
    which is how ``Optimizer.load_state_dict`` pairs them.

    Raises:
        IdMapError: if the groups differ from the checkpoint's in count or size,
            or a state tensor does not have the shape of the parameter its ID maps to.
    """
    expanded = expand_groups(tree, id_groups)
    if len(saved_groups) != len(expanded):
        raise IdMapError(
            f"the checkpoint has {len(saved_groups)} param group(s) (of {[len(g) for g in saved_groups]} parameters) "
            f"but input.param_groups gives {len(expanded)}; "
            "give one pattern list per param group of the optimizer that saved it"
        )
    mapping: dict[int, str] = {}
    for g, (ids, fqns) in enumerate(zip(saved_groups, expanded)):
        if len(ids) != len(fqns):
            raise IdMapError(
                f"param group {g} of the checkpoint holds {len(ids)} parameter(s) (IDs {_short(ids)}) "
                f"but input.param_groups[{g}]={list(id_groups[g])} matches {len(fqns)}: {_short(fqns)}; "
                "make the patterns match exactly the parameters of that group"
            )
        mapping.update(zip(ids, fqns))
    wrong = []
    for pid, shapes in sorted(state_shapes.items()):
        param = tree.param(mapping[pid])
        for name, shape in shapes.items():
            if shape != param.shape:
                wrong.append(
                    f"param ID {pid} maps to {param.fqn} of shape {param.shape} ({param.numel} elements), "
                    f"but its {name!r} has shape {shape} ({_numel(shape)} elements)"
                )
                break
    if wrong:
        raise IdMapError(
            "input.param_groups does not describe the optimizer that saved the checkpoint: "
            f"{_listing(wrong)}. "
            "List the groups, and the patterns in each, in the order that optimizer received its parameters "
            "(unset, IDs are matched to parameters by shape where that is unambiguous)"
        )
    return mapping


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def infer_by_shape(tree: ModuleTree, saved_groups: list[list[int]], state_shapes: StateShapes) -> dict[int, str]:
    """Map IDs to FQNs by the shape of their state, only where the checkpoint decides it.

    An ID whose tensor state has a shape exactly one parameter has is that
    parameter. Two or more parameters of one shape leave their IDs ambiguous:
    their state could be swapped, and nothing in the checkpoint says which
    way, so that is an error, never a guess by order. IDs without tensor state
    (SGD without momentum, no step taken) can be placed only when that cannot
    matter: they are all in one param group, exactly the remaining parameters
    are left for them, and no state at all moves with them, so that group
    holds the same parameters whichever way they pair.

    Raises:
        IdMapError: naming the ambiguous IDs and parameters, and how to resolve them.
    """
    shape_of: dict[int, tuple[int, ...]] = {}
    for pid, shapes in sorted(state_shapes.items()):
        distinct = sorted(set(shapes.values()))
        if len(distinct) > 1:
            raise IdMapError(
                f"param ID {pid} has state tensors of different shapes {shapes}; a parameter's state has its shape"
            )
        if distinct:
            shape_of[pid] = distinct[0]
    params_of: dict[tuple[int, ...], list[str]] = {}
    for p in tree.params:
        params_of.setdefault(p.shape, []).append(p.fqn)
    ids_of: dict[tuple[int, ...], list[int]] = {}
    for pid, shape in shape_of.items():
        ids_of.setdefault(shape, []).append(pid)

    mapping: dict[int, str] = {}
    ambiguous: list[str] = []
    for shape, pids in ids_of.items():
        candidates = params_of.get(shape, [])
        if len(pids) > len(candidates):
            raise IdMapError(
                f"param ID(s) {_short(pids)} have state of shape {shape}, but the model has "
                + (
                    f"only {len(candidates)} parameter(s) of that shape: {_short(candidates)}"
                    if candidates
                    else "no parameter of that shape"
                )
                + "; is model.factory / model.kwargs the model whose optimizer saved the checkpoint?"
            )
        if len(candidates) == 1:
            mapping[pids[0]] = candidates[0]
        else:
            ambiguous.append(
                f"param ID(s) {_short(pids)} have state of shape {shape}, as do parameters {_short(candidates)}"
            )

    group_of = {pid: g for g, ids in enumerate(saved_groups) for pid in ids}
    stateless = [pid for ids in saved_groups for pid in ids if pid not in shape_of]
    if stateless:
        taken = set(mapping.values())
        left = [p.fqn for p in tree.params if p.fqn not in taken]
        # Any pairing is the same when it is one group taking exactly the remaining parameters and nothing
        # (no scalar state either) moves with the IDs, or when there is only one way to pair.
        harmless = len({group_of[pid] for pid in stateless}) == 1 and (
            len(stateless) == 1 or not any(pid in state_shapes for pid in stateless)
        )
        if not ambiguous and len(left) == len(stateless) and harmless:
            mapping.update(zip(stateless, left))
        else:
            ambiguous.append(
                f"param ID(s) {_short(stateless)} have no tensor state (e.g. SGD without momentum, or no step taken), "
                f"so nothing tells which of {_short(left)} they are"
            )
    if ambiguous:
        raise IdMapError(
            f"cannot tell which parameter each param ID of the checkpoint is: {_listing(ambiguous)}. "
            "An optimizer numbers its parameters in the order it received them, "
            f"not necessarily named_parameters() order, so osdpipe does not guess; {how_to_give_groups(tree)} "
            f"(the checkpoint has {len(saved_groups)} group(s) of {[len(g) for g in saved_groups]} parameters)"
        )
    return mapping


def map_ids(
    tree: ModuleTree,
    saved_groups: list[list[int]],
    state_shapes: StateShapes,
    id_groups: Sequence[Sequence[str]] | None,
) -> dict[int, str]:
    """Param ID -> canonical FQN for every ID in the checkpoint's param groups.

    Args:
        tree: the model's module tree.
        saved_groups: the ``params`` list of each param group of the checkpoint.
        state_shapes: the shapes of each ID's positive-dimension state tensors.
        id_groups: the param groups of the optimizer that saved it, as FQN
            patterns per group in the order it received them; ``None``: match by shape.

    Raises:
        IdMapError: when an ID cannot be mapped safely.
    """
    counts = Counter(pid for ids in saved_groups for pid in ids)
    repeated = sorted(pid for pid, n in counts.items() if n > 1)
    if repeated:
        raise IdMapError(
            f"param ID(s) {_short(repeated)} appear in more than one place in the checkpoint's param groups; "
            "it is not an optimizer's state_dict()"
        )
    orphans = sorted(set(state_shapes) - set(counts))
    if orphans:
        raise IdMapError(
            f"the checkpoint has state for param ID(s) {_short(orphans)}, which none of its param groups holds; "
            "it is not an optimizer's state_dict()"
        )
    if id_groups is not None:
        return map_by_groups(tree, saved_groups, state_shapes, id_groups)
    return infer_by_shape(tree, saved_groups, state_shapes)
