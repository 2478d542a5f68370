"""kernels.c's token log-probs (``fp8rl_token_logprobs`` and its backward, reached through
``rollout.engine.token_logprobs(..., fused=True)``): within bounds derived from its FP32
arithmetic of a float64 reference, independent of the other rows, recorded by the rollout
as the training forward scores them, and the same bits whatever instruction set the
kernels are compiled for (docs/design.md section 3)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fp8rl.fp8 import kernels
from fp8rl.rollout.engine import SamplingParams, sample_next, token_logprobs

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no compiled kernels on this machine")

U = 2.0**-24  # FP32's unit roundoff


def _logits(n: int, v: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 4
    x[0] = 0.0  # a uniform row
    x[1, : v // 2] = float("-inf")  # half the vocabulary masked: p == 0 entries add no NaN
    x[2, 3] = 60.0  # one dominant token
    return x


def _sum_error(v: int) -> float:
    """Relative error bound of the kernel's sum of exponentials of a row of ``v``: each
    term within 2 ulps (Cephes' expf, about 1) of exp of its rounded argument, then
    chains of v / 64 additions per accumulator (16 lanes x 4 accumulators) and 6 levels
    of the reduction tree (Higham's gamma_n, n U to first order)."""
    return 4 * U + (v / 64 + 6) * U


@pytest.mark.parametrize("v", [49152, 37, 16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_within_their_rounding_bounds_of_float64(v: int, temperature: float):
    x = _logits(64, v)
    target = torch.randint(0, v, (64,), generator=torch.Generator().manual_seed(1))
    target[1] = v - 1  # a live token of the masked row
    logp, entropy = token_logprobs(x, target, temperature, with_entropy=True, fused=True)
    y = x.double() / temperature
    top = y.nan_to_num(neginf=0.0).abs().max(-1).values  # the largest finite |y| of each row
    ref = torch.log_softmax(y, -1)
    want = ref.gather(-1, target[:, None])[:, 0]
    p = ref.exp()
    want_entropy = -(p * ref.nan_to_num(neginf=0.0)).sum(-1)
    d_t = (y.gather(-1, target[:, None])[:, 0] - y.max(-1).values).abs()
    log_s = torch.logsumexp(y - y.max(-1, keepdim=True).values, -1)
    # logp = (y_t - m) - log(s): the sum's relative error becomes log(s)'s absolute one; each
    # rounding (the division by t, y_t - m, logf, the subtraction) adds a few ulps of its value
    bound = _sum_error(v) + 4 * U * (d_t + log_s + want.abs()) + 4 * U * top
    assert ((logp.double() - want).abs() <= bound).all(), (logp.double() - want).abs().max()
    # entropy = log(s) - w / s, w / s = E_p[y - m]: the sums' errors relative to the mean's size
    mean_d = (p * (y - y.max(-1, keepdim=True).values).nan_to_num(neginf=0.0)).sum(-1).abs()
    e_bound = 2 * _sum_error(v) * (1 + mean_d) + 4 * U * (log_s + mean_d) + 4 * U * top
    assert ((entropy.double() - want_entropy).abs() <= e_bound).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_gradient_within_its_rounding_bound_of_float64(temperature: float):
    v = 4099
    x = _logits(48, v, seed=2).requires_grad_()
    target = torch.randint(v // 2, v, (48,), generator=torch.Generator().manual_seed(3))
    g = torch.randn(48, generator=torch.Generator().manual_seed(4))
    logp, _ = token_logprobs(x, target, temperature, fused=True)
    (grad,) = torch.autograd.grad(logp, x, g)
    xd = x.detach().double().requires_grad_()
    (torch.log_softmax(xd / temperature, -1).gather(-1, target[:, None])[:, 0] * g.double()).sum().backward()
    y = xd.detach() / temperature
    top = y.nan_to_num(neginf=0.0).abs().max(-1).values  # the largest finite |y| of each row
    p = torch.softmax(y, -1)
    d = (y - y.max(-1, keepdim=True).values).nan_to_num(neginf=0.0).abs()
    log_s = torch.logsumexp(y - y.max(-1, keepdim=True).values, -1, keepdim=True)
    one_hot = torch.zeros_like(p).scatter_(-1, target[:, None], 1.0)
    # p_j = exp((y_j - m) - log s): log s off by the sum's error, each rounding a few ulps of
    # the argument (exp turns an absolute error of its argument into a relative one of p);
    # then g * (onehot - p) and / t, a few ulps each. exp_nonpos_v gives 0 below -87 (p < 2**-125),
    # and a product in FP32's subnormal range is off by up to its spacing, 2**-149
    rel_p = _sum_error(v) + 4 * U * (d + log_s + top[:, None]) + 4 * U
    bound = (g.double().abs()[:, None] / temperature * (p * rel_p + 4 * U * (one_hot - p).abs() + 2.0**-125)
             + 2.0**-149)
    assert ((grad.double() - xd.grad).abs() <= bound).all(), ((grad.double() - xd.grad).abs() / bound).max()


def test_a_row_s_bits_do_not_depend_on_the_other_rows():
    x = _logits(40, 2051, seed=5).requires_grad_()
    target = torch.randint(1100, 2051, (40,), generator=torch.Generator().manual_seed(6))
    g = torch.randn(40, generator=torch.Generator().manual_seed(7))
    logp, entropy = token_logprobs(x, target, 0.9, with_entropy=True, fused=True)
    (grad,) = torch.autograd.grad(logp, x, g)
    for rows in (slice(0, 1), slice(7, 9), slice(3, 40, 3)):
        sub = x.detach()[rows].clone().requires_grad_()
        lp, ent = token_logprobs(sub, target[rows], 0.9, with_entropy=True, fused=True)
        (gr,) = torch.autograd.grad(lp, sub, g[rows])
        assert torch.equal(lp, logp[rows]) and torch.equal(ent, entropy[rows]) and torch.equal(gr, grad[rows])


@pytest.mark.parametrize("temperature", [1.0, 0.8, 0.0])
def test_the_rollout_records_what_the_training_forward_scores(temperature: float):
    v = 3001
    x = _logits(12, v, seed=8)
    noise = None if temperature == 0 else torch.rand(12, v, generator=torch.Generator().manual_seed(9))
    params = SamplingParams(max_new_tokens=1, temperature=temperature)
    tok, lp = sample_next(x, params, noise, fused=True)
    want, _ = token_logprobs(x, tok, params.logprob_temperature, fused=True)
    assert torch.equal(lp, want)
    # and the unfused path is torch's log_softmax -> gather, a different rounding
    tok_torch, lp_torch = sample_next(x, params, noise)
    assert torch.equal(tok_torch, tok)
    assert torch.equal(lp_torch, torch.log_softmax(x / params.logprob_temperature, -1).gather(-1, tok[:, None])[:, 0])


def test_a_non_finite_row_gives_nan_and_a_bad_target_raises():
    x = _logits(4, 64)
    x[3, 5] = float("nan")
    logp, entropy = token_logprobs(x, torch.tensor([1, 40, 2, 0]), 1.0, with_entropy=True, fused=True)
    assert logp[:3].isfinite().all() and logp[3].isnan() and entropy[3].isnan()
    with pytest.raises(IndexError, match="outside the vocabulary of 64"):
        token_logprobs(x, torch.tensor([1, 64, 2, 0]), 1.0, fused=True)


def _isa_outputs() -> dict[str, torch.Tensor]:
    """Every compiled kernel's outputs on awkward inputs (ragged widths, masked and dominant
    logits, a temperature, values over many binades, masked key slots, every KV storage)."""
    x = _logits(24, 1037, seed=10).requires_grad_()
    target = torch.randint(600, 1037, (24,), generator=torch.Generator().manual_seed(11))
    logp, entropy = token_logprobs(x, target, 0.7, with_entropy=True, fused=True)
    (grad,) = torch.autograd.grad(logp, x, torch.randn(24, generator=torch.Generator().manual_seed(12)))
    h = torch.randn(5, 7, 133, generator=torch.Generator().manual_seed(13))
    w = torch.rand(133, generator=torch.Generator().manual_seed(14)) + 0.5
    p = torch.randn(70001, generator=torch.Generator().manual_seed(15))
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in (1, 2, 3):
        gr = torch.randn(70001, generator=torch.Generator().manual_seed(16 + step))
        kernels.adamw_(p, gr, m, v, decay=1 - 1e-3 * 0.01, weight=0.1, beta2=0.99,
                       bias_correction2_sqrt=(1 - 0.99**step) ** 0.5, eps=1e-8, neg_step=-(1e-3 / (1 - 0.9**step)))
    out = {"logp": logp, "entropy": entropy, "grad": grad, "rmsnorm": kernels.rmsnorm(h, w, 1e-6),
           "silu_mul": kernels.silu_mul(h, h.flip(-1)), "adamw": torch.stack([p, m, v])}
    # attention over FP32, BF16 and E4M3 keys and values (P in E4M3 for the last), 40 live slots of 48
    g = torch.Generator().manual_seed(20)
    q = torch.randn(2, 4, 5, 64, generator=g)
    kt, vv = torch.randn(2, 2, 64, 48, generator=g), torch.randn(2, 2, 48, 64, generator=g)
    blocked = torch.rand(2, 1, 5, 48, generator=g) < 0.3
    blocked[..., 0] = False
    mask = kernels.padded_mask(blocked)
    out["attention_fp32"] = kernels.attention(q, kt, vv, mask, 40, 0.125)
    out["attention_bf16"] = kernels.attention(q, kt.bfloat16(), vv.bfloat16(), mask, 40, 0.125)
    ks, vs = torch.tensor([0.01, 0.02]), torch.tensor([0.015, 0.005])
    e4m3 = (kt / ks.view(1, -1, 1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    v8 = (vv / vs.view(1, -1, 1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    out["attention_e4m3"] = kernels.attention(q, e4m3, v8, mask, 40, 0.125, ks, vs, p_scale=1 / 448)
    # the FP8 quantizers and the Gumbel-max
    x = torch.randn(37, 300, generator=g) * torch.logspace(-6, 3, 300)
    out["qdq_rows"] = kernels.qdq_rows(x, 128, False, 1e-12)
    codes, scales = kernels.quantize_blocks(x, 128, 128, True, 1e-12)
    out["quantize_blocks"] = torch.cat([codes.view(torch.uint8).flatten().float(), scales.flatten()])
    out["dequantize_blocks"] = kernels.dequantize_blocks(codes, scales, 128, 128, torch.bfloat16).float()
    codes, scales = kernels.quantize_blocks(x.T.contiguous(), 128, 1, False, 1e-12)  # the wgrad's token blocks
    out["quantize_column_blocks"] = torch.cat([codes.view(torch.uint8).flatten().float(), scales.flatten()])
    for block in ((1, 128), (128, 1)):  # the FP8 backward's operands on `cpu` (FP32) and `amx` (BF16)
        for dtype in (torch.float32, torch.bfloat16):
            values, _ = kernels.quantize_blocks(x.T.contiguous(), *block, False, 1e-12, dequantized=dtype)
            out[f"dequantized_blocks_{block}_{dtype}"] = values.float()
    out["argmax_sum"] = kernels.argmax_sum(x, x.flip(-1)).float()
    return out


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
def test_the_same_bits_whatever_instruction_set_the_kernels_are_built_for(
    march: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """The kernels' fixed 16-lane vectors and rounding (no FMA contraction, no fast math)
    are compiled to SSE2 alone (x86-64), AVX2 with FMA (x86-64-v3) or this CPU's own
    instructions (-march=native: AVX-512 here): the outputs must not change. What a CPU of
    that level would build and run, run here."""
    if kernels._compiler() is None:
        pytest.skip("no C compiler")
    if march == "x86-64-v3" and not {"avx2", "fma", "bmi2"} <= set(kernels._cpu_id().split()):
        pytest.skip("this CPU cannot run an x86-64-v3 (AVX2, FMA) build")
    native = _isa_outputs()
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in kernels.CFLAGS) + ("-Wno-psabi",)
    assert flags != kernels.CFLAGS
    monkeypatch.setattr(kernels, "CFLAGS", flags)
    monkeypatch.setenv("FP8RL_CACHE_DIR", str(tmp_path))
    kernels.library.cache_clear()
    try:
        assert kernels.library() is not None and list((tmp_path / "kernels").glob("*.so"))
        other = _isa_outputs()
    finally:
        monkeypatch.undo()
        kernels.library.cache_clear()
    for name, t in native.items():
        assert torch.equal(t, other[name]), (march, name)
    assert not math.isnan(float(native["logp"][0].detach()))
