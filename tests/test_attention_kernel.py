"""The fused attention kernel (fp8rl/fp8/kernels.c `fp8rl_attention`): its numbers against
a float64 reference, and the properties that make rollout == training hold by construction
(a row's bits do not depend on the batch, on the rows computed with it, on how many key
slots are passed beyond its live ones, or on BF16 vs FP32 storage of the same values)."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl.fp8 import kernels
from fp8rl.fp8.quant import dequantize_static, e4m3_values
from fp8rl.model.transformer import P_SCALE, _attention_torch, _FusedAttention, make_context

from numerics import sqnr_db

pytestmark = pytest.mark.skipif(not kernels.attention_available(64), reason="no compiled kernels here")


def _case(B: int, H: int, Hkv: int, T: int, L: int, D: int, seed: int = 0):
    """BF16-exact q [B, H, T, D], k, v [B, Hkv, L, D] (scores of order 1 so P spreads over
    the keys; V over 16 binades, so that sums in another order round differently), and the
    left-padded causal context of T query tokens ending at slot L."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, T, D, generator=g) * 0.3).bfloat16().float()
    k = (torch.randn(B, Hkv, L, D, generator=g) * 0.3).bfloat16().float()
    v = (torch.randn(B, Hkv, L, D, generator=g) * torch.exp2(torch.randint(-8, 8, (B, Hkv, L, D), generator=g).float()))
    pad_left = torch.randint(0, max(1, L - T), (B,), generator=g)
    ctx = make_context(pad_left, L - T, T, L)
    return q, k, v.bfloat16().float(), ctx


def _run(q, k, v, ctx, length=None, store=torch.float32, p_fp8=False, k_scale=None, v_scale=None):
    L = k.shape[2] if length is None else length
    kt = torch.nn.functional.pad(k[:, :, :L].transpose(-1, -2), (0, -L % 16)).contiguous()
    vv = v[:, :, :L].contiguous()
    kt, vv = kt.to(store), vv.to(store)  # float8_e4m3fn: the values must be on its grid (exact)
    return kernels.attention(q, kt, vv, ctx.kernel_mask(), L, 1 / math.sqrt(q.shape[-1]),
                             k_scale=k_scale, v_scale=v_scale, p_scale=P_SCALE if p_fp8 else 0.0)


def _reference(q, k, v, blocked, p_fp8=False):
    """Softmax attention in float64 (P rounded to E4M3 at P_SCALE where asked)."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    k64, v64 = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = (q.double() @ k64.transpose(-1, -2)) / math.sqrt(D)
    p = torch.softmax(s.masked_fill(blocked, float("-inf")), dim=-1)
    if p_fp8:
        p = dequantize_static(p.float(), torch.tensor(P_SCALE)).double()
    return p @ v64


@pytest.mark.parametrize("shape", [(2, 9, 3, 1, 150, 64), (3, 4, 2, 37, 64, 32), (2, 8, 8, 20, 40, 128)],
                         ids=["decode-gqa3", "prefill-gqa2", "mha-d128"])
def test_fused_attention_against_float64(shape):
    """FP32 arithmetic with a ~1 ulp exp: at least 120 dB against float64 (measured 2026-12-05
    on an Intel Xeon: 137-140 dB; a wrong mask, scale or sum order would show as < 60 dB)."""
    q, k, v, ctx = _case(*shape)
    ref = _reference(q, k, v, ctx.blocked)
    assert sqnr_db(ref, _run(q, k, v, ctx)) >= 120


def test_fused_attention_with_fp8_p_against_float64():
    """P stored in E4M3 (jet-kv): the kernel rounds the same probabilities the float64
    reference does to within their last FP32 bits, so only a rare tie flips: >= 60 dB
    against the reference that rounds P the same way (measured 2026-12-05 on an Intel Xeon:
    139 dB), while P left in FP32 is far from it (31 dB: the rounding is applied)."""
    q, k, v, ctx = _case(2, 9, 3, 5, 96, 64, seed=1)
    ref = _reference(q, k, v, ctx.blocked, p_fp8=True)
    assert sqnr_db(ref, _run(q, k, v, ctx, p_fp8=True)) >= 60
    assert sqnr_db(ref, _run(q, k, v, ctx)) < 45


def test_a_row_has_the_same_bits_alone_and_in_any_batch():
    """What rollout == training needs: each query row computed alone as a decode step (one
    token, the keys up to its slot, a prefix of 16-slot chunks) equals the same row in the
    training forward's call over all T tokens and every batch row."""
    B, H, Hkv, T, L, D = 3, 9, 3, 24, 70, 64
    q, k, v, ctx = _case(B, H, Hkv, T, L, D, seed=2)
    full = _run(q, k, v, ctx)
    for b in range(B):
        for t in (0, 7, T - 1):
            slot = L - T + t
            pad = torch.tensor([int(ctx.mask[b, 0, t].nonzero()[0])])
            one = make_context(pad, slot, 1, L)
            length = min(L, -(-(slot + 1) // 16) * 16)
            alone = _run(q[b : b + 1, :, t : t + 1], k[b : b + 1], v[b : b + 1], one, length=length)
            assert torch.equal(alone[0, :, 0], full[b, :, t]), (b, t)


def test_the_bits_do_not_depend_on_the_thread_count():
    """The kernel shares its (batch row, KV head) items among torch's threads: one thread,
    two and three (more than the items of a batch row) give the same bits."""
    q, k, v, ctx = _case(3, 9, 3, 5, 80, 64, seed=7)
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_run(q, k, v, ctx))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_bf16_and_scaled_storage_give_the_bits_of_the_fp32_values():
    """The rollout's cache holds BF16 (or E4M3 codes and per-head scales); the training
    forward passes the FP32 values: the same bits. The E4M3 data covers every code but NaN
    (subnormals and both zeros included), and the scales include one that is not a power
    of two and one below 2**-100 (the kernel's 2**8 folded into the scale stays exact)."""
    q, k, v, ctx = _case(2, 9, 3, 4, 50, 64, seed=3)
    assert torch.equal(_run(q, k, v, ctx, store=torch.bfloat16), _run(q, k, v, ctx))
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float()  # the 254 values
    g = torch.Generator().manual_seed(4)
    ks, vs = torch.tensor([0.011, 0.02, 0.0071]), torch.tensor([0.3, 2.0 ** -110, 0.9])
    for ky, vy in (
        (e4m3_values(k, ks.view(1, -1, 1, 1)), e4m3_values(v, vs.view(1, -1, 1, 1))),
        (codes[torch.randint(0, 254, k.shape, generator=g)] / 64, codes[torch.randint(0, 254, v.shape, generator=g)]),
    ):
        values = _run(q, ky * ks.view(1, -1, 1, 1), vy * vs.view(1, -1, 1, 1), ctx, p_fp8=True)
        fp8 = _run(q, ky, vy, ctx, store=torch.float8_e4m3fn, k_scale=ks, v_scale=vs, p_fp8=True)
        assert torch.equal(fp8, values)
    with pytest.raises(ValueError, match="take both scales"):
        _run(q, ky, vy, ctx, store=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="ones none"):
        _run(q, ky, vy, ctx, store=torch.bfloat16, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("store", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_kv_widened_once_per_item_gives_the_bits_of_the_cache_read_directly(store):
    """A prefill or training forward (several groups of 4 query rows per KV head) widens its
    BF16 or E4M3 keys and values to FP32 once; a decode step (one group) reads its cache.
    Each query row alone (a call of its own, the direct path) gets the bits it gets among
    all rows."""
    lib, kind = kernels.library(), kernels.KV_KINDS[store]
    assert lib.fp8rl_attention_work(kind, 12, 64, 48) > lib.fp8rl_attention_work(kind, 3, 64, 48) == 4 * 48
    assert lib.fp8rl_attention_work(kernels.KV_KINDS[torch.float32], 12, 64, 48) == 4 * 48  # FP32: read as is
    q, k, v, ctx = _case(2, 9, 3, 6, 40, 64, seed=11)
    scales = {}
    if store == torch.float8_e4m3fn:
        scales = {"k_scale": torch.tensor([0.011, 0.02, 0.0071]), "v_scale": torch.tensor([0.3, 2.0 ** -110, 0.9])}
        k, v = e4m3_values(k, scales["k_scale"].view(1, -1, 1, 1)), e4m3_values(v, scales["v_scale"].view(1, -1, 1, 1))
    L = k.shape[2]
    kt = torch.nn.functional.pad(k.transpose(-1, -2), (0, -L % 16)).contiguous().to(store)
    vv, mask = v.contiguous().to(store), ctx.kernel_mask()
    scale = 1 / math.sqrt(q.shape[-1])
    together = kernels.attention(q, kt, vv, mask, L, scale, p_scale=P_SCALE, **scales)
    for t in range(q.shape[2]):
        alone = kernels.attention(q[:, :, t : t + 1], kt, vv, mask[:, t : t + 1], L, scale, p_scale=P_SCALE, **scales)
        assert torch.equal(alone, together[:, :, t : t + 1])


def test_e4m3_storage_keeps_nan():
    """A NaN key read from E4M3 codes (0x7F) poisons its rows as the FP32 value does."""
    q, k, v, ctx = _case(1, 3, 1, 1, 16, 64, seed=9)
    k[0, 0, 15, 5] = float("nan")  # the last slot: the query's own, never masked
    one = torch.ones(1)
    ours = _run(q, k, v, ctx, store=torch.float8_e4m3fn, k_scale=one, v_scale=one)
    assert torch.isnan(ours).all() and torch.isnan(_run(q, k, v, ctx)).all()


def test_the_backward_is_that_of_the_same_function():
    """Gradients through `_FusedAttention` (recomputed in torch ops) against autograd on
    the torch composition, in float64."""
    q, k, v, ctx = _case(2, 4, 2, 6, 32, 32, seed=5)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    _FusedAttention.apply(*ins, ctx.blocked, ctx.kernel_mask(), False).backward(g)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    _attention_torch(*ref, ctx.blocked, False).backward(g.double())
    for got, want in zip(ins, ref):
        assert sqnr_db(want.grad, got.grad) >= 100


def test_the_kernel_is_used_only_for_head_sizes_it_handles():
    assert not kernels.attention_available(24)


@pytest.mark.parametrize("q_precision", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-bf16", "kv-fp8"])
def test_rope_store_has_the_bits_of_the_torch_code(q_precision: str, kv_fp8: bool):
    """`kernels.rope_store` (a rollout step's RoPE, Q storage and fused-cache write) against
    transformer.py's torch code: `apply_rope`, `store_heads` and the cache's stored values
    (BF16, or E4M3 values before the scale), bit for bit, on q/k/v rows that are views of one
    stacked GEMM output (as `linears_of_one_input` makes them), over 20 binades, with a
    per-row position, BF16 ties and zeros of both signs."""
    from fp8rl.model.config import ModelConfig
    from fp8rl.model.transformer import Transformer, apply_rope, store_heads

    B, T, H, Hkv, D, L, start = 3, 4, 6, 2, 64, 40, 9
    g = torch.Generator().manual_seed(8)
    rows = torch.randn(B * T, (H + 2 * Hkv) * D, generator=g) * torch.exp2(
        torch.randint(-10, 10, (B * T, (H + 2 * Hkv) * D), generator=g).float())
    # BF16 ties (low 16 bits 0x8000: round to even decides), kept by RoPE at position 0
    ties = rows[::2].view(torch.int32)
    ties[:, ::3] = (ties[:, ::3] & ~0xFFFF) | 0x8000
    rows[0, :5] = 0.0
    rows[1, :5] = -0.0
    q = rows[:, : H * D].view(B, T, H, D)
    k = rows[:, H * D : (H + Hkv) * D].view(B, T, Hkv, D)
    v = rows[:, (H + Hkv) * D :].view(B, T, Hkv, D)
    config = ModelConfig(vocab_size=32, hidden_size=H * D, intermediate_size=64, num_layers=1, num_heads=H,
                         num_kv_heads=Hkv, head_dim=D)
    positions = torch.randint(0, 500, (B, T), generator=g)
    positions[:, 0] = 0  # cos 1, sin 0: the rotation leaves the planted ties in place
    cos, sin = Transformer(config).rope(positions)
    q_scale = torch.rand(H, generator=g) + 0.01
    k_scale, v_scale = (torch.rand(Hkv, generator=g) * 4 + 0.01 for _ in range(2))
    store = torch.float8_e4m3fn if kv_fp8 else torch.bfloat16
    kt = torch.zeros(B, Hkv, D, 48, dtype=store)
    vc = torch.zeros(B, Hkv, L, D, dtype=store)
    q_val = kernels.rope_store(q, k, v, cos, sin, q_precision, q_scale, k_scale if kv_fp8 else None,
                               v_scale if kv_fp8 else None, kt, vc, start)

    qt, kt_ref = (apply_rope(t.transpose(1, 2), cos, sin) for t in (q, k))
    want_q = store_heads(qt, q_precision, q_scale)
    assert torch.equal(q_val.view(torch.int32), want_q.contiguous().view(torch.int32))  # signs of zero too
    vt = v.transpose(1, 2)
    if kv_fp8:
        want_k, want_v = e4m3_values(kt_ref, k_scale.view(1, -1, 1, 1)), e4m3_values(vt, v_scale.view(1, -1, 1, 1))
    else:
        want_k, want_v = kt_ref, vt
    bits = torch.uint8 if kv_fp8 else torch.int16  # the stored codes, signs of zero included
    got_k = kt[:, :, :, start : start + T].transpose(-1, -2)
    assert torch.equal(got_k.contiguous().view(bits), want_k.to(store).contiguous().view(bits))
    assert torch.equal(vc[:, :, start : start + T].view(bits), want_v.to(store).contiguous().view(bits))
    if kv_fp8:  # E4M3 subnormals and both zeros were written (the data spans 20 binades)
        codes = vc.view(torch.uint8)[:, :, start : start + T] & 0x7F
        assert bool(((codes > 0) & (codes < 8)).any()) and bool((vc.view(torch.uint8) == 0x80).any())
    assert not kt.view(bits)[:, :, :, :start].any() and not vc.view(bits)[:, :, start + T :].any()  # nothing else


_OTHER_ISA = r"""
import math, sys, torch
from fp8rl.fp8 import kernels
kernels.CFLAGS = kernels.CFLAGS + tuple(sys.argv[1:])  # instruction sets switched off
assert kernels.library() is not None, "the kernels did not build"
codes = torch.arange(256, dtype=torch.uint8)
values = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float()  # every E4M3 value but NaN
g = torch.Generator().manual_seed(0)
B, H, Hkv, L, D = 2, 6, 2, 40, 64
q = torch.randn(B, H, 1, D, generator=g)
kt = values[torch.randint(0, 254, (B, Hkv, D, 48), generator=g)]
v = values[torch.randint(0, 254, (B, Hkv, L, D), generator=g)]
mask = torch.zeros(B, 1, 48, dtype=torch.uint8)
mask[:, :, L:] = 1
ks, vs = torch.tensor([0.01, 3.0]), torch.tensor([2.0 ** -100, 0.7])
fp8 = kernels.attention(q, kt.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), mask, L, 0.125, ks, vs)
fp32 = kernels.attention(q, kt * ks.view(1, -1, 1, 1), v * vs.view(1, -1, 1, 1), mask, L, 0.125)
kt[0, 0, 3, 1] = float("nan")
nan = kernels.attention(q, kt.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), mask, L, 0.125, ks, vs)
print(torch.equal(fp8, fp32), bool(torch.isnan(nan[0, :3]).all() and not torch.isnan(nan[1]).any()))
"""


@pytest.mark.parametrize("flags", [
    ("-mno-avx512f",),  # the kernels' build on an AVX2 CPU (about 20 s)
    pytest.param(("-mno-avx512f", "-mno-f16c"), marks=pytest.mark.slow),  # older x86 only
], ids=["avx2-f16c", "no-f16c"])
def test_e4m3_storage_on_other_instruction_sets(tmp_path, flags: tuple[str, ...]):
    """The kernel decodes E4M3 codes with one AVX-512 conversion, two AVX ones (F16C
    without AVX-512, as on AVX2-only CPUs) or integer arithmetic (no F16C): built here
    with those instruction sets switched off (a fresh library in its own cache folder),
    each gives the FP32 values' bits, NaN included."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "FP8RL_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", _OTHER_ISA, *flags], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"], done.stdout


@pytest.mark.parametrize("backend", ["reference", "cpu", "amx"])
def test_a_forward_on_no_tokens_gives_no_logits(backend: str):
    """A model forward on [B, 0] token ids returns [B, 0, vocab] under every backend (the
    fused kernel used to refuse the empty tensors' arbitrary strides, the torch attention
    to infer a key axis from no elements)."""
    from fp8rl.model import load
    from fp8rl.precision import apply_flow, phase

    model, _ = load("tiny-arith")
    apply_flow(model, "jet-kv", backend=backend)
    with torch.no_grad(), phase(model, "train"):
        logits = model(torch.zeros(2, 0, dtype=torch.long))
    assert logits.shape == (2, 0, model.config.vocab_size) and logits.dtype == torch.float32
