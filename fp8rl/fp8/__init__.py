"""FP8 numerics: formats, block quantization, GEMM backends, FP8 linear layer.

This package is the bottom layer: it imports nothing else from fp8rl."""

from fp8rl.fp8.backends import BACKENDS, Backend, choose_backend, fp8_matmul, get_backend
from fp8rl.fp8.formats import AMAX_FLOOR, E4M3, E4M3_MAX, E5M2, E5M2_MAX, FP8Format, get_format
from fp8rl.fp8.linear import FP8Linear, LinearPlan
from fp8rl.fp8.quant import NonFiniteError, QTensor, dequantize, quantize, quantize_static

__all__ = [
    "AMAX_FLOOR", "E4M3", "E4M3_MAX", "E5M2", "E5M2_MAX", "FP8Format", "get_format",
    "QTensor", "NonFiniteError", "quantize", "quantize_static", "dequantize",
    "BACKENDS", "Backend", "choose_backend", "get_backend", "fp8_matmul", "FP8Linear", "LinearPlan",
]
