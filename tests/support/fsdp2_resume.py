"""Resume the user's model from osdpipe's output as the README tells an FSDP2 job to, on each rank of a real world.

``resume(source, path, fmt)`` runs inside a gloo world (``spawn_world``):
``fully_shard`` on every MixerBlock and the root, a fresh Adam, then
PyTorch's own path for the format: for ``dcp``, ``dcp.load`` into
``get_optimizer_state_dict``'s template and ``set_optimizer_state_dict`` (DCP
reshards the checkpoint onto this world whatever world wrote it); for
``fsdp_full``, ``set_optimizer_state_dict`` of the loaded file with
``full_state_dict=True``. The full state the job then holds is compared with
the source's, bitwise, and one training step must leave it finite. Returns
this rank's problems.
"""

from __future__ import annotations

import warnings

import torch
import userlm

from osdpipe.core.compare import diff


def resume(source: str, path: str, fmt: str) -> list[str]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = userlm.build()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if fmt == "dcp":
            state = {"optim": get_optimizer_state_dict(model, optim)}
            dcp.load(state, checkpoint_id=path)
            set_optimizer_state_dict(model, optim, state["optim"])
        else:
            full = torch.load(path, weights_only=True)
            set_optimizer_state_dict(model, optim, full, options=StateDictOptions(full_state_dict=True))
        loaded = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    problems = diff(loaded, torch.load(source, weights_only=True), path="resumed", sequence_types=False)
    tokens = torch.randint(0, userlm.VOCAB, (4, 5), generator=torch.Generator().manual_seed(99))
    model(tokens).float().pow(2).mean().backward()
    optim.step()
    for param, entries in optim.state.items():
        for name, value in entries.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            if local.is_floating_point() and not bool(torch.isfinite(local).all()):
                problems.append(f"after a step, state {name} of a {tuple(param.shape)} parameter is not finite")
    return problems
