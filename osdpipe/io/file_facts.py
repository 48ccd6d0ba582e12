"""What a checkpoint's files show of themselves, read from metadata and headers, never from tensor data.

A user describes their checkpoint with ``input.*``, ``source.*`` and
``optim.*``; the files often say the same things themselves:

* the **format**: a DCP directory has ``.metadata``, a ``rank_local`` one
  ``rank_<r>.pt`` files, a ``torch.save`` file keys its state by FQN
  (``fsdp_full``) or by param ID (``plain``);
* the **layout**: how many ranks saved it (DCP writes ``__<rank>_<n>.distcp``
  per rank; ``rank_local`` has a file per rank), how DCP's chunks cut each
  tensor, FSDP1's units (its FULL state shares one ``step`` tensor across a
  unit's parameters, which ``torch.save`` keeps), FSDP2's placements (a
  ``dtensor`` table, or DTensors), what osdpipe's own files record
  (``param_layout``, ``manifest.json``);
* the **optimizer** (:mod:`osdpipe.layout.optim_infer`), its hyperparameters per
  param group, the step range, the parameters with state, dtypes and bytes.

:func:`read_facts` gathers them for ``osdpipe inspect`` and for checking a
user's description against the files (:mod:`osdpipe.spec.reconcile`). Files are
memory-mapped, so a tensor's bytes are never read, with one exception: the
check that ``exp_avg`` equals ``exp_avg_sq`` for every parameter (PyTorch
2.13's FSDP1 ``use_orig_params`` FULL path on CPU saves them so) compares a
few elements first, and reads the rest only when every parameter's first
elements agree.

Each format reads what its own files show (:meth:`osdpipe.io.formats.base.Format.read_facts`,
with what every format shares of a loaded state in :mod:`osdpipe.io.formats.state_facts`).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from osdpipe.io import formats
from osdpipe.io.formats import InputError, megatron
from osdpipe.io.formats.base import OtherLayout
from osdpipe.io.formats.safe_load import load_torch_file
from osdpipe.io.formats.state_facts import Unit
from osdpipe.io.output import GENERATED_SOURCE, MANIFEST
from osdpipe.io.remote_input import RemotePath, as_path
from osdpipe.layout import kinds

__all__ = ["Facts", "Unit", "command", "detect_format", "read_facts"]

#: What a printed command leaves to the user, as words a shell passes unchanged: the target's world and the output's
#: place, and the function that builds the model where the files do not name it.
TARGET_AND_OUTPUT = ("target.world_size=M", "output.path=OUT_DIR")
USER_FACTORY = "PACKAGE.MODULE:FUNCTION"
#: The target keys of an osdpipe output's manifest that describe its layout beyond kind and world, each with the value
#: a command leaves unsaid (conf/source/fsdp1.yaml's), in the order a command names them.
_LAYOUT_DEFAULTS = {"wrap": None, "wrap_root": True, "sharding_strategy": "FULL_SHARD", "tp_size": 1, "tp_plan": {}}


def command(overrides: list[str]) -> str:
    """The ``osdpipe`` command of ``overrides`` and the target's placeholders, quoted for a POSIX shell where needed
    (``source.wrap=[Block]`` is a glob pattern to bash)."""
    return "osdpipe " + " ".join(shlex.quote(o) for o in [*overrides, *TARGET_AND_OUTPUT])


@dataclass
class Facts:
    """What the files at ``path`` show (``None``: they do not say).

    ``kind`` is ``fsdp1``, ``fsdp2``, ``ddp``, ``none``, or ``sharded`` for a
    DCP checkpoint of dim-0 chunks, which FSDP1's SHARDED_STATE_DICT and
    FSDP2 write byte for byte alike (and which converts the same either way).
    """

    path: str
    format: str
    key: str | None = None
    kind: str | None = None
    world_size: int | None = None
    shard_group_size: int | None = None
    use_orig_params: bool | None = None
    units: list[Unit] = field(default_factory=list)
    placements: list[str] = field(default_factory=list)
    optimizer: str | None = None
    optimizer_candidates: list[str] = field(default_factory=list)
    optimizer_why: str = ""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    #: Each param group's parameters by FQN, where the file names them (an FQN-keyed state); ``None`` for param IDs.
    group_fqns: list[list[str]] | None = None
    params: int = 0
    fqns: list[str] | None = None
    steps: list[float] | None = None
    dtypes: dict[str, int] = field(default_factory=dict)
    state_bytes: int = 0
    state_names: list[str] = field(default_factory=list)
    moments_alike: bool = False
    notes: list[str] = field(default_factory=list)
    #: The overrides that build the model, where the files name it (an osdpipe output's manifest); ``None``: the
    #: files cannot tell, and the command asks for the user's ``model.factory``.
    model: list[str] | None = None
    #: Layout keys beyond kind and world that the files name (an osdpipe output's manifest: ``source.wrap=[...]``).
    layout: list[str] = field(default_factory=list)
    #: The osdpipe ``manifest.json`` that says which layout and model these files are for (:func:`_from_manifest`);
    #: ``None``: none does.
    manifest: str | None = None

    def overrides(self) -> list[str]:
        """The ``key=value`` arguments that describe this checkpoint to ``osdpipe`` (what the files cannot say is left
        out)."""
        out = [f"input.path={self.path}", f"input.format={self.format}"]
        if self.key is not None and self.key != "optim":
            out.append(f"input.key={self.key}")
        out += self.source_keys()
        if self.optimizer is not None:
            out.append(f"optim.name={self.optimizer}")
        return [*out, *(self.model if self.model is not None else [f"model.factory={USER_FACTORY}"])]

    def source_keys(self) -> list[str]:
        """The ``source.*`` arguments that describe the layout that saved these files, as far as they show it."""
        out = []
        kind = kinds.find(self.kind)
        if kind is not None:
            out.append(f"source.kind={self.kind}")
        if self.world_size is not None:
            out.append(f"source.world_size={self.world_size}")
        if self.shard_group_size is not None and kind is not None:
            out += [f"source.{k}={v}" for k, v in kind.hybrid_keys(self.shard_group_size).items()]
        if (
            self.use_orig_params
            and kind is not None
            and kind.has_use_orig_params
            and formats.get(self.format).local_state
        ):
            out.append("source.use_orig_params=true")
        return out + self.layout

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["command"] = command(self.overrides())
        return out


def checkpoint_in(path: Path | RemotePath) -> Path | RemotePath:
    """``path``, or for an osdpipe output directory (its ``manifest.json``) that holds one checkpoint for every rank
    (``fsdp_full``, ``plain``, ``dcp``), that checkpoint: what a user points at to inspect a conversion, or to
    convert it again, is the ``output.path`` it was given.

    The formats say where they write (``output_path``); a format whose every rank loads the same path wrote one
    checkpoint. An output of ``rank_<r>.pt`` files is read where it is.
    """
    if path.is_dir() and (path / "manifest.json").is_file():
        for fmt in formats.FORMATS.values():
            if fmt.written and (inner := fmt.output_path(path, 0)) == fmt.output_path(path, 1) and inner.exists():
                return inner
    return path


def detect_format(path: str | Path) -> str:
    """The input format of ``path``, from what is there: ``dcp``, ``rank_local``, ``fsdp_full`` or ``plain``.

    A directory is the first directory format's, in the registry's order,
    that finds itself in it (:meth:`~osdpipe.io.formats.base.Format.found_in`:
    DCP's ``.metadata`` before ``rank_<r>.pt`` files); a file is the format
    of one file keyed as its state is, by param ID or by FQN. A URL (``s3://bucket/prefix``) is asked the same of
    the objects under it (:mod:`osdpipe.io.remote_input`).

    Raises:
        InputError: the path is missing or holds none of them.
    """
    p = as_path(path)
    remote = isinstance(p, RemotePath)
    if not remote and p.is_dir() and megatron.megatron_folder(p) is not None:
        raise OtherLayout(megatron.what_to_do_with(p))
    if p.is_dir():
        held = [f for f in formats.FORMATS.values() if f.directory]
        found = next((f for f in held if f.found_in(p)), None)
        if found is None:
            raise InputError(
                f"{p} holds neither {' nor '.join(f.found_by for f in held)}; point input.path at a checkpoint"
            )
        return found.name
    if not p.exists():
        raise InputError(f"{p} does not exist; give a checkpoint file or directory (or an s3:// or gs:// URL)")
    osd = load_torch_file(p)
    state = osd.get("state") if isinstance(osd, dict) else None
    if not isinstance(state, dict):
        raise InputError(f"{p} is not an optimizer state dict (no 'state' dict); point input.path at one")
    keys = [k for g in osd.get("param_groups") or [] if isinstance(g, dict) for k in g.get("params", [])] + list(state)
    by_id = bool(keys) and all(isinstance(k, int) and not isinstance(k, bool) for k in keys)
    return next(f.name for f in formats.FORMATS.values() if not f.directory and f.keyed_by_id == by_id)


def read_facts(path: str | Path, fmt: str | None = None, key: str | None = None) -> Facts:
    """What the checkpoint at ``path`` shows (in format ``fmt``, detected when ``None``; ``key``: a DCP checkpoint's
    top-level key).

    Each format reads its own (:meth:`~osdpipe.io.formats.base.Format.read_facts`).

    Raises:
        InputError: the files cannot be read as that format.
        KeyError: ``fmt`` is no format.
    """
    fmt = fmt or detect_format(path)
    reader = formats.FORMATS[fmt]
    facts = Facts(path=str(path), format=fmt)
    reader.read_facts(facts, as_path(path), key)
    _from_manifest(facts, as_path(path))
    return facts


def lone_file_in(path: Path | RemotePath) -> Path | RemotePath:
    """``path``, or for a local directory that holds one file and nothing else, and that no format reads as a
    checkpoint of its own (DCP's, rank files), that file: a folder with exactly one checkpoint file is that checkpoint
    (an osdpipe output's ``source/``, where a generated ``optim.pt`` is kept)."""
    if not isinstance(path, Path) or not path.is_dir() or megatron.megatron_folder(path) is not None:
        return path
    if any(f.found_in(path) for f in formats.FORMATS.values() if f.directory):
        return path
    entries = [p for p in path.iterdir() if not p.name.startswith(".")]
    return entries[0] if len(entries) == 1 and entries[0].is_file() else path


def _from_manifest(facts: Facts, path: Path | RemotePath) -> None:
    """An osdpipe output's ``manifest.json`` says exactly which layout and model its files are for: what the files
    alone cannot (a full file's world, FSDP1's units). Beside its rank files, or above its ``optim.pt`` or ``dcp/``,
    it describes them as the conversion's target; above the ``source/`` that keeps a source osdpipe generated for
    the conversion, it describes that source (the config's ``source``)."""
    found = _describing_manifest(facts, path)
    if found is None:
        return
    manifest, side, config = found
    layout = config[side]
    facts.kind, facts.world_size = layout.get("kind", facts.kind), layout.get("world_size", facts.world_size)
    facts.shard_group_size = layout.get("shard_group_size")
    kind = kinds.find(facts.kind)
    facts.use_orig_params = layout.get("use_orig_params") if kind is not None and kind.has_use_orig_params else None
    facts.layout = [f"source.{k}={_value(layout[k])}" for k, v in _LAYOUT_DEFAULTS.items() if layout.get(k, v) != v]
    if (layout.get("mixed_precision") or {}).get("param_dtype"):
        facts.layout.append(f"source.mixed_precision.param_dtype={layout['mixed_precision']['param_dtype']}")
    model = config.get("model") or {}
    if model.get("factory"):
        kwargs = [f"model.kwargs.{k}={_value(v)}" for k, v in sorted((model.get("kwargs") or {}).items())]
        facts.model = [f"model.factory={model['factory']}", *kwargs]
    facts.manifest = str(manifest)
    shown = json.dumps(layout, sort_keys=True)
    facts.notes.append(
        f"osdpipe's output ({manifest}): converted for target {shown}" if side == "target" else
        f"the source osdpipe generated for the conversion in {manifest.parent} ({manifest}): saved by {shown}"
    )


def _describing_manifest(facts: Facts, path: Path | RemotePath) -> tuple[Path | RemotePath, str, dict] | None:
    """The manifest that describes the files at ``path``, which side of its conversion they are (``target``,
    ``source``), and its config; ``None``: none does (the manifest of another checkpoint in the same folder: a kept
    ``source/``'s beside an output's)."""
    for manifest in (path / MANIFEST, path.parent / MANIFEST):
        if manifest.is_file():
            recorded = _recorded(manifest)
            if recorded is None or recorded.get("format") != facts.format:
                return None
            return manifest, "target", recorded["config"]
    for folder in (path.parent, path.parent.parent):  # <output>/source/optim.pt, <output>/source/<step>/<part>
        if folder.name == GENERATED_SOURCE and (recorded := _recorded(folder.parent / MANIFEST)) is not None:
            generated = (recorded["config"].get("input") or {}).get("path") is None
            return (folder.parent / MANIFEST, "source", recorded["config"]) if generated else None
    return None


def _recorded(manifest: Path | RemotePath) -> dict[str, Any] | None:
    """An osdpipe manifest's contents, where it is one (a config with both sides); ``None`` else."""
    try:
        recorded = json.loads(manifest.read_text())
        if isinstance(recorded["config"]["target"], dict) and isinstance(recorded["config"]["source"], dict):
            return recorded
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _value(value: Any) -> str:
    """A config value as an override writes it: lists and dicts in Hydra's brackets, the rest as JSON."""
    if isinstance(value, list):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    return value if isinstance(value, str) else json.dumps(value)
