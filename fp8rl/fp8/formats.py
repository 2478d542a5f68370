"""FP8 number formats and the constants of the block-scaling recipe.

Two OCP FP8 formats are used (docs/design.md section 3):

- E4M3 (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa bits, largest
  finite value 448, no infinities. Weights, activations and gradients.
- E5M2 (``torch.float8_e5m2``): 5 exponent bits, 2 mantissa bits, largest
  finite value 57344. Only where a recipe asks for more range.

Scales are FP32. ``"fp32"`` scales are ``amax / fmax``; ``"ue8m0"`` scales are
that value rounded *up* to a power of two (an 8-bit exponent, no mantissa),
which makes dequantization exact and matches DeepSeek-V3 / MXFP8 hardware.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    """One FP8 format: its name, torch dtype and largest finite value."""

    name: str
    dtype: torch.dtype
    max: float


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 448.0)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0)

E4M3_MAX = E4M3.max
E5M2_MAX = E5M2.max

# Blocks whose amax is below this are scaled as if their amax were this value,
# so an all-zero block gets a finite, non-zero scale (DeepSeek-V3 reference).
AMAX_FLOOR = 1e-4

# Whose convention a linear's input (activation) quantization follows, as its
# amax floor. "vllm": vLLM's group quantizer (`QuantFP8`, FP32 scales) computes
# clamp(amax / 448, min=1 / (448 * 512)), which is max(amax, 2**-9) / 448 in
# the same FP32 bits (2**-9 / 448 rounds to the constant). A flow picks one
# (`PrecisionFlow.quantizer`); weights and gradients always use AMAX_FLOOR.
AMAX_FLOORS: dict[str, float] = {"fp8rl": AMAX_FLOOR, "vllm": 2.0**-9}

FP8_FORMATS: tuple[str, ...] = ("e4m3", "e5m2")
SCALE_FORMATS: tuple[str, ...] = ("fp32", "ue8m0")


def get_format(fmt: str) -> FP8Format:
    """Return the ``FP8Format`` called ``fmt`` ("e4m3" or "e5m2")."""
    if fmt == "e4m3":
        return E4M3
    if fmt == "e5m2":
        return E5M2
    raise ValueError(f"unknown FP8 format {fmt!r}; valid formats: {', '.join(FP8_FORMATS)}")
