"""Settle the CPU vector-math library's choice of kernels before any work, so that float math is the same every time.

PyTorch hands contiguous float32 and float64 unary ops on the CPU (``sqrt``,
``exp``, ``tanh``...) to oneMKL's vector math (VML), each intra-op thread its
own chunk. oneMKL picks each function's kernel lazily, on its first call. In
the oneMKL that the PyTorch wheels bundle (2024.2), first calls that run on
several threads at once can race: one thread may run a low-accuracy kernel
for its whole chunk of that one call, although high accuracy was asked for
(pytorch/pytorch#188792; the open fix, pytorch/pytorch#188791, warms each
function up the same way; oneMKL 2025.0 no longer shows it). Every later
call is right.

What that did here: the ``resume`` check's target optimizer took the
process's first ``sqrt`` (Adam's denominator) over two threads, the second
thread's half came back about 1e-4 off, and a correct conversion failed the
check by a few ulp in that half (``osdpipe: error: verify failed: check
resume: ... 1808 of 16000 element(s) differ ..., first at flat index 8001``),
in 1 of 37 runs of that conversion here (8 of 61 under instrumentation that
made the race likelier). A job that resumes training can be hit the same
way, on its first step.

:func:`settle` calls each such function once on a few elements, which one
thread computes alone, so the choice is made before any call can race. It
costs about 2 ms, once per process. ``benchmarks/vml_first_call.py``
counts the corrupted first calls over many fresh processes with and without it.
"""

from __future__ import annotations

import functools

import torch

#: The unary ops PyTorch may compute with oneMKL's vector math (ATen's ``cpu/vml.h``), and neighbours that are cheap
#: to include: settling one that never reaches oneMKL costs nothing.
UNARY_OPS = (
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "erfinv", "exp", "expm1", "floor", "lgamma",
    "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt",
    "tan", "tanh", "trunc",
)  # fmt: skip
#: The dtypes oneMKL's vector math has kernels for.
DTYPES = (torch.float32, torch.float64)
#: Elements of the settling calls: far below what ATen splits over threads (a 16000-element sqrt is split in two).
ELEMENTS = 64


@functools.cache
def settle() -> None:
    """Make oneMKL choose its vector-math kernels now, on this thread alone (see the module docstring); once."""
    for dtype in DTYPES:
        values = torch.full((ELEMENTS,), 0.5, dtype=dtype)
        for name in UNARY_OPS:
            getattr(torch, name)(values)
