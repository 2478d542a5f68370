import math

import pytest
import torch

from fp8rl.rl.correction import importance_weights

# per-token ratios exp(logp_train_old - logp_rollout); row 1's last token is padding
RATIOS = torch.tensor([[0.4, 1.0, 3.0], [2.5, 1.8, 0.9]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _weights(method, **kw):
    rollout = torch.full((2, 3), -2.0, dtype=torch.float64)
    return importance_weights(rollout + RATIOS.log(), rollout, MASK, method, **kw)


def test_none_is_ones_on_unmasked_tokens():
    w, s = _weights("none")
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))
    assert s == {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_clip_frac": 0.0}


def test_tis_clamps_at_cap():
    w, s = _weights("tis", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.4, 1.0, 2.0], [2.0, 1.8, 0.0]]))
    assert w.dtype == torch.float32
    assert s["is_weight_mean"] == pytest.approx((0.4 + 1 + 2 + 2 + 1.8) / 5)
    assert s["is_weight_max"] == pytest.approx(2.0)
    assert s["is_clip_frac"] == pytest.approx(2 / 5)  # 3.0 and 2.5


def test_icepop_zeroes_outside_band():
    w, s = _weights("icepop", lo=0.5, hi=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.8, 0.0]]))
    assert s["is_weight_mean"] == pytest.approx(2.8 / 5)
    assert s["is_weight_max"] == pytest.approx(1.8)
    assert s["is_clip_frac"] == pytest.approx(3 / 5)  # 0.4, 3.0, 2.5


def test_seq_mask_tis_drops_sequences_by_geometric_mean_of_unmasked_tokens():
    # row 0: (0.4 * 1 * 3)^(1/3) = 1.063 -> kept, TIS-clamped
    # row 1: (2.5 * 1.8)^(1/2) = 2.121 > 2 -> dropped (with the masked 0.9 it would be 1.594, kept)
    assert (0.4 * 1.0 * 3.0) ** (1 / 3) < 2.0 < math.sqrt(2.5 * 1.8)
    w, s = _weights("seq-mask-tis", cap=2.0, lo=0.5, hi=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.4, 1.0, 2.0], [0.0, 0.0, 0.0]]))
    assert s["is_weight_mean"] == pytest.approx(3.4 / 5)
    assert s["is_weight_max"] == pytest.approx(2.0)
    assert s["is_clip_frac"] == pytest.approx(3 / 5)  # the clamped 3.0 + the two dropped tokens


@pytest.mark.parametrize("method", ["none", "tis", "icepop", "seq-mask-tis"])
def test_padding_garbage_does_not_leak(method):
    rollout = torch.tensor([[-1.0, float("-inf")]])
    train_old = torch.tensor([[-1.0, float("nan")]])
    w, s = importance_weights(train_old, rollout, torch.tensor([[1, 0]]), method)
    assert torch.equal(w, torch.tensor([[1.0, 0.0]]))
    assert s == {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_clip_frac": 0.0}


def test_weights_are_detached_and_overflow_guarded():
    rollout = torch.zeros(1, 2)
    train_old = torch.tensor([[1000.0, -1000.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    w, s = importance_weights(train_old, rollout, mask, "tis", cap=2.0)
    assert not w.requires_grad
    assert w[0, 0].item() == 2.0 and 0.0 < w[0, 1].item() < 1e-8
    w, _ = importance_weights(train_old, rollout, mask, "icepop")
    assert torch.equal(w, torch.zeros(1, 2))


def test_empty_mask_gives_zero_stats():
    w, s = importance_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), "tis")
    assert torch.equal(w, torch.zeros(1, 2))
    assert s == {"is_weight_mean": 0.0, "is_weight_max": 0.0, "is_clip_frac": 0.0}


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError, match="tis, icepop, seq-mask-tis"):
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "clip")
