"""load: open the source checkpoint on every rank that reads it, lazily.

Readers memory-map (``fsdp_full``, ``plain``, ``rank_local``) or read stored
chunks on demand (``dcp``), so opening costs no tensor bytes; the shard stage
reads only the ranges a rank needs. With ``runtime.transfer=scatter`` only one
rank per host opens it (see :mod:`osdpipe.run.transfer`). An input in object storage (``input.path=s3://...``) is
read by byte ranges with ``runtime.storage_options`` (:mod:`osdpipe.io.remote_input`): every rank reaches it.
"""

from __future__ import annotations

import socket
from pathlib import Path

from osdpipe.io import formats, remote_input
from osdpipe.io.formats import IdGroups, SourceMeta, SourceReader, canonical_meta, inspect_source, open_source
from osdpipe.io.weights import open_whole
from osdpipe.run.context import Context
from osdpipe.run.products import Opened, Tally
from osdpipe.run.transfer import reading_ranks
from osdpipe.spec.config import RunSpec
from osdpipe.spec.plan import Plan


def source_id_groups(spec: RunSpec, input_format: str) -> IdGroups:
    """The groups a param-ID keyed input's IDs follow,
    as FQN patterns per group (``None``: not known; see :meth:`Format.id_groups`)."""
    configured = [g.params for g in spec.optim.param_groups] or None
    return formats.get(input_format).id_groups(spec.input.param_groups, configured, generated=spec.input.path is None)


def open_input(plan: Plan, described: bool = False) -> SourceReader:
    """The source's reader: the optimizer checkpoint, or a whole checkpoint,
    whose model weights and carried entries come with it (:mod:`osdpipe.io.weights`); ``described``: for its
    metadata alone (:meth:`osdpipe.io.formats.base.Format.describe`)."""
    remote_input.configure(plan.spec.runtime.storage_options, plan.spec.runtime.memory_budget)
    if plan.checkpoint.whole:
        return open_whole(plan.checkpoint, plan.input_path, plan.input_format, tree=plan.tree, source=plan.source_spec,
                          written_in=plan.output_checkpoint, described=described, dtype=plan.spec.output.dtype,
                          named=plan.checkpoint.named_by(plan.spec.checkpoint.model_dump()))
    groups = source_id_groups(plan.spec, plan.input_format)
    return open_source(
        plan.input_format,
        plan.input_path,
        plan.spec.input.key,
        tree=plan.tree,
        source=plan.source_spec,
        id_groups=groups,
        described=described,
    )


def inspect_input(plan: Plan) -> SourceMeta:
    """Open the input and run every check that needs no process group
    (:func:`osdpipe.io.formats.inspect_source`); its canonical metadata.

    Raises:
        InputError: the input is damaged, unsafe, or does not fit the model and the source layout.
    """
    remote_input.configure(plan.spec.runtime.storage_options, plan.spec.runtime.memory_budget)
    if not plan.checkpoint.whole:
        groups = source_id_groups(plan.spec, plan.input_format)
        return inspect_source(
            plan.input_format,
            plan.input_path,
            plan.spec.input.key,
            tree=plan.tree,
            source=plan.source_spec,
            id_groups=groups,
        )
    return canonical_meta(open_input(plan, described=True).meta(), plan.tree, where=plan.input_path)


def load(ctx: Context, previous: None, tally: Tally) -> Opened:
    """Decide which ranks read the input (``runtime.transfer``), and open it on those."""
    plan = ctx.plan
    here = remote_input.is_remote(plan.input_path) or Path(plan.input_path).exists()  # a URL: every rank reaches it
    seen = ctx.world.process_facts((socket.gethostname(), here))
    readers = reading_ranks([h for h, _ in seen], [v for _, v in seen], ctx.spec.runtime.transfer, plan.input_path)
    opened = Opened(None, tuple(readers))
    if not opened.reads_itself(ctx.rank):
        return opened
    return Opened(open_input(plan), opened.reading_ranks)
