"""MKL's vector math initialized on one thread, before any call that two threads share.

torch's CPU builds compute sin, cos, exp, log, sqrt, tanh and a few more of float
tensors with Intel MKL's vector math (VML: ``vmsSin`` and kin, at its high-accuracy
setting). A tensor above torch's grain size (32,768 elements) is cut between the
OpenMP threads, and each thread calls VML on its part. Measured here (2-core Xeon with
AMX, torch 2.13.0+cpu with MKL 2024.2, 2026-12-06): when a process's *first* call of
such a function is made by two threads at once, one thread's part can come out less
accurate. The first ``Transformer.rope`` of a process gave sin(1) = 0.8415409 instead of
0.84147096 for one half of a [100, 43, 32] batch (the main thread's in some processes,
the worker's in others) in 3 of 8 fresh processes; every later call was right. So the
first forward of a process differed from the same forward later: the default run's
held-out accuracy before training read 0.365 in some processes and 0.36 in others, and a
process whose first forward is a rollout would not get the training forward's
log-probabilities for those rows.

``initialize_vector_math()`` calls each VML function torch uses, in FP32 and FP64, once on
a four-element tensor (one thread: no race), before the model's first forward
(``Transformer.__init__`` calls it): 0 of 10 processes then differed
(tests/test_vector_math.py).
"""

from __future__ import annotations

import functools

import torch

# torch's ATen/cpu/vml.h: the functions with an MKL implementation (acos .. log2), and
# abs, expm1 and log1p, which other torch versions route there too.
VML_FUNCTIONS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin",
                 "sqrt", "tan", "tanh", "trunc", "abs", "expm1", "log1p")


@functools.lru_cache(maxsize=None)
def initialize_vector_math() -> None:
    """Each of ``VML_FUNCTIONS`` once per dtype on a tensor too small to be shared
    between threads; once per process (later calls do nothing)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((4,), 0.5, dtype=dtype)
        for name in VML_FUNCTIONS:
            getattr(torch, name)(x)
