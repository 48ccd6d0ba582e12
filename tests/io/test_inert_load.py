"""A framework's pickled objects come out inert; a pickle that would run code is refused and runs nothing (issue 31)."""

from __future__ import annotations

import enum
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from osdpipe.io.formats import InputError
from osdpipe.io.formats.inert_load import Record, load_inert


def _fake_framework(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A framework's module (a top-level one: pickle imports it to save), with classes pickled as DeepSpeed pickles its
    own: an enum, a plain object, a namedtuple-like one."""
    module = types.ModuleType("fakespeed")

    class Stage(enum.IntEnum):
        gradients = 2

    class LossScaler:
        def __init__(self) -> None:
            self.cur_scale, self.dynamic = 1.0, False

    class Address:
        def __init__(self, numel: int, start: int) -> None:
            self.numel, self.start = numel, start

        def __reduce__(self):  # how a namedtuple-like object pickles: its class called with its fields
            return (type(self), (self.numel, self.start))

    for cls in (Stage, LossScaler, Address):
        cls.__module__, cls.__qualname__ = module.__name__, cls.__name__
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_a_frameworks_objects_come_out_as_records_and_its_tensors_as_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = _fake_framework(monkeypatch)
    flat = torch.arange(10, dtype=torch.float32)
    tagged = torch.nn.Parameter(torch.ones(3))
    tagged.ds_id = 7  # ZeRO-3 pickles its partitions with attributes of their own
    partition = torch.full((4,), 2.0)
    partition.ds_id = 8  # a plain tensor with an attribute pickles through torch._tensor._rebuild_from_type_v2
    path = tmp_path / "optim_states.pt"
    torch.save(
        {
            "zero_stage": ds.Stage.gradients,
            "loss_scaler": ds.LossScaler(),
            "address": ds.Address(5, 2),
            "flat": [flat],
            "tagged": tagged,
            "partition": partition,
            "shapes": {"w": torch.Size([2, 5])},
            "step": torch.tensor(3.0),
        },
        path,
    )
    monkeypatch.delitem(sys.modules, ds.__name__)  # as where DeepSpeed is not installed

    got = load_inert(path, ("fakespeed",), what="a DeepSpeed optimizer file")
    assert isinstance(got["zero_stage"], Record) and (
        got["zero_stage"].module, got["zero_stage"].name, got["zero_stage"].value
    ) == ("fakespeed", "Stage", 2)
    assert isinstance(got["loss_scaler"], Record) and got["loss_scaler"].state == {"cur_scale": 1.0, "dynamic": False}
    assert got["address"].args == (5, 2)
    assert torch.equal(got["flat"][0], flat) and got["shapes"]["w"] == torch.Size([2, 5]) and got["step"].item() == 3.0
    assert torch.equal(got["tagged"], tagged.detach()) and got["tagged"].ds_id == 7
    assert (
        type(got["partition"]) is torch.Tensor
        and torch.equal(got["partition"], partition)
        and got["partition"].ds_id == 8
    )
    assert ds.__name__ not in sys.modules, "reading a record never imports its module"


class _RunsCode:
    """What a hostile pickle holds: an object whose unpickling calls a function of the file's choosing."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    planted = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    ran = tmp_path / "it-ran"
    torch.save({"optimizer_state_dict": {"loss_scaler": _RunsCode(ran)}, "flat": torch.ones(4)}, planted)
    with pytest.raises(InputError) as refused:
        load_inert(planted, ("deepspeed",), what="a DeepSpeed optimizer file")
    message = str(refused.value)
    assert (
        str(planted) in message
        and "posix.system" in message
        and "refusing to load it" in message
        and "\n" not in message
    )
    assert not ran.exists(), "the planted command ran"


def test_a_class_of_a_package_not_described_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = _fake_framework(monkeypatch)
    path = tmp_path / "f.pt"
    torch.save({"scaler": ds.LossScaler()}, path)
    with pytest.raises(InputError, match="fakespeed.LossScaler, which a torchtitan file never holds"):
        load_inert(path, ("torchtitan",), what="a torchtitan file")


def test_a_damaged_file_is_named_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "cut.pt"
    torch.save({"flat": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(InputError) as refused:
        load_inert(path, ("deepspeed",), what="a DeepSpeed optimizer file")
    assert str(path) in str(refused.value) and "damaged" in str(refused.value)


class _Getattr:
    """A pickle that asks ``getattr`` of something other than a described class (how a hostile file reaches a
    function through an allowed name)."""

    def __reduce__(self):
        return (getattr, (torch.Size, "__init__"))


def test_getattr_of_anything_but_a_described_class_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f.pt"
    torch.save({"x": _Getattr()}, path)
    with pytest.raises(InputError, match="builtins.getattr, which an FSDP1 model file never holds"):
        load_inert(path, ("torch.distributed._shard",), what="an FSDP1 model file")


_SAVE_SHARDED = """
import sys, torch, torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
local = torch.arange(12, dtype=torch.float32).view(3, 4)
shard = Shard(local, ShardMetadata(shard_offsets=[0, 0], shard_sizes=[3, 4], placement="rank:0/cpu"))
torch.save({"w": init_from_local_shards([shard], 3, 4), "b": torch.ones(2)}, sys.argv[1])
dist.destroy_process_group()
"""


def test_a_sharded_tensor_is_read_as_its_local_shard_without_a_process_group(tmp_path: Path) -> None:
    """FSDP1's SHARDED_STATE_DICT values: torch.load refuses them outside a process group; osdpipe reads each one's
    local shard, its offset and the whole's shape, and runs nothing of the pickle."""
    import subprocess

    from osdpipe.io.formats.sharded_tensor import LocalShard, load_sharded_state

    path = tmp_path / "model_world_size_1_rank_0.pt"
    subprocess.run([sys.executable, "-c", _SAVE_SHARDED, str(path), str(tmp_path / "store")], check=True, timeout=120)
    with pytest.raises(RuntimeError, match="init_process_group"):
        torch.load(path, weights_only=False)
    got = load_sharded_state(path, "an FSDP1 model file")
    assert isinstance(got["w"], LocalShard) and torch.equal(got["w"].tensor, torch.arange(12.0).view(3, 4))
    assert (got["w"].offsets, got["w"].size, got["w"].device_type) == ((0, 0), (3, 4), "cpu")
    assert got["w"].whole.shape == (3, 4) and got["w"].whole.device.type == "meta"
    assert torch.equal(got["b"], torch.ones(2))
