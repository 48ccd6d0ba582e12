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
* the **optimizer** (:mod:`osdpipe.optim_infer`), its hyperparameters per
  param group, the step range, the parameters with state, dtypes and bytes.

:func:`read_facts` gathers them for ``osdpipe inspect`` and for checking a
user's description against the files (:mod:`osdpipe.reconcile`). Files are
memory-mapped, so a tensor's bytes are never read, with one exception: the
check that ``exp_avg`` equals ``exp_avg_sq`` for every parameter (PyTorch
2.13's FSDP1 ``use_orig_params`` FULL path on CPU saves them so) compares a
few elements first, and reads the rest only when every parameter's first
elements agree.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from osdpipe.formats import InputError, local_part
from osdpipe.loading import PARAM_LAYOUT
from osdpipe.optim_infer import NOT_HYPERPARAMETERS, Inferred, infer

#: DCP's ``FileSystemWriter`` names each rank's file ``__<rank>_<n>.distcp``.
_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")
_RANK_FILE = re.compile(r"rank_(0|[1-9]\d*)\.pt")
#: Elements of each moment compared before any whole tensor is (see the module docstring).
_FIRST = 16
#: What to say of a checkpoint whose first moments were overwritten by its second (:func:`moments_alike`).
MOMENTS_ALIKE = (
    "exp_avg equals exp_avg_sq for every parameter: no optimizer keeps them so, and PyTorch 2.13's FSDP1 use_orig_params "
    "FULL_STATE_DICT path on CPU saves them so (offload_to_cpu=True reuses one buffer); this checkpoint has lost its first moments"
)


@dataclass
class Unit:
    """An FSDP1 unit the files show: the parameters it flattens (when named), and its flat size without padding."""

    fqns: list[str]
    numel: int


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
    params: int = 0
    fqns: list[str] | None = None
    steps: list[float] | None = None
    dtypes: dict[str, int] = field(default_factory=dict)
    state_bytes: int = 0
    state_names: list[str] = field(default_factory=list)
    moments_alike: bool = False
    notes: list[str] = field(default_factory=list)

    def overrides(self) -> list[str]:
        """The ``key=value`` arguments that describe this checkpoint to ``osdpipe`` (what the files cannot say is left out)."""
        out = [f"input.path={self.path}", f"input.format={self.format}"]
        if self.key is not None and self.key != "optim":
            out.append(f"input.key={self.key}")
        if self.kind in ("fsdp1", "fsdp2", "ddp", "none"):
            out.append(f"source.kind={self.kind}")
        if self.world_size is not None:
            out.append(f"source.world_size={self.world_size}")
        if self.shard_group_size is not None and self.kind in ("fsdp1", "fsdp2"):
            out.append(f"source.shard_group_size={self.shard_group_size}")
            if self.kind == "fsdp1":
                out.append("source.sharding_strategy=HYBRID_SHARD")
        if self.use_orig_params and self.kind == "fsdp1" and self.format == "rank_local":
            out.append("source.use_orig_params=true")
        if self.optimizer is not None:
            out.append(f"optim.name={self.optimizer}")
        return out

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["command"] = "osdpipe " + " ".join([*self.overrides(), "target.world_size=<M>", "output.path=<dir>"])
        return out


def detect_format(path: str | Path) -> str:
    """The input format of ``path``, from what is there: ``dcp``, ``rank_local``, ``fsdp_full`` or ``plain``.

    Raises:
        InputError: the path is missing or holds none of them.
    """
    p = Path(path)
    if p.is_dir():
        if (p / ".metadata").is_file():
            return "dcp"
        if any(_RANK_FILE.fullmatch(f.name) for f in p.iterdir()):
            return "rank_local"
        raise InputError(f"{p} holds neither a DCP checkpoint (.metadata) nor rank_<r>.pt files; point input.path at a checkpoint")
    if not p.exists():
        raise InputError(f"{p} does not exist; point input.path at a checkpoint file or directory")
    from osdpipe.formats.safe_load import load_torch_file

    osd = load_torch_file(p)
    state = osd.get("state") if isinstance(osd, dict) else None
    if not isinstance(state, dict):
        raise InputError(f"{p} is not an optimizer state dict (no 'state' dict); point input.path at one")
    keys = [k for g in osd.get("param_groups") or [] if isinstance(g, dict) for k in g.get("params", [])] + list(state)
    return "plain" if keys and all(isinstance(k, int) and not isinstance(k, bool) for k in keys) else "fsdp_full"


def read_facts(path: str | Path, fmt: str | None = None, key: str | None = None) -> Facts:
    """What the checkpoint at ``path`` shows (in format ``fmt``, detected when ``None``; ``key``: a DCP checkpoint's top-level key).

    Raises:
        InputError: the files cannot be read as that format.
    """
    fmt = fmt or detect_format(path)
    reader = {"fsdp_full": _full_file, "plain": _full_file, "rank_local": _rank_local, "dcp": _dcp}[fmt]
    facts = Facts(path=str(path), format=fmt)
    reader(facts, Path(path), key)
    return facts


def _describe_state(facts: Facts, state: dict[Any, dict[str, Any]], param_groups: list[dict[str, Any]] | None) -> None:
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


def _tally(facts: Facts, state: dict[Any, Any]) -> None:
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
        {**{k: _plain(v) for k, v in g.items() if k not in NOT_HYPERPARAMETERS}, "params": len(g.get("params", []))} for g in param_groups or []
    ]


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
    from osdpipe.compare import bits_equal

    pairs = []
    for entry in state.values():
        a, b = (entry.get("exp_avg"), entry.get("exp_avg_sq")) if isinstance(entry, dict) else (None, None)
        a, b = local_part(a), local_part(b)
        if torch.is_tensor(a) and torch.is_tensor(b) and a.dim() > 0 and a.numel():
            pairs.append((a, b))
    if not pairs:
        return False
    for a, b in pairs:  # a few elements each first: a healthy file differs there, and its tensors are never read whole
        if not bits_equal(a.reshape(-1)[:_FIRST], b.reshape(-1)[:_FIRST]):
            return False
    return all(bits_equal(a, b) for a, b in pairs)


def _full_file(facts: Facts, path: Path, key: str | None) -> None:
    """An ``fsdp_full`` or ``plain`` file: one ``torch.save`` of a whole optimizer state dict."""
    from osdpipe.formats.fsdp_full import load_full

    osd = load_full(str(path), facts.format)
    state = {k: v for k, v in osd["state"].items() if isinstance(v, dict)}
    _describe_state(facts, state, osd.get("param_groups"))
    _tally(facts, state)
    facts.params = len(state)
    facts.moments_alike = moments_alike(state)
    if facts.format == "plain":
        facts.kind, facts.world_size = "none", 1
        facts.notes.append("param-ID keyed, every tensor whole: an unwrapped model's optim.state_dict(), or a DDP job's (the same on every rank)")
        return
    facts.fqns = sorted(map(str, state))
    facts.units = _shared_step_units(state)
    if any(len(u.fqns) > 1 for u in facts.units):
        facts.kind = "fsdp1"
        facts.notes.append(
            f"FSDP1's FULL state: {len(facts.units)} unit(s), each sharing one step tensor across its parameters; "
            "the world size that saved it is not recorded in a full state dict"
        )
    else:
        facts.units = []
        facts.notes.append("a full, FQN-keyed state: any kind of job can save one; it does not record the world size or the wrapping")


def _shared_step_units(state: dict[str, dict[str, Any]]) -> list[Unit]:
    """FSDP1 units, from the ``step`` tensor a FULL state shares across each unit's parameters (``torch.save`` keeps the sharing)."""
    units: dict[int, Unit] = {}
    for fqn, entry in state.items():
        step = entry.get("step")
        if not torch.is_tensor(step):
            continue
        numel = max((v.numel() for v in entry.values() if torch.is_tensor(v) and v.dim() > 0), default=0)
        unit = units.setdefault(step.untyped_storage().data_ptr(), Unit([], 0))
        unit.fqns.append(fqn)
        unit.numel += numel
    return list(units.values())


def _rank_local(facts: Facts, path: Path, key: str | None) -> None:
    """A directory of ``rank_<r>.pt``: each rank's own ``optim.state_dict()``."""
    from osdpipe.formats.fsdp_full import check_optim_state_dict
    from osdpipe.formats.rank_local import local_tensors, rank_files
    from osdpipe.formats.safe_load import load_torch_file
    from osdpipe.layout import DTENSOR_TABLE

    count = sum(1 for p in path.iterdir() if _RANK_FILE.fullmatch(p.name)) if path.is_dir() else 0
    files = rank_files(path, max(count, 1))  # refuses gaps and an empty directory, naming the missing file
    facts.world_size = len(files)
    osds = []
    for f in files:
        osd = load_torch_file(f)
        check_optim_state_dict(osd, f, "rank_local")
        osds.append(osd)
    first = osds[0]
    state = {k: v for k, v in first["state"].items() if isinstance(v, dict)}
    _describe_state(facts, state, first.get("param_groups"))
    for osd in osds:  # every rank's bytes: replicas too, as the files hold them
        _tally(facts, osd["state"])
    facts.moments_alike = all(moments_alike({k: v for k, v in o["state"].items() if isinstance(v, dict)}) for o in osds)
    records = first.get(PARAM_LAYOUT) or {}
    tables = [local_tensors(o).get(DTENSOR_TABLE) for o in osds]  # a file of DTensors, as to_rank_local would have saved it
    if any(tables):
        facts.kind = "fsdp2"
        meshes = {tuple(e["mesh"]) for t in tables for e in t.values()}
        facts.placements = sorted({f"mesh {list(e['mesh'])}: {', '.join(e['placements'])}" for t in tables for e in t.values()})
        if len(meshes) == 1 and len(mesh := next(iter(meshes))) == 2:
            facts.shard_group_size = mesh[1]
    if records:  # osdpipe's own file: it says what each param ID holds
        fqns = sorted({f for osd in osds for r in (osd.get(PARAM_LAYOUT) or {}).values() for f in r["fqns"]})
        facts.fqns, facts.params = fqns, len(fqns)
        flat = [r for r in records.values() if r["key"].endswith("_flat_param")]
        if flat:
            facts.kind = facts.kind or "fsdp1"
            facts.use_orig_params = False
            facts.units = [Unit(list(r["fqns"]), sum(math.prod(s) for s in r["shapes"])) for r in flat]
        elif facts.kind is None:
            pieces = any(list(r["local_shape"]) != list(s) for osd in osds for r in (osd.get(PARAM_LAYOUT) or {}).values() for s in r["shapes"][:1])
            facts.kind, facts.use_orig_params = ("fsdp1", True) if pieces else ("ddp", None)
    else:
        facts.params = len(state)
        if facts.kind is None:
            facts.kind = _kind_from_shapes(osds)
        if facts.kind == "fsdp1":
            facts.notes.append(f"{len(state)} flat parameter(s) per rank; the files do not name the parameters they flatten")
    _manifest(facts, path)


def _kind_from_shapes(osds: list[dict[str, Any]]) -> str | None:
    """The kind, from the local shapes alone: tensors of two or more dimensions are whole parameters (DDP); 1-D ones that
    differ across ranks are FSDP1 shards; 1-D ones alike everywhere could be either."""
    shapes = [{pid: tuple(v.shape) for pid, e in o["state"].items() if isinstance(e, dict) for v in e.values() if torch.is_tensor(v) and v.dim() > 0} for o in osds]
    if any(len(s) > 1 for o in shapes for s in o.values()):
        return "ddp"
    if any(o != shapes[0] for o in shapes[1:]):
        return "fsdp1"
    return None


def _manifest(facts: Facts, path: Path) -> None:
    """An osdpipe output directory's ``manifest.json`` says exactly which layout its files are for."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return
    try:
        target = json.loads(manifest.read_text())["config"]["target"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    facts.kind, facts.world_size = target.get("kind", facts.kind), target.get("world_size", facts.world_size)
    facts.shard_group_size = target.get("shard_group_size")
    facts.use_orig_params = target.get("use_orig_params") if facts.kind == "fsdp1" else None
    facts.notes.append(f"osdpipe's output ({manifest}): converted for target {json.dumps(target, sort_keys=True)}")


def dcp_optimizer_keys(metadata: Any) -> list[str]:
    """The top-level keys of a DCP checkpoint that hold an optimizer state dict (``state`` and ``param_groups`` under them)."""
    return sorted({str(p[0]) for p in metadata.planner_data.values() if len(p) > 1 and p[1] == "param_groups"})


def _dcp(facts: Facts, path: Path, key: str | None) -> None:
    """A DCP directory: its ``.metadata`` and its files' names; param groups and ``step`` (small items) are read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from osdpipe.formats.dcp_reader import DcpReader
    from osdpipe.formats.safe_load import read_dcp_metadata

    metadata = read_dcp_metadata(path / ".metadata")
    keys = dcp_optimizer_keys(metadata)
    if key is None:
        if len(keys) != 1:
            held = sorted({str(p[0]) for p in metadata.planner_data.values() if p})
            raise InputError(
                f"{path}: " + (f"several top-level keys hold optimizer state ({keys}); name one with input.key" if keys else f"no top-level key holds optimizer state (it holds {held})")
            )
        key = keys[0]
    facts.key = key
    reader = DcpReader(str(path), key)
    meta = reader.meta()
    _describe_state(facts, meta.state, meta.param_groups)
    facts.params = len(meta.state)
    facts.fqns = sorted(meta.state)
    chunks = 0
    for flat, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and len(md.size) > 0 and flat.startswith(f"{key}.state."):
            dtype = str(md.properties.dtype).removeprefix("torch.")
            facts.dtypes[dtype] = facts.dtypes.get(dtype, 0) + math.prod(md.size) * md.properties.dtype.itemsize
            chunks = max(chunks, sum(1 for c in md.chunks if math.prod(c.sizes)))
    facts.state_bytes = sum(facts.dtypes.values())
    ranks = {int(m.group(1)) for info in metadata.storage_data.values() if (m := _DCP_FILE.fullmatch(info.relative_path))}
    facts.world_size = max(ranks) + 1 if ranks else None
    facts.kind = "sharded"
    facts.notes.append(
        "dim-0 chunks, as FSDP1's SHARDED_STATE_DICT and FSDP2 both write them (byte for byte alike; a conversion needs no more)"
    )
    if facts.world_size is not None and 1 < chunks < facts.world_size and facts.world_size % chunks == 0:
        facts.shard_group_size = chunks
        facts.notes.append(f"{facts.world_size} ranks saved it, its tensors are cut in {chunks}: replica groups of {chunks} ranks (HSDP, HYBRID_SHARD)")
