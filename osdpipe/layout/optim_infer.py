"""Which optimizer saved a state: read from its param groups and state names, not from a user's word.

Every optimizer of ``torch.optim`` passes its own set of hyperparameters to
``Optimizer.__init__`` (what ``optim.state_dict()["param_groups"]`` then
holds besides ``params``), and keeps its own per-parameter state names
(``exp_avg``, ``momentum_buffer``, ``sum``). Both are read off the classes
themselves, so nothing here is a hand-kept table a new PyTorch release can
leave behind:

* the hyperparameters and their defaults, by building the class and
  catching the defaults it hands to ``Optimizer.__init__`` (:func:`defaults_of`):
  no parameter group is made, so nothing compiles or imports more;
* the state names, by building it on a small parameter and taking a step
  under each option that may add state (:func:`state_names_of`): only where
  the param groups cannot decide, or to check a name the user gave.

Classes with the same hyperparameter names tell themselves apart by their
switches: ``AdamW`` is ``Adam`` with ``decoupled_weight_decay=True``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from osdpipe.layout.optim import torch_optimizers

#: Param-group keys that say nothing of the optimizer:
#: LR schedulers add ``initial_lr``, named parameters ``param_names``.
NOT_HYPERPARAMETERS = frozenset({"params", "param_names", "initial_lr"})
#: Boolean options that change how an optimizer computes, never which state it keeps.
_HOW_NOT_WHAT = frozenset({"foreach", "fused", "capturable", "differentiable", "maximize", "decoupled_weight_decay"})


class _Caught(Exception):
    """Raised in place of ``Optimizer.__init__`` once it has been handed the defaults."""


def _options(cls: type[torch.optim.Optimizer], options: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(cls).parameters
    takes_lr = "lr" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {"lr": 1e-3, **options} if takes_lr else options


def defaults_of(cls: type[torch.optim.Optimizer]) -> dict[str, Any] | None:
    """The defaults ``cls`` hands to ``Optimizer.__init__`` (its param groups' hyperparameters),
    or ``None`` when it cannot be built plainly.

    ``Optimizer.__init__`` is stood in for while ``cls`` is built, so no
    parameter group is made (making one imports ``torch._dynamo``: a second
    of start-up the launcher does not need).
    """
    caught: dict[str, Any] = {}
    original = torch.optim.Optimizer.__init__

    def catch(self: Any, params: Any, defaults: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        caught.update(defaults)
        raise _Caught

    torch.optim.Optimizer.__init__ = catch  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls([torch.zeros(2, 3)], **_options(cls, {}))
    except _Caught:
        pass
    except Exception:  # noqa: BLE001 - it needs arguments osdpipe cannot guess
        return None
    finally:
        torch.optim.Optimizer.__init__ = original  # type: ignore[method-assign]
    return caught or None


@dataclass(frozen=True)
class Fingerprint:
    """What one optimizer class's param groups hold: ``name``, its hyperparameter names, and their defaults."""

    name: str
    hyperparameters: frozenset[str]
    defaults: tuple[tuple[str, Any], ...]


def fingerprint(cls: type[torch.optim.Optimizer], name: str) -> Fingerprint | None:
    defaults = defaults_of(cls)
    if defaults is None:
        return None
    plain = tuple(sorted((k, v) for k, v in defaults.items() if isinstance(v, (bool, int, float, str, type(None)))))
    return Fingerprint(name, frozenset(defaults) - NOT_HYPERPARAMETERS, plain)


@functools.cache
def fingerprints() -> tuple[Fingerprint, ...]:
    """Every optimizer of ``torch.optim`` that osdpipe converts, fingerprinted once per process."""
    found = (fingerprint(getattr(torch.optim, name), name) for name in torch_optimizers())
    return tuple(f for f in found if f is not None)


def _variants(cls: type[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    """Constructor options to probe:
    the defaults, each boolean option that may add state turned on, momentum turned on."""
    params = inspect.signature(cls).parameters
    variants: list[dict[str, Any]] = [{}]
    for name, p in params.items():
        if isinstance(p.default, bool) and not p.default and name not in _HOW_NOT_WHAT:
            variants.append({name: True})
    if "momentum" in params:
        variants.append({"momentum": 0.9})
        if "nesterov" in params:
            variants.append({"momentum": 0.9, "nesterov": True})
    return variants


def kept_state(cls: type[torch.optim.Optimizer], options: dict[str, Any]) -> set[str] | None:
    """The state names ``cls`` built with ``options`` keeps after one step on a 2x3 parameter
    (``None``: it refuses them)."""
    param = torch.zeros(2, 3, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optim = cls([param], **_options(cls, options))
            param.grad = torch.full_like(param, 0.5)
            optim.step()
    except Exception:  # noqa: BLE001 - an option this class or this machine does not support
        return None
    return set(optim.state_dict()["state"].get(0, {}))


@functools.cache
def state_names_of(cls: type[torch.optim.Optimizer]) -> frozenset[str] | None:
    """Every state name ``cls`` keeps under some option
    (``max_exp_avg_sq`` with ``amsgrad``, ``momentum_buffer`` with ``momentum``)."""
    probed = [names for names in (kept_state(cls, options) for options in _variants(cls)) if names is not None]
    return frozenset().union(*probed) if probed else None


@dataclass(frozen=True)
class Inferred:
    """What a checkpoint's state says of its optimizer.

    Attributes:
        name: the one ``torch.optim`` class that fits, else ``None``.
        candidates: every class that fits (more than one: the state cannot tell them apart).
        why: in words, what was read (for messages and ``osdpipe inspect``).
    """

    name: str | None
    candidates: tuple[str, ...]
    why: str


def hyperparameter_names(param_groups: list[dict[str, Any]] | None) -> frozenset[str]:
    """The hyperparameter names the groups hold (each group's, together)."""
    return frozenset().union(*(set(g) for g in param_groups or [])) - NOT_HYPERPARAMETERS


def infer(param_groups: list[dict[str, Any]] | None, state_names: set[str]) -> Inferred:
    """The optimizer whose param groups hold exactly these hyperparameter names (and whose switches have these values).

    Without param groups, the state names decide among the classes that keep
    them all. Classes with the same hyperparameter names are told apart by
    their switches (``decoupled_weight_decay``: ``Adam`` or ``AdamW``).
    """
    keys = hyperparameter_names(param_groups)
    if not keys and not state_names:
        return Inferred(None, (), "the checkpoint holds no param groups and no state")
    if keys:
        fits = [f for f in fingerprints() if f.hyperparameters == keys]
        what = f"hyperparameters {sorted(keys)}"
    else:
        fits = [
            f for f in fingerprints() if set(state_names) <= (state_names_of(getattr(torch.optim, f.name)) or set())
        ]
        what = f"no param groups, state {sorted(state_names)}"
    if len(fits) > 1 and param_groups:
        told = [f for f in fits if all(param_groups[0].get(k, v) == v for k, v in _telling(fits, f))]
        fits = told or fits
    names = tuple(f.name for f in fits)
    if len(names) == 1:
        return Inferred(names[0], names, f"{names[0]}: {what}")
    if not names:
        return Inferred(None, (), f"no optimizer of torch.optim has {what}")
    return Inferred(None, names, f"{' or '.join(names)}: {what} fit each of them")


def _telling(fits: list[Fingerprint], one: Fingerprint) -> list[tuple[str, Any]]:
    """``one``'s boolean defaults that differ from another candidate's: the switches that tell it apart.

    Only switches: a class fixes how it computes (``AdamW``'s decoupled
    weight decay), while a number (its default ``weight_decay``) is the
    user's to change.
    """
    others = [dict(f.defaults) for f in fits if f is not one]
    return [(k, v) for k, v in one.defaults if isinstance(v, bool) and any(k in o and o[k] != v for o in others)]
