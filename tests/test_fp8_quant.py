"""Block FP8 quantization against an independent float64 reference.

The reference below does not use torch's FP8 casts: it builds the E4M3 / E5M2
value grids from the bit layouts, loops over blocks for the scales, and rounds
to nearest (ties to even code) itself. ``quantize`` must match it bit for bit.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from fp8rl.fp8 import E4M3_MAX, E5M2_MAX, QTensor, dequantize, quantize
from fp8rl.fp8.quant import NonFiniteError

BLOCKS = [(1, 128), (128, 128), (128, 1)]


# ---------------------------------------------------------------- reference


def fp8_grid(fmt: str) -> np.ndarray:
    """Non-negative finite values of the format, indexed by their 7-bit code."""
    exp_bits, man_bits, bias = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}[fmt]
    n_codes = {"e4m3": 127, "e5m2": 124}[fmt]  # e4m3fn: 0x7F is NaN; e5m2: 0x7C.. are inf/NaN
    vals = []
    for code in range(n_codes):
        e, m = code >> man_bits, code & ((1 << man_bits) - 1)
        if e == 0:
            vals.append(m * 2.0 ** (1 - bias - man_bits))
        else:
            vals.append((1 + m / 2**man_bits) * 2.0 ** (e - bias))
    grid = np.array(vals)
    assert np.all(np.diff(grid) > 0)
    return grid


def ref_codes(v: np.ndarray, fmt: str) -> np.ndarray:
    """Round float64 values (|v| <= fmax) to the FP8 grid, ties to even; return uint8 codes."""
    grid = fp8_grid(fmt)
    a = np.abs(v)
    assert a.max(initial=0.0) <= grid[-1]
    hi = np.searchsorted(grid, a, side="left")  # grid[hi-1] < a <= grid[hi]
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(take_hi, hi, lo)
    return (code | (np.signbit(v).astype(np.int64) << 7)).astype(np.uint8)


def ref_scale(amax: float, fmax: float, scale_fmt: str, amax_floor: float = 1e-4) -> float:
    floor = float(np.float32(amax_floor))  # the FP32 floor the contract applies
    # amax and fmax are FP32 numbers: a float64 quotient rounded to FP32 is the
    # correctly rounded FP32 quotient (double rounding is innocuous for /).
    s = float(np.float32(max(amax, floor) / fmax))
    if scale_fmt == "ue8m0":
        k = math.ceil(math.log2(s))
        while 2.0 ** (k - 1) >= s:
            k -= 1
        while 2.0**k < s:
            k += 1
        s = 2.0**k
    return s


def ref_quantize(x: torch.Tensor, block, fmt: str, scale_fmt: str, amax_floor: float = 1e-4):
    """(codes uint8 [..., M, K], scale float64 [..., Mb, Kb]) by plain loops over blocks."""
    fmax = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    x64 = x.float().double().numpy()
    *lead, m, k = x64.shape
    bm, bk = block
    mb, kb = -(-m // bm), -(-k // bk)
    flat = x64.reshape(-1, m, k)
    scales = np.zeros((flat.shape[0], mb, kb))
    codes = np.zeros(flat.shape, dtype=np.uint8)
    for b in range(flat.shape[0]):
        for i in range(mb):
            for j in range(kb):
                blk = flat[b, i * bm : (i + 1) * bm, j * bk : (j + 1) * bk]
                s = ref_scale(float(np.abs(blk).max()), fmax, scale_fmt, amax_floor)
                scales[b, i, j] = s
                quot = (blk / s).astype(np.float32).astype(np.float64)  # FP32 division
                codes[b, i * bm : (i + 1) * bm, j * bk : (j + 1) * bk] = ref_codes(np.clip(quot, -fmax, fmax), fmt)
    return codes.reshape(x64.shape), scales.reshape(*lead, mb, kb)


def wide_range(shape, seed: int) -> torch.Tensor:
    """float32 values with magnitudes from 1e-6 to 1e4, some all-zero blocks, some > 448."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (torch.rand(shape, generator=g) * 10 - 6)
    x = torch.randn(shape, generator=g) * mag
    # Rows and columns with a common magnitude, so that whole blocks sit at
    # each end of the range (not only mixed blocks dominated by one big value).
    rowmag = 10.0 ** (torch.randint(-6, 5, shape[:-1] + (1,), generator=g).float())
    x = x + torch.randn(shape, generator=g) * rowmag
    x[..., :1, : min(130, shape[-1])] = 0.0  # all-zero 1x128 blocks (and partial ones)
    x[..., -1:, :] *= 1e-5  # rows below the 1e-4 amax floor
    return x


# ---------------------------------------------------------------- tests

SHAPES = [(3, 130), (200, 576), (257, 1536), (2, 3, 130), (1, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_quantize_bit_exact_e4m3(shape, block, scale_fmt):
    x = wide_range(shape, seed=zlib.crc32(repr((shape, block, scale_fmt)).encode()))
    q = quantize(x, block=block, scale_fmt=scale_fmt)
    codes, scales = ref_quantize(x, block, "e4m3", scale_fmt)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == x.shape
    assert q.scale.dtype == torch.float32 and tuple(q.scale.shape) == scales.shape
    assert q.block == block and q.fmt == "e4m3" and q.scale_fmt == scale_fmt
    np.testing.assert_array_equal(q.scale.double().numpy(), scales)
    np.testing.assert_array_equal(q.data.view(torch.uint8).numpy(), codes)


def boundary_cases(seed: int) -> torch.Tensor:
    """[256, 256] float32 built to hit the rounding edges of every step.

    Each 1x128 row has amax 448 * 2**k * (1 + j * 2**-23), j in {-1, 0, 1, 2}:
    scales one FP32 ulp around a power of two (where a floating-point log2
    rounds ``ceil`` the wrong way). The other elements are FP8 rounding
    midpoints times the scale, give or take an ulp, so the exact FP32 quotient
    decides the rounding (x * (1/scale) instead of x / scale changes codes).
    """
    g = torch.Generator().manual_seed(seed)
    grid = torch.from_numpy(fp8_grid("e4m3"))
    mids = (grid[:-1] + grid[1:]) / 2
    rows = []
    for r in range(256):
        k = int(torch.randint(-20, 10, (1,), generator=g))
        j = r % 4 - 1
        amax = np.float32(448.0 * 2.0**k) * (1 + j * 2.0**-23)
        s = float(np.float32(np.float32(amax) / np.float32(448.0)))
        picks = mids[torch.randint(0, len(mids), (127,), generator=g)]
        vals = (picks * s).float()
        towards = vals * torch.randint(0, 3, (127,), generator=g).float()  # 0, x or 2x
        vals = torch.nextafter(vals, towards)  # one ulp down, unchanged, one ulp up
        signs = torch.randint(0, 2, (127,), generator=g).float() * 2 - 1
        rows.append(torch.cat([torch.tensor([amax], dtype=torch.float32), vals * signs]))
    x = torch.stack(rows)
    return torch.cat([x, x.flip(1)], dim=1)


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_quantize_bit_exact_at_rounding_boundaries(scale_fmt):
    x = boundary_cases(seed=1)
    q = quantize(x, block=(1, 128), scale_fmt=scale_fmt)
    codes, scales = ref_quantize(x, (1, 128), "e4m3", scale_fmt)
    np.testing.assert_array_equal(q.scale.double().numpy(), scales)
    np.testing.assert_array_equal(q.data.view(torch.uint8).numpy(), codes)


@pytest.mark.parametrize("block", BLOCKS)
def test_quantize_bit_exact_e5m2(block):
    x = wide_range((130, 260), seed=7) * 1e3  # reach past E4M3's range
    q = quantize(x, block=block, fmt="e5m2")
    codes, scales = ref_quantize(x, block, "e5m2", "fp32")
    assert q.data.dtype == torch.float8_e5m2
    np.testing.assert_array_equal(q.scale.double().numpy(), scales)
    np.testing.assert_array_equal(q.data.view(torch.uint8).numpy(), codes)


def test_quantize_uses_only_real_elements_of_edge_blocks():
    # A partial edge block's scale comes from its own 2 elements, not padding
    # and not the neighbouring full block.
    x = torch.zeros(1, 130)
    x[0, :128] = 1000.0
    x[0, 128:] = torch.tensor([3.0, -5.0])
    q = quantize(x)
    assert q.scale[0, 1].item() == np.float32(5.0) / np.float32(448.0)
    assert q.data[0, 129].float().item() == -448.0


def test_quantize_bf16_input_equals_its_fp32_value():
    x = wide_range((64, 256), seed=3).bfloat16()
    a, b = quantize(x), quantize(x.float())
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises_naming_the_tensor(bad):
    x = torch.randn(5, 130)
    x[4, 129] = bad  # in the partial edge block
    with pytest.raises(ValueError, match="layers.3.mlp.up_proj.weight"):
        quantize(x, block=(128, 128), name="layers.3.mlp.up_proj.weight")


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="e4m3"):
        quantize(torch.randn(2, 2), fmt="e3m4")
    with pytest.raises(ValueError, match="ue8m0"):
        quantize(torch.randn(2, 2), scale_fmt="e8m0")
    with pytest.raises(ValueError, match="block"):
        quantize(torch.randn(2, 2), block=(0, 128))
    with pytest.raises(ValueError, match="2 dims"):
        quantize(torch.randn(8))


@pytest.mark.parametrize("block", BLOCKS)
def test_fp32_scales_requantize_to_the_identity(block):
    # Holds exactly: the block max maps to 448, and fl(fl(448*s)/448) == s for
    # every s = fl(a/448) (checked exhaustively over one binade of a).
    x = wide_range((2, 257, 576), seed=11)
    q = quantize(x, block=block)
    q2 = quantize(dequantize(q), block=block)
    assert torch.equal(q.data.view(torch.uint8), q2.data.view(torch.uint8))
    assert torch.equal(q.scale, q2.scale)


@pytest.mark.parametrize("block", BLOCKS)
def test_ue8m0_scales_are_powers_of_two_and_dequantize_exactly(block):
    x = wide_range((2, 257, 576), seed=12)
    q = quantize(x, block=block, scale_fmt="ue8m0")
    mantissa, _ = torch.frexp(q.scale)
    assert torch.all(mantissa == 0.5)
    # data * 2**k is exact, so dequantize equals the float64 product.
    ref = q.data.double() * torch.from_numpy(np.kron(q.scale.double().numpy(), np.ones(block)))[..., :257, :576]
    assert torch.equal(dequantize(q).double(), ref)
    # Requantizing gives back the same real values (data and scale may change).
    assert torch.equal(dequantize(quantize(dequantize(q), block=block, scale_fmt="ue8m0")), dequantize(q))


def test_ue8m0_requantize_is_not_always_the_identity():
    # amax 228 -> scale 2**ceil(log2(228/448)) = 1 -> 228 rounds to 224; the
    # requantized block has amax 224 -> scale 0.5 -> 224 becomes 448.
    x = torch.full((1, 128), 228.0)
    q = quantize(x, scale_fmt="ue8m0")
    assert q.scale.item() == 1.0 and q.data[0, 0].float().item() == 224.0
    q2 = quantize(dequantize(q), scale_fmt="ue8m0")
    assert q2.scale.item() == 0.5 and q2.data[0, 0].float().item() == 448.0
    assert torch.equal(dequantize(q2), dequantize(q))


def test_dequantize_is_data_times_block_scale():
    x = wide_range((3, 130), seed=5)
    q = quantize(x, block=(1, 128))
    s = q.scale.repeat_interleave(128, dim=-1)[:, :130]
    assert torch.equal(dequantize(q), q.data.float() * s)
    assert dequantize(q).dtype == torch.float32


def test_saturation_and_error_bound():
    x = torch.randn(64, 512) * 1e4
    q = quantize(x)
    assert q.data.float().abs().max().item() == E4M3_MAX
    # E4M3 has 3 mantissa bits: relative rounding error <= 2**-4 for normal values.
    big = x.abs() > x.abs().amax(-1, keepdim=True) / 64
    rel = ((dequantize(q) - x).abs() / x.abs())[big]
    assert rel.max().item() <= 2**-4
    assert quantize(torch.randn(4, 128) * 1e6, fmt="e5m2").data.float().abs().max().item() == E5M2_MAX


@pytest.mark.parametrize("block", [(128, 128), (1, 128)])
def test_transpose_is_exact(block):
    x = wide_range((300, 200), seed=9)
    q = quantize(x, block=block)
    qt = q.t()
    assert isinstance(qt, QTensor) and qt.block == block[::-1] and qt.data.shape == (200, 300)
    direct = quantize(x.t().contiguous(), block=block[::-1])
    assert torch.equal(qt.data.view(torch.uint8), direct.data.view(torch.uint8))
    assert torch.equal(qt.scale, direct.scale)
    assert torch.equal(dequantize(qt), dequantize(q).t())


def test_nbytes_counts_data_and_scales():
    q = quantize(torch.randn(1536, 576), block=(128, 128))
    assert q.nbytes == 1536 * 576 + 12 * 5 * 4
    assert q.nbytes / (1536 * 576 * 2) <= 0.52


COMPILED = [pytest.param(True, id="compiled"), pytest.param(False, id="torch")]  # quantize_dequantize's two paths


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_quantize_dequantize_equals_quantize_then_dequantize(scale_fmt: str, compiled: bool):
    """The fused pass the amx backend uses gives dequantize(quantize(x)) bit for
    bit: values over 60 binades, zeros, all-zero blocks, ragged K, 3-D input."""
    from fp8rl.fp8.quant import quantize_dequantize

    g = torch.Generator().manual_seed(21)
    for shape in [(16, 576), (7, 128), (300, 1536), (3, 5, 256), (2, 130)]:
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
        x[..., 0, :128] = 0.0
        x[..., -1, 3] = 1e-30
        want = dequantize(quantize(x, (1, 128), scale_fmt=scale_fmt))
        got = quantize_dequantize(x, 128, scale_fmt, compiled=compiled)
        assert got.shape == want.shape
        assert torch.equal(got.abs().view(torch.int32), want.abs().view(torch.int32)), (shape, scale_fmt)


@pytest.mark.parametrize("compiled", COMPILED)
def test_quantize_dequantize_rounds_like_the_e4m3_cast_everywhere(compiled: bool):
    """The magic-number rounding equals torch's E4M3 cast (round to nearest even,
    subnormals, the top of the range) on a dense sweep of FP32 values: each row
    starts with 448, so its scale is exactly 1 and the values are cast as they are."""
    from fp8rl.fp8.quant import quantize_dequantize

    sweep = torch.cat([torch.linspace(-460, 460, 1_000_001), torch.exp2(torch.linspace(-12, 9, 500_001))])
    sweep = torch.cat([sweep, -sweep[1_000_001:]])
    sweep = torch.cat([sweep, sweep.new_zeros(-sweep.numel() % 127)]).view(-1, 127).clamp(-448, 448)
    x = torch.cat([torch.full((sweep.shape[0], 1), 448.0), sweep], dim=1)  # [rows, 128], amax 448
    want = x.to(torch.float8_e4m3fn).float()
    assert torch.equal(quantize_dequantize(x, 128, compiled=compiled).abs(), want.abs())


@pytest.mark.parametrize("compiled", COMPILED)
def test_quantize_dequantize_refuses_nan_and_inf(compiled: bool):
    from fp8rl.fp8.quant import quantize_dequantize

    for bad in (float("nan"), float("inf")):
        x = torch.ones(4, 256)
        x[2, 7] = bad
        with pytest.raises(NonFiniteError, match="act"):
            quantize_dequantize(x, 128, name="act", compiled=compiled)


def test_row_block_fast_path_equals_the_general_path():
    """quantize's path for whole 1 x 128 blocks gives the same data and scales as
    the general (segmented) path, seen through a ragged input that takes it."""
    g = torch.Generator().manual_seed(22)
    for scale_fmt in ("fp32", "ue8m0"):
        x = torch.randn(9, 384, generator=g) * torch.exp2(torch.randint(-20, 20, (9, 384), generator=g).float())
        fast = quantize(x, (1, 128), scale_fmt=scale_fmt)
        general = quantize(torch.nn.functional.pad(x, (0, 1)), (1, 128), scale_fmt=scale_fmt)
        assert torch.equal(fast.data.view(torch.uint8), general.data[:, :384].view(torch.uint8))
        assert torch.equal(fast.scale, general.scale[:, :3])


@pytest.mark.parametrize("shape", [(40, 256), (40, 130), (2, 20, 128)])
def test_vllm_convention_is_vllms_scale_formula_and_matches_the_reference(shape):
    """quantizer "vllm" (amax floor 2**-9) gives vLLM's activation scales,
    clamp(amax / 448, min=1 / (448 * 512)) (vLLM's `QuantFP8`, written out here),
    bit for bit, and the float64 reference's data under that floor, on rows whose
    amax sits below, at and above 2**-9; quantize_dequantize agrees. Rows with an
    amax at or above 2**-9 are quantized as under fp8rl's own floor."""
    from fp8rl.fp8.formats import AMAX_FLOORS
    from fp8rl.fp8.quant import quantize_dequantize

    floor = AMAX_FLOORS["vllm"]
    g = torch.Generator().manual_seed(23)
    x = torch.randn(shape, generator=g)
    amax = torch.tensor([0.0, 1e-6, 1e-4, 1.5e-3, 2.0**-9, 2.0**-9 * 1.01, 3e-3, 1.0, 300.0, 1e4])
    rows = x.reshape(-1, shape[-1])
    rows.mul_((amax.repeat(-(-rows.shape[0] // len(amax)))[: rows.shape[0]] / rows.abs().amax(-1)).unsqueeze(-1))
    q = quantize(x, (1, 128), amax_floor=floor)
    xb = torch.nn.functional.pad(x, (0, -shape[-1] % 128)).unflatten(-1, (-1, 128))
    vllm_scale = (xb.abs().amax(-1) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    assert torch.equal(q.scale, vllm_scale)
    codes, scales = ref_quantize(x, (1, 128), "e4m3", "fp32", floor)
    assert np.array_equal(q.data.view(torch.uint8).numpy(), codes)
    want = dequantize(q)
    assert torch.equal(quantize_dequantize(x, 128, amax_floor=floor).abs(), want.abs())
    ours = quantize(x, (1, 128))
    big = (xb.abs().amax(-1) >= floor).unsqueeze(-1).expand(xb.shape).flatten(-2)[..., : shape[-1]]
    assert torch.equal(q.data.view(torch.uint8)[big], ours.data.view(torch.uint8)[big])
    assert not torch.equal(q.scale, ours.scale)  # the rows below 2**-9 differ


def test_dequantize_static_is_the_fp8_round_trip_bit_for_bit():
    """What FP8 attention multiplies (Q/K/V/P values) without the FP8 cast: equal to
    fp8_to_float(quantize_static(x, s)) * s in every bit, signs of zero included
    (tiny negatives round to -0 like the cast), saturation beyond 448 * s, per-head scales."""
    from fp8rl.fp8.quant import dequantize_static, fp8_to_float, quantize_static

    g = torch.Generator().manual_seed(24)
    sweep = torch.cat([torch.linspace(-500, 500, 400_001), torch.exp2(torch.linspace(-14, 9, 200_001)),
                       -torch.exp2(torch.linspace(-14, 9, 200_001)), torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    x = torch.cat([sweep, sweep.new_zeros(-sweep.numel() % 4)]).view(4, -1, 1).expand(4, -1, 3).contiguous()
    x = x * torch.exp2(torch.randint(-3, 3, x.shape, generator=g).float())
    scale = torch.tensor([1.0, 0.5, 2.0**-7, 3e-3]).view(4, 1, 1)
    want = fp8_to_float(quantize_static(x, scale)) * scale
    got = dequantize_static(x, scale)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert (got == 0).any() and torch.signbit(got[got == 0]).any()  # -0 occurs and is kept
