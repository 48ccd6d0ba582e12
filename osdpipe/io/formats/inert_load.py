"""Read a ``torch.save`` file that pickles a framework's own objects,
without importing the framework or running its code.

DeepSpeed's optimizer files pickle its own classes beside the tensors
(``LossScaler``, ``ZeroStageEnum``, ``fragment_address``), so
``torch.load(weights_only=True)`` refuses them, and a plain ``torch.load``
imports DeepSpeed and calls whatever the pickle names: any function of any
installed module, with arguments of the file's choosing.

:func:`load_inert` reads such a file through torch's own loader (its zip
records, storages and memory map) with an unpickler of ours that resolves
three kinds of names and refuses every other one:

* torch's tensor rebuilders, ``torch.Size``, dtypes and a few builtin
  containers: tensors and plain data come out as such;
* any name under one of the packages the caller trusts to *describe* (for
  DeepSpeed, ``deepspeed``): it comes out as a :class:`Record`, an inert
  object that keeps the class's name, the arguments it was built with and
  its state, and never imports the module; so does a tensor subclass of
  such a package that wraps others (FSDP1's ``ShardedTensor``, which a plain
  ``torch.load`` refuses outside a process group), its shards in its state;
* nothing else: a pickle that names ``os.system``, ``builtins.eval`` or a
  module of no known framework is refused in one line, and nothing of it runs.
"""

from __future__ import annotations

import collections
import io
import pickle
import types
from pathlib import Path
from typing import Any

import torch

from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.safe_load import RECOPY, RefusedGlobal, checked_torch_file, load_remote, torch_load_error
from osdpipe.io.store import is_remote


class Record:
    """An object of a class that was not imported: ``module.name``, built from ``args``, with ``state``, inert.

    Each pickled class becomes one subclass of it (:func:`record_class`), so
    that pickle's ways of building an object (calling the class, its
    ``__new__``, then setting its state) all land here.
    """

    module: str = ""
    name: str = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # everything is kept by __new__, whichever way pickle builds the object

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"Record({self.module}.{self.name}, args={self.args!r}, state={self.state!r})"

    @property
    def value(self) -> Any:
        """What a one-value object stands for (an enum member's value), else its state."""
        return self.args[0] if len(self.args) == 1 and self.state is None else self.state


_RECORD_CLASSES: dict[tuple[str, str], type[Record]] = {}


def record_class(module: str, name: str) -> type[Record]:
    """The :class:`Record` subclass that stands for ``module.name``
    (one per name, so that records of one class share it)."""
    key = (module, name)
    if key not in _RECORD_CLASSES:
        _RECORD_CLASSES[key] = types.new_class(
            name, (Record,), {}, lambda ns: ns.update(module=module, name=name, __qualname__=name)
        )
    return _RECORD_CLASSES[key]


def _reconstruct(cls: Any, base: Any, state: Any) -> Any:
    """``copyreg._reconstructor``, for records alone (how protocol 0-1 pickles build an object of a plain class)."""
    if not (isinstance(cls, type) and issubclass(cls, Record)):
        raise RefusedGlobal(getattr(cls, "__module__", "?"), getattr(cls, "__name__", "?"))
    return cls.__new__(cls)


def _wrapper_subclass(*args: Any) -> Any:
    """``torch._utils._rebuild_wrapper_subclass`` (a tensor subclass that wraps others: ``ShardedTensor``), never run:
    :func:`_from_type` makes a record of the subclass instead, if its package is described."""
    raise RefusedGlobal("torch._utils", "_rebuild_wrapper_subclass")


def _layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout``: a tensor layout by its name (``torch.strided``), a torch layout alone."""
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise RefusedGlobal("torch.serialization", "_get_layout")
    return value


def _nested(owner: Any, name: str) -> Any:
    """``getattr`` of a described class, as pickle names a nested class (``ShardedTensor.ProcessGroupState``): the
    record class of that name; of anything else, refused."""
    if not (isinstance(owner, type) and issubclass(owner, Record)) or not name.isidentifier():
        raise RefusedGlobal("builtins", "getattr")
    return record_class(owner.module, f"{owner.name}.{name}")


def _from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """``torch._tensor._rebuild_from_type_v2`` for plain tensors and parameters: a tensor pickled with attributes of its
    own (DeepSpeed's ``ds_id`` on a ZeRO-3 partition) comes back with them as plain values. A wrapper subclass of a
    described package (``ShardedTensor``) comes back as its record, its pickled state kept (its local shards)."""
    if func is _wrapper_subclass and isinstance(new_type, type) and issubclass(new_type, Record):
        record = new_type.__new__(new_type, *args[1:])
        record.state = state
        return record
    if func not in _TENSOR_BUILDERS or new_type not in (torch.Tensor, torch.nn.Parameter):
        raise RefusedGlobal("torch._tensor", "_rebuild_from_type_v2")
    tensor = func(*args)
    if isinstance(state, dict):
        for key, value in state.items():
            setattr(tensor, key, value)
    return tensor


_TENSOR_BUILDERS = {
    torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter, torch._utils._rebuild_parameter_with_state
}
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    # a parameter with attributes of its own: they are set from its pickled state, which this unpickler built
    ("torch._utils", "_rebuild_parameter_with_state"): torch._utils._rebuild_parameter_with_state,
    ("torch._tensor", "_rebuild_from_type_v2"): _from_type,
    ("torch._utils", "_rebuild_wrapper_subclass"): _wrapper_subclass,
    ("torch.serialization", "_get_layout"): _layout,
    ("builtins", "getattr"): _nested,
    ("__builtin__", "getattr"): _nested,  # protocol 2's name of it
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("copyreg", "_reconstructor"): _reconstruct,
    ("builtins", "object"): object,
}


class _InertUnpickler(pickle.Unpickler):
    """Resolves torch's tensor builders and plain data as themselves,
    names under :attr:`described` as :class:`Record`, and refuses the rest."""

    described: tuple[str, ...] = ()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        if any(module == p or module.startswith(p + ".") for p in self.described):
            return record_class(module, name)
        raise RefusedGlobal(module, name)


def _pickle_module(described: tuple[str, ...]) -> types.ModuleType:
    """A stand-in for the ``pickle`` module that ``torch.load(pickle_module=...)`` takes: its ``Unpickler`` is ours."""
    module = types.ModuleType("osdpipe_inert_pickle")
    module.Unpickler = type("Unpickler", (_InertUnpickler,), {"described": described})  # type: ignore[attr-defined]
    # torch asks for it on legacy files, which check_torch_zip refuses first
    module.load = pickle.load  # type: ignore[attr-defined]
    return module


def load_inert(path: str | Path, described: tuple[str, ...], *, what: str) -> Any:
    """``torch.load`` the file at ``path``, memory-mapped,
    with objects of the ``described`` packages as :class:`Record`.

    Args:
        path: a ``torch.save`` file (zip format).
        described: top-level packages whose objects are kept as records (``("deepspeed",)``).
        what: what the file is, for messages (``a DeepSpeed optimizer file``).

    Raises:
        InputError: one line naming the file: missing, damaged, or naming a global outside what is allowed.
    """
    module = _pickle_module(described)
    if is_remote(str(path)):  # in object storage: its tensors' bytes fetched as they are read
        p: Any = path

        def load() -> Any:
            return load_remote(str(path), module.Unpickler)
    else:
        p = checked_torch_file(path)

        def load() -> Any:
            return torch.load(p, map_location="cpu", mmap=True, weights_only=False, pickle_module=module)

    try:
        return load()
    except InputError:
        raise
    except RefusedGlobal as exc:
        if not exc.plausible:
            raise InputError(f"{p} is damaged or not {what} (it names no class such a file holds); {RECOPY}") from None
        raise InputError(
            f"{p} refers to {exc}, which {what} never holds; refusing to load it (nothing in it was run)"
        ) from None
    except Exception as exc:  # torch raises several types for a bad file
        raise torch_load_error(str(p), exc) from exc


def load_inert_bytes(raw: bytes, described: tuple[str, ...], *, what: str) -> Any:
    """:func:`load_inert` of a ``torch.save`` archive held in memory (a DCP byte item: Megatron's ``ShardedObject``).

    Raises:
        InputError: one line naming ``what``: damaged, or naming a global outside what is allowed.
    """
    try:
        return torch.load(
            io.BytesIO(raw), map_location="cpu", weights_only=False, pickle_module=_pickle_module(described)
        )
    except RefusedGlobal as exc:
        raise InputError(
            f"{what} refers to {exc}, which it never holds; refusing to load it (nothing in it was run)"
        ) from None
    except Exception as exc:  # torch raises several types for a damaged archive
        raise torch_load_error(what, exc) from exc
