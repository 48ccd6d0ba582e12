"""The validated run spec: the pydantic schema of a composed Hydra config.

Hydra composes YAML in the launcher process only; what reaches the ranks is a
frozen, picklable :class:`RunSpec`. Everything that can be checked without a
process group is checked here, before any process starts, and every error
names the key, the value and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from osdpipe.layout import LayoutSpec, ShardingStrategy
from osdpipe.sizes import parse_size, show_size

STAGE_ORDER = ("load", "broadcast", "flatten", "shard", "rekey", "verify", "save")
REQUIRED_STAGES = ("load", "broadcast", "flatten", "shard", "rekey")
VERIFY_CHECKS = ("roundtrip", "reference", "load_step", "resume", "replicas")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Frozen):
    """Which model: a built-in name or ``package.module:function``, its kwargs and seed.

    ``kwargs`` are only what the user gives: a factory's own defaults fill the
    rest, so naming another factory never inherits a built-in model's kwargs.
    ``units`` are the model's natural FSDP units, the default of
    ``source.wrap`` and ``target.wrap``; ``None``: the model's own
    ``fsdp_units`` attribute if it has one (every built-in model does), else
    the root only.
    """

    factory: str = "nested"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    seed: int = 0
    units: list[str] | None = None


class MixedPrecisionConfig(_Frozen):
    """Mixed precision of the job (FSDP1's ``MixedPrecision``): its forward/backward parameter dtype.

    It changes the layout: with ``use_orig_params`` FSDP1 aligns every
    parameter to 16 bytes of ``param_dtype``, not of the stored dtype.
    """

    param_dtype: Literal["float32", "bfloat16", "float16", "float64"] | None = None


class LayoutConfig(_Frozen):
    """One side of the conversion: how the model is wrapped and how its state is saved."""

    kind: str = "fsdp1"  # a layout kind of osdpipe.kinds
    world_size: int = Field(default=2, ge=1)
    sharding_strategy: ShardingStrategy = "FULL_SHARD"
    shard_group_size: int | None = Field(default=None, ge=1)  # HYBRID_SHARD (fsdp1) or HSDP (fsdp2): ranks per replica
    use_orig_params: bool = False
    wrap: list[str] = Field(default_factory=list)  # null in the config: the model's units (filled in by RunSpec)
    wrap_root: bool = True
    state_dict_type: Literal["full", "sharded", "local"] = "full"  # local: each rank's own optim.state_dict() (rank_local)
    mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig()

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        from osdpipe import kinds

        kinds.get(kind)
        return kind

    @model_validator(mode="after")
    def _kind_accepts(self) -> LayoutConfig:
        from osdpipe import kinds

        kinds.get(self.kind).validate(self.spec())
        return self

    def spec(self) -> LayoutSpec:
        return LayoutSpec(
            kind=self.kind,
            world_size=self.world_size,
            sharding_strategy=self.sharding_strategy,
            use_orig_params=self.use_orig_params,
            wrap=tuple(self.wrap),
            wrap_root=self.wrap_root,
            param_dtype=self.mixed_precision.param_dtype,
            shard_group_size=self.shard_group_size,
        )


class ParamGroupConfig(BaseModel):
    """A param group: FQN patterns (``fnmatch``) plus this group's own hyperparameters."""

    model_config = ConfigDict(frozen=True, extra="allow")
    params: list[str] = Field(min_length=1)

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


#: ``optim.name`` that means: the checkpoint's own optimizer (Adam for a source osdpipe generates).
AUTO = "auto"


class OptimConfig(_Frozen):
    """The optimizer every rank builds over the wrapped model's parameters.

    ``name`` is any optimizer class of ``torch.optim`` (``Adam``, ``Adagrad``,
    ``RMSprop``, ...; not ``LBFGS`` or ``SparseAdam``), a user's own
    ``package.module:Class`` (resolved by :func:`osdpipe.optim.resolve_optimizer`),
    or ``auto``: the one the checkpoint's state and param groups show
    (:mod:`osdpipe.reconcile` settles it before the config is validated).
    ``lr`` unset: the checkpoint's. ``kwargs`` and each param group's options
    must be arguments of its ``__init__``.
    """

    name: str = AUTO
    lr: float | None = Field(default=None, gt=0)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    param_groups: list[ParamGroupConfig] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _resolvable(cls, name: str) -> str:
        from osdpipe.optim import resolve_optimizer

        if name != AUTO:  # auto is the input's optimizer, read from its files, not a class name
            resolve_optimizer(name)
        return name

    @property
    def learning_rate(self) -> float:
        """``lr``, or the default for an optimizer osdpipe builds when no checkpoint says."""
        from osdpipe.reconcile import DEFAULT_LR

        return DEFAULT_LR if self.lr is None else self.lr

    @model_validator(mode="after")
    def _known_hyperparameters(self) -> OptimConfig:
        from osdpipe.optim import (
            accepted_hyperparameters,
            optimizer_label,
            resolve_optimizer,
        )

        if self.name == AUTO:
            return self
        accepted = accepted_hyperparameters(resolve_optimizer(self.name))
        label = optimizer_label(self.name)
        if "lr" in self.kwargs:
            raise ValueError("optim.kwargs.lr: set the learning rate as optim.lr (a param group may set its own lr)")
        if accepted is None:  # it takes **kwargs: whatever it does not know is its own to refuse
            return self
        if "lr" not in accepted:
            raise ValueError(f"optim.name={self.name!r}: {label} takes no lr, but every optimizer gets optim.lr; give it an lr argument")
        for where, keys in [("optim.kwargs", self.kwargs), *((f"optim.param_groups[{i}]", g.options) for i, g in enumerate(self.param_groups))]:
            unknown = set(keys) - accepted
            if unknown:
                raise ValueError(f"{where} has {sorted(unknown)}, which {label} does not take; it takes {sorted(accepted)}")
        return self


class InputConfig(_Frozen):
    """The source checkpoint. No ``path``: the source world trains the model and saves one.

    ``param_groups`` names, for a param-ID keyed input (``plain``,
    ``rank_local``), the FQN patterns of each param group of the optimizer
    that saved it, in the order it received them: the IDs are positions in
    that order. Unset: ``rank_local`` uses ``optim.param_groups``; ``plain``
    matches IDs to parameters by shape and refuses an ambiguous match.
    """

    path: str | None = None
    format: Literal["fsdp_full", "dcp", "plain", "rank_local"] = "fsdp_full"
    key: str = "optim"
    param_groups: list[list[str]] | None = None
    allow_nonfinite: bool = False  # convert NaN/Inf in the source as they are (with a warning) instead of failing

    @field_validator("path")
    @classmethod
    def _exists(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).exists():
            raise ValueError(f"{path!r} does not exist; point input.path at a checkpoint file or DCP directory")
        return path


class OutputConfig(_Frozen):
    """Where and how the converted state is written."""

    path: str
    format: Literal["rank_local", "fsdp_full", "dcp", "plain"] = "rank_local"
    key: str = "optim"
    overwrite: bool = False


class GenerateConfig(_Frozen):
    """How the source world trains when no input is given."""

    steps: int = Field(default=3, ge=0)
    seed: int = 0


#: The least ``runtime.memory_budget`` can be: two batches of 62 eight-byte elements.
MIN_MEMORY_BUDGET = 1000


class PipelineConfig(_Frozen):
    """Which stages run, in which order, and which verify checks."""

    stages: list[str] = Field(default_factory=lambda: list(STAGE_ORDER))
    checks: list[Literal["roundtrip", "reference", "load_step", "resume", "replicas"]] = Field(default_factory=lambda: list(VERIFY_CHECKS))
    #: ``resume``: the optimizer steps the target job and its reference take after loading.
    resume_steps: int = Field(default=2, ge=1)
    #: ``reference`` and ``load_step`` hold the whole state on every rank, or a live target model: they run
    #: only when the source's tensor state is at most this many bytes (``None``: always).
    full_state_checks_max: int | None = 10**9

    @field_validator("full_state_checks_max", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int | None:
        return parse_size(value)

    @field_validator("stages")
    @classmethod
    def _known_stages(cls, stages: list[str]) -> list[str]:
        from osdpipe.stages import STAGES

        unknown = [s for s in stages if s not in STAGES]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; known stages are {list(STAGES)}")
        required = [s for s in REQUIRED_STAGES if s not in stages]
        if required:
            raise ValueError(f"stages {required} cannot be skipped: they produce the converted state (only verify and save can)")
        order = [s for s in stages if s in STAGE_ORDER]
        if order != sorted(order, key=STAGE_ORDER.index):
            raise ValueError(f"stages {stages} are out of order; built-in stages run as {list(STAGE_ORDER)}")
        return stages


class RuntimeConfig(_Frozen):
    """How ranks are started and watched."""

    mode: Literal["online", "offline"] = "online"  # offline: one process, no process group, plays every target rank in turn
    launcher: Literal["auto", "local", "torchrun"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = Field(default=300.0, gt=0)
    progress: bool = True
    debug: bool = False  # print tracebacks with errors
    log_level: Literal["debug", "info", "warning", "error"] = "info"  # what osdpipe.log in the output directory holds
    #: ``shared``: every rank reads the input itself. ``scatter``: one rank per host reads it and sends
    #: each other rank exactly its ranges through the process group (the input on one node's local disk).
    transfer: Literal["shared", "scatter"] = "shared"
    #: Bytes a rank may hold in flight beyond its own output (reads, messages); ``None``: no bound.
    #: Conversion then copies, sends and checks in pieces of at most half of it.
    memory_budget: int | None = None

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> int | None:
        size = parse_size(value)
        if size is not None and size < MIN_MEMORY_BUDGET:
            raise ValueError(f"a memory budget of {show_size(size)} leaves no room to copy; give at least {show_size(MIN_MEMORY_BUDGET)}")
        return size

    @property
    def piece_bytes(self) -> int | None:
        """The most bytes one read, message or comparison holds at once (``None``: a whole local tensor)."""
        return None if self.memory_budget is None else self.memory_budget // 2


class RunSpec(_Frozen):
    """A complete, validated conversion."""

    model: ModelConfig = ModelConfig()
    source: LayoutConfig = LayoutConfig()
    target: LayoutConfig = LayoutConfig()
    optim: OptimConfig = OptimConfig()
    input: InputConfig = InputConfig()
    output: OutputConfig
    generate: GenerateConfig = GenerateConfig()
    pipeline: PipelineConfig = PipelineConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    @model_validator(mode="before")
    @classmethod
    def _optimizer_of_input(cls, raw: Any) -> Any:
        """``optim.name=auto`` where the launcher did not settle it (a config built in code): the input's own (:func:`osdpipe.reconcile.settle_optimizer`)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("optim", {}), dict):
            return raw
        from osdpipe.reconcile import settle_optimizer

        return settle_optimizer(raw)

    @model_validator(mode="before")
    @classmethod
    def _default_wrap(cls, raw: Any) -> Any:
        """``source.wrap`` / ``target.wrap`` unset or null: the model's own units (see :class:`ModelConfig`)."""
        if not isinstance(raw, dict):
            return raw
        sides = {side: raw.get(side) or {} for side in ("source", "target")}
        if all(isinstance(s, dict) and s.get("wrap") is not None for s in sides.values()):
            return raw
        model = raw.get("model") or {}
        units = model.get("units") if isinstance(model, dict) else None
        if units is None:
            from osdpipe.models import model_units

            try:
                units = model_units(model.get("factory", "nested"), model.get("kwargs") or {})
            except (ValueError, TypeError) as exc:
                raise ValueError(f"model: {exc}") from None
        out = dict(raw)
        for side, value in sides.items():
            if isinstance(value, dict) and value.get("wrap") is None:
                out[side] = {**value, "wrap": list(units)}
        return out

    @model_validator(mode="after")
    def _consistent(self) -> RunSpec:
        directory_formats = ("dcp", "rank_local")
        if self.input.path is not None and self.input.format in directory_formats and not Path(self.input.path).is_dir():
            raise ValueError(f"input.path={self.input.path!r}: a {self.input.format} input is a directory; use input.format=fsdp_full or plain for a file")
        if self.input.path is not None and self.input.format not in directory_formats and Path(self.input.path).is_dir():
            raise ValueError(f"input.path={self.input.path!r} is a directory; set input.format=dcp or rank_local")
        from osdpipe import kinds

        source, target = kinds.get(self.source.kind), kinds.get(self.target.kind)
        if self.input.path is not None and self.input.format == "plain" and not source.replicated:
            raise ValueError(
                "input.format=plain is the state of an unwrapped model (or a DDP job's, alike on every rank); "
                "set source.kind=none source.world_size=1, or source.kind=ddp"
            )
        if self.input.path is not None and self.input.format == "rank_local" and self.source.kind == "none":
            raise ValueError("input.format=rank_local needs the source's layout; set source.kind (fsdp1, ddp) and its world_size and wrap")
        if self.output.format == "plain" and not target.replicated:
            raise ValueError(
                f"output.format=plain is the state of a model every rank holds whole; target.kind={self.target.kind} shards it: "
                "set target.kind=none (and target.world_size=1) or ddp, or another output.format"
            )
        if self.runtime.mode == "offline" and self.runtime.transfer == "scatter":
            raise ValueError("runtime.transfer=scatter sends bytes between the ranks of a world; runtime.mode=offline has one process: set runtime.transfer=shared")
        if self.runtime.mode == "offline" and self.runtime.launcher == "torchrun":
            raise ValueError("runtime.mode=offline runs in one process, with no process group; set runtime.launcher=auto or local")
        if self.target.kind == "none" and self.output.format != "plain":
            raise ValueError("target.kind=none is an unwrapped model, whose optimizer loads one plain state dict: set output.format=plain")
        if self.input.path is None and self.source.state_dict_type not in source.state_dict_types:
            raise ValueError(
                f"source.state_dict_type={self.source.state_dict_type}: a {self.source.kind} job saves {', '.join(source.state_dict_types)}; "
                "choose one of those"
            )
        self._check_layouts()
        from osdpipe.output import conversion_entries

        previous = [p.name for p in conversion_entries(Path(self.output.path))]
        if previous and not self.output.overwrite:
            raise ValueError(f"output.path={self.output.path!r} already holds a conversion ({', '.join(previous[:3])}); choose another path or set output.overwrite=true")
        return self

    def _check_layouts(self) -> None:
        """Compute both layouts on the meta model: unknown wrap names, tied parameters across units, mixed dtypes."""
        from osdpipe import kinds
        from osdpipe.models import build_model
        from osdpipe.tree import describe

        try:
            tree = describe(build_model(self.model.factory, self.model.kwargs, device="meta"))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"model: {exc}") from None
        for side in ("source", "target"):
            try:
                kinds.get(getattr(self, side).kind).check(tree, getattr(self, side).spec())
            except ValueError as exc:
                raise ValueError(f"{side}.wrap={getattr(self, side).wrap}: {exc}") from None

    @property
    def source_input_format(self) -> str:
        """The format the source is read in: given, or what the source world saves."""
        if self.input.path is not None:
            return self.input.format
        from osdpipe import kinds

        return kinds.get(self.source.kind).saved_format(self.source.state_dict_type)


def validate(raw: dict[str, Any]) -> RunSpec:
    """Validate a composed config (a plain dict) into a :class:`RunSpec`.

    Raises:
        ConfigError: with one line per problem, naming the key, the value and the fix.
    """
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(exc) from None


class ConfigError(ValueError):
    """An invalid config, said in lines a user can act on."""

    def __init__(self, exc: ValidationError) -> None:
        lines = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "config"
            msg = err["msg"].removeprefix("Value error, ")
            value = err.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            if err["type"] == "extra_forbidden":
                msg = "is not a known key; check its spelling against the config reference in README.md"
            lines.append(f"{key}{shown}: {msg}" if err["loc"] else msg)
        super().__init__("\n".join(lines))

