import math

import pytest
import torch

from fp8rl.rl.grpo import group_advantages, masked_mean, policy_loss
from fp8rl.rollout.engine import token_entropy


# --- advantages ----------------------------------------------------------------


def test_group_advantages_uses_sample_std_and_zeroes_constant_groups():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(r, group_size=4)
    # group 1: mean 0.5, sample std sqrt((4 * 0.25) / 3) = sqrt(1/3)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=0)
    assert torch.equal(adv[4:], torch.zeros(4))


def test_group_advantages_g2_distinguishes_sample_from_population_std():
    adv = group_advantages(torch.tensor([0.0, 1.0]), group_size=2)
    # sample std of {0, 1} is sqrt(0.5); population std would give +-1
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([-a, a]), rtol=1e-6, atol=0)


def test_group_advantages_without_std_and_group_size_one():
    r = torch.tensor([3.0, 1.0, 2.0, 2.0])
    torch.testing.assert_close(group_advantages(r, 2, normalize_std=False), torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert torch.equal(group_advantages(r, 1), torch.zeros(4))


def test_group_advantages_constant_group_is_exactly_zero():
    # the float64 mean of three 0.1s is not exactly 0.1: r - mean would be ~1e-17, not 0
    adv = group_advantages(torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64), 3)
    assert torch.equal(adv, torch.zeros(3))


def test_group_advantages_rejects_ragged_batch():
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(torch.zeros(6), 4)


# --- masked mean -----------------------------------------------------------------


def test_masked_mean_ignores_masked_inf_and_empty_rows():
    x = torch.tensor([[1.0, 2.0, float("inf")], [float("nan"), 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_mean(x, mask).item() == 1.5
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 0.0]))


# --- policy loss -----------------------------------------------------------------


def _logps(ratios, old=-1.0):
    old_logp = torch.full_like(ratios, old)
    logp = (old_logp + ratios.log()).requires_grad_()
    return logp, old_logp


def test_policy_loss_clips_on_both_sides_for_both_advantage_signs():
    ratios = torch.tensor([[1.5, 0.5], [0.5, 1.5]])
    logp, old = _logps(ratios)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2)
    loss, stats = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    # A=+1: r=1.5 -> clipped to 1.28 (-1.28); r=0.5 -> unclipped (-0.5)
    # A=-1: r=0.5 -> clipped to 0.8 (+0.8);   r=1.5 -> unclipped (+1.5)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5) / 4, abs=1e-6)
    assert stats["ppo_clip_frac"] == 0.5
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert stats["kl"] == 0.0 and stats["n_tokens"] == 4
    loss.backward()
    # clipped tokens get no gradient; unclipped d(-r*A)/dlogp = -r*A / 4
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 4], [0.0, 1.5 / 4]]))


def test_policy_loss_is_weights_multiply_after_clipping_and_get_no_grad():
    ratios = torch.tensor([[1.5, 0.5], [0.5, 1.5]])
    logp, old = _logps(ratios)
    w = torch.tensor([[2.0, 3.0], [0.5, 1.0]], requires_grad=True)
    loss, _ = policy_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2), is_weights=w)
    # per-token clipped terms (-1.28, -0.5, 0.8, 1.5) times w
    assert loss.item() == pytest.approx((-1.28 * 2 - 0.5 * 3 + 0.8 * 0.5 + 1.5 * 1) / 4, abs=1e-6)
    loss.backward()
    assert w.grad is None


def test_policy_loss_fully_masked_rows_and_batch():
    ratios = torch.tensor([[1.5, 0.5], [1.0, 1.0]])
    logp, old = _logps(ratios)
    logp_bad = logp.detach().clone()
    logp_bad[1] = float("-inf")  # padding row: garbage must not leak into the loss
    mask = torch.tensor([[1, 1], [0, 0]])
    loss, stats = policy_loss(logp_bad, old, torch.tensor([1.0, 5.0]), mask)
    assert loss.item() == pytest.approx((-1.28 - 0.5) / 2, abs=1e-6)
    assert stats["n_tokens"] == 2

    empty, stats = policy_loss(logp, old, torch.tensor([1.0, 1.0]), torch.zeros(2, 2))
    assert empty.item() == 0.0 and stats["ppo_clip_frac"] == 0.0
    empty.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 2))


def test_policy_loss_k3_kl_to_reference():
    logp, old = _logps(torch.ones(1, 2))  # ratio 1
    ref = logp.detach() + torch.tensor([[math.log(2.0), 0.0]])
    loss, stats = policy_loss(logp, old, torch.tensor([0.0]), torch.ones(1, 2), ref_logp=ref, kl_coef=0.1)
    k3 = 2.0 - math.log(2.0) - 1.0  # exp(d) - d - 1 at d = ln 2
    assert stats["kl"] == pytest.approx(k3 / 2, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3 / 2, rel=1e-6)


def test_policy_loss_normalises_each_micro_batch_by_its_own_tokens():
    # Each micro-batch is its own optimizer step: the loss is a per-token mean.
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 3, generator=g, dtype=torch.float64) - 0.5
    logp = old + 0.4 * torch.randn(4, 3, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    loss, stats = policy_loss(logp, old, adv, mask)
    doubled, _ = policy_loss(torch.cat([logp, logp]), torch.cat([old, old]), torch.cat([adv, adv]), torch.cat([mask, mask]))
    assert stats["n_tokens"] == 6.0
    torch.testing.assert_close(doubled, loss, rtol=1e-6, atol=1e-7)


# --- entropy ---------------------------------------------------------------------


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The trainer's entropy metric: per-token entropy of the scorer, masked mean."""
    return masked_mean(token_entropy(torch.log_softmax(logits.float(), dim=-1)), mask)


def test_entropy_hand_values_and_mask():
    logits = torch.zeros(2, 2, 4)
    logits[0, 1] = torch.tensor([0.5, 0.25, 0.25, 0.0]).log()  # p = (1/2, 1/4, 1/4, 0)
    logits[1, :] = float("nan")  # masked row
    mask = torch.tensor([[1, 1], [0, 0]])
    h = entropy_from_logits(logits, mask)
    expected = (math.log(4.0) + 1.5 * math.log(2.0)) / 2
    assert h.item() == pytest.approx(expected, rel=1e-6)


def test_entropy_of_one_hot_is_zero_not_nan():
    logits = torch.tensor([[[0.0, float("-inf"), float("-inf")]]])
    assert entropy_from_logits(logits, torch.ones(1, 1)).item() == 0.0
