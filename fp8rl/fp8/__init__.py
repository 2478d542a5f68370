"""FP8 numerics: formats, block quantization, block-scaled GEMM, FP8 linear layer."""

from fp8rl.fp8.formats import AMAX_FLOOR, E4M3, E4M3_MAX, E5M2, E5M2_MAX, FP8Format, get_format
from fp8rl.fp8.gemm import BACKENDS, fp8_matmul
from fp8rl.fp8.linear import FP8Linear
from fp8rl.fp8.quant import NonFiniteError, QTensor, dequantize, quantize

__all__ = [
    "AMAX_FLOOR", "E4M3", "E4M3_MAX", "E5M2", "E5M2_MAX", "FP8Format", "get_format",
    "QTensor", "NonFiniteError", "quantize", "dequantize", "BACKENDS", "fp8_matmul", "FP8Linear",
]
