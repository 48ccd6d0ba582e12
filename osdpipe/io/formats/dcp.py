"""``dcp``: a torch.distributed.checkpoint directory, FQN-keyed, every parameter cut along dim 0 across the ranks.

Declared here; read by :mod:`osdpipe.io.formats.dcp_reader` and written by
:mod:`osdpipe.io.formats.dcp_writer`, both imported when first used, since
``torch.distributed.checkpoint`` takes a second to import and most runs
never touch a DCP checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from osdpipe.core.compare import diff
from osdpipe.io.digest import tensor_digests
from osdpipe.io.formats.base import Format, IdGroups, RankFiles, SourceReader, full_state
from osdpipe.layout.ranges import LayoutSpec, LocalTensor, dim0_chunk_bounds, dim0_layout
from osdpipe.layout.tree import ModuleTree

if TYPE_CHECKING:  # annotations only: osdpipe.io.file_facts imports the formats
    from osdpipe.io.file_facts import Facts

#: Where a ``dcp`` output's checkpoint directory goes, under ``output.path``.
DCP_DIR = "dcp"
#: What every rank of this process shares of the checkpoint being written: DCP's global plan, made once.
_PLAN = "dcp_plan"


class Dcp(Format):
    """One DCP checkpoint that every rank writes its dim-0 rows of (``dcp.save``'s), FQN-keyed;
    rank 0 finishes its ``.metadata``."""

    name = "dcp"
    keyed_by_id = False
    directory = True
    generated_name = DCP_DIR
    looks_like = "a DCP checkpoint (.metadata)"
    made_as_written = True
    loaded_by_dcp = True

    def output_path(self, directory: Path, rank: int) -> Path:
        return directory / DCP_DIR

    def output_layout(
        self, tree: ModuleTree, target: LayoutSpec, rank: int, optimizer_layout: Callable[[], tuple[LocalTensor, ...]]
    ) -> tuple[LocalTensor, ...]:
        return dim0_layout(tree, target.world_size, rank)

    def open(self, path: str, key: str, *, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups) -> SourceReader:
        # torch.distributed.checkpoint: only where a DCP checkpoint is read
        from osdpipe.io.formats.dcp_reader import DcpReader

        return DcpReader(path, key)

    def found_in(self, directory: Path) -> bool:
        return (directory / ".metadata").is_file()

    def read_facts(self, facts: Facts, path: Path, key: str | None) -> None:
        # torch.distributed.checkpoint: only where a DCP checkpoint is read
        from osdpipe.io.formats.dcp_facts import read_dcp_facts

        read_dcp_facts(facts, path, key)

    def files_per_rank(self, world_size: int) -> str | None:
        return f"its files __0_0.distcp .. __{world_size - 1}_0.distcp"

    def write(
        self,
        result: dict[str, Any],
        staging: Path,
        rank: int,
        *,
        key: str,
        tree: ModuleTree,
        world_size: int,
        shared: dict[str, Any],
    ) -> RankFiles:
        """Write this rank's dim-0 pieces into the checkpoint under ``staging/dcp``
        (see :mod:`osdpipe.io.formats.dcp_writer`)."""
        # torch.distributed.checkpoint: only where a DCP checkpoint is written
        from osdpipe.io.formats import dcp_writer

        if _PLAN not in shared:  # the same for every rank: offline, planned once for all of them
            shared[_PLAN] = dcp_writer.optimizer_plan(key, result, tree, world_size)
        state = {key: dcp_writer.rank_state(result, tree, world_size, rank, local=True)}
        results, file_digests, storages = dcp_writer.write_rank(staging / DCP_DIR, state, rank, shared[_PLAN])
        files = {f"{DCP_DIR}/{name}": digest for name, digest in sorted(file_digests.items())}
        # taken as they were written
        tensors = {f"{next(iter(files))}:{k}": v for k, v in tensor_digests(result, storages).items()} if files else {}
        return RankFiles(files, tensors, results)

    def read_written(self, path: Path, key: str) -> dict[str, Any]:
        # torch.distributed.checkpoint: only where a DCP checkpoint is read
        from osdpipe.io.formats.dcp_reader import DcpReader

        reader = DcpReader(str(path), key)
        return full_state(reader, reader.meta())

    def differences(
        self,
        directory: Path,
        key: str,
        rank: int,
        expected: dict[str, Any],
        *,
        tree: ModuleTree,
        world_size: int,
        opened: dict[str, Any],
    ) -> list[str]:
        """Rank ``rank``'s rows of the checkpoint against ``expected``, bitwise;
        scalar state and, once, the param groups as it holds them."""
        # torch.distributed.checkpoint: only where a DCP checkpoint is read
        from osdpipe.io.formats.dcp_reader import DcpReader

        if "reader" not in opened:  # opened (metadata read, structure checked) once for every rank
            opened["reader"] = reader = DcpReader(str(self.output_path(directory, rank)), key)
            opened["meta"] = reader.meta()
        return optimizer_differences(
            opened["reader"], opened["meta"], expected, tree=tree, world_size=world_size, rank=rank
        )

    def finish(self, staging: Path, shared: dict[str, Any], per_rank: list[RankFiles]) -> dict[str, str]:
        # torch.distributed.checkpoint: only where a DCP checkpoint is written
        from osdpipe.io.formats import dcp_writer

        return {
            f"{DCP_DIR}/.metadata": dcp_writer.finish(staging / DCP_DIR, shared[_PLAN], [r.results for r in per_rank])
        }


def optimizer_differences(
    reader: Any, saved: Any, expected: dict[str, Any], *, tree: ModuleTree, world_size: int, rank: int
) -> list[str]:
    """Where rank ``rank``'s dim-0 rows of the optimizer state a DCP ``reader`` reads
    (``saved``: its metadata) differ from ``expected``, bitwise.

    Tensors by the rows the rank wrote; scalar state as saved; on rank 0 the param groups.
    """
    problems = []
    for fqn, state in expected["state"].items():
        for name, want in state.items() if isinstance(state, dict) else []:
            if not (hasattr(want, "dim") and want.dim() > 0):
                problems += [
                    f"{reader.path}: {p}"
                    for p in diff(saved.state.get(fqn, {}).get(name), want, path=f"{fqn}.{name}", limit=1)
                ]
                continue
            if not want.numel():
                continue
            start = dim0_chunk_bounds(tree.param(fqn).shape, world_size, rank)[0]
            got = reader.read_range(fqn, name, start, start + want.numel())
            # diff's flat index is within this rank's rows, which begin at flat index ``start`` of the saved tensor
            problems += [
                f"{reader.path}: {p}"
                for p in diff(got, want.reshape(-1), path=f"{fqn}.{name} (rows from flat index {start})", limit=1)
            ]
    if rank == 0 and "param_groups" in expected:
        problems += [
            f"{reader.path}: {p}"
            for p in diff(
                saved.param_groups, expected["param_groups"], path="param_groups", limit=1, sequence_types=False
            )
        ]
    return problems
