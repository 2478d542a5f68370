"""GEMM backends against float64 math written here.

The backend-generic tests are parametrized over the registry (`BACKENDS`), so
a backend added there is tested by them; the backend-specific ones pin what
one backend promises beyond that (exactness, accuracy, chunking)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from numerics import sqnr_db

import fp8rl.fp8.backends as fb
from fp8rl.fp8 import BACKENDS, QTensor, choose_backend, fp8_matmul, get_backend, quantize
from fp8rl.fp8.backends import _NATIVE_ROWS, bf16_matmul
from fp8rl.model.transformer import Router

ALL = list(BACKENDS)


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
# batches to 16 rows, which works with this machine's BLAS (CPUBackend);
# "amx" from calling oneDNN on a fixed number of rows (backends._native_rows).
@pytest.mark.parametrize("backend", ALL)
def test_rows_are_independent_of_batch_size(backend):
    assert BACKENDS[backend].batch_invariant  # every registered backend promises it
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
    for backend in ALL:  # the backward flavour too
        out = fp8_matmul(dy, qw.t(), backend=backend, invariant=False)
        assert out.shape == (33, 200) and sqnr_db(exact, out) >= GENERIC_FP8_FLOOR_DB, backend


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
    with pytest.raises(ValueError, match="unknown GEMM backend 'auto'"):
        get_backend("auto")  # "auto" is a policy (choose_backend), not a backend
    with pytest.raises(ValueError, match="K mismatch"):
        fp8_matmul(a, quantize(torch.randn(8, 128), block=(128, 128)))
    with pytest.raises(ValueError, match="block width"):
        fp8_matmul(a, quantize(torch.randn(8, 256), block=(1, 64)))


# Every backend's FP8 GEMM against the exact reference: a BF16 output (the
# least any backend may write) with FP32 scales measured 49.9-50.9 dB on
# these shapes (amx); FP32-output backends are far above.
GENERIC_FP8_FLOOR_DB = 47.0


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("m,n,k", RAGGED[:4])
@pytest.mark.parametrize("invariant", [True, False])
def test_every_backend_fp8_gemm_against_reference(backend, m, n, k, invariant):
    a, b = operands(m, n, k, seed=11 * m + n)
    ref = fp8_matmul(a, b, backend="reference")
    out = fp8_matmul(a, b, backend=backend, invariant=invariant)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert sqnr_db(ref, out) >= GENERIC_FP8_FLOOR_DB, backend


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
    assert sqnr_db(ref, out) >= floor_db
    # the backward flavour (one call over all rows) computes the same product
    assert sqnr_db(ref, fp8_matmul(a, b, backend="amx", invariant=False)) >= floor_db


@pytest.mark.parametrize("backend", ALL)
def test_every_backend_bf16_matmul_is_a_bf16_gemm(backend):
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(300, 576, generator=g), torch.randn(200, 576, generator=g)
    exact = a.bfloat16().double() @ b.bfloat16().double().T  # exact products of the rounded operands
    for invariant in (True, False):
        out = bf16_matmul(a, b, backend, invariant=invariant)
        rel = (out.double() - exact).abs() / exact.abs().clamp(min=1.0)
        # at worst a BF16 output (unit roundoff 2**-8) of an FP32 sum; FP32 output on the emulating backends
        assert rel.max().item() <= 2.0**-8 + 1e-5, backend
        if backend in ("reference", "cpu") and invariant:  # FP32 sums of 128 products, then of 5 partials
            assert rel.max().item() <= 1e-5, backend
        if backend in ("reference", "cpu") and not invariant:
            # a backward GEMM: one FP32 BLAS sum over all 576 products, in BLAS's order; any
            # order of K FP32 additions is within K * 2**-24 * sum |a_k b_k| of the exact sum
            bound = 576 * 2.0**-24 * (a.bfloat16().double().abs() @ b.bfloat16().double().abs().T)
            assert ((out.double() - exact).abs() <= bound).all(), backend
    # rows independent of the batch around them
    full = bf16_matmul(a, b, backend)
    for lo, hi in [(0, 1), (3, 9), (0, 150), (299, 300)]:
        assert torch.equal(bf16_matmul(a[lo:hi], b, backend), full[lo:hi]), (backend, lo, hi)


def test_amx_bf16_matmul_writes_bf16_values():
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(300, 576, generator=g), torch.randn(200, 576, generator=g)
    out = bf16_matmul(a, b, "amx")
    assert torch.equal(out, out.bfloat16().float())  # BF16 values, like a GPU BF16 GEMM's output


def test_amx_rows_are_independent_of_chunking():
    # Long inputs are cut into calls of a measured tile (128 rows or a longer one,
    # backends._long_tiles); a row must come out the same whichever call and position it lands in.
    g = torch.Generator().manual_seed(9)
    for k, n in [(576, 1536), (1536, 576), (128, 384)]:
        big = max(fb._NATIVE_LONG_CANDIDATES)  # past the longest tile this CPU may have picked
        x, w = torch.randn(3 * big + 7, k, generator=g), torch.randn(n, k, generator=g)
        full = bf16_matmul(x, w, "amx")
        for lo, hi in [(0, 1), (0, 16), (5, 5 + _NATIVE_ROWS), (_NATIVE_ROWS - 3, 2 * _NATIVE_ROWS + 1),
                       (100, 100 + big), (big - 3, 2 * big + 1)]:
            assert torch.equal(bf16_matmul(x[lo:hi], w, "amx"), full[lo:hi]), (k, n, lo, hi)


@pytest.mark.parametrize("backend", ALL)
def test_every_backend_lm_head_forward_and_gradient(backend):
    """head_logits: BF16 operands, batch-invariant; head_grads: those of an FP32
    linear on the BF16-rounded operands (a BF16 GEMM's accuracy at worst)."""
    g = torch.Generator().manual_seed(12)
    h, w = torch.randn(70, 192, generator=g), torch.randn(300, 192, generator=g) * 0.1
    b = BACKENDS[backend]
    h16, w16 = h.bfloat16().double(), w.bfloat16().double()
    logits = b.head_logits(h, w, {})
    assert logits.dtype == torch.float32 and logits.shape == (70, 300)
    assert sqnr_db(h16 @ w16.T, logits) >= 47.0
    for lo, hi in [(0, 1), (5, 37), (69, 70)]:
        assert torch.equal(b.head_logits(h[lo:hi], w, {}), logits[lo:hi]), (backend, lo, hi)
    grad = torch.randn(70, 300, generator=g)
    dh, dw = b.head_grads(grad, h, w, True, True)
    assert sqnr_db(grad.double() @ w16, dh) >= 47.0 and sqnr_db(grad.double().T @ h16, dw) >= 47.0
    assert b.head_grads(grad, h, w, False, False) == (None, None)


@pytest.mark.parametrize("backend", ALL)
def test_every_backend_attention_products_are_batch_invariant(backend):
    """A query row computed alone (a decode step) gets the bits it gets among all
    the sequence's rows (the training forward), for any number of rows."""
    g = torch.Generator().manual_seed(13)
    b = BACKENDS[backend]
    for t_all, slots, d in [(24, 48, 32), (37, 64, 64), (5, 16, 64)]:
        q = fb.order_sensitive_rows(2 * 4 * t_all, d, g).view(2, 4, t_all, d)
        k = fb.order_sensitive_cols(2 * 4 * slots, d, g).view(2, 4, slots, d)
        v = torch.randn(2, 4, slots, d, generator=g)
        scores = b.attention_scores(q, k)  # [2, 4, t_all, slots]
        assert sqnr_db(q.double() @ k.double().transpose(-1, -2), scores) >= 100.0
        for t in sorted({0, 3, t_all - 1}):
            assert torch.equal(b.attention_scores(q[:, :, t : t + 1], k), scores[:, :, t : t + 1])
            assert torch.equal(b.attention_scores(q[:, :, : t + 1], k), scores[:, :, : t + 1])
        p = torch.softmax(scores, -1)
        out = b.attention_values(p, v)
        assert sqnr_db(p.double() @ v.double(), out) >= 100.0
        for t in sorted({0, 3, t_all - 1}):
            assert torch.equal(b.attention_values(p[:1, :, t : t + 1], v[:1]), out[:1, :, t : t + 1])


def test_choose_backend_policy(monkeypatch: pytest.MonkeyPatch):
    """The one policy for backend = "auto": the exact reference off the CPU;
    on the CPU amx where the CPU has AMX tiles (every model size); with
    AVX512-BF16 but no AMX, amx for dense models and for mixtures of experts from
    AVX512_BF16_MIN_MOE_WIDTH on, cpu for narrower ones (measured, benchmarks/README.md);
    else cpu; unless the measured
    batch-invariance check fails on the model's shapes."""
    small = nn.Linear(64, 64)
    big = nn.Linear(4096, 2048)
    # The probe itself is tested below; here it only records what it was asked
    # (run for real, amx's probe on a 4096-wide model takes ~110 s on a CPU
    # without native BF16, where torch.mm emulates BF16).
    probed: list[tuple[str, nn.Module]] = []
    monkeypatch.setattr(fb, "batch_invariance_failures", lambda backend, model: probed.append((backend.name, model)) or [])
    assert choose_backend(torch.device("meta"), big) is BACKENDS["reference"]
    assert probed == []
    monkeypatch.setattr(fb, "avx512_bf16_available", lambda: True)  # every AMX CPU has it too
    monkeypatch.setattr(fb, "amx_available", lambda: True)
    assert choose_backend(torch.device("cpu"), big) is BACKENDS["amx"]
    assert fb.resolve_backend("auto", small) is BACKENDS["amx"]
    assert probed == [("amx", big), ("amx", small)]
    monkeypatch.setattr(fb, "amx_available", lambda: False)  # AVX512-BF16 alone: dense amx, narrow MoE cpu
    low = fb.AVX512_BF16_MIN_MOE_WIDTH
    edge = nn.Sequential(nn.Linear(low, 64), nn.Linear(64, 5000))  # its narrowest decides
    assert fb.model_width(edge) == 64 and fb.model_width(big) == 4096 and fb.model_width(nn.ReLU()) == 0
    narrow = nn.Linear(low - 64, 4096)

    def moe(width: int) -> nn.Module:  # a router beside linears of the given width: a mixture of experts
        return nn.Sequential(Router(width, 4), nn.Linear(width, width), nn.Linear(width * 3, width))

    picks = [choose_backend(torch.device("cpu"), m).name for m in (big, narrow, edge, moe(low), moe(low - 64))]
    assert picks == ["amx", "amx", "amx", "amx", "cpu"]
    assert choose_backend(torch.device("cpu")) is BACKENDS["amx"]  # no model: the pick for a dense one
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # native BF16 GEMMs here: naming amx warns of nothing
        assert fb.resolve_backend("amx", small) is BACKENDS["amx"]
    monkeypatch.setattr(fb, "avx512_bf16_available", lambda: False)  # AVX2 only
    del probed[:]
    assert choose_backend(torch.device("cpu"), small) is BACKENDS["cpu"]
    assert choose_backend(torch.device("cpu"), big) is BACKENDS["cpu"]
    with pytest.warns(UserWarning, match="'amx' on a CPU without AMX tiles or AVX512-BF16"):
        assert fb.resolve_backend("amx", small) is BACKENDS["amx"]  # a name is taken as given, unprobed
    assert probed == [("cpu", small), ("cpu", big)]
    monkeypatch.setattr(fb, "batch_invariance_failures", lambda backend, model: ["fp8 GEMM 64x64: rows 0..0 differ"])
    with pytest.warns(UserWarning, match="not batch-invariant on this CPU .*fp8 GEMM 64x64.*reference"):
        assert choose_backend(torch.device("cpu"), small) is BACKENDS["reference"]


def _rows_leak(out: torch.Tensor, rows: int) -> torch.Tensor:
    """``out`` perturbed by the number of rows in the call: a product whose row
    results depend on the batch, by construction (on any CPU)."""
    return out * (1 + 2**-20 * (rows % 7))


class _BatchDependentAttention(fb.CPUBackend):
    def attention_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return _rows_leak(super().attention_scores(q, k), q.shape[-2])


class _BatchDependentFP8(fb.CPUBackend):
    def fp8_matmul(self, a, b, out_dtype, invariant=True):
        return _rows_leak(super().fp8_matmul(a, b, out_dtype, invariant), a.shape[0])


class _BatchDependentBF16(fb.AMXBackend):
    def bf16_matmul(self, a, b, cache, invariant=True):
        return _rows_leak(super().bf16_matmul(a, b, cache, invariant), a.shape[0])


class _BatchDependentHead(fb.AMXBackend):
    def head_logits(self, h, w, cache):
        return _rows_leak(super().head_logits(h, w, cache), h.shape[0])


def test_batch_invariance_check_passes_the_registry_and_catches_broken_backends():
    """The check auto relies on: silent for every registered backend on a
    SmolLM2-shaped model, and it names the product of a backend whose rows
    depend on the batch (one per kind of product)."""
    from fp8rl.model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=256)
    model = Transformer(cfg)
    for name, backend in BACKENDS.items():
        assert fb.batch_invariance_failures(backend, model) == [], name
    assert any(f.startswith("attention scores") for f in fb.batch_invariance_failures(_BatchDependentAttention(), model))
    assert any(f.startswith("fp8 GEMM 1536x576") for f in fb.batch_invariance_failures(_BatchDependentFP8(), model))
    assert any(f.startswith("bf16 GEMM 1536x576") for f in fb.batch_invariance_failures(_BatchDependentBF16(), model))
    assert any(f.startswith("LM head") for f in fb.batch_invariance_failures(_BatchDependentHead(), model))


@pytest.mark.parametrize("kind", ["native", "fp32"])
def test_row_tiles_are_measured_and_keep_rows_independent_of_the_batch(kind: str):
    """GEMMs run on row tiles measured on this CPU (a big one for long inputs,
    smaller ones for a decode step's running rows, equal in their bits): any slice of rows,
    alone or inside a long input, computes the same bits, and the measurement
    rejects tiles that would not (checked against a deliberately unmeasured
    choice: every smaller candidate it skipped really differs)."""
    g = torch.Generator().manual_seed(14)
    for k, n in [(576, 1536), (1536, 576), (576, 576), (128, 384)]:
        w = fb.order_sensitive_cols(n, k, g)
        if kind == "native":
            tiles = fb._native_row_tiles(k, n)
            candidates = fb._NATIVE_TILE_CANDIDATES + fb._NATIVE_LONG_CANDIDATES
            cache: dict = {}
            run = lambda rows: bf16_matmul(rows, w, "amx", cache)  # noqa: E731
        else:
            tiles, candidates = fb._fp32_row_tiles(128, n), fb._TILE_CANDIDATES
            run = lambda rows: bf16_matmul(rows, w, "cpu")  # noqa: E731
        assert tiles.big in candidates and set(tiles.sizes) <= set(candidates)
        x = fb.order_sensitive_rows(3 * tiles.big + 7, k, g)  # three long tiles and a padded one
        full = run(x)
        spans = [(0, 1), (3, 19), (200, 3 * tiles.big)] + [(40, 40 + t) for t in tiles.sizes] + [(9, 9 + t - 3) for t in tiles.sizes]
        for lo, hi in spans:
            assert torch.equal(run(x[lo:hi]), full[lo:hi]), (kind, k, n, lo, hi)


def test_backends_are_registry_singletons():
    import copy

    for name, b in BACKENDS.items():
        assert b.name == name and get_backend(b) is b and copy.deepcopy(b) is b


def test_tiled_attention_product_gradients():
    """The attention products' backward (two plain batched GEMMs under the tiled
    forward) is the gradient of the product."""
    g = torch.Generator().manual_seed(15)
    a = torch.randn(2, 3, 19, 8, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(2, 3, 8, 21, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(fb._bmm_tiled, (a, b))
    assert torch.equal(fb._bmm_tiled(a, b).detach(), fb._bmm_tiled(a.detach(), b.detach()))


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("k", [128, 576, 200])
@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("amax_floor", [1e-4, 2.0**-9])  # fp8rl's convention, vLLM's
def test_fp8_linear_is_quantize_then_fp8_matmul(name: str, k: int, scale_fmt: str, amax_floor: float):
    """A backend may keep a linear's quantized input in the form its GEMM multiplies
    (cpu and amx do, `linear_input`: `quantize_dequantize`), but the bits must be those of `quantize` then
    `fp8_matmul`, the path the dgrad and the reference take, under either amax floor."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(37, k, generator=g) * torch.exp2(torch.randint(-12, 12, (37, 1), generator=g).float())
    x[3] = 0.0  # an all-zero row: the amax floor
    x[5, :7] = 1e-6  # tiny values in an otherwise ordinary row: E4M3 subnormals
    x[6] *= 1e-3 / x[6].abs().max()  # a row between the two floors
    w = quantize(torch.randn(48, k, generator=g), (128, 128), scale_fmt=scale_fmt)
    backend = BACKENDS[name]
    fused = backend.fp8_linear(backend.linear_input(x, 128, scale_fmt, "x", amax_floor), w)
    plain = backend.fp8_matmul(quantize(x, (1, 128), scale_fmt=scale_fmt, amax_floor=amax_floor), w, torch.float32)
    assert torch.equal(fused, plain)
