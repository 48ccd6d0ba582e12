"""oneMKL's vector-math kernels are chosen before osdpipe computes anything it compares bit for bit
(:mod:`osdpipe.core.vector_math`: a first call of a vector-math function that runs on two threads at once can come
back wrong in one thread's half, pytorch/pytorch#188792).

The race itself needs many fresh processes to show (``benchmarks/vml_first_call.py`` counts it); these tests hold what
prevents it: every unary op an optimizer osdpipe steps takes is settled, settling runs each of them on a few elements
(far below what ATen splits over threads) in both dtypes, a conversion settles before its first stage, and so does
each test process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from osdpipe.core import vector_math
from osdpipe.verify.resume_training import ELEMENTWISE


class UnaryOps(TorchDispatchMode):
    """Records the unary pointwise ops called (one tensor in, nothing else but keyword options): the ops PyTorch may
    hand to oneMKL's vector math, by name, dtype and element count."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [a for a in func._schema.arguments if not a.kwarg_only]
        if torch.Tag.pointwise in func.tags and len(inputs) == 1 and str(inputs[0].type) == "Tensor":
            self.calls.append((func.overloadpacket.__name__.rstrip("_"), args[0].dtype, args[0].numel()))
        return func(*args, **(kwargs or {}))


def test_every_unary_op_an_elementwise_optimizer_steps_with_is_settled() -> None:
    taken: dict[str, set[str]] = {}
    for name in sorted(ELEMENTWISE):
        for options in ({}, {"weight_decay": 0.1}, {"maximize": True}):
            param = torch.nn.Parameter(torch.rand(8) + 0.1)
            try:
                optim = getattr(torch.optim, name)([param], **options)
            except TypeError:  # an option this optimizer does not have (Rprop: weight_decay)
                continue
            with UnaryOps() as ops:
                for _ in range(2):
                    param.grad = torch.rand(8)
                    optim.step()
            for op, _, _ in ops.calls:
                taken.setdefault(op, set()).add(name)
    taken.pop("clone", None)  # a copy, not math
    assert taken.get("sqrt") and "Adam" in taken["sqrt"], taken  # the recording sees what Adam's step does
    unsettled = {op: sorted(names) for op, names in taken.items() if op not in vector_math.UNARY_OPS}
    assert not unsettled, f"ops an optimizer steps with that vector_math.settle() does not settle: {unsettled}"


def test_settling_calls_every_op_in_both_dtypes_on_a_few_elements() -> None:
    with UnaryOps() as ops:
        vector_math.settle.__wrapped__()  # the function itself, not its once-a-process cache
    called = {(op, dtype) for op, dtype, numel in ops.calls if numel <= vector_math.ELEMENTS}
    missing = [(op, dtype) for op in vector_math.UNARY_OPS for dtype in vector_math.DTYPES if (op, dtype) not in called]
    assert not missing, missing


def test_a_conversion_settles_the_vector_math_before_its_first_stage(tmp_path: Path, monkeypatch) -> None:
    from helpers import planned

    from osdpipe.pipeline import loop
    from osdpipe.pipeline.execute import execute
    from osdpipe.spec.reconcile import settle_and_validate

    events: list[str] = []
    monkeypatch.setattr(vector_math, "settle", lambda: events.append("settle"))
    for name, stage in list(loop.STAGES.items()):
        monkeypatch.setitem(loop.STAGES, name, lambda *args, _n=name, _s=stage: (events.append(_n), _s(*args))[1])
    spec = settle_and_validate({
        "model": {"factory": "userlm:build"}, "target": {"world_size": 2}, "output": {"path": str(tmp_path / "out")},
        "pipeline": {"checks": ["roundtrip"]}, "runtime": {"mode": "offline", "progress": False},
    })  # fmt: skip
    assert execute(planned(spec)).ok  # offline: the stages run in this process, after generating a source here
    assert events[0] == "settle" and len(events) > 1, events


def settled_here() -> bool:
    """Whether this process has settled its vector math (in a rank: before the rank's function began)."""
    return vector_math.settle.cache_info().currsize == 1


def test_every_rank_of_a_local_world_settles_before_its_function_runs() -> None:
    from osdpipe.run.launch import run_local_world

    assert run_local_world(settled_here, 2, (), timeout_s=120) == [True, True]


def test_settled_before_the_first_test_of_its_process() -> None:
    """Run by the next test alone, in a fresh pytest process, where nothing else can have settled (in the whole
    suite it holds whenever any test before it settled: the proof is the next test's)."""
    assert settled_here()


def test_a_fresh_test_process_settles_before_its_first_test() -> None:
    from helpers import clean_env

    root = Path(__file__).resolve().parents[2]
    alone = f"{Path(__file__).relative_to(root)}::test_settled_before_the_first_test_of_its_process"
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", alone],
        cwd=root, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ran.returncode == 0 and "1 passed" in ran.stdout, ran.stdout[-3000:]
