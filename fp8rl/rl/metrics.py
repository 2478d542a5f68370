"""Rollout-vs-training mismatch metrics and the per-step metric names.

Names and formulas are the docs/design.md section 6 contract (NeMo-RL's
`token_mult_prob_error` and k3 `gen_kl`), so numbers compare across tools.
"""

from __future__ import annotations

import torch
from torch import Tensor

MISMATCH_METRICS = ("token_mult_prob_error", "max_abs_logprob_diff", "mean_abs_logprob_diff", "gen_kl")
# The same mismatch per answer (`sequence_mismatch`): what grows with answer length.
SEQUENCE_METRICS = ("seq_log_ratio_abs_mean", "seq_log_ratio_abs_max", "seq_ratio_off_2x_frac")
# Mixture-of-experts models: rollout and training choosing different experts (0.0 for dense models).
ROUTING_METRICS = ("routing_mismatch",)
IS_METRICS = ("is_weight_mean", "is_weight_max", "is_clip_frac")
TRAIN_METRICS = (
    "reward_mean", "accuracy", "response_len_mean", "entropy", "loss", "grad_norm", "lr", "ppo_clip_frac",
)
TIMING_METRICS = (
    "time_rollout_s", "time_train_s", "time_sync_s", "time_step_s", "rollout_tokens_per_s", "peak_mem_bytes",
)
# Every per-step metric a `metrics.jsonl` line carries (besides `step`).
METRIC_NAMES = MISMATCH_METRICS + SEQUENCE_METRICS + ROUTING_METRICS + IS_METRICS + TRAIN_METRICS + TIMING_METRICS


def mismatch_metrics(logp_train: Tensor, logp_rollout: Tensor, mask: Tensor) -> dict[str, float]:
    """Mismatch between training-forward and rollout log-probs of the same tokens.

    logp_train, logp_rollout, mask: [B, T] (or any equal shapes). With
    d = logp_train - logp_rollout over unmasked tokens, in float64:
      token_mult_prob_error  mean exp(|d|)       (1.0 = identical policies)
      max_abs_logprob_diff   max |d|
      mean_abs_logprob_diff  mean |d|
      gen_kl                 mean exp(d) - d - 1 (k3 estimate of KL(rollout || train))
      n_tokens               number of unmasked tokens
    With no unmasked token the values are the no-mismatch ones (1, 0, 0, 0).
    No clamping: a huge d shows up as a huge (or inf) metric, as it should.
    """
    if logp_train.shape != logp_rollout.shape or logp_train.shape != mask.shape:
        raise ValueError(
            f"logp_train {tuple(logp_train.shape)}, logp_rollout {tuple(logp_rollout.shape)} "
            f"and mask {tuple(mask.shape)} must have the same shape"
        )
    m = mask.bool()
    d = (logp_train.detach().double() - logp_rollout.detach().double())[m]
    n = d.numel()
    if n == 0:
        return {
            "token_mult_prob_error": 1.0, "max_abs_logprob_diff": 0.0, "mean_abs_logprob_diff": 0.0,
            "gen_kl": 0.0, "n_tokens": 0,
        }
    a = d.abs()
    return {
        "token_mult_prob_error": float(torch.exp(a).mean()),
        "max_abs_logprob_diff": float(a.max()),
        "mean_abs_logprob_diff": float(a.mean()),
        "gen_kl": float((torch.exp(d) - d - 1).mean()),
        "n_tokens": n,
    }


def sequence_mismatch(logp_train: Tensor, logp_rollout: Tensor, mask: Tensor) -> dict[str, float]:
    """Sequence-level view of the mismatch: what answer length does to it.

    logp_train, logp_rollout, mask: [B, T]. Per sequence b, with
    d = logp_train - logp_rollout on its unmasked tokens (float64),
    s_b = sum_t d is the log of the sequence-level importance ratio
    pi_train(y_b) / pi_rollout(y_b). Independent per-token errors make |s_b|
    grow like sqrt(length) (systematic ones like length), which is why long
    answers are where an off-policy rollout hurts.
      response_len_mean       mean unmasked tokens per sequence
      seq_log_ratio_abs_mean  mean |s_b|
      seq_log_ratio_abs_max   max |s_b|
      seq_ratio_off_2x_frac   fraction of sequences with exp(|s_b|) > 2
    Sequences without unmasked tokens count with s_b = 0.
    """
    if logp_train.shape != logp_rollout.shape or logp_train.shape != mask.shape or logp_train.dim() != 2:
        raise ValueError(
            f"logp_train {tuple(logp_train.shape)}, logp_rollout {tuple(logp_rollout.shape)} "
            f"and mask {tuple(mask.shape)} must be the same [B, T] shape"
        )
    m = mask.bool()
    d = torch.where(m, logp_train.detach().double() - logp_rollout.detach().double(), torch.zeros((), dtype=torch.float64))
    s = d.sum(dim=1).abs()  # [B]
    return {
        "response_len_mean": float(m.sum(dim=1).double().mean()),
        "seq_log_ratio_abs_mean": float(s.mean()),
        "seq_log_ratio_abs_max": float(s.max()),
        "seq_ratio_off_2x_frac": float((s > torch.log(torch.tensor(2.0, dtype=torch.float64))).double().mean()),
    }


def routing_mismatch(routing_train: Tensor | None, routing_rollout: Tensor | None, mask: Tensor) -> float:
    """Share of sampled tokens whose experts differ between rollout and training.

    routing_train, routing_rollout: Int[B, S, L, k] (`Rollout.routing`'s form: for
    each token, the ascending expert ids of each of the L MoE layers at the
    position that sampled it), mask: Bool[B, S]. A token counts as mismatched
    when any layer's expert set differs. Both None (a dense model): 0.0; no
    unmasked token: 0.0.
    """
    if routing_train is None and routing_rollout is None:
        return 0.0
    if routing_train is None or routing_rollout is None or routing_train.shape != routing_rollout.shape:
        raise ValueError(
            f"routing_train {None if routing_train is None else tuple(routing_train.shape)} and routing_rollout "
            f"{None if routing_rollout is None else tuple(routing_rollout.shape)} must both be [B, S, L, k] tensors"
        )
    if routing_train.shape[:2] != mask.shape:
        raise ValueError(f"routing {tuple(routing_train.shape)} does not fit mask {tuple(mask.shape)}")
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        return 0.0
    differs = (routing_train != routing_rollout).flatten(2).any(dim=-1)  # [B, S]
    return float((differs & m).sum()) / n
