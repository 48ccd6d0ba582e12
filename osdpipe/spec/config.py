"""The validated run spec: the pydantic schema of a composed Hydra config.

Hydra composes YAML in the launcher process only; what reaches the ranks is a
frozen, picklable :class:`RunSpec`. Everything that can be checked without a
process group is checked here, before any process starts, and every error
names the key, the value and the fix.

:func:`validate` checks in two passes, so that a mistyped value is said
before torch is imported (about two seconds): first the schema
(:func:`check_schema`: types, ranges, choices, unknown keys, and the rules
that need neither the model nor the input's files), then the rest: the
layout kinds, the optimizer class and the model's default units, which
need torch, and ``input.format`` against the path. Whether both wrappings
fit the model is the plan's question (:func:`osdpipe.spec.plan.plan_run`).
This module imports none of that at module level; the validators of the
second pass import it when they run, and they skip themselves in the first
(:func:`_complete`). Nothing here reads the input's files: an
``optim.name=auto`` with an input is settled from them before validation
(:mod:`osdpipe.spec.reconcile`). :func:`check_overrides`
checks the command line's values alone, before Hydra composes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from osdpipe.core.sizes import parse_size, show_size
from osdpipe.io.output import already_holds, conversion_entries
from osdpipe.io.store import is_remote, is_url, parse, redact, slash_short
from osdpipe.spec import checks as check_registry  # the checks' names and order; it imports no torch
from osdpipe.spec.megatron import MEGATRON, megatron_problem

if TYPE_CHECKING:
    from osdpipe.layout.ranges import LayoutSpec

#: The built-in stages, in the order they run (the stage registry, :mod:`osdpipe.pipeline.stages`, holds these
#: names).
STAGE_ORDER = ("load", "broadcast", "flatten", "shard", "rekey", "verify", "save")
REQUIRED_STAGES = ("load", "broadcast", "flatten", "shard", "rekey")
#: The verify checks, in the order they run: the check catalog's (it imports no torch; the checks themselves are in
#: osdpipe.verify.checks).
VERIFY_CHECKS = check_registry.names()

#: FSDP1's sharding strategies by ``torch.distributed.fsdp.ShardingStrategy`` member name (FSDP2 takes FULL_SHARD and
#: NO_SHARD).
ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]

#: The validation context of :func:`check_schema`'s pass: the validators that need torch, or the input's settled facts,
#: skip themselves.
SCHEMA_ONLY = {"osdpipe.schema_only": True}


def _complete(info: ValidationInfo) -> bool:
    """Whether this validation runs every check: those that import torch too (every validation but
    :func:`check_schema`'s)."""
    return not (isinstance(info.context, dict) and info.context.get("osdpipe.schema_only"))


def output_takes_input(output_path: str, input_path: str | None) -> str | None:
    """Why ``output_path`` and ``input_path`` overlap, else ``None``: the same place, an output that is a directory (a
    prefix) the input is in, or an output inside the input.

    A conversion is committed by replacing what its output holds whole, so an output that holds the input would,
    with ``output.overwrite=true``, take the checkpoint it converts with it, and its manifest would name a source no
    longer there. An output inside the input writes the conversion among the source checkpoint's own files, where
    the next look at that checkpoint (a framework's loader, ``osdpipe inspect``, another conversion) finds it too.
    Local paths are compared resolved (symlinks followed); URLs as written, a prefix as a directory of keys."""
    if input_path is None or is_url(input_path) != is_url(output_path):
        return None
    if is_url(input_path):
        if not (is_remote(input_path) and is_remote(output_path)):
            return None  # a URL osdpipe does not serve is refused by its own check
        given, out = parse(input_path, "input.path"), parse(output_path, "output.path")
        if (given.scheme, given.bucket) != (out.scheme, out.bucket):
            return None
        holds = not out.key or given.key == out.key or given.key.startswith(out.key + "/")
        inside = not given.key or out.key.startswith(given.key + "/")
    else:
        given_path, out_path = Path(input_path).resolve(), Path(output_path).resolve()
        holds = given_path == out_path or out_path in given_path.parents
        inside = given_path in out_path.parents
    shown = f"output.path={redact(output_path)!r}"
    if holds:
        return (f"{shown} holds input.path={redact(input_path)!r}, the checkpoint it converts, and a conversion "
                "replaces what its output.path holds: give another output.path")
    if inside:
        return (f"{shown} is inside input.path={redact(input_path)!r}, the checkpoint it converts: the conversion "
                "would be written among the source's own files; give an output.path outside it")
    return None


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


#: The target's kind where ``target.kind`` is unset (null) and the source's is not one to follow
#: (:func:`followed_kind`).
FALLBACK_TARGET_KIND = "fsdp1"


def followed_kind(source_kind: str) -> str:
    """The target's kind where ``target.kind`` is unset (null, the command's default): the source's, so that a
    checkpoint converts for the kind of job that saved it; :data:`FALLBACK_TARGET_KIND` where that is a kind of one
    process (``none``), whose target would be one unwrapped process and a ``plain`` file, not ranks to reshard to, or
    no kind (``source.kind``'s own error says so, once).

    The command settles the source's kind from the input's files first, and says in a warning what it chose where
    they do not tell (:mod:`osdpipe.spec.reconcile`)."""
    from osdpipe.layout import kinds  # the kind registry imports torch: not before the schema is checked

    kind = kinds.find(source_kind)
    return FALLBACK_TARGET_KIND if kind is None or kind.one_process is not None else source_kind


class LayoutConfig(_Frozen):
    """One side of the conversion: how the model is wrapped and how its state is saved.

    ``kind`` null is the target's alone: the source's kind (:func:`followed_kind`), filled in before the full
    validation; the schema pass leaves it open.
    """

    kind: str | None = "fsdp1"  # a layout kind of osdpipe.layout.kinds
    world_size: int = Field(default=2, ge=1)
    sharding_strategy: ShardingStrategy = "FULL_SHARD"
    shard_group_size: int | None = Field(default=None, ge=1)  # HYBRID_SHARD (fsdp1) or HSDP (fsdp2): ranks per replica
    use_orig_params: bool = False
    wrap: list[str] = Field(default_factory=list)  # null in the config: the model's units (filled in by RunSpec)
    wrap_root: bool = True
    # local: each rank's own optim.state_dict() (rank_local)
    state_dict_type: Literal["full", "sharded", "local"] = "full"
    mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig()
    tp_size: int = Field(default=1, ge=1)  # tensor-parallel ranks, the innermost mesh dimension (fsdp2, megatron)
    pp_size: int = Field(default=1, ge=1)  # pipeline-parallel stages (megatron): world = tp_size x pp_size x DP
    # model chunks per pipeline stage (megatron's virtual pipeline stages, its interleaved schedule); 1: none
    vpp_size: int = Field(default=1, ge=1)
    # expert-parallel ranks (megatron's mixture of experts): they split each (PP, TP) rank's data-parallel ranks
    ep_size: int = Field(default=1, ge=1)
    # module FQN pattern -> colwise | rowwise | sequence | package.module:callable
    tp_plan: dict[str, str] = Field(default_factory=dict)

    @field_validator("tp_plan")
    @classmethod
    def _known_styles(cls, plan: dict[str, str]) -> dict[str, str]:
        from osdpipe.layout.tp import style_problem  # imports no torch at module level

        for pattern, style in plan.items():
            why = style_problem(style)
            if why is not None:
                raise ValueError(f"{pattern}: {why}")
        return plan

    def mesh_problem(self) -> str | None:
        """Why ``world_size``, ``tp_size``, ``pp_size`` and ``tp_plan`` make no mesh (``None``: they do); nothing here
        needs the model or torch."""
        if self.pp_size > 1 and self.world_size % (self.tp_size * self.pp_size):
            return (
                f"tp_size={self.tp_size} x pp_size={self.pp_size} does not divide world_size={self.world_size}; "
                "the world is tp_size x pp_size x data-parallel ranks"
            )
        if self.world_size % self.tp_size:
            return (
                f"tp_size={self.tp_size} does not divide world_size={self.world_size}; "
                "the world is replicas x shard group x tp_size"
            )
        if self.tp_plan and self.tp_size == 1:
            return (
                "tp_plan applies with tensor parallelism: set tp_size (the tensor-parallel ranks), "
                "or leave tp_plan empty"
            )
        return None

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str | None, info: ValidationInfo) -> str | None:
        if kind is None and _complete(info):  # the target's was filled in (RunSpec._target_follows_source)
            raise ValueError(
                "null names no kind; give the kind of job that saved the source (fsdp1, fsdp2, ddp or none): only "
                "target.kind may be left null, for the source's"
            )
        if _complete(info):
            from osdpipe.layout import kinds  # the kind registry imports torch: not before the schema is checked

            kinds.get(kind)
        return kind

    @model_validator(mode="after")
    def _kind_accepts(self, info: ValidationInfo) -> LayoutConfig:
        if _complete(info):
            from osdpipe.layout import kinds  # the kind registry imports torch: not before the schema is checked

            kind = kinds.get(self.kind)
            if self.tp_size > 1 and not kind.tensor_parallel:
                raise ValueError(
                    f"tp_size={self.tp_size}: kind={self.kind} has no tensor parallelism; set kind=fsdp2, or tp_size=1"
                )
            kind.validate(self.spec())
        return self

    def spec(self) -> LayoutSpec:
        """This side's layout, as the layout math and the kinds take it."""
        # the layout math imports torch (through osdpipe.layout.tree): not at start-up
        from osdpipe.layout.ranges import LayoutSpec

        return LayoutSpec(
            kind=self.kind,
            world_size=self.world_size,
            sharding_strategy=self.sharding_strategy,
            use_orig_params=self.use_orig_params,
            wrap=tuple(self.wrap),
            wrap_root=self.wrap_root,
            param_dtype=self.mixed_precision.param_dtype,
            shard_group_size=self.shard_group_size,
            tp_size=self.tp_size,
            tp_plan=tuple(self.tp_plan.items()),
            pp_size=self.pp_size,
            vpp_size=self.vpp_size,
            ep_size=self.ep_size,
        )


class ParamGroupConfig(BaseModel):
    """A param group: FQN patterns (``fnmatch``) plus this group's own hyperparameters."""

    model_config = ConfigDict(frozen=True, extra="allow")
    params: list[str] = Field(min_length=1)

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


#: ``optim.name`` that means: the checkpoint's own optimizer (:data:`GENERATED_OPTIMIZER` for a source osdpipe
#: generates).
AUTO = "auto"
#: The optimizer that trains a source osdpipe generates (no ``input.path``) when ``optim.name=auto``.
GENERATED_OPTIMIZER = "Adam"
#: The learning rate of an optimizer osdpipe builds when neither ``optim.lr`` nor a checkpoint says one.
DEFAULT_LR = 1e-2


class OptimConfig(_Frozen):
    """The optimizer every rank builds over the wrapped model's parameters.

    ``name`` is any optimizer class of ``torch.optim`` (``Adam``, ``Adagrad``,
    ``RMSprop``, ...; not ``LBFGS`` or ``SparseAdam``), a user's own
    ``package.module:Class`` (resolved by :func:`osdpipe.layout.optim.resolve_optimizer`),
    or ``auto``: the one the checkpoint's state and param groups show
    (:mod:`osdpipe.spec.reconcile` settles it before the config is validated;
    with no input, :data:`GENERATED_OPTIMIZER`).
    ``lr`` unset: the checkpoint's. ``kwargs`` and each param group's options
    must be arguments of its ``__init__``.
    """

    name: str = AUTO
    lr: float | None = Field(default=None, gt=0)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    param_groups: list[ParamGroupConfig] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _resolvable(cls, name: str, info: ValidationInfo) -> str:
        if name != AUTO and _complete(info):  # auto is the input's optimizer, read from its files, not a class name
            from osdpipe.layout.optim import resolve_optimizer  # imports torch.optim: not before the schema is checked

            resolve_optimizer(name)
        return name

    @property
    def learning_rate(self) -> float:
        """``lr``, or the default for an optimizer osdpipe builds when no checkpoint says."""
        return DEFAULT_LR if self.lr is None else self.lr

    @model_validator(mode="after")
    def _known_hyperparameters(self, info: ValidationInfo) -> OptimConfig:
        if self.name == AUTO or not _complete(info):
            return self
        from osdpipe.layout.optim import accepted_hyperparameters, optimizer_label, resolve_optimizer

        accepted = accepted_hyperparameters(resolve_optimizer(self.name))
        label = optimizer_label(self.name)
        if "lr" in self.kwargs:
            raise ValueError("optim.kwargs.lr: set the learning rate as optim.lr (a param group may set its own lr)")
        if accepted is None:  # it takes **kwargs: whatever it does not know is its own to refuse
            return self
        if "lr" not in accepted:
            raise ValueError(
                f"optim.name={self.name!r}: {label} takes no lr, but every optimizer gets optim.lr; "
                "give it an lr argument"
            )
        for where, keys in [
            ("optim.kwargs", self.kwargs),
            *((f"optim.param_groups[{i}]", g.options) for i, g in enumerate(self.param_groups)),
        ]:
            unknown = set(keys) - accepted
            if unknown:
                raise ValueError(
                    f"{where} has {sorted(unknown)}, which {label} does not take; it takes {sorted(accepted)}"
                )
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
    format: Literal[
        "fsdp_full", "dcp", "plain", "rank_local", "verl", "deepspeed", "megatron", "safetensors"
    ] = "fsdp_full"
    key: str = "optim"
    param_groups: list[list[str]] | None = None
    allow_nonfinite: bool = False  # convert NaN/Inf in the source as they are (with a warning) instead of failing

    @field_validator("path")
    @classmethod
    def _exists(cls, path: str | None) -> str | None:
        if path is not None and is_url(path):
            parse(path, "input.path")  # a scheme osdpipe reads, a bucket; whether it is there is asked with the options
            return path
        if path is not None and (why := slash_short(path)) is not None:
            raise ValueError(why)
        if path is not None and not Path(path).exists():
            raise ValueError(f"{path!r} does not exist; point input.path at a checkpoint file or directory")
        return path


class OutputConfig(_Frozen):
    """Where and how the converted state is written.

    ``model_format=safetensors`` also exports a whole checkpoint's model
    weights, full, in Hugging Face's safetensors files (:mod:`osdpipe.io.safetensors_out`),
    in files of at most ``max_shard_size`` bytes (``None``: one file), keyed
    by ``model_keys``: ``fqn``, the model's own ``state_dict()`` names;
    ``hf``, Hugging Face's names and layout through the model's own
    state-dict adapter (torchtitan's ``to_hf``: what its HF export writes
    and ``transformers`` loads); ``auto``, ``hf`` where the model has such
    an adapter (``model=torchtitan``), else ``fqn``.

    ``checkpoint`` names the layout a whole checkpoint is written in (see
    :class:`CheckpointConfig`); unset, the input's own, and for a DeepSpeed
    save, which osdpipe does not write, ``pytorch``. ``pytorch`` and
    ``accelerate`` are written from a checkpoint of any layout; ``torchtitan`` from one whose files say
    the step it was saved at (a DeepSpeed save's ``global_steps``), which
    names its ``step-<N>`` folder; ``hf`` from a Megatron-LM save: a Hugging Face
    model folder of its fp32 master weights; ``megatron`` from a Hugging Face model's ``accelerate``, ``pytorch`` or
    ``torchtitan`` checkpoint, or its model folder: a Megatron-LM save for ``target.tp_size`` x ``target.pp_size``
    x DP, optimizer included (:meth:`osdpipe.io.checkpoints.megatron.Megatron.map_into`); ``verl`` from a veRL
    checkpoint only.
    """

    path: str
    format: Literal["rank_local", "fsdp_full", "dcp", "plain", "megatron", "safetensors", "verl"] = "rank_local"
    checkpoint: Literal["torchtitan", "accelerate", "pytorch", "hf", "megatron", "verl"] | None = None
    key: str = "optim"
    overwrite: bool = False
    #: Sync every file and directory of a committed conversion to disk (see :mod:`osdpipe.io.output`); ``false``: for
    #: scratch output only.
    fsync: bool = True
    model_format: Literal["safetensors"] | None = None
    max_shard_size: int | None = None
    model_keys: Literal["auto", "fqn", "hf"] = "auto"
    #: How a Megatron-LM output saves its distributed optimizer (``checkpoint=megatron``); ``None``: as the source did.
    megatron_optim_format: Literal["dp_reshardable", "fully_reshardable"] | None = None
    #: The dtype a Hugging Face folder's weights are cast to (``output.checkpoint=hf``); ``None``: the fp32 masters.
    dtype: Literal["float32", "bfloat16", "float16"] | None = None

    @field_validator("path")
    @classmethod
    def _served(cls, path: str) -> str:
        """A URL names a store osdpipe writes and a bucket: else ``az://c/p`` or ``s3a://b/p`` would be taken for a
        local path and the conversion land in a directory named ``az:`` beside the user."""
        if is_url(path):
            parse(path, "output.path")
        elif (why := slash_short(path)) is not None:
            raise ValueError(why)
        return path

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _shard_size(cls, value: Any) -> int | None:
        size = parse_size(value)
        if size == 0:
            raise ValueError("a shard holds at least one byte; give a size such as 5GB, or null for one file")
        return size


class CheckpointConfig(_Frozen):
    """What the input is (:mod:`osdpipe.io.checkpoints`): the optimizer's state alone, or a whole training checkpoint
    as a framework lays it out.

    ``optimizer``: ``input.path`` is an optimizer checkpoint (``input.format``,
    ``input.key``). ``torchtitan``, ``accelerate``, ``pytorch`` (a DCP
    directory of ``{"model", "optim"}``, PyTorch's own state dicts):
    ``input.path`` is the framework's checkpoint folder; its model weights
    convert with the optimizer, everything else in it is carried over
    unchanged, and the output is laid out as the framework lays it out.
    ``deepspeed``: a ZeRO save folder, whose fp32 master weights are the
    model's; it is written in PyTorch's layout (osdpipe does not write DeepSpeed's).
    ``verl``: a veRL FSDP checkpoint folder (``actor/`` of ``global_step_<N>``, or the run's folder), each rank's
    model, optimizer and extra state; written again as one for ``target.world_size`` ranks (a job on CPU meshes so
    far), or in another layout with ``output.checkpoint``.
    ``megatron``: a Megatron-LM ``torch_dist`` save folder, written again as one
    for ``target.tp_size`` x ``target.pp_size`` x DP (:mod:`osdpipe.spec.megatron`).
    ``hf``: a Hugging Face model folder (``config.json`` and safetensors), its
    weights alone, written as a Megatron-LM ``release`` save with ``output.checkpoint=megatron``.

    ``model`` and ``flavor`` name a torchtitan checkpoint's model as
    torchtitan does (``--module llama3``, flavor ``8B``): torchtitan's own
    model from its registry, the same as ``model=torchtitan
    model.kwargs.name=<model> model.kwargs.flavor=<flavor>``
    (:func:`name_torchtitans_model` sets those as the config is composed).
    """

    layout: Literal[
        "optimizer", "torchtitan", "accelerate", "pytorch", "deepspeed", "megatron", "hf", "verl"
    ] = "optimizer"
    model: str | None = None
    flavor: str | None = None

    @model_validator(mode="after")
    def _torchtitans_names(self) -> CheckpointConfig:
        if self.model is None and self.flavor is None:
            return self
        if self.layout != "torchtitan":
            raise ValueError(
                "checkpoint.model and checkpoint.flavor name a torchtitan checkpoint's model; "
                f"set checkpoint=torchtitan, or model.factory for checkpoint={self.layout}"
            )
        if self.model is None or self.flavor is None:
            raise ValueError(
                "checkpoint.model and checkpoint.flavor go together, as torchtitan names a model: "
                "checkpoint.model=llama3 checkpoint.flavor=8B"
            )
        return self


class GenerateConfig(_Frozen):
    """How the source world trains when no input is given."""

    steps: int = Field(default=3, ge=0)
    seed: int = 0


#: The least ``runtime.memory_budget`` can be: two batches of 62 eight-byte elements.
MIN_MEMORY_BUDGET = 1000


class PipelineConfig(_Frozen):
    """Which stages run, in which order, and which verify checks."""

    stages: list[str] = Field(default_factory=lambda: list(STAGE_ORDER))
    checks: list[str] = Field(default_factory=lambda: list(check_registry.default_names()))
    #: ``resume``: the optimizer steps the target job and its reference take after loading.
    resume_steps: int = Field(default=2, ge=1)
    #: ``reference`` and ``load_step`` hold the whole state on every rank, or a live target model: they run
    #: only when the source's tensor state is at most this many bytes (``None``: always).
    full_state_checks_max: int | None = 10**9

    @field_validator("full_state_checks_max", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int | None:
        return parse_size(value)

    @field_validator("checks")
    @classmethod
    def _known_checks(cls, names: list[str]) -> list[str]:
        unknown = [n for n in names if n not in check_registry.names()]
        if unknown:
            raise ValueError(f"unknown check(s) {unknown}; the checks are {list(check_registry.names())}")
        return names

    @field_validator("stages")
    @classmethod
    def _known_stages(cls, stages: list[str]) -> list[str]:
        unknown = [s for s in stages if s not in STAGE_ORDER]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; known stages are {list(STAGE_ORDER)}")
        required = [s for s in REQUIRED_STAGES if s not in stages]
        if required:
            raise ValueError(
                f"stages {required} cannot be skipped: they produce the converted state (only verify and save can)"
            )
        if stages != sorted(stages, key=STAGE_ORDER.index):
            raise ValueError(f"stages {stages} are out of order; built-in stages run as {list(STAGE_ORDER)}")
        return stages


class RuntimeConfig(_Frozen):
    """How ranks are started and watched."""

    # offline: processes with no target job play the target's ranks in turn
    mode: Literal["online", "offline"] = "online"
    #: offline: how many local processes play the target's ranks (a share each, see osdpipe.run.world.ShareWorld);
    #: under torchrun, the torchrun world's size.
    workers: int = Field(default=1, ge=1)
    launcher: Literal["auto", "local", "torchrun"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = Field(default=300.0, gt=0)
    progress: bool = True
    debug: bool = False  # print tracebacks with errors
    log_level: Literal["debug", "info", "warning", "error"] = "info"  # what osdpipe.log in the output directory holds
    #: ``shared``: every rank reads the input itself. ``scatter``: one rank per host reads it and sends
    #: each other rank exactly its ranges through the process group (the input on one node's local disk).
    transfer: Literal["shared", "scatter"] = "shared"
    #: Bytes a rank may hold in flight (reads, messages); ``None``: no bound. Conversion then copies, sends and
    #: checks in pieces of at most half of it, and, where nothing needs the rank's output whole (``pipeline.checks``
    #: of ``roundtrip`` alone), makes the output as it writes it, so the budget bounds the output too
    #: (osdpipe.run.streamed_output).
    memory_budget: int | None = None
    #: fsspec's options for an ``s3://`` or ``gs://`` path, per scheme (``{s3: {endpoint_url: ...}}``), over the store's
    #: own endpoint and credential chain (osdpipe.io.store); recorded with every credential as ``***``.
    storage_options: dict[Literal["s3", "gs"], dict[str, Any]] = {}

    @field_serializer("storage_options")
    def _no_credential_recorded(self, options: dict[str, dict[str, Any]]) -> dict[str, Any]:
        from osdpipe.io.store import redacted_options  # no torch, no fsspec

        return redacted_options(options)

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> int | None:
        size = parse_size(value)
        if size is not None and size < MIN_MEMORY_BUDGET:
            raise ValueError(
                f"a memory budget of {show_size(size)} leaves no room to copy; "
                f"give at least {show_size(MIN_MEMORY_BUDGET)}"
            )
        return size

    @property
    def piece_bytes(self) -> int | None:
        """The most bytes one read, message or comparison holds at once (``None``: a whole local tensor)."""
        return None if self.memory_budget is None else self.memory_budget // 2


class RunSpec(_Frozen):
    """A complete, validated conversion."""

    model: ModelConfig = ModelConfig()
    #: Unset: the class's defaults, built without the kind checks, which import torch (the full pass checks both
    #: layouts).
    source: LayoutConfig = Field(default_factory=LayoutConfig.model_construct)
    target: LayoutConfig = Field(default_factory=LayoutConfig.model_construct)
    optim: OptimConfig = OptimConfig()
    input: InputConfig = InputConfig()
    output: OutputConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    generate: GenerateConfig = GenerateConfig()
    pipeline: PipelineConfig = PipelineConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    @model_validator(mode="before")
    @classmethod
    def _generated_source_optimizer(cls, raw: Any) -> Any:
        """No input and ``optim.name=auto`` (or ``lr`` unset): the source osdpipe trains uses
        :data:`GENERATED_OPTIMIZER` at :data:`DEFAULT_LR`.

        With an input, ``auto`` is the input's optimizer, which only its files
        tell (:func:`osdpipe.spec.reconcile.settle_optimizer`, before validation).
        """
        if (
            not isinstance(raw, dict)
            or not isinstance(raw.get("optim", {}), dict)
            or not isinstance(raw.get("input", {}), dict)
        ):
            return raw
        optim = raw.get("optim") or {}
        if (raw.get("input") or {}).get("path") is not None or (
            optim.get("name", AUTO) != AUTO and optim.get("lr") is not None
        ):
            return raw
        name = GENERATED_OPTIMIZER if optim.get("name", AUTO) == AUTO else optim["name"]
        return {
            **raw,
            "optim": {**optim, "name": name, "lr": DEFAULT_LR if optim.get("lr") is None else optim["lr"]},
        }

    @model_validator(mode="before")
    @classmethod
    def _target_follows_source(cls, raw: Any, info: ValidationInfo) -> Any:
        """``target.kind`` null: the source's kind (:func:`followed_kind`); a ``target`` without ``kind`` is the
        schema's default. The schema pass leaves it null: the layout kinds import torch."""
        if not isinstance(raw, dict) or not _complete(info):
            return raw
        target, source = raw.get("target"), raw.get("source") or {}
        if not isinstance(target, dict) or "kind" not in target or target["kind"] is not None:
            return raw
        given = source.get("kind", LayoutConfig.model_fields["kind"].default) if isinstance(source, dict) else None
        return raw if given is None else {**raw, "target": {**target, "kind": followed_kind(given)}}

    @model_validator(mode="before")
    @classmethod
    def _default_wrap(cls, raw: Any, info: ValidationInfo) -> Any:
        """``source.wrap`` / ``target.wrap`` unset or null: the model's own units (see :class:`ModelConfig`).

        The schema pass does not build the model: it checks the rest with no units.
        """
        if not isinstance(raw, dict):
            return raw
        sides = {side: raw.get(side) or {} for side in ("source", "target")}
        if all(isinstance(s, dict) and s.get("wrap") is not None for s in sides.values()):
            return raw
        model = raw.get("model") or {}
        units = model.get("units") if isinstance(model, dict) else None
        if units is None and not _complete(info):
            units = []
        elif units is None:
            # builds the model on the meta device (torch): not before the schema is checked
            from osdpipe.layout.models import model_units

            try:
                units = model_units(model.get("factory", "nested"), model.get("kwargs") or {})
            except (ValueError, TypeError) as exc:
                raise ValueError(f"model: {exc}") from None
        out = dict(raw)
        for side, value in sides.items():
            if isinstance(value, dict) and value.get("wrap") is None:
                out[side] = {**value, "wrap": list(units) if isinstance(units, (list, tuple)) else units}
        return out

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> RunSpec:
        why = megatron_problem(self)
        if why is not None:
            raise ValueError(why)
        # a Megatron save's source side is what its files say (reconcile settles it)
        for side in ("target",) if self.checkpoint.layout == MEGATRON else ("source", "target"):
            why = getattr(self, side).mesh_problem()
            if why is not None:
                raise ValueError(f"{side}.{why}")
        named = self.checkpoint.model
        # a Megatron output's model is Megatron's GPT of the checkpoint: checkpoint.model names the source's alone
        if named is not None and self.output.checkpoint != MEGATRON and (
            (self.model.factory, self.model.kwargs.get("name"), self.model.kwargs.get("flavor"))
            != ("torchtitan", named, self.checkpoint.flavor)
        ):
            raise ValueError(
                f"checkpoint.model={named} checkpoint.flavor={self.checkpoint.flavor} names torchtitan's own model, "
                f"model.factory={self.model.factory} another (or other kwargs); give one of them"
            )
        if self.runtime.mode == "offline" and self.runtime.transfer == "scatter":
            raise ValueError(
                "runtime.transfer=scatter sends bytes between the ranks of a world; "
                "runtime.mode=offline plays ranks apart: set runtime.transfer=shared"
            )
        if self.runtime.workers > 1 and self.runtime.mode != "offline":
            raise ValueError(
                f"runtime.workers={self.runtime.workers} plays the target's ranks offline; "
                "set runtime.mode=offline (online, the world has target.world_size ranks)"
            )
        if self.runtime.workers > getattr(self.target, "world_size", self.runtime.workers):
            raise ValueError(
                f"runtime.workers={self.runtime.workers} is more than target.world_size={self.target.world_size}; "
                "each worker plays at least one target rank"
            )
        if not _complete(info):
            return self  # the rest needs torch, or what the input's files settle (input.format, source.*)
        # the registries import torch: not before the schema is checked
        from osdpipe.io import checkpoints, formats
        from osdpipe.layout import kinds

        input_is_dir = self._input_is_dir()

        source, target = kinds.get(self.source.kind), kinds.get(self.target.kind)
        given, written = formats.get(self.input.format), formats.get(self.output.format)
        layout = checkpoints.get(self.checkpoint.layout)
        if self.input.path is not None and layout.whole and not input_is_dir:
            raise ValueError(
                f"input.path={self.input.path!r}: checkpoint={layout.name} reads the framework's checkpoint folder "
                f"({layout.looks_like}); point it there"
            )
        if (
            self.input.path is not None
            and not layout.whole
            and given.directory != input_is_dir
        ):
            files, directories = (
                " or ".join(f.name for f in formats.FORMATS.values() if f.directory == d) for d in (False, True)
            )
            if given.directory:
                raise ValueError(
                    f"input.path={self.input.path!r}: a {given.name} input is a directory; "
                    f"use input.format={files} for a file"
                )
            raise ValueError(f"input.path={self.input.path!r} is a directory; set input.format={directories}")
        why = (
            (given.refuses_source(source) if self.input.path is not None else None)
            or written.refuses_target(target)
            or target.refuses_output(written)
        )
        if why is not None:
            raise ValueError(why)
        if self.output.checkpoint is not None and not layout.whole:
            raise ValueError(
                f"output.checkpoint={self.output.checkpoint} writes a whole training checkpoint, model and optimizer; "
                "the input is an optimizer's alone (checkpoint=optimizer): set checkpoint= to the input's layout "
                "(torchtitan, accelerate, pytorch, deepspeed), or leave output.checkpoint out"
            )
        writer = checkpoints.written(self.checkpoint.layout, self.output.checkpoint)
        why = (
            layout.refuses(given, source, generated=self.input.path is None)
            or writer.refuses_output(layout, written, target)
        )
        if why is not None:
            raise ValueError(why)
        if self.output.model_keys == "hf":
            # imports the model's framework: not before the schema is checked
            from osdpipe.layout.models import hf_adapter

            if hf_adapter(self.model.factory, self.model.kwargs) is None:
                raise ValueError(
                    f"output.model_keys=hf: model.factory={self.model.factory} has no Hugging Face state-dict adapter "
                    "(model=torchtitan has torchtitan's); set output.model_keys=fqn"
                )
        if self.output.model_format is not None and not layout.whole:
            raise ValueError(
                f"output.model_format={self.output.model_format} exports a whole checkpoint's model; "
                "this input is an optimizer's alone (checkpoint=optimizer): set checkpoint=torchtitan, accelerate, "
                "pytorch or deepspeed for a checkpoint that holds the model"
            )
        if self.input.path is None and self.source.state_dict_type not in source.state_dict_types:
            raise ValueError(
                f"source.state_dict_type={self.source.state_dict_type}: a {self.source.kind} job saves "
                f"{', '.join(source.state_dict_types)}; choose one of those"
            )
        previous = [p.name for p in conversion_entries(Path(self.output.path))]
        if previous and not self.output.overwrite:
            raise ValueError(already_holds(self.output.path, previous))
        return self

    def _input_is_dir(self) -> bool:
        """Whether ``input.path`` is a directory: on the local disk, or in object storage a prefix with objects under
        it, asked now with ``runtime.storage_options`` (a missing bucket or key, refused credentials: one line)."""
        if self.input.path is None:
            return False
        if not is_remote(self.input.path):
            return Path(self.input.path).is_dir()
        from osdpipe.io import remote_input  # fsspec: only for an input in object storage

        remote_input.configure(self.runtime.storage_options, self.runtime.memory_budget)
        return remote_input.probe(self.input.path).get("type") == "directory"

    @property
    def source_input_format(self) -> str:
        """The format the source is read in: given, or what the source world saves."""
        if self.input.path is not None:
            return self.input.format
        from osdpipe.io import checkpoints  # the registries import torch: a running job's question, not start-up's
        from osdpipe.layout import kinds

        layout = checkpoints.get(self.checkpoint.layout)
        if layout.whole:  # the framework's own layout: its sharded variant
            return layout.input_formats[0]
        return kinds.get(self.source.kind).saved_format(self.source.state_dict_type)


def name_torchtitans_model(raw: dict[str, Any], model_given: bool) -> dict[str, Any]:
    """``raw`` with ``checkpoint.model`` and ``checkpoint.flavor`` (torchtitan's names: ``llama3``, ``8B``) as the
    model they name, torchtitan's own from its registry (``model.factory=torchtitan``), where the user named no model
    otherwise (``model_given``); where they did, the schema refuses the two if they disagree."""
    named = raw.get("checkpoint") or {}
    if model_given or named.get("model") is None or named.get("flavor") is None:
        return raw
    return {
        **raw,
        "model": {
            **(raw.get("model") or {}),
            "factory": "torchtitan",
            "kwargs": {"name": named["model"], "flavor": named["flavor"]},
        },
    }


def check_schema(raw: dict[str, Any]) -> RunSpec:
    """Check what needs neither torch nor the input's files: types, ranges, choices, unknown keys, stages, sizes,
    paths, runtime's rules.

    It imports nothing heavy, so that a mistyped value is said at once: the
    launcher runs it before anything that imports torch, and before the
    input's files settle what the user left out (:mod:`osdpipe.spec.reconcile`):
    what depends on that (``input.format`` against the path) waits for
    :func:`validate`.

    Returns the config as far as the schema checks it (what a Megatron conversion, which the layout kinds do not lay
    out, runs from: :mod:`osdpipe.spec.megatron`).

    Raises:
        ConfigError: with one line per problem, naming the key, the value and the fix.
    """
    try:
        return RunSpec.model_validate(raw, context=SCHEMA_ONLY)
    except ValidationError as exc:
        raise ConfigError(exc) from None


def validate(raw: dict[str, Any]) -> RunSpec:
    """Validate a composed config (a plain dict) into a :class:`RunSpec`: :func:`check_schema`, then what needs
    torch.

    The second pass checks the layout kinds, the optimizer class and its
    hyperparameters, fills ``wrap`` with the model's units and computes both
    layouts on the meta model. ``optim.name=auto`` with an ``input.path``
    stays ``auto``: a config built in code settles it from the input's files
    with :func:`osdpipe.spec.reconcile.settle_and_validate`, the command with
    :func:`osdpipe.spec.reconcile.reconcile`.

    Raises:
        ConfigError: with one line per problem, naming the key, the value and the fix.
    """
    check_schema(raw)
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(exc) from None


def check_overrides(values: dict[str, Any]) -> None:
    """Check keys and values one by one against the schema, before Hydra composes a config from them.

    ``values`` are a command line's overrides (``{"target.world_size":
    "zero"}``), typed as Hydra types them. The command line wins over every
    YAML file, so a key the schema does not have, or a value its field
    refuses, is wrong whatever the rest of the config turns out to be; this
    says so in the lines the composed config would, without Hydra's second
    or so. Keys it cannot judge alone pass: those outside the schema's
    sections (``hydra.*``, ``recipe``), under an open dict (``model.kwargs.*``),
    naming a config group (``model=mlp``), and ``null`` (``wrap``'s "the
    model's units"). :func:`check_schema` checks them all once composed.

    Raises:
        UnknownKey: a key the schema does not have (the first such).
        ConfigError: one line per value its field refuses.
    """
    lines: list[str] = []
    for key, value in values.items():
        field = _schema_field(key)
        if field is None or value is None:
            continue
        model, name = field
        try:
            model.model_validate({name: value}, context=SCHEMA_ONLY)
        except ValidationError as exc:
            lines += _lines([e for e in exc.errors() if e["loc"][:1] == (name,)], tuple(key.split(".")[:-1]))
    if lines:
        raise ConfigError(lines)


def _schema_field(key: str) -> tuple[type[BaseModel], str] | None:
    """The section and the name of the plain field a dotted key names; ``None`` when the schema alone cannot judge
    the key.

    Raises:
        UnknownKey: the key is not in a section that takes only its own keys.
    """
    *parents, name = key.split(".")
    model: type[BaseModel] = RunSpec
    for part in parents:
        if part not in model.model_fields:
            if model is RunSpec:
                return None  # hydra.*, ...: Hydra's own
            raise UnknownKey(key)
        annotation = model.model_fields[part].annotation
        if (
            not (isinstance(annotation, type) and issubclass(annotation, BaseModel))
            or annotation.model_config.get("extra") != "forbid"
        ):
            return None  # an open dict (model.kwargs), a list or a plain value on the way
        model = annotation
    if model is RunSpec:
        return None  # a config group (model=mlp) or Hydra's (recipe=...)
    if name not in model.model_fields:
        raise UnknownKey(key)
    annotation = model.model_fields[name].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return None  # a section given whole
    return model, name


def _lines(errors: list[Any], where: tuple[str, ...] = ()) -> list[str]:
    """Pydantic's errors as one line each: the key (under ``where``), the value given, and what is wrong or what
    to do."""
    lines = []
    for err in errors:
        loc = (*where, *err["loc"])
        key = ".".join(str(p) for p in loc)
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {redact(repr(value))})"  # a URL's password: never said
        if err["type"] == "extra_forbidden":
            msg = "is not a known key; check its spelling against the config reference in docs/config.md"
        said_whole = msg.startswith(f"{key}=")  # the message names the key and its value itself (a URL, redacted)
        lines.append(f"{key}{shown}: {msg}" if loc and not said_whole else msg)
    return lines


class ConfigError(ValueError):
    """An invalid config, said in lines a user can act on."""

    def __init__(self, problems: ValidationError | list[str]) -> None:
        super().__init__("\n".join(_lines(problems.errors()) if isinstance(problems, ValidationError) else problems))


class UnknownKey(ConfigError):
    """A key that is not in the config, in the words Hydra's complaint about it is said in
    (:func:`osdpipe.cli.compose.hydra_message`)."""

    def __init__(self, key: str) -> None:
        super().__init__([unknown_key(key)])


def unknown_key(key: str) -> str:
    """The line for a key the config does not have."""
    return (
        f"{key}: not a known key; check its spelling against the config reference in docs/config.md "
        "(osdpipe --help lists the main keys)"
    )
