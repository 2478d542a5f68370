"""kernels.c's RMSNorm and SwiGLU gate (`fused_pointwise`): their numerics against float64,
the summation order they define, row independence, and the gradients of their autograd
wrappers against torch's ops (docs/design.md section 3)."""

from __future__ import annotations

import pytest
import torch

from fp8rl.fp8 import kernels
from fp8rl.fp8.backends import BACKENDS
from fp8rl.model.transformer import MLP, RMSNorm
from fp8rl.precision import apply_flow
from test_engine import tiny_model

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="compiled kernels unavailable (no C compiler)")

EPS = 1e-5


def rmsnorm_in_the_kernels_order(x: torch.Tensor, w: torch.Tensor, eps: float, with_inv: bool = False):
    """The order kernels.c documents, one FP32 operation at a time: 16 lane sums of the
    rounded squares over each row's elements in ascending order (lane j % 16), a halving
    tree over the lanes, then 1 / sqrt(ss / d + eps) and w * (x * r). The square root is
    correctly rounded (C's sqrtf), which torch.sqrt is not on every CPU (MKL's vector math:
    one ulp off for 17% of inputs on an AMD EPYC Zen 4, 2026-12-07): float64's, rounded once
    to FP32, which is the correctly rounded FP32 root (53 >= 2 * 24 + 2 bits)."""
    rows, d = x.shape
    lanes = torch.zeros(rows, 16, dtype=torch.float32)
    padded = torch.cat([x, x.new_zeros(rows, -d % 16)], dim=1)
    for c in range(0, padded.shape[1], 16):
        v = padded[:, c : c + 16]
        lanes = lanes + v * v
    width = 8
    while width:
        lanes = torch.cat([lanes[:, :width] + lanes[:, width : 2 * width], lanes[:, 2 * width :]], dim=1)
        width //= 2
    mean = lanes[:, :1] / torch.tensor(float(d), dtype=torch.float32)
    root = (mean + torch.tensor(eps, dtype=torch.float32)).double().sqrt().float()
    inv = torch.tensor(1.0, dtype=torch.float32) / root
    return (w * (x * inv), inv) if with_inv else w * (x * inv)


@pytest.mark.parametrize("d", [8, 20, 128, 576, 1000])
def test_rmsnorm_kernel_is_its_documented_order_bit_for_bit(d: int):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(7, d, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    w = torch.randn(d, generator=g)
    want, want_inv = rmsnorm_in_the_kernels_order(x, w, EPS, with_inv=True)
    assert torch.equal(kernels.rmsnorm(x, w, EPS), want)
    inv = torch.empty(7, 1)
    assert torch.equal(kernels.rmsnorm(x, w, EPS, inv), want) and torch.equal(inv, want_inv)


@pytest.mark.parametrize("d", [20, 576])
def test_rmsnorm_kernel_against_float64(d: int):
    """Each output within 4 FP32 ulps (relative 2**-21) of the float64 RMSNorm: the sum of
    squares of d terms, a square root, a division and two products, each rounded once."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, d, generator=g) * torch.logspace(-4, 4, 64)[:, None]
    w = torch.randn(d, generator=g)
    got = kernels.rmsnorm(x, w, EPS).double()
    x64 = x.double()
    want = w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    assert ((got - want).abs() <= 2.0**-21 * want.abs()).all()


def test_rmsnorm_kernel_row_is_the_same_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 576, generator=g)  # past the kernel's threading threshold: rows on both threads
    w = torch.randn(576, generator=g)
    full = kernels.rmsnorm(x, w, EPS)
    for r in (0, 1, 150, 299):
        assert torch.equal(kernels.rmsnorm(x[r : r + 1], w, EPS), full[r : r + 1])
    assert torch.equal(kernels.rmsnorm(x.view(3, 100, 576), w, EPS), full.view(3, 100, 576))
    strided = torch.randn(300, 600, generator=g)[:, :576]
    assert torch.equal(kernels.rmsnorm(strided, w, EPS), kernels.rmsnorm(strided.contiguous(), w, EPS))


def silu_mul64(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    g64 = g.double()
    return g64 / (1 + torch.exp(-g64)) * u.double()


@pytest.mark.parametrize("n", [5, 16, 1536])
def test_silu_mul_kernel_against_float64(n: int):
    """Within 8 FP32 ulps (relative 2**-20) of float64 silu(g) * u: exp about 1 ulp, then
    a sum, a division and two products, each rounded once."""
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(33, n, generator=gen) * 6
    u = torch.randn(33, n, generator=gen)
    got, want = kernels.silu_mul(g, u).double(), silu_mul64(g, u)
    assert ((got - want).abs() <= 2.0**-20 * want.abs() + 1e-37).all()


def test_silu_mul_kernel_at_the_edges():
    g = torch.tensor([0.0, -0.0, 100.0, -100.0, -200.0, 88.0, -88.0, float("inf"), float("nan"), 1e-30, -86.0])
    u = torch.full_like(g, 3.0)
    got = kernels.silu_mul(g[None], u[None])[0]
    assert got[0] == 0 and got[1] == 0
    assert got[2] == 300.0 and got[5] == 264.0  # sigmoid rounds to 1
    # exp(g) below -87 is taken as 0 (it is below 2**-125): silu(g) * u is then 0, off by at
    # most |g * u| * 2**-125 (FP32 subnormals): -100 * 3 * 3.7e-44 here
    assert got[3] == 0 and float(silu_mul64(g[3:4], u[3:4]).abs()) <= 300 * 2.0**-125
    assert got[4] == 0 and got[6] == 0  # -88 and -200 too
    assert got[7] == float("inf") and torch.isnan(got[8])
    assert float(got[10]) == pytest.approx(float(silu_mul64(g[10:], u[10:])), rel=2.0**-20)  # above -87: exact rule
    assert float(got[9]) == pytest.approx(1.5e-30, rel=1e-6)


def test_silu_mul_kernel_reads_the_halves_of_a_stacked_product():
    """g and u as the split of a gate/up GEMM's [T, 2N] output (row stride 2N): the bits of
    contiguous copies; a row alone the bits of its row in the batch."""
    gen = torch.Generator().manual_seed(3)
    gu = torch.randn(2, 40, 2 * 1536, generator=gen) * 4
    g, u = gu.split(1536, dim=-1)
    out = kernels.silu_mul(g, u)
    assert torch.equal(out, kernels.silu_mul(g.contiguous(), u.contiguous()))
    assert torch.equal(kernels.silu_mul(g[1, 7:8], u[1, 7:8]), out[1, 7:8])
    with pytest.raises(ValueError, match="one shape"):
        kernels.silu_mul(g, u[..., :-1])


def test_fused_rmsnorm_gradients_are_torchs():
    gen = torch.Generator().manual_seed(4)
    ref, fused = RMSNorm(100, EPS), RMSNorm(100, EPS)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(100, generator=gen))
        fused.weight.copy_(ref.weight)
    fused.fused_pointwise = True
    x = torch.randn(3, 5, 100, generator=gen, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    grad = torch.randn(3, 5, 100, generator=gen)
    y_ref, y = ref(x), fused(x2)
    torch.testing.assert_close(y, y_ref, rtol=2.0**-20, atol=0)
    y_ref.backward(grad)
    y.backward(grad)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)


def test_fused_silu_mul_gradients_are_torchs():
    gen = torch.Generator().manual_seed(5)
    mlp = MLP(32, 48)
    mlp.fused_pointwise = True
    x = torch.randn(4, 6, 32, generator=gen, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y = mlp(x)
    mlp.fused_pointwise = False
    y_ref = mlp(x2)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-7)
    grad = torch.randn_like(y)
    gw = torch.autograd.grad(y, [x, *mlp.parameters()], grad)
    gw_ref = torch.autograd.grad(y_ref, [x2, *mlp.parameters()], grad)
    for a, b in zip(gw, gw_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "cpu", "amx"])
def test_apply_flow_gives_norms_and_mlps_their_backends_choice(backend: str):
    model = tiny_model(qk_norm=True)
    apply_flow(model, "bf16", backend)
    modules = [m for m in model.modules() if isinstance(m, (RMSNorm, MLP))]
    assert modules and all(m.fused_pointwise is BACKENDS[backend].fused_pointwise for m in modules)
    assert BACKENDS[backend].fused_pointwise is (backend != "reference")


def test_the_torch_ops_run_where_the_kernels_do_not_load(monkeypatch: pytest.MonkeyPatch):
    norm = RMSNorm(16, EPS)
    norm.fused_pointwise = True
    x = torch.randn(2, 16)
    monkeypatch.setattr(kernels, "library", lambda: None)
    x32 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    assert torch.equal(norm(x), norm.weight * x32)
