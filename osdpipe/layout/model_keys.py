"""A model's state-dict keys as its own ``state_dict()`` gives them, and how each key's rows are its parameters' rows.

The optimizer is keyed by parameter; the model by whatever ``state_dict()``
gives, hooks included. A hook may split one parameter into several keys
(torchtitan's fused ``wqkv`` saves as ``wq``, ``wk`` and ``wv``, each a set of
interleaved row blocks of it), merge several into one, or rename. osdpipe
converts parameters, so it needs each key as rows of parameters: a
:class:`KeyMap`, learned from the model itself rather than from any
framework's name.

How it is learned (:func:`probe`): only where the state dict's names differ
from the parameters' (a model without such hooks costs nothing more). Each
module that holds state-dict hooks, with no hooked ancestor, is given probe
tensors in place of its parameters: every element holds ``parameter index *
2**32 + row``, as float64 (exact), each a broadcast view of one column, so a
probe costs one row's memory. The module's own ``state_dict()`` then runs its
hooks on the probes, and each key's values say, row by row, which parameter
row it holds. A hook that moves elements within a row, mixes rows, computes
with the values or changes the dtype gives values that are no probe; that is
refused with one line naming the key, as osdpipe cannot convert such a key by
moving rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from math import prod

import torch
from torch import nn

#: A probe value is ``parameter index * ROW_SPAN + row``: exact in float64 for 2**21 parameters of up to 2**32 rows.
ROW_SPAN = 2**32


class KeyMapError(ValueError):
    """A state-dict hook makes a key that is not rows of the model's parameters."""


@dataclass(frozen=True)
class Rows:
    """Rows ``[key_row, key_row + count)`` of a key hold rows
    ``[param_row, param_row + count)`` of parameter ``param`` (its canonical FQN)."""

    param: str
    param_row: int
    key_row: int
    count: int


@dataclass(frozen=True)
class KeyMap:
    """A key of ``model.state_dict()`` that is not a parameter's own name:
    its shape, dtype, and its rows as runs of parameters' rows.

    A 0-dim key has one row. Every run's parameter has the key's row shape
    (the trailing dimensions), so a row range of the key is one contiguous
    range of that parameter's flattened view, and back.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    runs: tuple[Rows, ...]

    @property
    def row_numel(self) -> int:
        return prod(self.shape[1:])

    def runs_of(self, param: str) -> Iterator[Rows]:
        return (r for r in self.runs if r.param == param)


def rows_of(shape: tuple[int, ...]) -> int:
    """How many rows a tensor of ``shape`` has: dim 0, or one for a 0-dim tensor."""
    return shape[0] if shape else 1


def key_ranges(key: KeyMap, param: str, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """Where elements ``[start, stop)`` of ``param``'s flattened view are in ``key``:
    ``(key start, key stop, param start)`` per run it crosses."""
    width = key.row_numel
    for run in key.runs_of(param):
        lo, hi = max(start, run.param_row * width), min(stop, (run.param_row + run.count) * width)
        if lo < hi:
            shift = (run.key_row - run.param_row) * width
            yield lo + shift, hi + shift, lo


def gather(key: KeyMap, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The key's value, made from whole parameters (``params``: canonical FQN -> full tensor)."""
    out = torch.empty(key.shape, dtype=getattr(torch, key.dtype))
    rows = out.reshape(rows_of(key.shape), -1)
    for run in key.runs:
        source = params[run.param].reshape(-1, key.row_numel)
        rows[run.key_row : run.key_row + run.count] = source[run.param_row : run.param_row + run.count]
    return out


def key_rows_within(key: KeyMap, param: str, first: int, last: int) -> Iterator[tuple[int, int, int]]:
    """The key's rows that are rows ``[first, last)`` of ``param``:
    ``(key row, rows, offset in [first, last))`` per run."""
    for run in key.runs_of(param):
        lo, hi = max(first, run.param_row), min(last, run.param_row + run.count)
        if lo < hi:
            yield run.key_row + lo - run.param_row, hi - lo, lo - first


def probe(model: nn.Module, names: list[str], params: list[nn.Parameter]) -> tuple[KeyMap, ...]:
    """Each key of ``model.state_dict()`` that its hooks make,
    as rows of ``params`` (canonical names ``names``, in that order).

    ``model`` may live on the ``meta`` device: only the hooked modules see
    probes, and only for the call.

    Raises:
        KeyMapError: a hook's key is not whole rows of parameters, or the hook fails on probes.
    """
    index = {id(p): i for i, p in enumerate(params)}
    own = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    maps: list[KeyMap] = []
    for prefix, module in _outermost_hooked(model):
        with _probes(module, index) as probes:
            try:
                state = module.state_dict(prefix=f"{prefix}." if prefix else "", keep_vars=True)
            except Exception as exc:  # noqa: BLE001 - said in one line below
                raise KeyMapError(
                    f"the state-dict hook of {prefix or 'the model'} ({type(module).__name__}) "
                    f"fails on probe values: {exc}"
                ) from None
            buffers = {id(b) for b in module.buffers()}
            for key, value in state.items():
                if (
                    not torch.is_tensor(value)
                    or id(value) in buffers
                    or (key in own and any(value is p for p in probes))
                ):
                    # a buffer (under any name: buffers are carried whole),
                    # or a parameter under its own name (a renamed one is mapped)
                    continue
                maps.append(_decode(key, value, names, params))
    return tuple(maps)


def _outermost_hooked(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that hold state-dict hooks
    (``register_state_dict_post_hook`` and the older ``_register_state_dict_hook``), none inside another."""
    hooked: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not (module._state_dict_hooks or module._state_dict_pre_hooks):
            continue
        if not any(name == outer or name.startswith(f"{outer}.") or outer == "" for outer, _ in hooked):
            hooked.append((name, module))
    return hooked


@contextmanager
def _probes(module: nn.Module, index: dict[int, int]) -> Iterator[list[torch.Tensor]]:
    """Every parameter under ``module`` replaced by its probe (a tied one by one probe) for the block, then put back."""
    saved: list[tuple[nn.Module, str, nn.Parameter]] = []
    made: dict[int, torch.Tensor] = {}
    try:
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is None:
                    continue
                if id(param) not in made:
                    made[id(param)] = _probe(index[id(param)], tuple(param.shape))
                saved.append((owner, name, param))
                owner._parameters[name] = made[id(param)]  # the dict itself: no nn.Parameter, no check of the device
        yield list(made.values())
    finally:
        for owner, name, param in saved:
            owner._parameters[name] = param


def _probe(i: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Parameter ``i``'s probe: each element its row's code, one column broadcast to the shape (one row's memory)."""
    codes = torch.arange(rows_of(shape), dtype=torch.float64).add_(i * ROW_SPAN)
    if not shape:
        return codes[0]
    return codes.reshape(shape[0], *(1 for _ in shape[1:])).expand(shape)


def _decode(key: str, value: torch.Tensor, names: list[str], params: list[nn.Parameter]) -> KeyMap:
    """``value``, a hook's key made of probes, as runs of parameters' rows."""

    def refuse(why: str) -> KeyMapError:
        return KeyMapError(
            f"the model's state-dict key {key} {why}; osdpipe converts a key only as whole rows of parameters"
        )

    if value.dtype != torch.float64:
        raise refuse(f"comes out as {value.dtype} from probes of float64")
    shape = tuple(value.shape)
    rows = value.reshape(rows_of(shape), -1)
    if rows.shape[1] and not bool((rows == rows[:, :1]).all()):
        raise refuse("mixes elements of different rows within one row")
    codes = rows[:, 0].tolist() if rows.shape[1] else []
    runs: list[Rows] = []
    dtype = None
    for key_row, code in enumerate(codes):
        i, row = divmod(code, ROW_SPAN)
        if code != int(code) or not 0 <= i < len(params) or row >= rows_of(tuple(params[int(i)].shape)):
            raise refuse("holds values that are no parameter's rows (the hook computes with them)")
        i, row = int(i), int(row)
        param = params[i]
        if tuple(param.shape[1:]) != shape[1:]:
            raise refuse(f"has rows of shape {list(shape[1:])}, but {names[i]}'s rows are {list(param.shape[1:])}")
        if dtype not in (None, param.dtype):
            raise refuse("holds rows of parameters of different dtypes")
        dtype = param.dtype
        last = runs[-1] if runs else None
        if last is not None and last.param == names[i] and last.param_row + last.count == row:
            runs[-1] = Rows(last.param, last.param_row, last.key_row, last.count + 1)
        else:
            runs.append(Rows(names[i], row, key_row, 1))
    return KeyMap(key, shape, str(dtype or torch.float32).removeprefix("torch."), tuple(runs))
