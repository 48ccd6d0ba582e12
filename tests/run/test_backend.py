"""``runtime.backend``: ``auto`` takes NCCL only where every rank on the machine has a GPU of its own (two ranks on
one GPU fail NCCL's first collective: "invalid device ordinal", as a 4-rank benchmark did on a one-GPU machine), and
``nccl`` asked for with too few GPUs is refused in one line before any rank starts."""

from __future__ import annotations

import pytest

from osdpipe.run.launch import backend_for


@pytest.mark.parametrize(
    ("asked", "ranks", "gpus", "chosen"),
    [
        (None, 2, 0, "gloo"),  # no GPU
        (None, 4, 1, "gloo"),  # fewer GPUs than ranks: NCCL would put two ranks on one GPU
        (None, 1, 1, "nccl"),
        (None, 8, 8, "nccl"),
        ("gloo", 8, 8, "gloo"),  # what the user asks for
        ("nccl", 2, 2, "nccl"),
    ],
)
def test_auto_takes_nccl_only_with_a_gpu_per_rank(asked, ranks: int, gpus: int, chosen: str) -> None:
    assert backend_for(asked, ranks, gpus) == chosen


def test_nccl_with_fewer_gpus_than_ranks_is_one_line_saying_what_to_set() -> None:
    with pytest.raises(ValueError) as caught:
        backend_for("nccl", 4, 1)
    assert str(caught.value) == (
        "runtime.backend=nccl runs one rank per GPU, and this machine has 1 GPU(s) for 4 rank(s); set "
        "runtime.backend=gloo (or auto, which chooses it here), or start fewer ranks per machine"
    )
