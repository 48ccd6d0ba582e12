"""Hold offline rank files against what real FSDP builds for those ranks of a large world.

Run as ``python fake_rank_files.py KIND WORLD SOURCE OUT RANK [RANK ...]``
(a subprocess: the fake process group must not live in the test process).
For each rank it starts PyTorch's fake process group as that rank of
``WORLD``, builds the user's model with every parameter set to the source's
full ``exp_avg`` of that parameter, and wraps it as the target does (FSDP1
over MixerBlock units, or ``fully_shard`` on MixerBlocks and the root). FSDP
cuts the parameters locally, so the rank's local parameters are, bitwise,
what that rank's ``exp_avg`` must be: they are compared with
``OUT/rank_<r>.pt``. Prints one JSON list of problems.
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
import torch.distributed as dist
import userlm
from torch.testing._internal.distributed.fake_pg import FakeStore


def _model(full: dict) -> torch.nn.Module:
    model = userlm.build()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(full["state"][name]["exp_avg"])
    return model


def _local_params(kind: str, model: torch.nn.Module, world: int) -> list[torch.Tensor]:
    """The rank's local parameters, in ``model.parameters()`` order of the wrapped model."""
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return [p.to_local() for p in model.parameters()]
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({userlm.MixerBlock}), device_id=torch.device("cpu"))
    return [p.detach() for p in wrapped.parameters()]


def main(kind: str, world: int, source: str, out: str, ranks: list[int]) -> list[str]:
    full = torch.load(source, weights_only=True)
    problems = []
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            expected = _local_params(kind, _model(full), world)
        finally:
            dist.destroy_process_group()
        got = torch.load(f"{out}/rank_{rank}.pt", weights_only=True)["state"]
        if sorted(got) != list(range(len(expected))):
            problems.append(f"rank {rank}: param IDs {sorted(got)}, real FSDP has {len(expected)} parameters")
            continue
        for pid, want in enumerate(expected):
            have = got[pid]["exp_avg"]
            if have.shape != want.shape or not torch.equal(have.view(torch.uint8), want.contiguous().view(torch.uint8)):
                problems.append(
                    f"rank {rank}, param ID {pid}: {tuple(have.shape)}"
                    f" differs from real FSDP's {tuple(want.shape)} shard"
                )
    return problems


if __name__ == "__main__":
    kind, world, source, out, *ranks = sys.argv[1:]
    print(json.dumps(main(kind, int(world), source, out, [int(r) for r in ranks])))
