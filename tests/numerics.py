"""Numerics helpers shared by the tests (imported as `from numerics import ...`)."""

from __future__ import annotations

import math

import torch


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``x`` against the reference ``ref``, in dB:
    ``10 log10(sum ref^2 / sum (ref - x)^2)``, in float64 (torchao's measure);
    ``inf`` when ``x`` equals ``ref``."""
    ref, x = ref.detach().double(), x.detach().double()
    noise = ((ref - x) ** 2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10((ref**2).sum().item() / noise)
