"""deepspeed: a DeepSpeed ZeRO save as a whole training checkpoint, read only: written in PyTorch's layout
(:mod:`osdpipe.io.checkpoints.pytorch`), torchtitan's (``output.checkpoint=torchtitan``, a ``step-<N>`` folder of its
``global_steps``) or accelerate's (``output.checkpoint=accelerate``).

osdpipe reads DeepSpeed's files (:mod:`osdpipe.io.formats.deepspeed`, no
DeepSpeed code run) and writes what a PyTorch job loads; it never writes
DeepSpeed's own layout back. What each part of a save becomes:

* the model's weights are the **fp32 master weights** in the optimizer files,
  not the module's copy in the training dtype (bf16 or fp16 in a
  mixed-precision run, which ZeRO rounds the masters to after each step);
  the module's buffers come from the model-states file, whole;
* the optimizer's state and param groups, as for ``input.format=deepspeed``;
* DeepSpeed's own entries of the model-states file that a PyTorch job has no
  place for (``lr_scheduler``, ``global_steps``, ``ds_config``, the client
  state given to ``save_checkpoint``) are carried under their own names, as
  values, and the report says so;
* the entries that describe how DeepSpeed partitioned its own files
  (``param_shapes``, ``dp_world_size``, the module copy...) are left out,
  and the report names each.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from osdpipe.io.checkpoints.base import (
    CarriedData,
    Carrying,
    CheckpointLayout,
    Entry,
    ModelNaming,
    Part,
    WholeCheckpoint,
    register,
)
from osdpipe.io.remote_input import as_path

if TYPE_CHECKING:  # annotations only: reading imports torch
    import torch

    from osdpipe.io.formats.deepspeed import ZeroReader
    from osdpipe.io.weights import ModelMeta
    from osdpipe.layout.tree import ModuleTree

#: Entries of the model-states file that describe DeepSpeed's own partitioning and saving,
#: which the output does not have.
FRAMEWORKS_OWN = (
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
    "sparse_tensor_module_names",
)


class ZeroWeights:
    """The model's weights of a ZeRO save:
    each parameter's fp32 master weights, cut from every rank's flat partitions, and the module's buffers.

    The :class:`~osdpipe.io.weights.WeightsReader` of a DeepSpeed save.
    """

    def __init__(self, reader: ZeroReader, module: dict[str, Any], tree: ModuleTree) -> None:
        from osdpipe.io.weights import stored_names

        self.reader, self.module, self.tree = reader, module, tree
        self._names = stored_names(reader.save.shapes, tree)

    def model_meta(self) -> ModelMeta:
        from osdpipe.io import fetched_memory
        from osdpipe.io.formats.base import TensorRef
        from osdpipe.io.weights import model_meta_of

        stored = {name: TensorRef(shape, "float32") for name, shape in self.reader.save.shapes.items()}
        buffers = {
            name: value
            for name, value in self.module.items()
            if self.tree.resolve(name) is None and self.tree.key_map(name) is None
        }
        fetched_memory.fetch_all(buffers)  # a save in object storage: their bytes fetched
        return model_meta_of(stored, buffers, self.tree, str(self.reader.save.folder))

    def stored_name(self, name: str) -> str | None:
        return self._names.get(name)

    def read_weights(self, name: str, start: int, stop: int) -> torch.Tensor:
        from osdpipe.io.formats.deepspeed import MASTER_WEIGHTS

        return self.reader.read_range(name, MASTER_WEIGHTS, start, stop)


def saved_model(path: str) -> Any:
    """The model a ZeRO save names, built from its files alone: ``model.factory`` where the user gives none.

    Every optimized parameter under its name and shape (``param_shapes``),
    in the order of the module's own state dict, fp32 as the master weights
    are; each tied name the same parameter (``shared_params``); each
    persistent buffer under its name, shape and dtype (the module's state
    dict). It has no ``forward``: osdpipe's checks step a model on synthetic
    gradients, and the output's names are those of the job that saved it,
    so the job that resumes loads them into its own model.

    Raises:
        ValueError: the save has frozen parameters, which its files hold in the training dtype only.
    """
    import torch
    from torch import nn

    from osdpipe.io.formats.deepspeed import model_states, read_save

    save = read_save(path)
    states = model_states(save.folder)
    if states.get("frozen_param_shapes"):
        raise ValueError(
            f"{save.folder} holds frozen parameters, which osdpipe does not read yet; give model.factory=<your model>"
        )
    tied = {alias: source for alias, source in (states.get("shared_params") or {}).items() if alias not in save.shapes}
    module_keys = list(states.get("module") or {})
    names = [k for k in module_keys if k in save.shapes or k in tied] + [k for k in save.shapes if k not in module_keys]
    buffers = [k for k in module_keys if k not in save.shapes and k not in tied]
    root = nn.Module()

    def owner(name: str) -> tuple[nn.Module, str]:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        return module, leaf

    made: dict[str, nn.Parameter] = {}
    for name in names:
        module, leaf = owner(name)
        source = tied.get(name, name)
        if source not in made:
            made[source] = nn.Parameter(torch.empty(save.shapes[source]))
        module.register_parameter(leaf, made[source])
    for name in buffers:
        value = states["module"][name]
        module, leaf = owner(name)
        module.register_buffer(leaf, torch.empty(value.shape, dtype=value.dtype))
    return root


def _carried_values(states: dict[str, Any]) -> dict[str, Any]:
    """The model-states file's entries a conversion carries: every one that does not describe DeepSpeed's own layout."""
    return {k: v for k, v in states.items() if k not in FRAMEWORKS_OWN}


def _stored_size(value: Any) -> int:
    """About how many bytes an entry takes, as pickled: the size ``inspect`` and the report give it.

    Its tensors' bytes are counted, not pickled: a save in object storage has not fetched them
    (:mod:`osdpipe.io.fetched_memory`), and a local one need not read them.
    """
    import torch

    tensor_bytes = 0

    class Sizing(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            nonlocal tensor_bytes
            if torch.is_tensor(obj):
                tensor_bytes += obj.numel() * obj.element_size()
                return id(obj)
            return None

    out = io.BytesIO()
    try:
        Sizing(out).dump(value)
    except Exception:  # noqa: BLE001 - an object that does not pickle (a record of DeepSpeed's) is shown without a size
        return 0
    return len(out.getvalue()) + tensor_bytes


@register
class DeepSpeedZero(CheckpointLayout):
    name = "deepspeed"
    looks_like = (
        "a DeepSpeed ZeRO save folder (latest, global_step<N>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt), "
        "written in PyTorch's layout"
    )
    input_formats = ("deepspeed",)
    output_formats = ()
    written_as = "pytorch"
    saves_step = True  # global_steps, in the model-states file
    #: Its files by their records' ranges (the optimizer's partitions, the model states), in object storage too.

    def recognizes(self, path: Path) -> bool:
        from osdpipe.io.formats.deepspeed import DeepSpeed  # torch: only where a folder is looked at

        return path.is_dir() and DeepSpeed().found_in(path)

    def refuses_source_kind(self, kind: Any) -> str | None:
        return (
            "checkpoint=deepspeed: osdpipe reads DeepSpeed's saves but does not train a DeepSpeed job itself; "
            "give input.path=<the save folder>"
        )

    def model_from_files(self, path: str, written_in: CheckpointLayout | None = None) -> tuple[str, dict[str, Any]]:
        """:func:`saved_model`: the files name every parameter, its shape and every buffer."""
        from osdpipe.io.formats.deepspeed import tag_folder

        return f"{__name__}:saved_model", {"path": str(tag_folder(path))}

    def model_naming(self, path: Path) -> ModelNaming:
        """None: the model is built from the files themselves (:meth:`model_from_files`); your own ``model.factory`` may
        still be given."""
        return ModelNaming(())

    def newest_in(self, path: str) -> str | None:
        """A save folder: the ``global_step<N>`` folder its ``latest`` file names,
        as DeepSpeed's ``load_checkpoint`` takes it."""
        from osdpipe.io.formats.base import InputError
        from osdpipe.io.formats.deepspeed import LATEST, tag_folder

        folder = as_path(path)
        try:
            return str(tag_folder(folder)) if (folder / LATEST).is_file() else None
        except InputError:
            return None  # reading the folder then says what is wrong, in one line

    def read(self, path: Path) -> WholeCheckpoint:
        from osdpipe.io.formats.deepspeed import model_states, read_save

        save = read_save(path)
        states = model_states(save.folder)
        # rank 0's, which model_states reads
        states_file = min(p.name for p in save.folder.iterdir() if p.name.endswith("model_states.pt"))
        optimizer_files = f"{save.files[0].name.replace('_0_', '_<r>_', 1)} x {save.world_size}"
        numel = sum(n for flat in save.flat_groups for _, n in flat)
        entries = [
            Entry(
                "model",
                "model",
                f"{optimizer_files} (fp32 master weights); buffers from {states_file}",
                4 * numel,
                len(save.shapes),
            ),
            Entry(
                "optim_states",
                "optimizer",
                optimizer_files,
                sum(f.stat().st_size for f in save.files),
                len(save.flat_groups) * save.world_size,
            ),
        ]
        entries += [
            Entry(k, "framework" if k in FRAMEWORKS_OWN else "other", states_file, _stored_size(v))
            for k, v in states.items()
        ]
        module_dtypes = sorted(
            {
                str(v.dtype).removeprefix("torch.")
                for k, v in states.get("module", {}).items()
                if k in save.shapes and v.numel()
            }
        )
        notes = [
            f"DeepSpeed ZeRO stage {save.stage} on {save.world_size} rank(s), {save.folder.name}; "
            "the model's weights are the fp32 master weights"
            + (
                f", not the module's {'/'.join(module_dtypes)} copy"
                if module_dtypes and module_dtypes != ["float32"]
                else ""
            )
        ]
        return WholeCheckpoint(
            self.name, str(save.folder), tuple(entries), str(save.folder), "optim", "nested", tuple(notes)
        )

    def optimizer_part(self, path: str, input_format: str, written_in: CheckpointLayout | None = None) -> Part:
        from osdpipe.io.formats.deepspeed import tag_folder

        return Part(str(tag_folder(path)), "deepspeed", "optim")

    def open_model(self, path: str, input_format: str, tree: ModuleTree, optimizer: Any) -> ZeroWeights:
        """The masters from the optimizer part's own reader: its files are opened, and checked, once."""
        from osdpipe.io.formats.deepspeed import ZeroReader, model_states

        reader = optimizer if isinstance(optimizer, ZeroReader) else ZeroReader(path)
        return ZeroWeights(reader, dict(model_states(reader.save.folder).get("module") or {}), tree)

    def carried(
        self, path: str, input_format: str, tree: ModuleTree, written_in: CheckpointLayout | None = None,
    ) -> Carrying:
        """DeepSpeed's entries a PyTorch job has no place for,
        each leaf under its own name (as ``dcp.save`` flattens them)."""
        import torch

        from osdpipe.core.state_paths import leaf_paths  # each leaf named as dcp.save names it
        from osdpipe.io.formats.deepspeed import model_states, tag_folder

        folder = tag_folder(path)
        states = model_states(folder)
        flat, paths = leaf_paths(_carried_values(states))
        tensors = {
            k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in flat.items() if torch.is_tensor(v)
        }
        step = states.get("global_steps")
        return Carrying(
            str(folder),
            tuple(flat),
            tuple(paths[k] for k in flat),
            tensors,
            (),
            self.read(folder).entries,
            layout=self.name,
            step=int(step) if isinstance(step, (int, float)) or torch.is_tensor(step) else None,
        )

    def read_carried(self, carrying: Carrying) -> CarriedData:
        """The carried leaves' values (the model-states file loads with ``weights_only=True``: plain data)."""
        from osdpipe.core.state_paths import leaf_paths
        from osdpipe.io import fetched_memory
        from osdpipe.io.formats.deepspeed import model_states

        # a save in object storage: the carried tensors' bytes fetched
        flat, _ = leaf_paths(fetched_memory.fetch_all(_carried_values(model_states(as_path(carrying.source)))))
        return CarriedData(
            tensors={k: flat[k] for k in carrying.item_tensors},
            values={k: flat[k] for k in carrying.items if k not in carrying.item_tensors},
        )
