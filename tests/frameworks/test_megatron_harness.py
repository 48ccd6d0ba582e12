"""The Megatron-Core harness itself (:mod:`frameworks.mcore`): real megatron-core 0.16.1 saves and loads on CPU.

osdpipe's Megatron tests trust two things this module proves once:

* the harness's ``load`` (Megatron-LM's ``load_checkpoint`` steps, on megatron-core's API, with the workarounds
  for its bugs) gives back, bit for bit, what the saving job held: weights, fp32 masters, moments, per-parameter
  step, param groups, scheduler, iteration; and a resume of K synthetic steps after that load equals the saving
  job's own K steps (``--resume-truth``), so "loaded and resumed" is a test osdpipe's outputs can be put to;
* megatron-core itself reshards a ``fully_reshardable`` save (TP2 PP2 DP1 -> TP1 PP1 DP4) to the same state, and the
  resume is comparable across layouts (synthetic gradients, elementwise Adam).

Each job is a 4-rank ``torchrun`` on CPU with gloo, tens of seconds on 2 cores: three jobs per case, two cases.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from frameworks import mcore

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

TIMEOUT = 400


def _load(path):
    return torch.load(path, weights_only=False)


def _assert_same(expected_path, actual_path):
    differences = mcore.dump_differences(_load(expected_path), _load(actual_path))
    assert not differences, "\n".join(differences[:40])


def _save_then_load(tmp_path, saved: tuple[int, int], sharding: str, loaded: tuple[int, int]):
    """A job at TP x PP ``saved`` trains 3 steps, saves in ``sharding`` and takes 2 more; a job at ``loaded`` loads
    the save and takes the same 2: the save, then the load, in one launch on 4 ranks (each job built afresh), as
    megatron-core's start is most of a job's time. The save's folder."""
    src = tmp_path / "src"
    mcore.each(tmp_path, 4, [
        mcore.save_argv(src, tp=saved[0], pp=saved[1], sharding=sharding, steps=3, resume_truth=2,
                        dump_after=tmp_path / "src.resumed.pt"),
        mcore.load_argv(src, tmp_path / "loaded.pt", tp=loaded[0], pp=loaded[1], resume=2,
                        dump_after=tmp_path / "loaded.resumed.pt"),
    ], label="save-load", timeout=TIMEOUT)
    return src


def test_dp_reshardable_loads_back_bitwise_and_resumes(tmp_path):
    """TP2 PP1 DP2, dp_reshardable (Megatron-LM's default): the same layout loads the truth, resumes like the source."""
    src = _save_then_load(tmp_path, (2, 1), "dp_reshardable", (2, 1))
    truth = _load(mcore.truth_path(src))
    assert truth["iteration"] == 3 and len(truth["param_groups"]) == 2
    assert truth["model"]["embedding.word_embeddings.weight"].shape == (1024, 64)  # vocab 1000 padded (128 x TP)
    assert {float(v["step"]) for v in truth["optim"].values()} == {3.0}
    assert (src / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert {p.name for p in (src / "iter_0000003").iterdir()} >= {".metadata", "common.pt", "metadata.json"}

    _assert_same(mcore.truth_path(src), tmp_path / "loaded.pt")
    _assert_same(tmp_path / "src.resumed.pt", tmp_path / "loaded.resumed.pt")
    assert _load(tmp_path / "loaded.resumed.pt")["iteration"] == 5


def test_fully_reshardable_is_resharded_by_megatron(tmp_path):
    """TP2 PP2 DP1, fully_reshardable, loaded by Megatron at TP1 PP1 DP4: the truth, and the same resume."""
    src = _save_then_load(tmp_path, (2, 2), "fully_reshardable", (1, 1))
    _assert_same(mcore.truth_path(src), tmp_path / "loaded.pt")
    _assert_same(tmp_path / "src.resumed.pt", tmp_path / "loaded.resumed.pt")
