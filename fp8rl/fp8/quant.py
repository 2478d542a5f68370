"""Block-wise FP8 quantization (DeepSeek-V3 recipe), docs/design.md section 3.

A tensor ``x`` of shape ``[..., M, K]`` is cut, over its last two dims, into
blocks of ``(bm, bk)`` elements; every block gets one FP32 scale:

    amax  = max(|x|) over the block's real elements, then max(amax, 1e-4)
            (the floor is a parameter: 2**-9 follows vLLM, formats.AMAX_FLOORS)
    scale = amax / fmax                      (FP32; fmax = 448 for E4M3)
    scale = 2 ** ceil(log2(scale))           (only for scale_fmt="ue8m0")
    q     = clamp(x / scale, -fmax, fmax).to(fp8)
    x    ~= q.float() * scale                (dequantize)

Block shapes used by the library:
    (1, 128)    activations and gradients, one scale per token per 128 features
    (128, 128)  weights
    (128, 1)    token-axis requantization for the weight-gradient GEMM
Any ``(bm, bk)`` works. Edge blocks may be partial (SmolLM2's hidden size 576
is 4.5 blocks of 128); their amax covers only their real elements.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from fp8rl.fp8 import kernels
from fp8rl.fp8.formats import AMAX_FLOOR, E4M3, SCALE_FORMATS, get_format


class DerivedCache(dict):
    """Forms derived from a tensor (a transpose, a backend's converted or packed
    weight), computed on first use. A copied model recomputes them instead of
    copying them (some, like oneDNN's packed weights, cannot be copied)."""

    def __deepcopy__(self, memo: dict) -> "DerivedCache":
        return DerivedCache()


class NonFiniteError(ValueError):
    """A tensor to be quantized holds NaN or Inf (the message names it)."""


@dataclass
class QTensor:
    """A block-quantized tensor.

    data:      fp8 tensor, same shape as the original ``[..., M, K]``
    scale:     fp32 tensor ``[..., ceil(M/bm), ceil(K/bk)]``: the dequantization
               multiplier of each block (``x ~= data * scale``)
    block:     ``(bm, bk)``
    fmt:       "e4m3" or "e5m2"
    scale_fmt: "fp32" or "ue8m0"
    cache:     derived forms computed on first use (the transpose, a GEMM
               backend's dequantized blocks). A QTensor is never modified in
               place, so a weight quantized once per optimizer step pays for
               these once per step, not once per GEMM call.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    fmt: str = "e4m3"
    scale_fmt: str = "fp32"
    cache: dict = field(default_factory=DerivedCache, repr=False, compare=False)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        """Storage of the quantized tensor: fp8 data plus fp32 scales."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def t(self) -> "QTensor":
        """Transpose a 2-D QTensor: ``[M, K]`` with blocks ``(bm, bk)`` becomes
        ``[K, M]`` with blocks ``(bk, bm)``.

        Exact and cheap (two views, no requantization): each block maps to one
        block of the transpose with the same scale. The dgrad GEMM uses it on
        the 128x128-block weight, whose transpose is again 128x128-blocked.
        """
        if self.data.dim() != 2:
            raise ValueError(f"QTensor.t() needs a 2-D QTensor, got shape {tuple(self.data.shape)}")
        if "t" not in self.cache:
            bm, bk = self.block
            self.cache["t"] = QTensor(self.data.t(), self.scale.t(), (bk, bm), self.fmt, self.scale_fmt)
        return self.cache["t"]


def _ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Round positive, normal FP32 ``scale`` up to a power of two, exactly.

    frexp gives ``scale = m * 2**e`` with ``m`` in [0.5, 1). ``ceil(log2(scale))``
    is ``e``, except when ``m == 0.5`` (scale already a power of two): ``e - 1``.
    The power of two is built from its IEEE-754 bits, so no floating log2/exp2
    rounding can creep in. Scales here are >= 1e-4 / 57344 > 2**-126 (normal).
    """
    mantissa, exponent = torch.frexp(scale)
    k = exponent - (mantissa == 0.5).to(exponent.dtype)
    return ((k + 127) << 23).to(torch.int32).view(torch.float32)


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or any(int(b) != b or b < 1 for b in block):
        raise ValueError(f"block must be two positive ints (bm, bk), got {block!r}")
    return int(block[0]), int(block[1])


def _segments(n: int, b: int) -> list[tuple[int, int, int]]:
    """Split ``range(n)`` into ``(start, stop, rows_per_block)`` pieces: the
    whole blocks of ``b``, then the partial edge block if any."""
    full = n // b * b
    segs = [(0, full, b)] if full else []
    if full < n:
        segs.append((full, n, n - full))
    return segs


def quantize(
    x: torch.Tensor,
    block: tuple[int, int] = (1, 128),
    fmt: str = "e4m3",
    scale_fmt: str = "fp32",
    name: str = "tensor",
    amax_floor: float = AMAX_FLOOR,
    compiled: bool = True,
) -> QTensor:
    """Quantize ``x`` ``[..., M, K]`` block-wise to FP8 (see module docstring).

    ``name`` names the tensor in the error raised when ``x`` holds NaN or Inf
    (a non-finite value would otherwise poison its block's scale silently);
    ``amax_floor`` is the smallest amax a block is scaled for. A 2-D E4M3 tensor
    on the CPU (a weight, the FP8 backward's gradients and inputs) takes the compiled
    kernel where it is available, with ``compiled`` (``kernels.quantize_blocks``: the
    same operations, the same bits);
    the torch code below is what runs elsewhere and what it is tested against.
    Returns a QTensor with ``data`` ``[..., M, K]`` and ``scale``
    ``[..., ceil(M/bm), ceil(K/bk)]``.
    """
    f = get_format(fmt)
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"unknown scale_fmt {scale_fmt!r}; valid: {', '.join(SCALE_FORMATS)}")
    bm, bk = _check_block(block)
    if x.dim() < 2:
        raise ValueError(f"quantize needs a tensor of at least 2 dims [..., M, K], {name!r} has shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.element_size() == 1:
        raise ValueError(f"quantize needs a float32/bf16/fp16/fp64 tensor, {name!r} is {x.dtype}")

    *lead, m, k = x.shape
    if fmt == "e4m3" and compiled:  # one compiled pass where available (2-D CPU tensors)
        try:
            made = kernels.quantize_blocks(x, bm, bk, scale_fmt == "ue8m0", amax_floor)
        except ValueError:
            raise NonFiniteError(f"quantize: tensor {name!r} contains NaN or Inf") from None
        if made is not None:
            return QTensor(made[0], made[1], (bm, bk), fmt, scale_fmt)
    if bm == 1 and k % bk == 0:
        return _quantize_rows(x, bk, f, scale_fmt, name, amax_floor)
    if bm == 1 and k % bk:
        # Row blocks with a ragged last column block (SmolLM2's 576 = 4.5 x 128):
        # zero-pad to whole blocks and quantize in one region instead of two.
        # Bitwise the same: zeros never raise max|x| and quantize to zero.
        padded = quantize(torch.nn.functional.pad(x, (0, -k % bk)), block, fmt, scale_fmt, name, amax_floor)
        return QTensor(padded.data[..., :k], padded.scale, (bm, bk), fmt, scale_fmt)
    x32 = x.float()
    q = torch.empty(x.shape, dtype=f.dtype, device=x.device)
    scale = torch.empty(*lead, -(-m // bm), -(-k // bk), dtype=torch.float32, device=x.device)
    # Up to four regions: whole blocks, the partial column of edge blocks, the
    # partial row, the corner. Each region is viewed (no copy) as
    # [..., row blocks, rows per block, col blocks, cols per block].
    for r0, r1, rb in _segments(m, bm):
        for c0, c1, cb in _segments(k, bk):
            xb = x32[..., r0:r1, c0:c1].unflatten(-1, (-1, cb)).unflatten(-3, (-1, rb))
            # max(|x|) as max(max x, -min x): no |x| temporary. NaN propagates.
            amax = torch.maximum(xb.amax(dim=(-3, -1)), xb.amin(dim=(-3, -1)).neg())
            if not torch.isfinite(amax).all():
                raise NonFiniteError(f"quantize: tensor {name!r} contains NaN or Inf")
            s = amax.clamp_min(amax_floor) / f.max
            if scale_fmt == "ue8m0":
                s = _ue8m0(s)
            scale[..., r0 // bm : -(-r1 // bm), c0 // bk : -(-c1 // bk)] = s
            # The cast (round to nearest even) happens in the copy into q.
            q[..., r0:r1, c0:c1] = _scaled(xb, s[..., :, None, :, None], f.max).flatten(-4, -3).flatten(-2, -1)
    return QTensor(q, scale, (bm, bk), fmt, scale_fmt)


def _row_block_scales(xb: torch.Tensor, fmax: float, scale_fmt: str, name: str, amax_floor: float) -> torch.Tensor:
    """FP32 scales ``[..., M, K/bk, 1]`` of the row blocks of ``xb`` ``[..., M, K/bk, bk]``:
    ``max(amax, amax_floor) / fmax`` (ue8m0: rounded up to a power of two);
    NonFiniteError naming the tensor if it holds NaN or Inf."""
    amax = xb.abs().amax(dim=-1, keepdim=True)
    if not bool((amax < float("inf")).all()):  # False for NaN and Inf
        raise NonFiniteError(f"quantize: tensor {name!r} contains NaN or Inf")
    s = amax.clamp_min_(amax_floor).div_(fmax)
    return _ue8m0(s) if scale_fmt == "ue8m0" else s


def _quantize_rows(x: torch.Tensor, bk: int, f, scale_fmt: str, name: str, amax_floor: float) -> QTensor:
    """``quantize`` for ``(1, bk)`` blocks when ``bk`` divides K: the same
    arithmetic as the general path (bitwise), in about a third of the torch
    calls (what a decode step's many small activations pay for)."""
    xb = x.float().unflatten(-1, (-1, bk))  # [..., M, K/bk, bk]
    s = _row_block_scales(xb, f.max, scale_fmt, name, amax_floor)
    q = _scaled(xb, s, f.max).to(f.dtype).flatten(-2)
    return QTensor(q, s[..., 0], (1, bk), f.name, scale_fmt)


# IEEE-754 single-precision bit fields used by quantize_dequantize.
_EXPONENT_BITS = 0x7F800000
_E4M3_MIN_NORMAL_EXP = (127 - 6) << 23  # exponent field of 2**-6, E4M3's smallest normal


def quantize_dequantize(
    x: torch.Tensor, bk: int = 128, scale_fmt: str = "fp32", name: str = "tensor", amax_floor: float = AMAX_FLOOR,
    compiled: bool = True,
) -> torch.Tensor:
    """``dequantize(quantize(x, (1, bk), "e4m3", scale_fmt, amax_floor=amax_floor))`` as FP32 ``[..., M, K]``,
    bit for bit (up to the sign of zero), without storing FP8.

    For backends whose GEMM multiplies dequantized values (no FP8 arithmetic on
    the CPU): about 15 elementwise passes instead of about 35 torch calls, which
    is most of what an FP8 linear adds to a decode step. Each ``y = x / scale``
    is rounded to the E4M3 grid by adding and subtracting a magic number: for
    ``2**e <= |y| < 2**(e+1)`` E4M3 keeps 3 mantissa bits, a spacing of
    ``2**(e-3)``, and FP32 has that spacing (``2**(e-3)``) between
    ``1.5 * 2**(e+20)`` and ``2**(e+21)``, so ``(y + 1.5 * 2**(e+20)) - 1.5 * 2**(e+20)``
    is ``y`` rounded to nearest even on the E4M3 grid, exactly as the cast
    rounds. Below ``2**-6`` (E4M3 subnormals, spacing ``2**-9``) ``e`` is held at
    -6. ``y`` is clamped to +-448 first, which the grid then keeps.

    On the CPU with ``compiled`` (the default) the compiled kernel does it in one
    pass where it is available (``kernels.qdq_rows``: the same operations, the same
    bits); below is the torch code, what runs elsewhere and what it is tested against.
    """
    if bk < 1:
        raise ValueError(f"block width must be >= 1, got {bk}")
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"unknown scale_fmt {scale_fmt!r}; valid: {', '.join(SCALE_FORMATS)}")
    if compiled:
        try:
            out = kernels.qdq_rows(x, bk, scale_fmt == "ue8m0", amax_floor)
        except ValueError:
            raise NonFiniteError(f"quantize: tensor {name!r} contains NaN or Inf") from None
        if out is not None:
            return out
    k = x.shape[-1]
    x32 = x.float()
    if k % bk:
        x32 = torch.nn.functional.pad(x32, (0, -k % bk))  # zeros never raise a block's amax
    xb = x32.unflatten(-1, (-1, bk))  # [..., M, K/bk, bk]
    s = _row_block_scales(xb, E4M3.max, scale_fmt, name, amax_floor)
    out = _round_to_e4m3_(_scaled(xb, s, E4M3.max)).mul_(s).flatten(-2)
    return out[..., :k] if k % bk else out


def _round_to_e4m3_(y: torch.Tensor) -> torch.Tensor:
    """Round FP32 ``y`` (``|y| <= 448``) in place to the E4M3 grid, to nearest even, as
    the cast rounds, by the magic-number addition of ``quantize_dequantize``; a
    negative value that rounds to zero gives +0 (the cast: -0)."""
    exponent = y.view(torch.int32).bitwise_and(_EXPONENT_BITS).clamp_min_(_E4M3_MIN_NORMAL_EXP)
    magic = exponent.add_((20 << 23) | (1 << 22)).view(torch.float32)  # 1.5 * 2**(e+20)
    return y.add_(magic).sub_(magic)


def dequantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8_to_float(quantize_static(x, scale)) * scale`` (E4M3) as FP32, bit for bit,
    signs of zero included, without the FP8 round trip: torch's FP8 cast is a scalar
    loop on the CPU and the way back a table gather, which made FP8 attention's
    Q/K/V/P storage a sizeable part of a ``jet-kv`` step."""
    return e4m3_values(x, scale).mul_(scale)


def e4m3_values(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8_to_float(quantize_static(x, scale))`` as FP32, signs of zero included: the E4M3
    values before their scale (``dequantize_static`` is these times ``scale``). They are
    exact in BF16, which is how an FP8 KV cache of the fused attention holds them."""
    x32 = x.float()
    y = _round_to_e4m3_(_scaled(x32, scale, E4M3.max))
    return torch.copysign(y, x32, out=y)


def _scaled(x32: torch.Tensor, scale: torch.Tensor, fmax: float) -> torch.Tensor:
    """``clamp(x / scale, -fmax, fmax)``: true FP32 division, clamp before the
    cast (so out-of-range values saturate instead of becoming NaN)."""
    return (x32 / scale).clamp_(-fmax, fmax)


def quantize_static(x: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """FP8 data of ``x`` under a given (static) FP32 ``scale`` that broadcasts to it.

    The same divide, clamp and cast as ``quantize``, without computing the scale:
    used for the Q/K/V and P tensors of FP8 attention, whose per-head scales are
    calibrated between steps. Values beyond ``fmax * scale`` saturate, as static
    scales do. Dequantize with ``fp8_to_float(data) * scale``.
    """
    f = get_format(fmt)
    return _scaled(x.float(), scale, f.max).to(f.dtype)


def fp8_to_float(data: torch.Tensor) -> torch.Tensor:
    """Exact FP8 -> FP32 conversion through a 256-entry lookup table.

    Same values as ``data.float()``, but torch's FP8 cast is a scalar loop on
    CPU (about 9 ns per element here) while a table gather is ~15x faster.
    """
    codes = data.contiguous().view(torch.uint8).reshape(-1).int()
    return _lut(data.dtype, data.device).index_select(0, codes).view(data.shape)


@functools.lru_cache(maxsize=None)
def _lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """FP32 value of each of the 256 codes of an FP8 ``dtype`` (read-only)."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(dtype).float()


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32, compiled: bool = True) -> torch.Tensor:
    """Tensor ``[..., M, K]`` with ``data * scale`` (one FP32 rounding per element), as
    FP32 or rounded once more to ``dtype`` (``dequantize(q).to(dtype)``'s bits). A 2-D
    E4M3 tensor on the CPU takes one compiled pass where available (``compiled``)."""
    if compiled:
        out = kernels.dequantize_blocks(q.data, q.scale, *q.block, dtype)
        if out is not None:
            return out
    out = _dequantize32(q)
    return out if dtype == torch.float32 else out.to(dtype)


def quantize_dequantize_blocks(
    x: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32, scale_fmt: str = "fp32",
    name: str = "tensor", amax_floor: float = AMAX_FLOOR, compiled: bool = True,
) -> torch.Tensor:
    """``dequantize(quantize(x, block, "e4m3", scale_fmt, amax_floor=amax_floor), dtype)`` ``[M, K]``,
    bit for bit (signs of zero included), without storing FP8: the FP8 backward's operands
    for a backend whose GEMM multiplies dequantized values (``Backend.grad_operand``). A
    2-D CPU tensor takes one compiled pass where available (``kernels.quantize_blocks``
    with ``dequantized``) instead of two or three (quantize, dequantize, a BF16 rounding)."""
    if compiled and scale_fmt in SCALE_FORMATS and x.is_floating_point() and x.element_size() > 1:
        try:
            made = kernels.quantize_blocks(x, *_check_block(block), scale_fmt == "ue8m0", amax_floor, dequantized=dtype)
        except ValueError:
            raise NonFiniteError(f"quantize: tensor {name!r} contains NaN or Inf") from None
        if made is not None:
            return made[0]
    # quantize refuses what the kernel does not take (a bad format, dtype or shape) with its message
    q = quantize(x, block, scale_fmt=scale_fmt, name=name, amax_floor=amax_floor, compiled=compiled)
    return dequantize(q, dtype, compiled)


def _dequantize32(q: QTensor) -> torch.Tensor:
    bm, bk = q.block
    m, k = q.data.shape[-2:]
    out = fp8_to_float(q.data)
    if bm == 1 and k % bk == 0:  # row blocks: one broadcast multiply
        return out.unflatten(-1, (-1, bk)).mul_(q.scale[..., None]).flatten(-2)
    for r0, r1, rb in _segments(m, bm):
        for c0, c1, cb in _segments(k, bk):
            s = q.scale[..., r0 // bm : -(-r1 // bm), c0 // bk : -(-c1 // bk)]
            out[..., r0:r1, c0:c1].unflatten(-1, (-1, cb)).unflatten(-3, (-1, rb)).mul_(s[..., :, None, :, None])
    return out
