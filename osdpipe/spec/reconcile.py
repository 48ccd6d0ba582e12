"""Believe the files, not the flags: a user's description of a checkpoint, held against what its files show.

Before the config is validated, in the launcher, the input's metadata is read
(:func:`osdpipe.io.file_facts.read_facts`) and every fact the files show settles a
key of the config:

* a key the user did not give (a default, or a recipe's value for the source
  it would generate) takes the files' value: ``input.format``, ``input.key``,
  ``source.world_size``, ``source.kind`` and its FSDP2 mesh, ``optim.name``
  (``auto``: the checkpoint's optimizer); ``optim.lr`` is left unset: the checkpoint's param groups keep
  their own (values read from files are facts, never validated as settings: ``lr=0.0`` at the end of a schedule);
* a key the user gave that contradicts the files is a :class:`Contradiction`:
  one line that says what the files show and how to mend it (exit code 2,
  nothing written);
* a hyperparameter the user gave that differs from the checkpoint's is one
  warning each: the output keeps the checkpoint's, as PyTorch's own
  conversions do, and a resuming optimizer's ``load_state_dict`` sets it.

A file that cannot be read is left to the pre-flight check that follows
(:func:`osdpipe.pipeline.execute.check_source`), which says what is wrong with it.
"""

from __future__ import annotations

import copy
import glob
from collections.abc import Iterable
from typing import Any

from osdpipe.io import checkpoints, formats, remote_input
from osdpipe.io.errors import ModelRefused
from osdpipe.io.file_facts import checkpoint_in, detect_format, read_facts
from osdpipe.io.formats import InputError
from osdpipe.io.formats.base import OtherLayout
from osdpipe.io.formats.state_facts import MOMENTS_ALIKE
from osdpipe.io.store import is_remote
from osdpipe.layout import kinds
from osdpipe.layout.optim import optimizer_label, resolve_optimizer
from osdpipe.layout.optim_infer import fingerprint, hyperparameter_names, kept_state, state_names_of
from osdpipe.spec.config import (
    AUTO,
    DEFAULT_LR,
    GENERATED_OPTIMIZER,
    ConfigError,
    RunSpec,
    check_schema,
    followed_kind,
    validate,
)


class Contradiction(ValueError):
    """A key the user gave says one thing, the input's files another (exit code 2)."""


class Given:
    """The config keys a user set themselves: on the command line (Hydra's task overrides) or as an API argument.

    A group override (``optim=adamw``) gives every key under it.
    """

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = {k.lstrip("+~").split("=", 1)[0].strip() for k in keys}

    def __contains__(self, key: str) -> bool:
        return any(key == k or key.startswith(f"{k}.") for k in self.keys)

    @classmethod
    def from_overrides(cls, overrides: Iterable[str]) -> Given:
        return cls(o for o in overrides if "=" in o)


def _get(raw: dict[str, Any], key: str) -> Any:
    node: Any = raw
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def reconcile(raw: dict[str, Any], given: Given) -> tuple[dict[str, Any], list[str]]:
    """``raw`` (a composed config, as a plain dict) settled against the input's files; and the warnings to report.

    Raises:
        Contradiction: a key the user gave contradicts the files.
    """
    raw = copy.deepcopy(raw)
    path = _get(raw, "input.path")
    if path is None:  # osdpipe generates the source: its optimizer is the config's, Adam for auto
        if _get(raw, "optim.name") in (None, AUTO):
            _set(raw, "optim.name", GENERATED_OPTIMIZER)
        if _get(raw, "optim.lr") is None:
            _set(raw, "optim.lr", DEFAULT_LR)
        return raw, _settle_target_kind(raw, _get(raw, "source.kind"), "the source osdpipe trains")
    notes, facts = _from_files(raw, given, path)
    if "source.kind" in given:
        told = _get(raw, "source.kind")
    else:  # what the files show: settled into source.kind (a plain file's none), or named alone (an osdpipe output's)
        told = facts.kind if facts is not None and kinds.find(facts.kind) is not None else None
    notes += _settle_target_kind(raw, told, _get(raw, "input.path"))
    return raw, notes + _advice(raw)


def _advice(raw: dict[str, Any]) -> list[str]:
    """What the framework's job on the target will make of a whole checkpoint's output (its layout's
    :meth:`~osdpipe.io.checkpoints.base.CheckpointLayout.advice`), once the target is settled."""
    layout = checkpoints.get(_get(raw, "checkpoint.layout") or "optimizer")
    if not layout.whole:
        return []
    writer, target = checkpoints.written(layout.name, _get(raw, "output.checkpoint")), _get(raw, "target") or {}
    try:
        if writer is layout:
            return writer.advice(_get(raw, "input.path"), target, _get(raw, "output.format"))
        return writer.foreign_advice(layout.name, target)
    except (InputError, OSError):
        return []  # the pre-flight check says what is wrong with it


def _from_files(raw: dict[str, Any], given: Given, path: str) -> tuple[list[str], Any]:
    """Settle ``raw`` (in place) against the files of the input at ``path``: the warnings to report, and the facts of
    its optimizer's files (``None``: it has none, or they cannot be read; the pre-flight check says why)."""
    layout = checkpoints.get(_get(raw, "checkpoint.layout") or "optimizer")
    if is_remote(path):  # read with the user's options (osdpipe.io.remote_input)
        remote_input.configure(_get(raw, "runtime.storage_options"))
        try:  # the first look, bounded (osdpipe.io.store.first_look_s): a store that fails it is said now, once, not
            remote_input.probe(path)  # after the reads below waited out s3fs's retries and the pre-flight check again
        except InputError as exc:
            raise ConfigError([str(exc)]) from None
    notes: list[str] = []
    # an earlier conversion's output.path: the checkpoint it holds (a whole checkpoint's folder, too)
    if (inner := checkpoint_in(held := remote_input.as_path(path))) != held:
        _set(raw, "input.path", str(inner))
        notes.append(f"input.path={path} is an osdpipe output; converting the checkpoint it holds, {inner}")
        path = str(inner)
    # the framework's folder of checkpoints
    if layout.whole and remote_input.as_path(path).is_dir() and (newest := layout.newest_in(path)) is not None:
        _set(raw, "input.path", newest)
        notes.append(f"input.path={path} is {layout.name}'s folder of checkpoints; converting the newest, {newest}")
        path = newest
    if layout.whole and (why := another_layouts(layout, path)) is not None:
        raise Contradiction(why)
    if layout.whole:  # the optimizer part shows what the job was; the folder itself is the layout's
        fmt = _get(raw, "input.format") if "input.format" in given else layout.input_format_of(path)
        writer = checkpoints.written(layout.name, _get(raw, "output.checkpoint"))
        for key, value in writer.settles(layout, path).items():  # what the output's own layout says of its job
            if key not in given:
                _set(raw, key, value)
        model_given = "model.factory" in given
        if model_given and writer is not layout and writer.builds_own_model:
            _name_the_sources_model(raw, given, layout, writer)  # the run's model is the output job's own
            model_given = False
        if not model_given and (named := _model_from_files(layout, path, writer, raw)) is not None:
            _set(raw, "model.factory", named[0])
            _set(raw, "model.kwargs", named[1])
            notes.append(
                f"no model.factory given: the model is built from {path}'s files (every parameter's name and shape); "
                "give model.factory=... for your own"
            )
        _set(raw, "input.format", fmt)
        keep = (
            layout.output_format_of(fmt)
            if writer is layout
            else writer.output_formats[0]  # another framework's: its own format
        )
        if "output.format" not in given and keep is not None:
            _set(raw, "output.format", keep)  # the source's state-dict type, which the job that resumes is set to
        try:
            part = layout.optimizer_part(path, fmt, writer)
            why = layout.refuses_keys(path, given, raw)
        except InputError:
            return notes, None  # the pre-flight check says what is wrong with it
        if why is not None:
            raise Contradiction(why)
        # a model-only checkpoint: no optimizer to settle; the checks resume with the one osdpipe trains
        if part is None:
            if _get(raw, "optim.name") in (None, AUTO):
                _set(raw, "optim.name", GENERATED_OPTIMIZER)
            return notes + [
                f"{path} holds the model alone (no optimizer state): the output holds the model alone too"
            ], None
        _settle_source_kind(raw, given, formats.get(part.format))  # the format's, even where its files fail
        try:
            facts = read_facts(part.path, part.format, part.key)
        except InputError:
            return notes, None  # the pre-flight check says what is wrong with it
        _settle_layout(raw, given, facts)
        # read through a map into the output job's own model (a Hugging Face model's into Megatron's GPT): its groups
        # hold the target model's parameters the source's are read into
        mapping = None if writer is layout else _map_into(writer, layout, path, raw)
        if mapping is not None and facts.group_fqns:
            facts.group_fqns = [mapping.members(group, mapping.pieces) for group in facts.group_fqns]
        return notes + _settle_optimizer(raw, given, facts), facts
    try:
        fmt = detect_format(path)
    except OtherLayout as exc:
        raise Contradiction(f"input.path: {exc}") from None
    except InputError:
        return notes, None  # the pre-flight check says what is wrong with it
    _settle(raw, given, "input.format", fmt, f"{path} is {formats.get(fmt).looks_like}")
    try:
        facts = read_facts(path, fmt, _get(raw, "input.key") if "input.key" in given else None)
    except InputError:
        return notes, None
    if facts.key is not None:
        _settle(raw, given, "input.key", facts.key, f"{path} holds its optimizer state under {facts.key!r}")
    _settle_layout(raw, given, facts)
    notes += _settle_optimizer(raw, given, facts)
    if facts.moments_alike:
        notes.append(f"{path}: {MOMENTS_ALIKE}; it converts as it is")
    return notes, facts


def _settle_target_kind(raw: dict[str, Any], told: str | None, source: str) -> list[str]:
    """``target.kind`` unset (null): the source's kind (:func:`osdpipe.spec.config.followed_kind`), where ``told``
    (the user gave it, or ``source``'s files show it); else ``source.kind``'s. A warning says the kind chosen where it
    is not the source's known one: the files do not tell it, or the source is one process's."""
    target = raw.get("target")
    if not isinstance(target, dict) or "kind" not in target or target["kind"] is not None:
        return []  # given (a recipe's, a framework's), or the schema's default
    kind = followed_kind(told or _get(raw, "source.kind"))
    target["kind"] = kind
    if told == kind or (told is not None and kinds.find(told) is None):
        return []  # followed, or no kind at all (source.kind's error says so)
    choose = "set target.kind (fsdp1, fsdp2, ddp, or none with target.world_size=1) for the job that loads it"
    if told is not None:
        return [f"target.kind={kind}: {source} is {kinds.get(told).one_process} (source.kind={told}), not a layout "
                f"of ranks to follow; {choose}"]
    return [f"target.kind={kind}, source.kind's: {source}'s files do not say which kind of job saved it; {choose}"]


def another_layouts(layout: Any, path: str) -> str | None:
    """Why ``path``, given as ``checkpoint=<layout>``, is the checkpoint of another layout (an accelerate folder as
    torchtitan's, a Megatron-LM save as DeepSpeed's), naming the ``checkpoint=`` that reads it; ``None``: ``layout``
    reads it, or no layout does (the pre-flight check says what is wrong with it). Said as a bad config, before
    anything runs, rather than as the stage that fails to find its files."""
    try:
        where = checkpoint_in(remote_input.as_path(path))  # an earlier conversion's output: the checkpoint it holds
        if layout.recognizes(where) or (found := checkpoints.recognizing(where)) is None:
            return None
    except (InputError, OSError):
        return None
    other = found[0]
    if other.name == layout.name or (layout.one_dcp and other.one_dcp):
        return None  # either reads the other's DCP directory
    return (f"input.path: {where} is {other.looks_like}, not what checkpoint={layout.name} reads "
            f"({layout.looks_like}); set checkpoint={other.name}")


def _map_into(writer: Any, layout: Any, path: str, raw: dict[str, Any]) -> Any:
    """The map the output's layout ``writer`` reads the checkpoint at ``path`` (``layout``'s, its model as ``raw``'s
    ``checkpoint`` section names it, if it does) through into its own model, if any (``None`` also where the files
    cannot say: the pre-flight check says what is wrong with them)."""
    try:
        return writer.map_into(layout, path, named=layout.named_by(raw.get("checkpoint") or {}))
    except (InputError, OSError, ValueError):
        return None


def _name_the_sources_model(raw: dict[str, Any], given: Given, layout: Any, writer: Any) -> None:
    """Where the output's job builds a model of its own of the checkpoint (``writer``'s: Megatron's GPT), the
    ``model`` section the user gave names the source's (``model=torchtitan``): set (in ``raw``) as the
    ``checkpoint`` keys that name it (:meth:`~osdpipe.io.checkpoints.base.CheckpointLayout.naming_of`).

    Raises:
        Contradiction: a model the source's layout is not named by, or ``checkpoint`` keys given that name another.
    """
    model = raw.get("model") or {}
    naming = layout.naming_of(model)
    if naming is None:
        raise Contradiction(
            f"model.factory={model.get('factory')}: a {writer.name} output holds {writer.name}'s own model of the "
            f"checkpoint, made of its files; drop model.* (the {layout.name} checkpoint's model is read from them)"
        )
    for key, value in naming.items():
        if key in given and _get(raw, key) not in (None, value):
            raise Contradiction(f"{key}={_get(raw, key)} names another model than model.*; give one of them")
        _set(raw, key, value)


def _model_from_files(
    layout: Any, path: str, writer: Any, raw: dict[str, Any],
) -> tuple[str, dict[str, Any]] | None:
    try:
        return layout.model_for(writer, path, raw)
    except ModelRefused as exc:  # read, and no model it could build: said now, or the run builds another
        raise ConfigError([str(exc)]) from None
    except (InputError, OSError):
        return None  # the pre-flight check says what is wrong with it


def settle_optimizer(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with ``optim.name=auto`` settled from the input, where no launcher reconciled it.

    What validating a config built in code (the Python API, tests) needs:
    the optimizer is the only key a run cannot go without that ``auto``
    leaves open. An input that cannot be read leaves it open for the
    pre-flight check to explain.
    """
    optim = _get(raw, "optim") or {}
    if optim.get("name", AUTO) != AUTO and (optim.get("lr") is not None or _get(raw, "input.path") is not None):
        return raw
    raw = copy.deepcopy(raw)
    if _get(raw, "input.path") is None:
        return reconcile(raw, Given(()))[0]
    try:
        facts = read_facts(_get(raw, "input.path"), _get(raw, "input.format") or "fsdp_full", _get(raw, "input.key"))
    except (InputError, KeyError):
        return raw
    _settle_optimizer(raw, Given(["optim.name"] if optim.get("name", AUTO) != AUTO else []), facts)
    return raw


def settle_and_validate(raw: dict[str, Any]) -> RunSpec:
    """A config built in code (the Python API, tests, benchmarks), validated as the command validates its own.

    :func:`osdpipe.spec.config.check_schema` first, then :func:`settle_optimizer`
    (which reads the input's files), then :func:`osdpipe.spec.config.validate`.
    :func:`osdpipe.spec.config.validate` alone leaves ``optim.name=auto`` with an
    input as it is: the config module reads no files.

    Raises:
        ConfigError: one line per problem; an optimizer the input's files cannot tell is one too.
    """
    check_schema(raw)
    try:
        raw = settle_optimizer(raw)
    except Contradiction as exc:
        raise ConfigError([str(exc)]) from None
    return validate(raw)


def _settle(raw: dict[str, Any], given: Given, key: str, value: Any, shows: str) -> None:
    """``key`` takes the files' ``value`` unless the user gave it; given and different, it is a
    :class:`Contradiction`."""
    current = _get(raw, key)
    if current == value:
        return
    if key in given:
        raise Contradiction(
            f"{key}={current}, but {shows}: set {key}={value}, or leave {key} out and osdpipe reads it from the input"
        )
    _set(raw, key, value)


def _settle_layout(raw: dict[str, Any], given: Given, facts: Any) -> None:
    """What the files show of the layout that saved them: the kind a format's files come from (a plain file's: one
    process), and the keys its format says they settle (:meth:`~osdpipe.io.formats.base.Format.shows`: the world size
    of DCP's and rank files, FSDP2 and its mesh)."""
    fmt = formats.get(facts.format)
    if "source.kind" in given:
        kind = _get(raw, "source.kind")
        refusal = fmt.refuses_saved_by(kinds.find(kind), facts.path)
        if refusal is not None:
            raise Contradiction(f"source.kind={kind}, but {refusal}")
    else:
        _settle_source_kind(raw, given, fmt)
    for shown in fmt.shows(facts, kinds.find(_get(raw, "source.kind"))):
        if shown.shows is not None:
            _settle(raw, given, shown.key, shown.value, shown.shows)
        elif shown.key not in given:
            _set(raw, shown.key, shown.value)


def _settle_source_kind(raw: dict[str, Any], given: Given, fmt: Any) -> None:
    """The kind of job a format's files come from (:attr:`~osdpipe.io.formats.base.Format.source_kind`), where the
    user did not say: a kind of one process (a plain file's, a save read whole) on one rank."""
    if "source.kind" in given or fmt.source_kind is None:
        return
    _set(raw, "source.kind", fmt.source_kind)
    if kinds.get(fmt.source_kind).one_process is not None and "source.world_size" not in given:
        _set(raw, "source.world_size", 1)


def _settle_optimizer(raw: dict[str, Any], given: Given, facts: Any) -> list[str]:
    """``optim.name`` from the checkpoint unless given; a given one must keep the state the checkpoint has. Returns the
    warnings."""
    name = _get(raw, "optim.name")
    warnings: list[str] = []
    if "optim.name" not in given or name in (None, AUTO):
        if facts.optimizer is None:
            raise Contradiction(
                f"optim.name=auto, but the optimizer of {facts.path} cannot be told from its state "
                f"({facts.optimizer_why}); "
                + (
                    f"set optim.name to one of {', '.join(facts.optimizer_candidates)}"
                    if facts.optimizer_candidates
                    else "set optim.name=package.module:Class"
                )
            )
        _set(raw, "optim.name", facts.optimizer)
    else:
        try:
            cls = resolve_optimizer(name)
        except ValueError:
            return warnings  # validation names what is wrong with the name itself
        mismatch = _does_not_fit(cls, name, raw, facts)
        if mismatch:
            held = f"{facts.optimizer}'s: " if facts.optimizer else ""
            raise Contradiction(
                f"optim.name={name} {mismatch}; {facts.path} holds {held}state {facts.state_names}: "
                + (
                    f"set optim.name={facts.optimizer}, or leave it out (auto: the checkpoint's)"
                    if facts.optimizer
                    else "set optim.name to the optimizer that saved it"
                )
            )
        if facts.optimizer is not None and facts.optimizer != name:
            warnings.append(
                f"optim.name={name}, but {facts.path} was saved by {optimizer_label(facts.optimizer)}, "
                "as its param groups' hyperparameter names and its state names show; "
                f"converting for {optimizer_label(name)} as asked, with the checkpoint's hyperparameters"
            )
    if (
        "optim.param_groups" not in given
        and not _get(raw, "optim.param_groups")
        and facts.group_fqns
        and len(facts.group_fqns) > 1
    ):
        # The target's optimizer takes the checkpoint's grouping (the Trainer's decay / no-decay groups), each FQN
        # matched as itself.
        _set(raw, "optim.param_groups", [{"params": [glob.escape(f) for f in group]} for group in facts.group_fqns])
    # optim.lr stays unset: the checkpoint's groups hold their lr, which load_state_dict sets. It is a fact of the
    # files, never validated as a setting (a schedule that decayed to 0 ends with lr=0.0, which optim.lr refuses).
    return warnings + _differing_hyperparameters(raw, given, facts)


def _does_not_fit(cls: type, name: str, raw: dict[str, Any], facts: Any) -> str | None:
    """How the optimizer ``name`` cannot take the checkpoint's state, in words (``None``: it can).

    It cannot when it reads hyperparameters the checkpoint's param groups lack
    (they replace its own on loading); when, built as configured, it keeps
    state the checkpoint lacks; or when the checkpoint holds state it never
    keeps. The hyperparameters are compared first: the state names need a
    step of the optimizer.
    """
    known = fingerprint(cls, name)
    keys = hyperparameter_names(facts.param_groups)
    if known is not None and keys and known.hyperparameters - keys:
        return (
            f"reads hyperparameters {sorted(known.hyperparameters - keys)}, "
            "which the checkpoint's param groups (loaded in place of its own) do not have"
        )
    held = set(facts.state_names)
    if not held:
        return None
    options = {
        **(_get(raw, "optim.kwargs") or {}),
        **({"lr": _get(raw, "optim.lr")} if _get(raw, "optim.lr") is not None else {}),
    }
    kept, ever = kept_state(cls, options), state_names_of(cls)
    if kept is not None and kept - held:
        return f"keeps state {sorted(kept - held)}, which the checkpoint does not hold"
    if ever is not None and held - ever:
        return f"never keeps state {sorted(held - ever)}, which the checkpoint holds"
    return None


def _differing_hyperparameters(raw: dict[str, Any], given: Given, facts: Any) -> list[str]:
    """One warning per hyperparameter the user gave (``optim.lr``, ``optim.kwargs.*``, ``optim.param_groups[i].*``)
    that differs from the checkpoint's."""
    out = []
    groups = facts.param_groups
    configured = [
        (f"optim.{k}" if k == "lr" else f"optim.kwargs.{k}", k, v, range(len(groups)))
        for k, v in [("lr", _get(raw, "optim.lr")), *(_get(raw, "optim.kwargs") or {}).items()]
    ]
    for i, group in enumerate(_get(raw, "optim.param_groups") or []):
        configured += [(f"optim.param_groups[{i}].{k}", k, v, [i]) for k, v in group.items() if k != "params"]
    for key, name, value, indices in configured:
        if key.split("[")[0] not in given and key not in given:
            continue
        for i in indices:
            if i < len(groups) and name in groups[i] and not _same(groups[i][name], value):
                out.append(
                    f"{key}={value} differs from the checkpoint's {name}={groups[i][name]} in param group {i}; "
                    f"the output keeps the checkpoint's {groups[i][name]}, "
                    "which a resuming optimizer's load_state_dict sets (change it after loading to train with another)"
                )
                break
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
