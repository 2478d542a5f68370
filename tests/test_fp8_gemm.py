"""fp8_matmul backends against float64 math written here."""

from __future__ import annotations

import pytest
import torch

from fp8rl.fp8 import QTensor, fp8_matmul, quantize
from fp8rl.fp8.gemm import _NATIVE_ROWS, bf16_matmul


def deq64(q: QTensor) -> torch.Tensor:
    """Dequantize in float64: an FP8 value times an FP32 scale is exact there."""
    m, k = q.data.shape
    bm, bk = q.block
    s = q.scale.double().repeat_interleave(bm, 0)[:m].repeat_interleave(bk, 1)[:, :k]
    return q.data.double() * s


def operands(m: int, n: int, k: int, seed: int, b_block=(128, 128), scale_fmt="fp32"):
    """a: (1,128) activations with per-row magnitudes; b: weights, blocks b_block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 10.0 ** torch.randint(-3, 3, (m, 1), generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, : min(k, 128)] *= 100.0  # K blocks with very different weight scales
    return quantize(x, scale_fmt=scale_fmt), quantize(w, block=b_block, scale_fmt=scale_fmt)


def ulp32(x: torch.Tensor) -> torch.Tensor:
    x = x.float().abs()
    return (torch.nextafter(x, torch.full_like(x, float("inf"))) - x).double()


RAGGED = [(3, 5, 130), (200, 96, 576), (257, 40, 1536), (64, 300, 200), (1, 1, 1)]


@pytest.mark.parametrize("m,n,k", RAGGED)
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_reference_is_float32_rounding_of_float64_product(m, n, k, b_block):
    a, b = operands(m, n, k, seed=m + n + k, b_block=b_block)
    out = fp8_matmul(a, b, backend="reference")
    assert out.dtype == torch.float32 and out.shape == (m, n)
    A, B = deq64(a), deq64(b)
    exact = A @ B.T
    # float64 GEMM error bound for ``exact`` itself, far below an FP32 ulp.
    gamma = k * 2.0**-53 * (A.abs() @ B.abs().T)
    err = (out.double() - exact).abs()
    assert torch.all(err <= 0.5 * ulp32(exact) + gamma)
    assert (out == exact.float()).double().mean().item() >= 0.999


# "reference" guarantees batch invariance; "cpu" gets it from padding small
# batches to 16 rows, which works with this machine's BLAS (see gemm._cpu);
# "amx" from calling oneDNN on a fixed number of rows (gemm._native_rows).
@pytest.mark.parametrize("backend", ["reference", "cpu", "amx"])
def test_rows_are_independent_of_batch_size(backend):
    a, b = operands(64, 96, 576, seed=1)
    x = a.data  # rows of a (1,128)-quantized tensor are quantized independently
    rows = [QTensor(x[i : i + 1], a.scale[i : i + 1], a.block) for i in range(64)]
    alone = torch.cat([fp8_matmul(row, b, backend=backend) for row in rows])
    for bs in range(1, 65):
        batch = fp8_matmul(QTensor(x[:bs], a.scale[:bs], a.block), b, backend=backend)
        assert torch.equal(batch, alone[:bs]), bs


def test_reference_is_independent_of_k_block_order():
    # Permuting whole K blocks of both operands permutes the block partials;
    # the reference sums them in a canonical order, so no bit may change.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(48, 1024, generator=g) * torch.logspace(-3, 3, 1024)[torch.randperm(1024, generator=g)]
    w = torch.randn(80, 1024, generator=g)
    perm = torch.randperm(8, generator=g)
    cols = (perm[:, None] * 128 + torch.arange(128)).reshape(-1)
    assert not torch.equal(perm, torch.arange(8))
    for blk in [(128, 128), (1, 128)]:
        ref = fp8_matmul(quantize(x), quantize(w, block=blk), backend="reference")
        out = fp8_matmul(quantize(x[:, cols]), quantize(w[:, cols], block=blk), backend="reference")
        assert torch.equal(out, ref)


@pytest.mark.parametrize("m,n,k", RAGGED + [(2048, 64, 576)])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_cpu_backend_matches_reference(m, n, k, b_block, scale_fmt):
    a, b = operands(m, n, k, seed=3 * m + n, b_block=b_block, scale_fmt=scale_fmt)
    ref = fp8_matmul(a, b, backend="reference").double()
    out = fp8_matmul(a, b, backend="cpu")
    assert out.dtype == torch.float32 and out.shape == (m, n)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-6
    assert torch.equal(fp8_matmul(a, b), out)  # "cpu" is the default on CPU tensors


def test_dgrad_operand_transposed_weight():
    # dx = dy @ W uses the weight's transpose: non-contiguous fp8 data.
    g = torch.Generator().manual_seed(4)
    dy = quantize(torch.randn(33, 300, generator=g))
    qw = quantize(torch.randn(300, 200, generator=g), block=(128, 128))
    exact = deq64(dy) @ deq64(qw)
    for backend in ["reference", "cpu"]:
        out = fp8_matmul(dy, qw.t(), backend=backend)
        assert out.shape == (33, 200)
        assert ((out.double() - exact).norm() / exact.norm()).item() < 1e-6


def test_bf16_output():
    a, b = operands(40, 72, 640, seed=5)
    ref = fp8_matmul(a, b, backend="reference").double()
    # reference: one bf16 rounding (unit roundoff 2**-8) of its float64 sum.
    out = fp8_matmul(a, b, out_dtype=torch.bfloat16, backend="reference")
    assert out.dtype == torch.bfloat16
    assert torch.all((out.double() - ref).abs() <= 2.0**-8 * (1 + 2.0**-15) * ref.abs())
    out = fp8_matmul(a, b, out_dtype=torch.bfloat16, backend="cpu")
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 2.0**-8


def test_bad_backend_and_shapes_raise():
    a, b = operands(4, 8, 256, seed=6)
    with pytest.raises(ValueError, match="reference.*cpu|cpu.*reference"):
        fp8_matmul(a, b, backend="cutlass")
    with pytest.raises(ValueError, match="K mismatch"):
        fp8_matmul(a, quantize(torch.randn(8, 128), block=(128, 128)))
    with pytest.raises(ValueError, match="block width"):
        fp8_matmul(a, quantize(torch.randn(8, 256), block=(1, 64)))


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return 10 * torch.log10(ref.pow(2).sum() / (out.double() - ref).pow(2).sum()).item()


@pytest.mark.parametrize("m,n,k", RAGGED[:4] + [(2048, 64, 576)])
@pytest.mark.parametrize("scale_fmt,floor_db", [("fp32", 47.0), ("ue8m0", 53.0)])
def test_amx_backend_against_reference(m, n, k, scale_fmt, floor_db):
    # BF16 output rounding (2**-9 relative) plus, for FP32 scales, one BF16
    # rounding of each dequantized operand: measured 49.9-50.9 dB (fp32 scales)
    # and 55.6-56.5 dB (ue8m0, exact dequantization) on these shapes.
    a, b = operands(m, n, k, seed=7 * m + n, scale_fmt=scale_fmt)
    ref = fp8_matmul(a, b, backend="reference")
    out = fp8_matmul(a, b, backend="amx")
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert sqnr_db(out, ref) >= floor_db
    # the backward flavour (one call over all rows) computes the same product
    assert sqnr_db(fp8_matmul(a, b, backend="amx", invariant=False), ref) >= floor_db


def test_amx_bf16_matmul_is_a_bf16_gemm():
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(300, 576, generator=g), torch.randn(200, 576, generator=g)
    exact = a.bfloat16().double() @ b.bfloat16().double().T  # exact products of the rounded operands
    for backend in ["cpu", "amx"]:
        out = bf16_matmul(a, b, backend)
        rel = (out.double() - exact).abs() / exact.abs().clamp(min=1.0)
        # cpu: FP32 output; amx: BF16 output (unit roundoff 2**-8) of an FP32 sum
        assert rel.max().item() <= (1e-5 if backend == "cpu" else 2.0**-8 + 1e-5), backend
    out = bf16_matmul(a, b, "amx")
    assert torch.equal(out, out.bfloat16().float())  # BF16 values, like a GPU BF16 GEMM's output


def test_amx_rows_are_independent_of_chunking():
    # Long inputs are cut into calls of _NATIVE_ROWS rows; a row must come out
    # the same whichever call and position it lands in.
    g = torch.Generator().manual_seed(9)
    for k, n in [(576, 1536), (1536, 576), (128, 384)]:
        x, w = torch.randn(3 * _NATIVE_ROWS + 7, k, generator=g), torch.randn(n, k, generator=g)
        full = bf16_matmul(x, w, "amx")
        for lo, hi in [(0, 1), (0, 16), (5, 5 + _NATIVE_ROWS), (_NATIVE_ROWS - 3, 2 * _NATIVE_ROWS + 1)]:
            assert torch.equal(bf16_matmul(x[lo:hi], w, "amx"), full[lo:hi]), (k, n, lo, hi)
