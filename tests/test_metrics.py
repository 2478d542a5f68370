import math

import pytest
import torch

from fp8rl.rl.metrics import METRIC_NAMES, mismatch_metrics, routing_mismatch, sequence_mismatch


def test_identical_logps_are_exactly_no_mismatch():
    logp = -torch.rand(3, 5, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    m = mismatch_metrics(logp, logp.clone(), mask)
    assert m == {
        "token_mult_prob_error": 1.0,
        "max_abs_logprob_diff": 0.0,
        "mean_abs_logprob_diff": 0.0,
        "gen_kl": 0.0,
        "n_tokens": 13,
    }


def test_hand_computed_mismatch():
    rollout = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    train = rollout + torch.tensor([[0.1, -0.2, 5.0]])  # last token masked
    m = mismatch_metrics(train, rollout, torch.tensor([[1, 1, 0]]))
    assert m["token_mult_prob_error"] == pytest.approx((math.exp(0.1) + math.exp(0.2)) / 2, rel=1e-6)
    assert m["max_abs_logprob_diff"] == pytest.approx(0.2, rel=1e-6)
    assert m["mean_abs_logprob_diff"] == pytest.approx(0.15, rel=1e-6)
    k3 = (math.exp(0.1) - 0.1 - 1) + (math.exp(-0.2) + 0.2 - 1)
    assert m["gen_kl"] == pytest.approx(k3 / 2, rel=1e-5)
    assert m["n_tokens"] == 2


def test_empty_mask_reports_no_mismatch():
    m = mismatch_metrics(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2))
    assert m["token_mult_prob_error"] == 1.0 and m["gen_kl"] == 0.0 and m["n_tokens"] == 0


def test_metric_names_are_the_design_contract():
    expected = {
        "token_mult_prob_error", "max_abs_logprob_diff", "mean_abs_logprob_diff", "gen_kl", "routing_mismatch",
        "seq_log_ratio_abs_mean", "seq_log_ratio_abs_max", "seq_ratio_off_2x_frac",
        "is_weight_mean", "is_weight_max", "is_clip_frac",
        "reward_mean", "accuracy", "response_len_mean", "entropy", "loss", "grad_norm", "lr", "ppo_clip_frac",
        "time_rollout_s", "time_train_s", "time_sync_s", "time_step_s", "rollout_tokens_per_s", "peak_mem_bytes",
    }
    assert len(METRIC_NAMES) == len(set(METRIC_NAMES)) == 25
    assert set(METRIC_NAMES) == expected


def test_sequence_mismatch_sums_per_sequence():
    train = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.5, -1.5, -2.0, 5.0], [-0.5, -1.0, 7.0, 7.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    m = sequence_mismatch(train, rollout, mask)
    # s = (0.5 - 0.5 - 1.0, -0.5 + 0, 0) -> |s| = (1.0, 0.5, 0); masked entries ignored
    assert m["response_len_mean"] == pytest.approx(5 / 3)
    assert m["seq_log_ratio_abs_mean"] == pytest.approx(0.5)
    assert m["seq_log_ratio_abs_max"] == pytest.approx(1.0)
    assert m["seq_ratio_off_2x_frac"] == pytest.approx(1 / 3)  # exp(1.0) > 2 > exp(0.5)
    with pytest.raises(ValueError, match="same"):
        sequence_mismatch(train, rollout, mask[:, :2])


def test_sequence_mismatch_grows_with_length():
    # i.i.d. per-token errors: |sum| over L tokens grows like sqrt(L)
    g = torch.Generator().manual_seed(0)
    short, long = (sequence_mismatch(0.01 * torch.randn(4000, n, generator=g), torch.zeros(4000, n),
                                     torch.ones(4000, n)) for n in (16, 256))
    ratio = long["seq_log_ratio_abs_mean"] / short["seq_log_ratio_abs_mean"]
    assert 3.5 < ratio < 4.5  # sqrt(256 / 16) = 4


def test_routing_mismatch_counts_tokens_whose_expert_set_differs():
    # [B=1, S=4, L=2 layers, k=2]: token 1 differs in layer 1, token 2 nowhere, token 3 masked out
    rollout = torch.tensor([[[[-1, -1], [-1, -1]], [[0, 3], [1, 2]], [[2, 5], [0, 1]], [[1, 4], [4, 6]]]])
    train = rollout.clone()
    train[0, 1, 1] = torch.tensor([1, 3])
    train[0, 3, 0] = torch.tensor([0, 4])
    mask = torch.tensor([[False, True, True, False]])
    assert routing_mismatch(train, rollout, mask) == 0.5
    assert routing_mismatch(train, rollout, torch.zeros_like(mask)) == 0.0
    assert routing_mismatch(None, None, mask) == 0.0  # a dense model
    with pytest.raises(ValueError, match="must both be"):
        routing_mismatch(train, None, mask)
    with pytest.raises(ValueError, match="does not fit mask"):
        routing_mismatch(train, rollout, mask[:, :3])
