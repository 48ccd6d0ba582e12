"""Entry point that torchrun launches to run torchtitan's own trainer on CPU.

This is ``torchtitan.train.main`` with its own command line (``--module llama3
--config llama3_debugmodel ...``), plus the small in-process patches that
torchtitan 0.3.0 needs to train on a machine without a GPU.  The patches live
only in this launched process; nothing in torchtitan or osdpipe is edited.

Patches (each says why):

1. Device: ``torchtitan.tools.utils`` picks its device at import time and, with
   no accelerator, falls back to "cuda".  We make ``_get_available_device_type``
   answer "cpu" for that one import, so torchtitan uses ``torch.cpu``, starts a
   ``gloo`` process group and builds its device mesh on "cpu".
2. Memory monitor: the metrics ask the device module for a name, properties
   and memory statistics; ``torch.cpu`` has none, so a monitor reporting zero
   replaces it.
3. Attention: llama3 uses FlexAttention, which has no backward on CPU.  The
   compiled flex kernel is replaced by ``scaled_dot_product_attention`` under
   the dense mask that the BlockMask's own ``mask_mod`` gives (the same
   block-causal attention).  The BlockMask is built eagerly instead of through
   ``torch.compile`` (only its ``mask_mod`` is used, and compiling it on CPU
   costs seconds per rank).
4. Reductions: torchtitan sets FSDP2's gradient divide factor to 1.0; FSDP2
   then reduces with PREMUL_SUM, which gloo refuses.  Wherever a divide factor
   is set we also call ``set_force_sum_reduction_for_comms(True)``.
5. Barrier: after the first step ``set_pg_timeouts`` calls
   ``barrier(device_ids=[current_device()])``, a TypeError on CPU; we use a
   plain ``barrier()``.  It then calls ``torch.distributed.set_timeout``,
   absent from torch 2.13; ``distributed_c10d._set_pg_timeout`` is used.
6. Rank 0 sleeps 2 s after training "for other ranks to complete"; nothing
   after it needs that (the process group is destroyed collectively), so the
   sleep is skipped to keep CI fast.

Dump facility: when the environment variable ``TITAN_DUMP`` names a file, then
right after torchtitan's checkpointer has loaded (at the start of
``Trainer.train``, before the first step of this run) every rank takes part in
gathering the full state, and rank 0 writes to that file, after the first
training step, a dict with ``step``, ``model`` (full tensors of the model's own
``state_dict()``, whose hooks give wq/wk/wv), ``optim`` (full, FQN-keyed, from
``get_optimizer_state_dict``), ``optim_flat`` (torchtitan's own flat
``state.<fqn>.<name>`` / ``param_groups.<fqn>.<key>`` dict, gathered),
``lr_scheduler``, ``loaded`` and ``loss_after``.
"""

from __future__ import annotations

import math
import os
import sys
import time
import types
from datetime import timedelta
from typing import Any

import torch
import torch._utils

DUMP_ENV = "TITAN_DUMP"


def _import_torchtitan_on_cpu() -> None:
    """Import ``torchtitan.tools.utils`` while torch reports a "cpu" device."""
    original = torch._utils._get_available_device_type
    torch._utils._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils as tt_utils
    finally:
        torch._utils._get_available_device_type = original
    if tt_utils.device_type != "cpu":
        raise RuntimeError(
            "torchtitan.tools.utils was imported before the CPU patch "
            f"(device_type={tt_utils.device_type!r})"
        )


def _patch_memory_monitor() -> None:
    """Give the metrics a device memory monitor that reports zero."""
    from torchtitan.components import metrics

    class CpuMemoryMonitor:
        device_name = "cpu"
        device_capacity_gib = 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.build_device_memory_monitor = lambda: CpuMemoryMonitor()


def _patch_attention() -> None:
    """Replace the compiled FlexAttention kernel with SDPA under the dense mask."""
    from torch.nn.attention.flex_attention import (
        AuxOutput,
        create_block_mask,
        create_mask,
    )
    from torchtitan.models.common import attention

    def flex_as_sdpa(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        score_mod=None,
        block_mask=None,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_aux=None,
        kernel_options: dict | None = None,
    ):
        if score_mod is not None:
            raise NotImplementedError("CPU flex replacement has no score_mod")
        mask = None
        if block_mask is not None:
            batch = block_mask.shape[0]
            mask = create_mask(
                block_mask.mask_mod, batch, 1, q.shape[-2], k.shape[-2], q.device
            )
        want_lse = return_aux is not None and getattr(return_aux, "lse", False)
        if not want_lse:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
            )
            return out, AuxOutput()
        # Explicit softmax when the caller also wants the log-sum-exp.
        if enable_gqa and k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        s = q.shape[-1] ** -0.5 if scale is None else scale
        scores = (q @ k.transpose(-2, -1)).float() * s
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = (torch.softmax(scores, dim=-1).to(q.dtype)) @ v
        return out, AuxOutput(lse=lse)

    attention.FlexAttention._compiled_flex_attn = staticmethod(flex_as_sdpa)
    attention.FlexAttention.compiled_flex_attn = staticmethod(flex_as_sdpa)
    attention._compiled_create_block_mask = create_block_mask


def _patch_fsdp_reduction() -> None:
    """Force SUM reductions wherever FSDP2's divide factor is set (gloo has no PREMUL_SUM)."""
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor: float) -> None:
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def _patch_pg_timeouts() -> None:
    """``set_pg_timeouts`` with a plain barrier (CPU has no device ids).

    torchtitan 0.3.0 also calls ``torch.distributed.set_timeout``, which
    torch 2.13 does not have; its private ``_set_pg_timeout`` does the same.
    """
    from torch.distributed import distributed_c10d
    from torchtitan.distributed import utils as dist_utils

    set_timeout = getattr(torch.distributed, "set_timeout", None) or (
        distributed_c10d._set_pg_timeout
    )

    def set_pg_timeouts(timeout: timedelta, parallel_dims) -> None:
        torch.distributed.barrier()
        groups = [
            mesh.get_group()
            for mesh in parallel_dims.get_all_one_dimensional_meshes().values()
        ] + [None]
        for group in groups:
            set_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts


def _patch_final_sleep() -> None:
    """Skip rank 0's 2-second courtesy sleep at the end of ``Trainer.train``."""
    import torchtitan.trainer as trainer_module

    shim = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("__")})
    shim.sleep = lambda seconds: None
    trainer_module.time = shim


# ---------------------------------------------------------------- dump facility


def _gather_state(trainer) -> dict[str, Any]:
    """Gather the trainer's full state; collective: every rank must call it.

    Returns the full dict on rank 0 and an (almost) empty one elsewhere.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    rank0 = torch.distributed.get_rank() == 0
    # The model's own state_dict (torchtitan's hooks split wqkv into wq/wk/wv,
    # as in the checkpoint).  get_model_state_dict cannot be used: it maps
    # every key back to a module attribute and fails on the hook-made "wq".
    # Every rank gathers each DTensor in the same (dict) order.
    model: dict[str, Any] = {}
    for part in trainer.model_parts:
        for key, value in part.state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu().clone()
            model[key] = value

    inner = list(trainer.optimizers.optimizers)
    # get_optimizer_state_dict (and torchtitan's own state_dict) would run a
    # zero-lr "init" step on an optimizer with no state, which changes Adam's
    # step count and so the next training step: never touch an empty one.
    has_state = all(len(o.state) > 0 for o in inner)
    optim: dict[str, Any] = {}
    optim_flat: dict[str, Any] = {}
    if has_state:
        for part, opt in zip(trainer.model_parts, inner, strict=True):
            sd = get_optimizer_state_dict(part, opt, options=options)
            optim.setdefault("state", {}).update(sd.get("state", {}))
            optim.setdefault("param_groups", []).extend(sd.get("param_groups", []))
        flat = trainer.optimizers.state_dict()
        for key in sorted(flat):
            value = flat[key]
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu().clone()
            optim_flat[key] = value
    if not rank0:
        return {}
    return {
        "step": int(trainer.step),
        "ntokens_seen": int(trainer.ntokens_seen),
        "model": model,
        "optim": optim,
        "optim_flat": optim_flat,
        "lr_scheduler": trainer.lr_schedulers.state_dict(),
        "world_size": torch.distributed.get_world_size(),
    }


def _write(path: str, dump: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(dump, tmp)
    os.replace(tmp, path)


def _install_dump(path: str) -> None:
    """Wrap ``Trainer.train`` so that its checkpoint load is followed by a dump."""
    from torchtitan.trainer import Trainer

    original_train = Trainer.train

    def train(self):
        box: dict[str, Any] = {}
        original_load = self.checkpointer.load
        original_log = self.metrics_processor.log

        def load(*args, **kwargs):
            loaded = original_load(*args, **kwargs)
            box["dump"] = _gather_state(self)
            box["dump"]["loaded"] = bool(loaded)
            return loaded

        def log(step, global_avg_loss, *args, **kwargs):
            if "dump" in box and "written" not in box:
                box["written"] = True
                loss = float(global_avg_loss)
                if torch.distributed.get_rank() == 0:
                    box["dump"]["loss_after"] = loss
                    box["dump"]["loss_step"] = int(step)
                    _write(path, box["dump"])
                if not math.isfinite(loss):
                    raise RuntimeError(f"loss after load is not finite: {loss}")
            return original_log(step, global_avg_loss, *args, **kwargs)

        self.checkpointer.load = load
        self.metrics_processor.log = log
        try:
            result = original_train(self)
        finally:
            self.checkpointer.load = original_load
            self.metrics_processor.log = original_log
        if "dump" in box and "written" not in box:
            # No training step ran after the load (steps already reached).
            if torch.distributed.get_rank() == 0:
                box["dump"]["loss_after"] = None
                _write(path, box["dump"])
        return result

    Trainer.train = train


def main() -> None:
    _import_torchtitan_on_cpu()
    _patch_memory_monitor()
    _patch_attention()
    _patch_fsdp_reduction()
    _patch_pg_timeouts()
    _patch_final_sleep()
    dump = os.environ.get(DUMP_ENV)
    if dump:
        _install_dump(dump)
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    sys.exit(main())
