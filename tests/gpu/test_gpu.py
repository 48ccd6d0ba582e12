"""What only a GPU machine can run: the command on NCCL with CUDA tensors, FSDP1 and FSDP2 sources made on the GPU,
converted, loaded back there and resumed (``benchmarks/gpu_check.py``'s cases, one GPU each). Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_check  # noqa: E402 - benchmarks/ is no package: its module is found once its folder is on the path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine (benchmarks/gpu_check.sh)"
    ),
]


@pytest.mark.parametrize("name", sorted(gpu_check.CASES))
def test_a_conversion_on_one_gpu_passes_every_check(name: str, tmp_path: Path) -> None:
    row = gpu_check.run_case(name, gpu_check.CASES[name], tmp_path)
    assert row["ok"], row


def test_the_fsdp1_gather_of_moments_runs_on_the_gpu(tmp_path: Path) -> None:
    row = gpu_check.run_moments(tmp_path)
    assert row["ok"], row
