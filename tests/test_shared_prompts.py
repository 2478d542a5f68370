"""A prompt shared by several rows (a GRPO group) is computed once: in the
rollout's prefill and in the training forward (`score`). The forward's bits
must not change (rollout == training still holds bit for bit); the gradient is
the same sum, rounded differently, and must be as accurate as the per-row one
(docs/design.md section 9)."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8rl.model import load
from fp8rl.precision import PRESETS, apply_flow, refresh_weights
from fp8rl.rollout.calibrate import calibrate
from fp8rl.rollout.engine import (
    SamplingParams,
    generate,
    left_pad,
    prompt_groups,
    routing_record,
    sampled_routing,
    score,
)
from fp8rl.rollout.kv_cache import PromptKV
from test_engine import prompts, tiny_model

GROUP = 4


def grouped_prompts(n: int = 4) -> list[list[int]]:
    """n distinct prompts of different lengths, each repeated GROUP times (a GRPO batch)."""
    return [p for p in prompts(n) for _ in range(GROUP)]


def sample(model: torch.nn.Module, ps: list[list[int]], max_new: int = 12):
    return generate(model, ps, SamplingParams(max_new_tokens=max_new), eos_ids=[1], pad_id=0,
                    seeds=list(range(len(ps))))


def flowed(flow: str, backend: str, model: torch.nn.Module | None = None) -> torch.nn.Module:
    model = model if model is not None else tiny_model(qk_norm=True)
    apply_flow(model, PRESETS[flow], backend=backend)
    refresh_weights(model)
    if PRESETS[flow].needs_calibration:
        calibrate(model, *left_pad(grouped_prompts(), 0))
    return model


def test_prompt_groups_finds_rows_with_the_same_prompt_in_row_order():
    tokens = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 0, 6]])
    pad_left = torch.tensor([1, 0, 1, 1, 0, 2])
    first, of_row = prompt_groups(tokens, pad_left)
    assert first.tolist() == [0, 1, 5] and of_row.tolist() == [0, 1, 0, 0, 1, 2]
    # the same token ids with another padding are another prompt (pad id 0 == a token id here)
    assert prompt_groups(torch.tensor([[0, 6], [0, 6]]), torch.tensor([1, 0])) is None
    assert prompt_groups(tokens[:2], pad_left[:2]) is None  # nothing shared: the plain forward


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("flow", ["bf16", "jet", "jet-kv"])
def test_a_shared_prefill_gives_each_row_the_bits_it_gets_alone(flow: str, backend: str):
    """The rollout prefills each distinct prompt once and copies its K/V and logits to
    its rows: every row's tokens and log-probs equal those of the row sampled alone."""
    model = flowed(flow, backend)
    ps = grouped_prompts()
    out = sample(model, ps)
    assert out.n_tokens > 100
    for b, p in enumerate(ps):
        alone = generate(model, [p], SamplingParams(max_new_tokens=12), eos_ids=[1], pad_id=0, seeds=[b],
                         prompt_len=out.prompt_len)
        width = alone.tokens.shape[1]
        assert torch.equal(alone.tokens[0], out.tokens[b, :width]), b
        assert torch.equal(alone.logprobs[0], out.logprobs[b, :width]), b


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("flow", ["bf16", "jet", "jet-e2e", "jet-kv", "fp8-grads"])
def test_scoring_shared_prompts_changes_no_bit(flow: str, backend: str):
    """`score` with each prompt computed once == the one-call forward, bit for bit, and
    (unified flows) == the rollout's log-probs."""
    model = flowed(flow, backend)
    out = sample(model, grouped_prompts())
    with torch.no_grad():
        shared, ent_shared = score(model, out, with_entropy=True)
        plain, ent_plain = score(model, out, with_entropy=True, share_prompts=False)
    assert torch.equal(shared, plain) and torch.equal(ent_shared, ent_plain)
    m = out.completion_mask
    if flow != "bf16" or backend == "reference":
        assert torch.equal(shared[m], out.logprobs[m])


def test_scoring_shared_prompts_changes_no_bit_with_experts():
    """tiny-moe: the same log-probs and the same recorded experts of every position."""
    model, _ = load("tiny-moe")
    apply_flow(model, "jet", backend="cpu")
    refresh_weights(model)
    ps = [[5 + i, 40 + 3 * i, 77, 12 + i][: 2 + i % 3] for i in range(3) for _ in range(GROUP)]
    out = sample(model, ps)
    records = []
    with torch.no_grad():
        for share in (True, False):
            record = routing_record(model)
            logp, _ = score(model, out, routing=record, share_prompts=share)
            records.append((logp, sampled_routing(record, out.tokens.shape[1])))
    (a, ra), (b, rb) = records
    assert torch.equal(a, b) and torch.equal(ra, rb)
    assert torch.equal(ra[out.completion_mask], out.routing[out.completion_mask])


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.double().pow(2).sum() / (ref.double() - x.double()).pow(2).sum()))


def weighted_grads(model: torch.nn.Module, out, share: bool) -> list[torch.Tensor]:
    model.zero_grad()
    logp, _ = score(model, out, share_prompts=share)
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(0))
    (logp * w).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def backward_floor_db(flow: str | None) -> float:
    """How close two roundings of the same gradient must be, from the backward's precision.
    FP32 (no flow): two FP32 summation orders, 2**-24 relative each (~140 dB; measured 130).
    BF16 backward GEMMs: a prompt's gradient rounded to BF16 once (summed over its rows)
    instead of once per row, 2**-9 relative each (~54 dB; measured 52.4 at the worst
    parameter). FP8 backward GEMMs (E4M3 / E5M2 gradients, 2**-4 / 2**-3): measured 26."""
    if flow is None:
        return 110.0
    f = PRESETS[flow]
    return 20.0 if "fp8" in (f.train_dgrad, f.train_wgrad, f.grad_transport) else 45.0


@pytest.mark.parametrize("flow", [None, "bf16", "jet", "jet-e2e", "jet-kv", "fp8-grads"])
def test_shared_prompts_give_the_same_gradient_as_accurately(flow: str | None):
    """The gradient with each prompt computed once is the per-row gradient up to the
    rounding of the backward's precision (SQNR floor per flow, on every parameter),
    and it is as close to the full-FP32 gradient as the per-row one (within 0.5 dB)."""
    floor_db = backward_floor_db(flow)
    base = tiny_model(qk_norm=True)
    out = sample(base, grouped_prompts())
    fp32 = weighted_grads(copy.deepcopy(base), out, share=False)
    model = flowed(flow, "cpu", copy.deepcopy(base)) if flow else copy.deepcopy(base)
    shared, plain = weighted_grads(model, out, share=True), weighted_grads(model, out, share=False)
    assert min(sqnr_db(b, a) for a, b in zip(shared, plain)) >= floor_db
    if flow is not None:
        for ref, a, b in zip(fp32, shared, plain):
            assert sqnr_db(ref, a) >= sqnr_db(ref, b) - 0.5


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("percentile", [99.9, 50.0, 10.0])
def test_calibrating_with_shared_prompts_sets_the_same_scales(backend: str, percentile: float):
    """The trainer calibrates on the step's grid with `prompt_len`: each prompt computed
    once, its per-token amax counted for each of its rows, so the pooled tokens and
    their order are those of the one-call forward, and every Q/K/V scale the same
    bits (a low percentile is sensitive to which tokens are pooled: pads excluded)."""
    from fp8rl.config import CalibrationConfig

    model = flowed("jet-kv", backend)
    out = sample(model, grouped_prompts())
    cfg = CalibrationConfig(percentile=percentile)
    before, scales = model.attention_scales(), []
    for prompt_len in (None, out.prompt_len):
        model.set_attention_scales(before)  # the calibration forward runs on the scales it replaces
        stats = calibrate(model, out.tokens, out.pad_left, out.cache_len, cfg, prompt_len=prompt_len)
        scales.append((stats, model.attention_scales()))
    assert scales[0] == scales[1]
    assert scales[0][0]["calib_tokens"] == int((torch.arange(out.tokens.shape[1]) >= out.pad_left[:, None]).sum())


def test_prompt_kv_refuses_a_completion_call_that_does_not_follow_the_prompt():
    kv = PromptKV(torch.tensor([0, 0]), cache_len=8)
    k = torch.zeros(1, 2, 3, 4)
    full_k, _ = kv.update(0, 0, k, k)
    assert full_k.shape == (1, 2, 8, 4)
    with pytest.raises(ValueError, match="not where the prompt call ended"):
        kv.update(0, 4, torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    with pytest.raises(ValueError, match="exceed cache_len"):
        kv.update(0, 3, torch.zeros(2, 2, 6, 4), torch.zeros(2, 2, 6, 4))


def _serial_index_backward(x: torch.Tensor, of_row: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``x[of_row]``'s own backward on one thread: index_put_ accumulating row by row."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.zeros_like(x).index_put_((of_row,), grad, accumulate=True)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("of_row", [
    [0] * 8 + [1] * 8 + [2] * 8,  # a GRPO batch: 3 groups of 8, the middle one across the threads' split
    [0, 1, 0, 2, 1, 0, 2, 2, 0, 1],  # interleaved, groups of unequal size
    [0, 1, 2],  # one row per prompt
])
def test_rows_of_prompts_backward_adds_in_row_order_on_any_threads(of_row: list[int]):
    """The gradient of a shared prompt is its rows' sum in row order from zero, the bits
    ``x[of_row]``'s own backward gives on one thread, run after run on two threads (where
    that backward splits the middle prompt's rows between the threads: this test fails
    for ``x[of_row]``)."""
    from fp8rl.rollout.kv_cache import rows_of_prompts

    of_row_t = torch.tensor(of_row)
    U = int(of_row_t.max()) + 1
    g = torch.Generator().manual_seed(0)
    # Magnitudes spread over 12 decades: any other order of a prompt's adds rounds differently.
    grad = torch.randn(len(of_row), 2, 43, 32, generator=g) * torch.logspace(-6, 6, len(of_row))[:, None, None, None]
    x = torch.randn(U, 2, 43, 32, generator=g, requires_grad=True)
    expected = _serial_index_backward(x.detach(), of_row_t, grad)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite runs on one (conftest.py); the split needs two
    try:
        for _ in range(20):
            y = rows_of_prompts(x, of_row_t)
            assert torch.equal(y, x.detach()[of_row_t])
            (dx,) = torch.autograd.grad(y, x, grad)
            assert torch.equal(dx, expected)
    finally:
        torch.set_num_threads(threads)
    # The order matters at these magnitudes: the rows summed last to first give other bits.
    reversed_sum = _serial_index_backward(x.detach(), of_row_t.flip(0), grad.flip(0))
    assert U == len(of_row) or not torch.equal(reversed_sum, expected)
