"""``osdpipe inspect PATH [--json]``: what a checkpoint is, read from its files (:mod:`osdpipe.io.file_facts`).

Prints the format, what the files show of the layout that saved it, the
optimizer and its hyperparameters per param group, the step range, the
parameters with state, dtypes and bytes, and the overrides that describe it
to ``osdpipe``. ``--json`` prints one object instead. Metadata and headers
only: no tensor's bytes are read (see :mod:`osdpipe.io.file_facts` for the one
exception, a damaged file's moments). PATH may be a URL, ``s3://bucket/prefix`` (or ``gs://``), of a DCP
checkpoint or an osdpipe output holding one: its ``.metadata`` and small items are read by byte ranges, with the
store's own endpoint and credentials (:mod:`osdpipe.io.remote_input`).

Exit codes: 0 it was read; 1 it cannot be read as a checkpoint (or does not exist); 2 a bad command line.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from osdpipe.core.sizes import show_size  # it imports no torch

if TYPE_CHECKING:  # annotations only: this module is imported before torch, which facts needs
    from osdpipe.io.checkpoints import WholeCheckpoint
    from osdpipe.io.checkpoints.base import ModelNaming
    from osdpipe.io.file_facts import Facts

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
USAGE = (
    "usage: osdpipe inspect PATH [--json] [--key KEY]  "
    "(PATH: a checkpoint file, a DCP directory, a directory of rank_<r>.pt, or an osdpipe output)"
)

def run_inspect(args: list[str]) -> int:
    """The command: read the facts, print them, return the exit code."""
    as_json = "--json" in args
    rest = [a for a in args if a != "--json"]
    key = None
    if "--key" in rest:
        at = rest.index("--key")
        if at + 1 >= len(rest):
            print(f"osdpipe inspect: error: --key needs a value; {USAGE}", file=sys.stderr)
            return EXIT_USAGE
        key = rest[at + 1]
        del rest[at : at + 2]
    if rest[:1] == ["--help"]:
        print(USAGE)
        return EXIT_OK
    if len(rest) != 1 or rest[0].startswith("-"):
        wrong = "one PATH" if not rest or not rest[0].startswith("-") else repr(rest[0]) + " is not an option"
        print(f"osdpipe inspect: error: {wrong}; {USAGE}", file=sys.stderr)
        return EXIT_USAGE
    # torch: not on inspect --help's path (tests/cli/test_startup.py)
    from osdpipe.io.checkpoints import recognize
    from osdpipe.io.file_facts import checkpoint_in, lone_file_in, read_facts
    from osdpipe.io.formats.state_facts import MOMENTS_ALIKE
    from osdpipe.io.remote_input import as_path, probe
    from osdpipe.io.store import is_url
    from osdpipe.run.collective import one_line

    facts = None
    try:
        if is_url(rest[0]):  # another scheme, a missing bucket or key, refused credentials: one line naming PATH
            probe(rest[0], "PATH")
        path = checkpoint_in(as_path(rest[0]))  # an osdpipe output: the checkpoint it holds, whole or an optimizer's
        whole = recognize(path)
        if whole is None:  # a folder of one checkpoint file (an output's source/) is that file
            facts = read_facts(lone_file_in(path), None, key)
        elif whole.optimizer_path is not None:  # the optimizer part reads as any optimizer checkpoint
            facts = read_facts(as_path(whole.optimizer_path), None, key or whole.optimizer_key)
    except Exception as exc:  # noqa: BLE001 - a file that cannot be read says so in one line
        print(f"osdpipe inspect: error: {for_path(one_line(exc))}", file=sys.stderr)
        return EXIT_FAILED
    if facts is not None and facts.moments_alike:
        facts.notes.append(f"warning: {MOMENTS_ALIKE}")
    if whole is not None:
        from osdpipe.io.checkpoints import get  # torch: not on inspect --help's path

        naming = get(whole.layout).model_naming(as_path(whole.path))
        notes = [*whole.notes, naming.why] if naming.why else list(whole.notes)
    if as_json:
        if whole is None:
            shown = facts.to_json() if facts is not None else None
        else:
            checkpoint = {**whole.to_json(), "notes": notes, "command": whole_command(whole, naming, facts)}
            shown = {"checkpoint": checkpoint, "optimizer": facts.to_json() if facts else None}
        print(json.dumps(shown, indent=2, sort_keys=True))
    elif whole is None:
        print(describe(facts))
    else:
        optimizer = facts and WHOLE_OPTIMIZER + describe(facts, command=False)
        described = describe_whole(whole) + "".join(f"\n  note         {n}" for n in notes[len(whole.notes):])
        print("\n".join(filter(None, [described, optimizer, "  convert with " + whole_command(whole, naming, facts)])))
    return EXIT_OK


def describe(f: Facts, command: bool = True) -> str:
    """The facts as a person reads them (``command``: with the overrides that convert it)."""
    kind = {
        "sharded": "sharded (dim-0 chunks: FSDP1 SHARDED_STATE_DICT or FSDP2, alike)",
        None: "cannot tell from the files",
    }.get(f.kind, f.kind)
    lines = [f"{f.path}", f"  format       {f.format}" + (f" (key {f.key!r})" if f.key else "")]
    lines.append(f"  kind         {kind}" + (" (use_orig_params)" if f.use_orig_params else ""))
    lines.append(f"  world size   {f.world_size if f.world_size is not None else 'not recorded'}" + (
        f", replica groups of {f.shard_group_size} rank(s)" if f.shard_group_size else ""
    ))
    for i, unit in enumerate(f.units[:8]):
        named = ", ".join(unit.fqns[:3]) + (f" and {len(unit.fqns) - 3} more" if len(unit.fqns) > 3 else "")
        lines.append(f"  unit {i:<7} {unit.numel:,} elements flat" + (f": {named}" if named else ""))
    if len(f.units) > 8:
        lines.append(f"  ... and {len(f.units) - 8} more unit(s)")
    for placement in f.placements[:4]:
        lines.append(f"  placement    {placement}")
    optimizer = f.optimizer or (
        " or ".join(f.optimizer_candidates) if f.optimizer_candidates else "none of torch.optim's"
    )
    lines.append(f"  optimizer    {optimizer}  (state {', '.join(f.state_names) or 'none'})")
    for i, group in enumerate(f.param_groups):
        shown = ", ".join(f"{k}={v}" for k, v in sorted(group.items()) if k != "params")
        lines.append(f"  group {i:<6} {group['params']} param(s): {shown}")
    if f.steps is not None:
        lines.append(
            f"  steps        {_number(f.steps[0])}"
            + (f" .. {_number(f.steps[1])}" if f.steps[1] != f.steps[0] else "")
        )
    lines.append(f"  parameters   {f.params} with state")
    dtypes = ", ".join(f"{d} {show_size(n)}" for d, n in sorted(f.dtypes.items()))
    lines.append(f"  state        {show_size(f.state_bytes)} of tensors" + (f" ({dtypes})" if dtypes else ""))
    lines += [f"  note         {n}" for n in f.notes]
    if command:
        from osdpipe.io.file_facts import command as osdpipe_command  # torch: not on inspect --help's path

        lines.append("  convert with " + osdpipe_command(f.overrides()))
    return "\n".join(lines)

#: Said before a whole checkpoint's optimizer part.
WHOLE_OPTIMIZER = (
    "optimizer part (the command below converts the whole checkpoint: the model and the optimizer, "
    "every other entry carried over):\n"
)


def for_path(message: str) -> str:
    """A reader's message, said of inspect's ``PATH``: the readers are the conversion's, and name its ``input.path``."""
    return message.replace("input.path", "PATH")


def whole_command(whole: WholeCheckpoint, naming: ModelNaming, facts: Facts | None = None) -> str:
    """The command that converts a whole checkpoint, once the target and the output are filled in: its layout, the model
    that saved it (``naming``: named where the files and the framework can tell), and its folder. The conversion reads
    the rest from the files; where an osdpipe manifest describes its optimizer part (``facts``: an osdpipe output, or
    the source a conversion generated), the layout and the model it names, which the files cannot tell."""
    from osdpipe.io.checkpoints import get  # torch: not on inspect --help's path
    from osdpipe.io.checkpoints.base import ModelNaming
    from osdpipe.io.file_facts import command

    layout = get(whole.layout)
    model, described = list(naming.overrides), []
    if facts is not None and facts.manifest is not None:
        described = facts.source_keys()
        if facts.model is not None and naming.overrides == ModelNaming.users_own().overrides:
            model = facts.model
    return command([f"checkpoint={whole.layout}", *model, f"input.path={whole.path}", *described,
                    *layout.target_placeholders])


def describe_whole(w: WholeCheckpoint) -> str:
    """A whole training checkpoint as a person reads it: the layout, the model and optimizer parts, and every other
    entry with its size."""
    lines = [w.path, f"  layout       {w.layout} (a whole training checkpoint)"]
    model = w.part("model")
    if model:
        tensors = sum(e.tensors for e in model)
        lines.append(
            f"  model        {len(model)} entr{'y' if len(model) == 1 else 'ies'}, {tensors} tensor(s), "
            f"{show_size(sum(e.size for e in model))}: "
            + ", ".join(sorted({e.where for e in model}))
        )
    for e in w.part("optimizer"):
        lines.append(f"  optimizer    {e.name}: {e.tensors} tensor(s), {show_size(e.size)} in {e.where}")
    for e in w.part("other"):
        whose = (
            f"  (source rank {e.source_rank}'s: it describes the world that saved it)"
            if e.source_rank is not None
            else ""
        )
        lines.append(f"  entry        {e.name}: {show_size(e.size)} in {e.where}{whose}")
    left_out = [e.name for e in w.part("framework")]
    if left_out:
        lines.append(f"  left out     {', '.join(left_out)}: they describe how the framework laid out its own files")
    lines += [f"  note         {n}" for n in w.notes]
    return "\n".join(lines)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
